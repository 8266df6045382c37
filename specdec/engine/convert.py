"""Conversion of a catalogued GGUF (see `specdec.catalog`) into a Hugging Face directory.

transformers dequantises a GGUF on load but refuses to save a model loaded that way, so the
model is rebuilt from its config, given the dequantised state dict, its embeddings tied, and
saved as float32 safetensors with the tokenizer (and its chat template). The directory is
written under a temporary name and renamed only when complete, then marked with
`specdec-source.json`; an unmarked directory (an interrupted run) is converted again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from specdec.catalog import (
    CATALOG,
    MARKER,
    CatalogError,
    GGUFModel,
    cached_dir,
    is_ready,
    locate_gguf,
    verify_checksum,
)


def convert(model: GGUFModel, gguf_path: Path, out: Path) -> None:
    """Dequantise the GGUF into a float32 Hugging Face directory at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = rebuilt.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise CatalogError(f"{model.name}: GGUF weights do not match the model's layout")
    rebuilt.tie_weights()
    rebuilt.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure(name: str, progress=print) -> Path:
    """The converted directory of catalogued model `name`, converting on first use."""
    if name not in CATALOG:
        raise CatalogError(f"model: unknown catalogued model {name!r}; known: {sorted(CATALOG)}")
    model = CATALOG[name]
    target = cached_dir(model)
    if is_ready(target):
        return target
    gguf_path = locate_gguf(model)
    verify_checksum(model, gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"converting {model.filename} into {target} (once) …")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        convert(model, gguf_path, work)
        (work / MARKER).write_text(
            json.dumps(
                {
                    "model": model.name,
                    "package": model.requirement,
                    "file": model.filename,
                    "sha256": model.sha256,
                    "licence": model.licence,
                    "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
                indent=2,
            )
            + "\n"
        )
        if target.exists():  # a stale, unmarked directory from an interrupted run
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    progress(f"converted in {time.monotonic() - started:.0f} s")
    return target


def resolve_model(value: str, progress=print) -> str:
    """A `--model` value: a catalogued name (converted into the cache on first use) or a
    directory, returned as is."""
    if value in CATALOG:
        return str(ensure(value, progress=progress))
    return value
