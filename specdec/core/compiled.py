"""The C++ kernels (`specdec/engine/csrc/`, `specdec/core/csrc/`), compiled on first use for the
CPU they run on.

Each is built with torch's extension builder (a C++ compiler and ninja; `make` builds them
ahead, `python -m specdec.engine.compiled` does the same) into `$SPECDEC_KERNEL_CACHE`
(default `~/.cache/specdec/kernels`), under a name that hashes the source, the flags, torch's
version and this CPU's instruction-set flags (`-march=native`: built for the CPU it runs
on). Later starts import the built module directly. Where one cannot be built (no compiler,
a read-only cache), `Extension.get` logs why once per process and returns the reason, and its
callers fall back to other kernels: `specdec.engine.attention_kernel` (`--attention-kernel`),
`specdec.engine.kernels` (`--linear-kernel`) and `specdec.core.row_kernel` (`--sampling-kernel`).
The builder lives here, below the engine, because the sampling math (`specdec.core`) has a
kernel too; `python -m specdec.engine.compiled` builds them all.
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

# -fopenmp: ATen's parallel_for is OpenMP in torch's CPU build, and compiles to a serial loop
# without it (the kernels then ran on one thread whatever --threads said)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine", "csrc")  # the default


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


def _import(name: str, path: str):
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Extension:
    """One kernel: `<directory>/<source>` built as `<prefix>_<hash>`, once per machine."""

    def __init__(self, prefix: str, source: str, what: str, fallback: str, directory: str = CSRC):
        self.prefix, self.what, self.fallback = prefix, what, fallback
        self.source = os.path.join(directory, source)
        self._lock = threading.Lock()
        self._loaded: dict[str, object] = {}  # module name -> module, or why it is unavailable

    def module_name(self) -> str:
        """The built module's name: a hash of what it is built from and for."""
        with open(self.source, "rb") as f:
            digest = hashlib.sha256(f.read())
        for part in (" ".join(CFLAGS + LDFLAGS), torch.__version__, sys.version, _cpu_flags()):
            digest.update(b"\0" + part.encode())
        return f"{self.prefix}_{digest.hexdigest()[:16]}"

    def build(self, name: str):
        """The module `name`: imported where built, else built (raises where it cannot be)."""
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
        log.info("building %s %s (once per machine)", self.what, name)
        return load(
            name,
            [self.source],
            extra_cflags=list(CFLAGS),  # copies: torch's builder appends to the lists it is given
            extra_ldflags=list(LDFLAGS),
            build_directory=directory,
        )

    def get(self):
        """The module, or a line saying why it is unavailable (built or found once per
        process; where it is unavailable, that is logged then, naming the fallback)."""
        with self._lock:
            name = self.module_name()
            if name not in self._loaded:
                try:
                    self._loaded[name] = self.build(name)
                except Exception as error:  # no compiler, no ninja, a read-only cache, …
                    self._loaded[name] = f"{type(error).__name__}: {str(error).strip()[:300]}"
                    log.warning(
                        "%s unavailable, %s instead: %s",
                        self.what,
                        self.fallback,
                        self._loaded[name],
                    )
            return self._loaded[name]

    def module(self, flag: str, required: bool):
        """The built module, or None where it cannot be built (the reason is logged once, by
        `get`); where the flag asks for it (`required`), ValueError naming the flag and why."""
        found = self.get()
        if not isinstance(found, str):
            return found
        if required:
            raise ValueError(f"{flag}: compiled is not available: {found}")
        return None
