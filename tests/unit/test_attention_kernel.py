"""The compiled attention kernel (`specdec.engine.attention_kernel`): against torch's own
attention on random blocks (grouped heads, head sizes it specialises and one it does not,
strided queries, sessions it is not given left alone), and as a runtime chooses it — on
where it fits, off where it may not be, a kernel that attends one key too far caught by the
check at load. The toolchain is part of the set-up (`make tools`), so these tests build the
kernel and fail, not skip, where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from specdec.engine import attention_kernel, session_attention
from specdec.engine.model import ModelRuntime, RuntimeSettings

RTOL = 1e-5


@pytest.fixture(scope="module")
def kernel():
    return attention_kernel.load("compiled")


def reference(query, keys, values, starts, lengths, scale):
    """Torch's attention, session by session: [n, heads, dim] each."""
    out = []
    for i, (k, v, start, n) in enumerate(zip(keys, values, starts, lengths)):
        end = start + n
        mask = torch.ones(n, end, dtype=torch.bool).tril(start)
        o = F.scaled_dot_product_attention(
            query[i : i + 1, :, :n],
            k[None, :, :end],
            v[None, :, :end],
            attn_mask=mask,
            scale=scale,
            enable_gqa=query.shape[1] != k.shape[0],
        )[0]
        out.append(o.transpose(0, 1))
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(6, 6, 64), (9, 3, 64), (4, 2, 16), (2, 1, 128)],
    ids=["mha-64", "gqa-64", "gqa-16", "gqa-128"],
)
def test_kernel_equals_torch_attention_and_writes_the_new_kv(kernel, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    starts = [0, 37, 5, 200, 63]
    lengths = [1, 4, attention_kernel.MAX_BLOCK, 1, 7]
    batch, width = len(starts), max(lengths)
    # as a model hands them over: [B, T, heads, dim] transposed to [B, heads, T, dim]
    query = torch.randn(batch, width, heads, dim, generator=gen).transpose(1, 2)
    key = torch.randn(batch, width, kv_heads, dim, generator=gen).transpose(1, 2)
    value = torch.randn(batch, width, kv_heads, dim, generator=gen).transpose(1, 2)
    cached = [torch.randn(kv_heads, s + n + 9, dim, generator=gen) for s, n in zip(starts, lengths)]
    cached_v = [torch.randn_like(k) for k in cached]
    before = [k.clone() for k in cached]
    keys, values = [k.clone() for k in cached], [v.clone() for v in cached_v]
    for i, (s, n) in enumerate(zip(starts, lengths)):  # what the kernel must write
        cached[i][:, s : s + n] = key[i, :, :n]
        cached_v[i][:, s : s + n] = value[i, :, :n]
    rows = [0, 1, 2, 4]  # session 3 is not the kernel's: its rows stay as they were
    out = torch.full((batch, width, heads, dim), 7.0)
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    scale = dim**-0.5
    kernel.attend(
        query, key, value, out, rows, pick(keys), pick(values), pick(starts), pick(lengths), scale
    )
    expected = reference(query, cached, cached_v, starts, lengths, scale)
    for i in rows:
        n = lengths[i]
        assert torch.equal(keys[i], cached[i]) and torch.equal(values[i], cached_v[i]), i
        assert torch.allclose(out[i, :n], expected[i], rtol=RTOL, atol=RTOL), i
    assert torch.equal(out[3], torch.full_like(out[3], 7.0))
    assert torch.equal(keys[3], before[3]) and not torch.equal(keys[3], cached[3])
    # negative control: the same comparison finds a query that sees one key too many
    shifted = reference(query, cached, cached_v, [s + 1 for s in starts[:2]], [1, 3], scale)
    assert not torch.allclose(out[1, :3], shifted[1], rtol=RTOL, atol=RTOL)


def test_kernel_refuses_what_it_cannot_attend(kernel):
    q = torch.zeros(1, 2, 1, 8)
    out = torch.zeros(1, 1, 2, 8)
    buffers = [torch.zeros(2, 4, 8)]
    with pytest.raises(RuntimeError, match="float32"):
        kernel.attend(q.double(), q, q, out, [0], buffers, buffers, [0], [1], 1.0)
    with pytest.raises(RuntimeError, match="must fit its buffers"):
        kernel.attend(q, q, q, out, [0], buffers, buffers, [4], [1], 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = [torch.zeros(2, 8, 4).transpose(1, 2)]
        kernel.attend(q, q, q, out, [0], strided, strided, [0], [1], 1.0)


def load(model_dir: str, kernel: str, attention: str = "auto") -> ModelRuntime:
    return ModelRuntime(
        RuntimeSettings(
            model_dir, device="cpu", threads=1, batch_attention=attention, attention_kernel=kernel
        )
    )


def test_a_runtime_uses_the_kernel_where_it_fits(model_dirs, kernel):
    assert load(model_dirs["target"], "auto")._attention_kernel is kernel
    assert load(model_dirs["target"], "compiled")._attention_kernel is kernel
    assert load(model_dirs["target"], "torch")._attention_kernel is None
    padded = load(model_dirs["target"], "auto", "padded")
    assert padded._attention_kernel is None and not padded.session_attention
    with pytest.raises(ValueError, match="attention_kernel: compiled needs float32 attention"):
        load(model_dirs["target"], "compiled", "padded")
    with pytest.raises(ValueError, match="attention_kernel: expected one of"):
        load(model_dirs["target"], "cuda")


def test_without_a_toolchain_auto_falls_back_and_compiled_says_why(model_dirs, monkeypatch, caplog):
    def no_compiler(name):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(attention_kernel.EXTENSION, "_loaded", {})
    monkeypatch.setattr(attention_kernel.EXTENSION, "build", no_compiler)
    with caplog.at_level(logging.WARNING, "specdec.engine.compiled"):
        runtime = load(model_dirs["target"], "auto")
    assert runtime.session_attention and runtime._attention_kernel is None
    assert "no C++ compiler" in caplog.text
    with pytest.raises(ValueError, match="compiled is not available: RuntimeError: no C"):
        load(model_dirs["target"], "compiled")


def test_the_check_at_load_catches_a_kernel_that_is_wrong(model_dirs, kernel, monkeypatch):
    """Negative control: a kernel whose queries each see one key too far (their own block's
    next token) is found by the check at load: auto keeps torch's attention, compiled fails."""
    real = session_attention.SessionRows.__init__

    def one_too_far(self, sessions, lengths, kernel=None):
        real(self, sessions, lengths, kernel)
        self.kernel_starts = [s + 1 for s in self.kernel_starts]

    monkeypatch.setattr(session_attention.SessionRows, "__init__", one_too_far)
    runtime = load(model_dirs["target"], "auto")
    assert runtime.session_attention and runtime._attention_kernel is None
    with pytest.raises(ValueError, match="compiled does not fit this model: the check at load"):
        load(model_dirs["target"], "compiled")
