"""The compiled attention of short blocks over each session's own KV (`csrc/session_attention.cpp`).

`session_attention` attends per session: on a CPU that is one `scaled_dot_product_attention`
call per session and layer, and at a verify pass's few queries over a few hundred cached keys
the call's fixed cost (~35 µs with the slicing and copies around it) outweighs its arithmetic:
at 16 sessions of the code target, half the pass was attention. The kernel does one call per
layer for every session whose block is at most `MAX_BLOCK` tokens (prompt prefill chunks and
longer blocks keep torch's kernel, as fast from ~12 queries on: its tiled products win over
the kernel's loops as the queries grow) in float32 on the CPU.

It is C++ compiled on first use with torch's extension builder (a C++ compiler and ninja;
`make` builds it ahead, `python -m specdec.engine.attention_kernel` does the same) into
`$SPECDEC_KERNEL_CACHE` (default `~/.cache/specdec/kernels`), under a name that hashes the
source, the flags, torch's version and this CPU's instruction-set flags (it is built for
the CPU it runs on, `-march=native`). Later starts import the built module directly.
`--attention-kernel` chooses: auto (the kernel where it builds, else torch's per-session
calls, with the reason logged once), compiled (the kernel, or fail to start), torch.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import threading

import torch

log = logging.getLogger(__name__)

MODES = ("auto", "compiled", "torch")
MAX_BLOCK = 12  # longer blocks (prefill chunks, γ > 11) keep torch's attention
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "session_attention.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # module name -> module, or the reason it is unavailable


def kernel_dir() -> str:
    return os.environ.get("SPECDEC_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "specdec", "kernels"
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def module_name() -> str:
    """The built module's name: a hash of what it is built from and for."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(source)
    for part in (" ".join(CFLAGS), torch.__version__, sys.version, _cpu_flags()):
        digest.update(b"\0" + part.encode())
    return "specdec_attention_" + digest.hexdigest()[:16]


def _import(name: str, path: str):
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str):
    directory = os.path.join(kernel_dir(), name)
    built = os.path.join(directory, name + ".so")
    # torch's builder holds `lock` in the directory while it builds: another process's
    # half-written module is loaded through it (it waits), never imported directly
    if os.path.exists(built) and not os.path.exists(os.path.join(directory, "lock")):
        return _import(name, built)
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja is not installed (apt-get install ninja-build)")
    from torch.utils.cpp_extension import load  # imports setuptools: only when building

    os.makedirs(directory, exist_ok=True)
    log.info("building the attention kernel %s (once per machine)", name)
    return load(name, [SOURCE], extra_cflags=CFLAGS, build_directory=directory, verbose=False)


def load(mode: str = "auto"):
    """The kernel's module, or None where `mode` is torch or (under auto) it cannot be built;
    with compiled, RuntimeError naming why it cannot."""
    if mode not in MODES:
        raise ValueError(f"attention_kernel: expected one of {list(MODES)}, got {mode!r}")
    if mode == "torch":
        return None
    with _lock:
        name = module_name()
        if name not in _loaded:
            try:
                _loaded[name] = _build(name)
            except Exception as error:  # no compiler, no ninja, a read-only cache, …
                _loaded[name] = f"{type(error).__name__}: {str(error).strip()[:300]}"
                if mode == "auto":
                    log.warning(
                        "attention kernel unavailable, torch's per-session attention instead: %s",
                        _loaded[name],
                    )
        found = _loaded[name]
    if isinstance(found, str):
        if mode == "compiled":
            raise RuntimeError(f"attention_kernel: compiled is not available: {found}")
        return None
    return found


def main() -> int:
    """Build the kernel ahead of the workers (the Makefile does); 0 even where it cannot be
    built: the workers then use torch's attention."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load("auto")
    print("attention kernel:", module_name() if module is not None else "unavailable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
