"""`python -m specdec.engine.compiled`: build every C++ kernel ahead of the workers (the
Makefile's `kernels` target). The builder itself is `specdec.core.compiled` (the sampling math
below the engine has a kernel too); its names are re-exported here for the engine's kernels."""

from __future__ import annotations

import logging

from specdec.core.compiled import CFLAGS, CSRC, LDFLAGS, Extension, kernel_dir

__all__ = ["CFLAGS", "CSRC", "LDFLAGS", "Extension", "kernel_dir", "main"]


def main() -> int:
    """Build every kernel ahead of the workers (the Makefile does); 0 even where one cannot
    be built: the workers then use torch's kernels."""
    from specdec.core import row_kernel
    from specdec.engine import attention_kernel, kernels

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for extension in (attention_kernel.EXTENSION, kernels.EXTENSION, row_kernel.EXTENSION):
        found = extension.get()
        print(f"{extension.what}:", found if isinstance(found, str) else extension.module_name())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
