"""The lean forward (`specdec.engine.lean_forward`, `--model-forward`): the model's modules
called directly must give the model's own logits bit for bit — for each family it claims
(Llama, Mistral, Qwen2, Qwen3: tiny random models saved and loaded like a user's), through
batched prefills, blocks of different lengths and kept positions, over many passes, next to a
runtime of the same weights on Hugging Face's forward. Where it may not stand in (another
architecture, the padded batch copy, forward hooks, `hf`) the runtime keeps the model's own
forward, and `lean` refuses, naming the flag. Negative control: a model whose decoder layer
does one thing more than the family's (a residual scaled by 1 + 2⁻²⁰) is caught by the check at
load — auto keeps Hugging Face's forward, lean fails. The q/k/v and gate/up projections fused
into one call of the streamed kernel each give the same logits too; fused calls that swapped
k for v are caught at load (each module's own projections then run)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import save_architecture
from transformers import AutoTokenizer
from transformers.models.llama import modeling_llama

from specdec.engine import lean_forward
from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime, RuntimeSettings

# name: (config class, extra config); the fixture's Llama target is the fourth family
FAMILIES = {
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
}
GEMMA = ("GemmaConfig", {"head_dim": 16})  # attends over the sessions' own KV, another block
# heads of 64: k and v fill whole groups of the streamed kernel, so q/k/v fuse into one call
WIDE = {
    "llama-wide": ("LlamaConfig", {"head_dim": 64}),
    "qwen3-wide": ("Qwen3Config", {"head_dim": 64}),
}


def load(model_dir: str, forward: str = "auto", attention: str = "auto") -> ModelRuntime:
    return ModelRuntime(
        RuntimeSettings(
            model_dir, device="cpu", threads=1, batch_attention=attention, model_forward=forward
        )
    )


@pytest.fixture(scope="module")
def family_dirs(model_dirs, tmp_path_factory) -> dict[str, str]:
    """The fixture's Llama target, and a tiny random model of each other family (and of Gemma,
    which the lean forward does not claim) with the fixture's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    root = tmp_path_factory.mktemp("families")
    dirs = {"llama": model_dirs["target"]}
    for name, (config_class, extra) in {**FAMILIES, **WIDE, "gemma": GEMMA}.items():
        dirs[name] = save_architecture(config_class, extra, tokenizer, str(root / name))
    return dirs


def passes(runtime: ModelRuntime, seed: int) -> list[torch.Tensor]:
    """Three sessions through a serving-like run: a batched prefill of different lengths,
    verify blocks of different lengths with γ+1 kept, single steps with 1 kept, a lone
    session's block, for 12 rounds; every pass's logits."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runtime.vocab_size

    def draw(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    sessions = [KVSession(f"s{i}") for i in range(3)]
    for session, n in zip(sessions, (11, 5, 23)):
        session.sync(draw(n))
    out = list(runtime.forward(sessions, [s.pending() for s in sessions]))
    for round_ in range(12):
        blocks = [draw(1 + (round_ + i) % 4) for i in range(3)]
        out.append(runtime.forward(sessions, blocks, keep=max(map(len, blocks))))
        out.append(runtime.forward(sessions, [draw(1) for _ in sessions], keep=1))
        out.append(runtime.forward(sessions[:1], [draw(3)], keep=3))
    return out


@pytest.mark.parametrize("family", ["llama", *FAMILIES, "llama-wide", "qwen3-wide"])
def test_lean_logits_equal_the_models_own_bit_for_bit(family_dirs, family):
    lean, own = load(family_dirs[family]), load(family_dirs[family], "hf")
    assert lean._lean is not None and own._lean is None
    # gate/up fuse into one streamed-kernel call; q/k/v where q and k fill whole groups of
    # its layout (the wide models' heads of 64 always; heads of 16 only on a 256-bit CPU)
    attention = lean.model.model.layers[0].self_attn
    width = attention.q_proj.packed.shape[2]
    qkv = all(p.out_features % width == 0 for p in (attention.q_proj, attention.k_proj))
    assert qkv or not family.endswith("wide")
    assert lean._lean.fused == (3 if qkv else 1) * lean.model.config.num_hidden_layers
    ours, theirs = passes(lean, seed=7), passes(own, seed=7)
    assert len(ours) == len(theirs) == 3 + 12 * 3
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"pass {i}: max |Δ| {float((a - b).abs().max())}"


def test_where_it_may_not_stand_in_the_model_keeps_its_own_forward(model_dirs, family_dirs, caplog):
    with caplog.at_level(logging.INFO, "specdec.engine.lean_forward"):
        gemma = load(family_dirs["gemma"])
        assert gemma.session_attention and gemma._lean is None
        assert load(model_dirs["gpt2"])._lean is None
        assert load(model_dirs["target"], attention="padded")._lean is None
    assert "GemmaForCausalLM is not one of the decoder families" in caplog.text
    assert "GPT2LMHeadModel is not one of the decoder families" in caplog.text
    assert "padded batch copy" in caplog.text
    with pytest.raises(ValueError, match="model_forward: lean does not fit this model: GPT2"):
        load(model_dirs["gpt2"], "lean")
    with pytest.raises(ValueError, match="model_forward: lean does not fit .* padded batch"):
        load(model_dirs["target"], "lean", "padded")
    with pytest.raises(ValueError, match="model_forward: expected one of"):
        load(model_dirs["target"], "fast")
    assert load(model_dirs["target"], "lean")._lean is not None


def test_a_model_with_forward_hooks_keeps_its_own_forward(model_dirs):
    """A hook on a decoder layer (an adapter, a probe) would be skipped: not used."""
    runtime = load(model_dirs["target"], "hf")
    runtime.model.model.layers[1].register_forward_hook(lambda *args: None)
    lean_forward.install(runtime, "auto")
    assert runtime._lean is None
    with pytest.raises(ValueError, match="lean does not fit this model: the model or a layer"):
        lean_forward.install(runtime, "lean")


def test_the_check_at_load_catches_a_layer_it_does_not_reproduce(model_dirs, monkeypatch):
    """Negative control: a decoder layer that scales its residual by 1 + 2⁻²⁰ (a variant of
    the family the lean forward would silently skip) — the check at load finds other logits:
    auto keeps the model's own forward, lean fails to start."""
    real = modeling_llama.LlamaDecoderLayer.forward

    def scaled(self, hidden_states, *args, **kwargs):
        return real(self, hidden_states * (1 + 2**-20), *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", scaled)
    assert load(model_dirs["target"])._lean is None
    with pytest.raises(ValueError, match="lean does not fit this model: the check at load found"):
        load(model_dirs["target"], "lean")


def test_the_check_at_load_catches_fused_projections_that_are_wrong(family_dirs, monkeypatch):
    """Negative control for the fused calls: if they handed k's outputs out as v's, the check
    at load finds other logits and the lean forward runs each module's own projections."""
    real = lean_forward.Fused.__call__

    def swapped(self, x):
        out = real(self, x)
        return (out[0], out[2], out[1]) if len(out) == 3 else out

    monkeypatch.setattr(lean_forward.Fused, "__call__", swapped)
    runtime = load(family_dirs["llama-wide"])
    assert runtime._lean is not None and runtime._lean.fused == 0
    ours, theirs = passes(runtime, seed=3), passes(load(family_dirs["llama-wide"], "hf"), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_modules_laid_out_otherwise_keep_the_models_own_forward(model_dirs, monkeypatch):
    """A model of a claimed class whose modules it cannot find (a variant, a patched model):
    auto keeps Hugging Face's forward and says why, lean refuses — the worker never crashes."""

    def missing(self, model, fuse=True):
        raise AttributeError("'LlamaDecoderLayer' object has no attribute 'mlp'")

    monkeypatch.setattr(lean_forward.LeanForward, "__init__", missing)
    assert load(model_dirs["target"])._lean is None
    with pytest.raises(ValueError, match="lean does not fit .* laid out otherwise"):
        load(model_dirs["target"], "lean")
