"""A decoder's forward pass without Hugging Face's per-call wrappers (`--model-forward`).

A call of a `transformers` causal LM runs, around the model's own layers, a stack of
decorators (`can_return_tuple`, `merge_with_config_defaults`, `capture_outputs`, the
gradient-checkpointing layer wrapper), builds a causal mask — after scanning the position ids
for packed sequences — and wraps each result in a `ModelOutput` dataclass. The attention over
each session's own KV (`session_attention`) needs no mask, and none of the rest does anything
in inference: on the code pair's one-layer draft that was a quarter of a step (0.97 → 0.73 ms
in-process, one thread), and the workers driven directly at one request ran a greedy γ = 4
round in 19.9 ms instead of 22.2 (docs/benchmarks.md, "The model's layers without the
wrappers").

`LeanForward` calls the same modules in the same order with the same arguments — embedding,
the model's rotary embedding, per layer input norm → the model's own attention module (q/k/v
projections, rotary, `session_attention`, output projection) → residual → post-attention norm
→ the model's own MLP → residual, final norm, `slice_logits_to_keep`, LM head — so its logits
are the model's bit for bit. It is used only where that is known and checked:
- the model is one of `FAMILIES` (decoder layers read from their source in the pinned
  `transformers`: pre-norm residual blocks, nothing between the layers but the rotary
  embedding; a family with another block — Gemma's extra norms and scaled embedding, GPT-2 —
  keeps Hugging Face's forward);
- its attention reads each session's own KV (the padded batch copy needs the model's cache
  object and mask);
- no forward hooks on the model, its base model or its layers (they would be skipped);
- and at load, `runtime.forward` over the check's sessions (a batched prefill of different
  lengths, then blocks of different lengths keeping 2 positions each, then single steps
  keeping 1) gives logits EQUAL (`torch.equal`) to the same calls through the model's own
  forward.
`auto` uses it where all of this holds and logs why not elsewhere; `lean` fails to start
instead; `hf` never uses it.

With the streamed linear kernel (`specdec.engine.kernels`) a layer's q/k/v projections, and its
MLP's gate/up projections, each run as one call (`Fused`) where all but the last fill whole
groups of the kernel's layout: at two threads each call is a parallel region to start and
join, seven a layer become four. The check at load covers them: where the fused logits
differ, the lean forward runs each module's own projections (and logs why).
"""

from __future__ import annotations

import logging
import sys

import torch
from transformers.modeling_utils import slice_logits_to_keep

from specdec.engine.kernels import StreamedLinear
from specdec.engine.kv import KVSession
from specdec.engine.session_attention import check_inputs, session_attention

log = logging.getLogger(__name__)

MODES = ("auto", "lean", "hf")
# causal LM classes whose base model and decoder layers this forward reproduces (transformers
# 5.x source: LlamaModel / LlamaDecoderLayer and their copies)
FAMILIES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)


class Fused:
    """Linear layers of one input computed in one call of the streamed kernel: their packed
    weights concatenated once, each layer's own weight then a view of it (no second copy).
    Each output is one sum over the inputs in order whatever group holds it, so every layer's
    outputs are the ones its own call gives, bit for bit — what the check at load confirms."""

    def __init__(self, layers: list[StreamedLinear]) -> None:
        self.kernel = layers[0].kernel
        self.sizes = [layer.out_features for layer in layers]
        self.packed = torch.cat([layer.packed for layer in layers])
        biases = [layer.bias for layer in layers]
        self.bias = None if biases[0] is None else torch.cat(biases)
        start = 0
        for layer in layers:
            groups = layer.packed.shape[0]
            layer.packed = self.packed[start : start + groups]  # a view: one copy of the weights
            start += groups

    @staticmethod
    def fits(layers) -> bool:
        """Streamed layers of one kernel, input width and bias presence, each but the last
        filling whole groups (its outputs then end where the next layer's begin)."""
        if not all(isinstance(layer, StreamedLinear) for layer in layers):
            return False
        first = layers[0]
        width = first.packed.shape[2]
        return (
            all(layer.kernel is first.kernel for layer in layers)
            and all(layer.in_features == first.in_features for layer in layers)
            and all((layer.bias is None) == (first.bias is None) for layer in layers)
            and all(layer.out_features % width == 0 for layer in layers[:-1])
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.kernel.linear(x, self.packed, self.bias, sum(self.sizes))
        return out.split(self.sizes, dim=-1)


class LeanForward:
    """The model's logits for a pass of session rows, calling its modules directly. With
    `fuse`, a layer's q/k/v projections and its MLP's gate/up projections each run as one
    call of the streamed kernel where they qualify (`Fused`), the attention module's steps
    then taken here as the model's source takes them (projections, its q/k norms where it
    has them, rotary, attention, output projection)."""

    def __init__(self, model, fuse: bool = True) -> None:
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.layers = []
        self.fused = 0  # calls saved a pass
        # the family's own rotary step (the fused attention takes the module's steps itself)
        self.rotate = getattr(sys.modules[type(base).__module__], "apply_rotary_pos_emb", None)
        for layer in base.layers[: model.config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            gate_up = [mlp.gate_proj, mlp.up_proj]
            qkv = Fused(qkv) if fuse and self.rotate is not None and Fused.fits(qkv) else None
            gate_up = Fused(gate_up) if fuse and Fused.fits(gate_up) else None
            self.fused += 2 * (qkv is not None) + (gate_up is not None)
            self.layers.append(
                (layer.input_layernorm, attn, qkv, layer.post_attention_layernorm, mlp, gate_up)
            )
        self.norm = base.norm
        self.head = model.lm_head

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep, rows
    ) -> torch.Tensor:
        """Logits [B, kept positions, head] — what `model(...).logits` returns for the same
        `input_ids`, `position_ids`, `logits_to_keep` and `specdec_rows=rows`."""
        hidden = self.embed(input_ids)
        position = self.rotary(hidden, position_ids)
        for input_norm, attention, qkv, post_norm, mlp, gate_up in self.layers:
            x = input_norm(hidden)
            if qkv is None:
                update, _ = attention(
                    hidden_states=x,
                    position_embeddings=position,
                    attention_mask=None,
                    specdec_rows=rows,
                )
            else:
                update = self._attention(attention, qkv, x, position, rows)
            hidden = hidden + update
            x = post_norm(hidden)
            if gate_up is None:
                hidden = hidden + mlp(x)
            else:
                gate, up = gate_up(x)
                hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        hidden = self.norm(hidden)
        return self.head(slice_logits_to_keep(hidden, logits_to_keep))

    def _attention(self, attention, qkv: Fused, x, position, rows) -> torch.Tensor:
        """The attention module's forward (Llama's; Qwen3's with its q/k norms) from one call
        of the q/k/v projections."""
        shape = (*x.shape[:-1], -1, attention.head_dim)
        query, key, value = (y.view(shape) for y in qkv(x))
        if hasattr(attention, "q_norm"):
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key, value = (y.transpose(1, 2) for y in (query, key, value))
        cos, sin = position
        query, key = self.rotate(query, key, cos, sin)
        out, _ = session_attention(
            attention, query, key, value, None, scaling=attention.scaling, specdec_rows=rows
        )
        return attention.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


def install(runtime, mode: str) -> None:
    """Set `runtime._lean` to a `LeanForward` where `mode` asks for it and the model
    qualifies (see the module docstring), else None; `lean` that does not qualify raises
    ValueError naming the flag."""
    if mode not in MODES:
        raise ValueError(f"model_forward: expected one of {list(MODES)}, got {mode!r}")
    runtime._lean = None
    if mode == "hf":
        return
    reason = _unfit(runtime)
    if reason is None:
        try:
            reference = _check_logits(runtime, None)  # the model's own forward, once
        except Exception as error:  # the check cannot run: the model keeps its own forward
            reference, reason = None, f"the check at load failed ({type(error).__name__})"
    if reason is None:
        lean, reason = _checked(runtime, reference, fuse=True)
        if reason is not None and lean is not None and lean.fused:  # the modules' own, then?
            log.info("model %s: projections not fused (%s)", runtime.model_name, reason)
            lean, reason = _checked(runtime, reference, fuse=False)
        if reason is None:
            runtime._lean = lean
            return
    if mode == "lean":
        raise ValueError(f"model_forward: lean does not fit this model: {reason}")
    log.info("model %s: Hugging Face's forward (%s)", runtime.model_name, reason)


def _checked(runtime, reference, fuse: bool) -> tuple[LeanForward | None, str | None]:
    """A lean forward of the runtime's model and why it may not stand in (None: it may):
    the check's logits through it against `reference`, the model's own."""
    try:
        lean = LeanForward(runtime.model, fuse)
    except (AttributeError, TypeError, ValueError, RuntimeError) as error:  # another layout
        return None, f"its modules are laid out otherwise ({type(error).__name__}: {error})"
    try:
        ours = _check_logits(runtime, lean)
    except Exception as error:  # a model this forward cannot run keeps its own
        return lean, f"the check at load failed ({type(error).__name__}: {error})"
    if not all(torch.equal(a, b) for a, b in zip(ours, reference)):
        return lean, "the check at load found logits other than the model's own forward's"
    return lean, None


def _unfit(runtime) -> str | None:
    """Why the lean forward may not stand in for this model's, or None."""
    model = runtime.model
    name = type(model).__name__
    if name not in FAMILIES:
        return f"{name} is not one of the decoder families it reproduces"
    if not runtime.session_attention:
        return "its batches attend over a padded batch copy, which needs the model's cache"
    modules = [model, model.model, *model.model.layers]
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return "the model or a layer has forward hooks"
    return None


@torch.inference_mode()
def _check_logits(runtime, lean: LeanForward | None) -> list[torch.Tensor]:
    """The check's logits through `runtime.forward` with `lean` (None: the model's own
    forward): a batched prefill of different lengths, then blocks of different lengths keeping
    2 positions each, then single steps keeping 1."""
    histories, blocks = check_inputs(runtime.vocab_size)
    runtime._lean = lean
    try:
        sessions = [KVSession(f"lean-check-{i}") for i in range(len(histories))]
        for session, history in zip(sessions, histories):
            session.sync(history)
        prefill = runtime.forward(sessions, [s.pending() for s in sessions])
        block = runtime.forward(sessions, blocks, keep=2)  # kept per session: a tensor
        step = runtime.forward(sessions, [[b[0]] for b in blocks], keep=1)  # a count
    finally:
        runtime._lean = None
    return [*prefill, block, step]
