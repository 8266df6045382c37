"""Prepacked oneDNN linear layers: the same linear map as torch's own, checked at load (the
compiled streamed kernel, auto's first choice: tests/unit/test_streamed_linear.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.engine import kernels
from specdec.engine.kernels import PackedLinear, pack_linears
from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime, RuntimeSettings

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def load(model_dir: str, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def count_linears(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 80, 300])
def test_packed_linear_equals_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 200, bias=bias)
        x = torch.randn(2, rows, 96, generator=gen)
        want = torch.nn.functional.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def rows_computed(monkeypatch, rows: int) -> list[int]:
    """The row counts oneDNN computes for one `PackedLinear` call on `rows` rows."""
    real, seen = torch.ops.mkldnn._linear_pointwise, []

    def spy(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    with monkeypatch.context() as patch:  # the spy for this call only
        patch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
        got = packed(x)
    assert got.shape == (rows, 48)
    assert torch.allclose(got, torch.nn.functional.linear(x, linear.weight, linear.bias), atol=1e-5)
    return seen


def test_fewer_rows_than_min_rows_run_as_min_rows(monkeypatch):
    """One to three rows run oneDNN's kernel for MIN_ROWS rows (zero rows below, cut off
    after): its kernels for one or two rows stream an uncached weight more slowly."""
    assert kernels.MIN_ROWS == 4
    for rows in (1, 2, 3):
        assert rows_computed(monkeypatch, rows) == [kernels.MIN_ROWS]
    assert rows_computed(monkeypatch, 7) == [7]


def test_negative_control_without_padding_one_row_runs_alone(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ROWS", 1)
    seen = rows_computed(monkeypatch, 1)
    assert seen == [1]


@pytest.mark.parametrize("kernel", ["auto", "packed", "compiled"])
def test_every_linear_of_a_llama_is_packed_and_logits_agree(model_dirs, kernel):
    """auto takes the compiled kernel (tests/unit/test_streamed_linear.py)."""
    stock, packed = load(model_dirs["target"]), load(model_dirs["target"])
    linears = count_linears(stock)
    assert pack_linears(packed, kernel) == linears > 0
    assert kernels.kernel_of(packed) == ("compiled" if kernel == "auto" else kernel)
    assert count_linears(packed) == 0
    ids = torch.randint(
        0, stock.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        want, got = stock(input_ids=ids).logits, packed(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_default_and_unsupported_models_keep_torchs_kernels(model_dirs):
    model = load(model_dirs["target"])
    assert pack_linears(model, "default") == 0
    assert count_linears(model) > 0
    half = load(model_dirs["target"], dtype=torch.bfloat16)
    assert pack_linears(half, "auto") == 0
    with pytest.raises(ValueError, match="linear_kernel: packed needs a float32 model"):
        pack_linears(half, "packed")
    with pytest.raises(ValueError, match="linear_kernel: expected one of"):
        pack_linears(model, "fast")


def test_a_disagreeing_kernel_is_caught_at_load(model_dirs, monkeypatch):
    """Negative control: a packed layer that is off by a little is refused, whole model kept
    (auto, with the compiled kernel off by as much, keeps torch's own)."""
    model = load(model_dirs["target"])
    linears = count_linears(model)
    for kind in (PackedLinear, kernels.StreamedLinear):
        real = kind.forward
        monkeypatch.setattr(kind, "forward", lambda self, x, real=real: real(self, x) * (1 + 1e-3))
    assert pack_linears(model, "auto") == 0
    assert count_linears(model) == linears
    with pytest.raises(ValueError, match="the packed kernel disagrees"):
        pack_linears(model, "packed")
    monkeypatch.setattr(kernels, "CHECK_RTOL", 1e-2)  # the same error within a looser bound
    assert pack_linears(model, "packed") == linears


@pytest.mark.parametrize("kernel", ["auto", "packed", "compiled"])
def test_runtime_packs_on_cpu_and_computes_what_torchs_kernels_compute(model_dirs, kernel):
    packed = ModelRuntime(
        RuntimeSettings(model_dirs["target"], device="cpu", threads=1, linear_kernel=kernel)
    )
    assert kernels.kernel_of(packed.model) == ("compiled" if kernel == "auto" else kernel)
    stock = ModelRuntime(
        RuntimeSettings(model_dirs["target"], device="cpu", threads=1, linear_kernel="default")
    )
    assert packed.packed_linears > 0 and stock.packed_linears == 0
    prompt = list(range(3, 40))
    outs = []
    for runtime in (packed, stock):
        sessions = [KVSession("a"), KVSession("b")]
        sessions[0].sync(prompt)
        sessions[1].sync(prompt[:20])
        runtime.forward(sessions, [s.pending() for s in sessions], keep=1)
        outs.append(runtime.forward(sessions, [[5, 6, 7], [8, 9, 10]], keep=3))
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_a_model_that_reads_a_linear_weight_keeps_torchs_kernels(model_dirs, monkeypatch):
    """Model code that reaches into `.weight` fails on a packed layer: the smoke forward at
    load notices, and every layer goes back to torch's own."""
    model = load(model_dirs["target"])
    linears = count_linears(model)
    mlp = type(model.model.layers[0].mlp)
    real = mlp.forward
    monkeypatch.setattr(
        mlp, "forward", lambda self, x: real(self, x) + self.up_proj.weight.sum() * 0
    )
    assert pack_linears(model, "auto") == 0
    assert count_linears(model) == linears
    for kernel in ("packed", "compiled"):
        with pytest.raises(ValueError, match=f"does not run {kernel}"):
            pack_linears(model, kernel)
    monkeypatch.setattr(mlp, "forward", real)
    assert pack_linears(model, "auto") == linears
