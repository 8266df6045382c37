"""Attention over each session's own KV buffers: a batched forward that copies no KV.

A batch of sessions shares every linear layer (one GEMM over all their new tokens), but its
attention is per session: session i's queries attend to the KV in its own buffers
(`KVSession.keys[layer][:, :kv_len + n_i]`), into which this pass writes its n_i new keys and
values first. Nothing is left-padded, no batch copy of the KV is built when the batch changes
(sessions finishing, arriving, or two groups taking turns on the target), no holes are
attended over and masked, and nothing is appended afterwards. What it costs: one attention
call per session and layer, instead of one per layer over the padded batch — except for the
short blocks of verify and draft passes (float32, CPU), which the compiled kernel of
`attention_kernel` takes for all sessions in one call a layer (`--attention-kernel`).

The model runs it through Hugging Face's attention interface (`AttentionInterface`, the way
vLLM and TGI plug their kernels into `transformers` models): it is registered under
`IMPLEMENTATION`, `install` switches a model to it, and `ModelRuntime.forward` passes the
batch's rows as the keyword `specdec_rows` (a call without them, such as a plain Hugging Face
call of the same model, runs the model's own sdpa attention). A model qualifies only if it
runs sdpa through that interface, every layer attends to the whole causal prefix (no sliding
window, no logit soft-capping), and a check at load finds the logits of its own attention;
any other model keeps the padded batch (`specdec.engine.batch_kv`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec.engine import attention_kernel
from specdec.engine.attention_kernel import MAX_BLOCK
from specdec.engine.kv import KVSession

log = logging.getLogger(__name__)

IMPLEMENTATION = "specdec_sessions"
MODES = ("auto", "sessions", "padded")
# the check at load: |Δlogit| ≤ CHECK_RTOL · (1 + max |logit|) in float32 (8 ulps in a
# half type), and the same argmax wherever the top two differ by more than twice that
CHECK_RTOL = 1e-4


class SessionRows:
    """One forward's sessions, where each one's new tokens start (its kv_len before the pass)
    and how many there are (its input is right-padded to the longest). With the compiled
    kernel (`attention_kernel`), the sessions whose block it takes (at most its MAX_BLOCK
    tokens) are attended in one call per layer, the others (prefill chunks) by torch."""

    def __init__(self, sessions: list[KVSession], lengths: list[int], kernel=None):
        self.sessions = sessions
        self.lengths = lengths
        self.starts = [s.kv_len for s in sessions]
        self.kernel = kernel
        short = [kernel is not None and n <= MAX_BLOCK for n in lengths]
        self.kernel_rows = [i for i, takes in enumerate(short) if takes]
        self.torch_rows = [i for i, takes in enumerate(short) if not takes]
        # the kernel's arguments that are the same in every layer
        self.kernel_sessions = [sessions[i] for i in self.kernel_rows]
        self.kernel_starts = [self.starts[i] for i in self.kernel_rows]
        self.kernel_lengths = [lengths[i] for i in self.kernel_rows]
        # query j of a block starting at s sees keys 0..s+j: a lower triangle shifted right
        self.masks = [
            None
            if n == 1 or short[i]
            else torch.ones(n, s + n, dtype=torch.bool, device=_device(x)).tril(s)
            for i, (x, s, n) in enumerate(zip(sessions, self.starts, lengths))
        ]


def _device(session: KVSession) -> torch.device:
    return session.keys[0].device


def session_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, specdec_rows=None, **_
):
    """The attention interface's signature: query [B, heads, q, dim], key/value [B, kv_heads,
    q, dim] of this pass's tokens only (no cache object is passed); returns [B, q, heads, dim].
    A call of the model without rows (a plain Hugging Face call) gets the model's own sdpa
    attention, with its own mask (`sdpa_mask` is registered for this implementation too)."""
    rows: SessionRows | None = specdec_rows
    if rows is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **_
        )
    layer = module.layer_idx
    if rows.kernel is not None:
        return _compiled(rows, layer, query, key, value, scaling), None
    out = query.new_zeros(query.shape)
    for i in range(len(rows.sessions)):
        out[i, :, : rows.lengths[i]] = _torch_row(rows, i, layer, query, key, value, scaling)
    return out.transpose(1, 2), None


def _torch_row(rows: SessionRows, i: int, layer: int, query, key, value, scaling):
    """Session i's attention by torch's kernel ([heads, n, dim]), its new KV written first."""
    session, start, n = rows.sessions[i], rows.starts[i], rows.lengths[i]
    end = start + n
    keys, values = session.keys[layer], session.values[layer]
    keys[:, start:end] = key[i, :, :n]
    values[:, start:end] = value[i, :, :n]
    return F.scaled_dot_product_attention(
        query[i : i + 1, :, :n],
        keys[None, :, :end],
        values[None, :, :end],
        attn_mask=rows.masks[i],
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )[0]


def _compiled(rows: SessionRows, layer: int, query, key, value, scaling) -> torch.Tensor:
    """[B, q, heads, dim]: the kernel's sessions in one call, the rest by torch's kernel."""
    batch, heads, width, dim = query.shape
    out = query.new_zeros(batch, width, heads, dim)
    if rows.kernel_rows:
        query, key, value = (
            x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value)
        )
        rows.kernel.attend(
            query,
            key,
            value,
            out,
            rows.kernel_rows,
            [s.keys[layer] for s in rows.kernel_sessions],
            [s.values[layer] for s in rows.kernel_sessions],
            rows.kernel_starts,
            rows.kernel_lengths,
            dim**-0.5 if scaling is None else float(scaling),
        )
    for i in rows.torch_rows:
        out[i, : rows.lengths[i]] = _torch_row(
            rows, i, layer, query, key, value, scaling
        ).transpose(0, 1)
    return out


AttentionInterface.register(IMPLEMENTATION, session_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def install(runtime, mode: str, kernel: str = "auto") -> None:
    """Switch `runtime.model` to attention over each session's own KV, as `mode` asks:
    auto (where the model qualifies, on a CPU), sessions (that, or ValueError), padded (never).
    Installed, `runtime._kv_like` holds per layer an empty [kv_heads, 0, head_dim] tensor
    that new sessions' buffers take their shape, dtype and device from; else it stays None.
    `kernel` (`attention_kernel.MODES`) chooses who attends the short blocks: float32 on a
    CPU, the compiled kernel (auto: where it builds and agrees on the check at load;
    compiled: that, or ValueError); else torch. `runtime._attention_kernel` holds it."""
    if mode not in MODES:
        raise ValueError(f"batch_attention: expected one of {list(MODES)}, got {mode!r}")
    if kernel not in attention_kernel.MODES:
        raise ValueError(
            f"attention_kernel: expected one of {list(attention_kernel.MODES)}, got {kernel!r}"
        )
    runtime._attention_kernel = None
    if mode == "padded":
        _no_kernel(kernel, "--batch-attention padded")
        return
    reason = _unfit(runtime.model, mode)
    if reason is None:
        runtime._kv_like, reference = _reference(runtime)
        # every config object the model's modules read (a composite model has several)
        configs = {id(m.config): m.config for m in runtime.model.modules() if hasattr(m, "config")}
        before = [(c, c._attn_implementation) for c in configs.values()]
        for config, _ in before:
            config._attn_implementation = IMPLEMENTATION
        runtime._attention_kernel = _kernel(runtime, kernel)
        reason = _disagrees(runtime, reference)
        if reason is not None and runtime._attention_kernel is not None:
            runtime._attention_kernel = None  # the kernel's answer differs: torch's, then?
            if kernel == "compiled":
                raise ValueError(f"attention_kernel: compiled does not fit this model: {reason}")
            log.warning("attention kernel not used: %s", reason)
            reason = _disagrees(runtime, reference)
        if reason is not None:
            runtime._kv_like = None
            for config, implementation in before:
                config._attn_implementation = implementation
    if reason is None:
        return
    if mode == "sessions":
        raise ValueError(f"batch_attention: sessions does not fit this model: {reason}")
    log.info("batched attention over a padded batch copy: %s", reason)
    _no_kernel(kernel, "the padded batch copy")


def _kernel(runtime, kernel: str):
    """The compiled kernel's module where `kernel` asks for it and it fits, else None."""
    if kernel == "torch":
        return None
    if runtime.device.type != "cpu" or runtime.dtype != torch.float32:
        _no_kernel(kernel, f"{runtime.dtype} on {runtime.device.type}")
        return None
    return attention_kernel.load(kernel)


def _no_kernel(kernel: str, why: str) -> None:
    if kernel == "compiled":
        raise ValueError(
            f"attention_kernel: compiled needs float32 attention over each session's own KV "
            f"on a CPU, not {why}"
        )


def _unfit(model, mode: str) -> str | None:
    """Why the model cannot (or, under auto, should not) attend per session, or None."""
    config = model.config.get_text_config()
    if mode == "auto" and model.device.type != "cpu":
        return (
            f"on {model.device.type} the padded batch is the default (one attention kernel per "
            "layer, not one per session; not measured on a GPU yet)"
        )
    if config._attn_implementation != "sdpa":
        return f"it runs {config._attn_implementation} attention, not sdpa"
    if not type(model)._can_set_attn_implementation():
        return "its attention does not go through transformers' AttentionInterface"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "some layers do not attend to the whole prefix (layer_types)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    return None


def check_inputs(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two sessions of different cached lengths, then blocks of different lengths."""
    gen = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(1, vocab, (n,), generator=gen).tolist()  # noqa: E731
    return [draw(9), draw(4)], [draw(3), draw(1)]


@torch.inference_mode()
def _reference(runtime) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's own attention, one sequence at a time: the logits of the check's blocks,
    and the KV shapes of its cache (the templates of the sessions' buffers)."""
    histories, blocks = check_inputs(runtime.vocab_size)
    reference, like = [], None
    for history, block in zip(histories, blocks):
        ids = torch.tensor([history + block], device=runtime.device)
        out = runtime.model(input_ids=ids, use_cache=True)
        reference.append(out.logits[0, -len(block) :].float())
        if like is None:
            like = [layer.keys[0, :, :0].clone() for layer in out.past_key_values.layers]
    return like, reference


def _disagrees(runtime, reference: list[torch.Tensor]) -> str | None:
    """Run the check's sessions through `runtime.forward` (a batched prefill of different
    lengths, then a batched step of different lengths); why it differs from the reference."""
    histories, blocks = check_inputs(runtime.vocab_size)
    sessions = [KVSession(f"check-{i}") for i in range(len(histories))]
    try:
        for session, history in zip(sessions, histories):
            session.sync(history)
        runtime.forward(sessions, [s.pending() for s in sessions])
        got = runtime.forward(sessions, blocks)
    except Exception as error:  # any model this path cannot run keeps the padded one
        return f"the check at load failed ({type(error).__name__}: {error})"
    dtype = next(runtime.model.parameters()).dtype
    relative = max(CHECK_RTOL, 8 * torch.finfo(dtype).eps)  # bfloat16 rounds at 2^-8
    for ours, theirs in zip(got, reference):
        tolerance = relative * (1.0 + float(theirs.abs().max()))
        if ours.shape != theirs.shape or float((ours - theirs).abs().max()) > tolerance:
            return "the check at load found other logits than the model's own attention"
        top2 = theirs.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance  # rows that are no near-tie
        if not torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear]):
            return "the check at load found another argmax than the model's own attention"
    return None
