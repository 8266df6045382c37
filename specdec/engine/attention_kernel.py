"""The compiled attention of short blocks over each session's own KV (`csrc/session_attention.cpp`).

`session_attention` attends per session: on a CPU that is one `scaled_dot_product_attention`
call per session and layer, and at a verify pass's few queries over a few hundred cached keys
the call's fixed cost (~35 µs with the slicing and copies around it) outweighs its arithmetic:
at 16 sessions of the code target, half the pass was attention. The kernel does one call per
layer for every session whose block is at most `MAX_BLOCK` tokens (prompt prefill chunks and
longer blocks keep torch's kernel, as fast from ~12 queries on: its tiled products win over
the kernel's loops as the queries grow) in float32 on the CPU.

It is C++ compiled on first use for the CPU it runs on (`specdec.engine.compiled`).
`--attention-kernel` chooses: auto (the kernel where it builds, else torch's per-session
calls, with the reason logged once), compiled (the kernel, or fail to start), torch.
"""

from __future__ import annotations

from specdec.engine.compiled import Extension

MODES = ("auto", "compiled", "torch")
MAX_BLOCK = 12  # longer blocks (prefill chunks, γ > 11) keep torch's attention
EXTENSION = Extension(
    "specdec_attention",
    "session_attention.cpp",
    "the attention kernel",
    "torch's per-session attention",
)


def load(mode: str = "auto"):
    """The kernel's module, or None where `mode` is torch or (under auto) it cannot be built;
    with compiled, ValueError naming why it cannot."""
    if mode not in MODES:
        raise ValueError(f"attention_kernel: expected one of {list(MODES)}, got {mode!r}")
    if mode == "torch":
        return None
    return EXTENSION.module("attention_kernel", required=mode == "compiled")
