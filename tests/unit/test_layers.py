"""The layering of docs/architecture.md holds: imports point only downward, the tiers never
import each other, and the coordinator process loads neither torch nor a model class."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (package prefix, layer): a module may import only from layers below its own, or its own package.
LAYERS = [
    ("specdec", 0),  # the package itself: a docstring and the version
    ("specdec.v1", 0),
    ("specdec.errors", 0),
    ("specdec.core", 1),
    ("specdec.text", 1),
    ("specdec.catalog", 1),
    ("specdec.engine", 2),
    ("specdec.serving", 3),
    ("specdec.worker", 4),
    ("specdec.client", 4),
    ("draft_worker", 5),
    ("target_worker", 5),
    ("coordinator", 5),
    ("specdec.launcher", 6),
    ("specdec.__main__", 7),
    ("bench", 7),
]
# Modules the coordinator's process may import: it holds no model.
TORCH_FREE = [
    "specdec.errors",
    "specdec.text",
    "specdec.catalog",
    "specdec.serving",
    "specdec.client",
    "coordinator",
]
TORCH_FREE += [f"specdec.core.{m}" for m in ("params", "prefix", "acceptance", "perf_model")]


def package_of(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, layer in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return best


def modules():
    for top in ("specdec", "draft_worker", "target_worker", "coordinator", "bench"):
        for folder, _dirs, files in os.walk(os.path.join(ROOT, top)):
            if os.path.relpath(folder, ROOT).startswith(os.path.join("specdec", "v1")):
                continue
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield rel.removesuffix(".__init__"), path


def imports(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def violations() -> list[str]:
    bad = []
    for module, path in modules():
        own = package_of(module)
        assert own is not None, f"{module} belongs to no layer; add it to LAYERS"
        for name in imports(path):
            other = package_of(name)
            if other is None or other[0] == own[0]:
                continue
            if other[1] >= own[1]:
                bad.append(f"{module} (layer {own[1]}) imports {name} (layer {other[1]})")
        if any(module == m or module.startswith(m + ".") for m in TORCH_FREE):
            for name in imports(path):
                heavy = name.split(".")[0] == "torch" or name.startswith(
                    ("specdec.engine", "specdec.worker", "transformers.models")
                )
                heavy = (
                    heavy
                    or name.startswith("transformers.AutoModel")
                    or (
                        name.startswith("specdec.core.")
                        and name.split(".")[2] in ("rng", "sampling", "proposal", "verify")
                    )
                )
                if heavy:
                    bad.append(f"{module} must stay torch-free but imports {name}")
    return bad


def test_imports_point_downward():
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """Negative control: an engine module that imports a service is reported."""
    fake = tmp_path / "specdec" / "engine"
    fake.mkdir(parents=True)
    (fake / "leak.py").write_text("from coordinator.store import SessionStore\nimport torch\n")
    (tmp_path / "specdec" / "text").mkdir()
    (tmp_path / "specdec" / "text" / "leak.py").write_text("import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    found = violations()
    assert any("specdec.engine.leak (layer 2) imports coordinator.store" in v for v in found)
    assert any("specdec.text.leak must stay torch-free but imports torch" in v for v in found)


@pytest.mark.parametrize("entry", ["coordinator.__main__", "specdec.client"])
def test_the_coordinator_process_loads_no_model_code(entry):
    """Import the entry point and load the demo target's tokenizer in a fresh interpreter."""
    code = (
        f"import sys, {entry}\n"
        "from specdec.text.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer('models/target')\n"
        "assert tok.encode('def f(x):', add_special_tokens=False)\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')"
        " or m.startswith('transformers.models.'))\n"
        "print(len(heavy), heavy[:5])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 "), f"{entry} loaded model code: {out.stdout}"


def test_the_process_check_can_fail():
    """Negative control: the same probe reports torch once the engine is imported."""
    code = (
        "import sys, coordinator.__main__, specdec.engine.model\n"
        "print(sum(m == 'torch' or m.startswith('torch.') for m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0
