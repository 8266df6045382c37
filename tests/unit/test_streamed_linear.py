"""The compiled streamed linear kernel (`StreamedLinear`, `csrc/streamed_linear.cpp`): the
same linear map as `F.linear` at every row count and shape, a row's result independent of
the rows batched with it and of the thread count, and how `--linear-kernel` chooses it —
auto takes it, falls back to oneDNN where it cannot be built or disagrees, compiled fails
instead. The toolchain is part of the set-up (`make tools`), so these tests build the kernel
and fail, not skip, where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specdec.engine import kernels
from specdec.engine.kernels import PackedLinear, StreamedLinear, kernel_of, pack_linears
from specdec.engine.model import ModelRuntime, RuntimeSettings


@pytest.fixture(scope="module")
def module():
    found = kernels.EXTENSION.get()
    assert not isinstance(found, str), found
    return found


def load(model_dir: str, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def count(model, kind) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("shape", [(96, 200), (384, 1024), (64, 1), (1000, 130)])
def test_equals_f_linear_at_every_row_count(module, shape):
    """Rows 1-20 (one to four row groups of either build), 64 and 300; outputs a multiple of
    the layout's group and not; with and without a bias; 3-d inputs."""
    inputs, outputs = shape
    gen = torch.Generator().manual_seed(inputs + outputs)
    for bias in (False, True):
        linear = torch.nn.Linear(inputs, outputs, bias=bias)
        layer = StreamedLinear(linear, module)
        for rows in [*range(1, 21), 64, 300]:
            x = torch.randn(rows, inputs, generator=gen)
            want = F.linear(x, linear.weight, linear.bias)
            got = layer(x)
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (rows, bias)
        x = torch.randn(2, 3, inputs, generator=gen)
        assert torch.allclose(layer(x), F.linear(x, linear.weight, linear.bias), atol=1e-5)


def rows_that_move(layer, x: torch.Tensor) -> list[int]:
    """The row counts n whose first n rows, computed alone, differ in any bit from the same
    rows computed in the whole batch `x`."""
    full = layer(x)
    return [n for n in range(1, x.shape[0]) if not torch.equal(layer(x[:n]), full[:n])]


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(module):
    gen = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(384, 1000)
    layer = StreamedLinear(linear, module)
    x = torch.randn(13, 384, generator=gen)
    assert rows_that_move(layer, x) == []
    assert rows_that_move(layer, x.flip(0)) == []
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(threads)


def test_negative_control_a_kernel_that_blocks_by_row_count_is_caught():
    """The check above can fail: a kernel that, like torch's and oneDNN's, picks its
    blocking by the row count (here: above 6 rows the inputs in two halves, summed after)
    gives a row other bits alone than in a batch of 13."""
    gen = torch.Generator().manual_seed(7)
    linear = torch.nn.Linear(384, 1000)
    w, b, half = linear.weight.detach(), linear.bias.detach(), 192

    def blocked(t):
        if t.shape[0] <= 6:
            return F.linear(t, w, b)
        return F.linear(t[:, :half], w[:, :half]) + F.linear(t[:, half:], w[:, half:]) + b

    x = torch.randn(13, 384, generator=gen)
    assert set(range(1, 7)) <= set(rows_that_move(blocked, x))


def test_bad_arguments_are_refused(module):
    layer = StreamedLinear(torch.nn.Linear(32, 16), module)
    with pytest.raises(RuntimeError, match="packed weight does not match x"):
        module.linear(torch.randn(2, 31), layer.packed, None, 16)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        module.linear(torch.randn(2, 32, dtype=torch.float64), layer.packed, None, 16)
    with pytest.raises(RuntimeError, match="bias must be"):
        module.linear(torch.randn(2, 32), layer.packed, torch.zeros(15), 16)
    assert module.linear(torch.zeros(0, 32), layer.packed, None, 16).shape == (0, 16)


def test_a_disagreeing_compiled_kernel_gives_way_to_onednn(model_dirs, monkeypatch):
    """Negative control of the check at load: a compiled layer off by 1e-3 is refused; auto
    then packs with oneDNN, compiled fails naming the layer."""
    model = load(model_dirs["target"])
    linears = count(model, torch.nn.Linear)
    real = StreamedLinear.forward
    monkeypatch.setattr(StreamedLinear, "forward", lambda self, x: real(self, x) * (1 + 1e-3))
    with pytest.raises(ValueError, match="the compiled kernel disagrees on layer"):
        pack_linears(model, "compiled")
    assert count(model, torch.nn.Linear) == linears
    assert pack_linears(model, "auto") == linears
    assert kernel_of(model) == "packed" and count(model, PackedLinear) == linears


def test_without_a_toolchain_auto_uses_onednn_and_compiled_says_why(
    model_dirs, monkeypatch, caplog
):
    def no_compiler(name):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(kernels.EXTENSION, "_loaded", {})
    monkeypatch.setattr(kernels.EXTENSION, "build", no_compiler)
    model = load(model_dirs["target"])
    with caplog.at_level(logging.WARNING, "specdec.engine.compiled"):
        assert pack_linears(model, "auto") > 0
        assert pack_linears(load(model_dirs["target"]), "auto") > 0
    assert kernel_of(model) == "packed" and "no C++ compiler" in caplog.text
    assert caplog.text.count("streamed linear kernel unavailable") == 1  # once a process
    with pytest.raises(ValueError, match="compiled is not available: RuntimeError: no C"):
        pack_linears(load(model_dirs["target"]), "compiled")


def test_compiled_needs_a_float32_cpu_model(model_dirs):
    with pytest.raises(ValueError, match="compiled needs a float32 model on a CPU"):
        pack_linears(load(model_dirs["target"], dtype=torch.bfloat16), "compiled")


def test_the_runtime_says_which_kernel_runs_its_linears(model_dirs, caplog):
    with caplog.at_level(logging.INFO, "specdec.engine.model"):
        runtime = ModelRuntime(RuntimeSettings(model_dirs["target"], device="cpu", threads=1))
    assert kernel_of(runtime.model) == "compiled"
    assert f"{runtime.packed_linears} linear layers on the compiled streamed kernel" in caplog.text


def test_the_kernel_runs_on_torchs_threads(module):
    """Built with OpenMP, its parallel_for uses torch's intra-op threads (without -fopenmp it
    compiled to a serial loop: --threads 2 ran the layers on one); one thread: one."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert module.threads_used() == 2
        torch.set_num_threads(1)
        assert module.threads_used() == 1
    finally:
        torch.set_num_threads(threads)


def test_building_leaves_the_flags_and_so_the_name_alone(monkeypatch, tmp_path):
    """torch's builder appends to the flag lists it is given: the build passes copies, or the
    next kernel's name (a hash of the flags) would change after every build in a process and
    each start would build a kernel again."""
    import torch.utils.cpp_extension as cpp

    from specdec.engine import compiled

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory):
        extra_cflags.append("-DX")
        extra_ldflags.append("-ltorch")
        return object()

    monkeypatch.setenv("SPECDEC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp, "load", fake_load)
    extension = compiled.Extension("specdec_test", "streamed_linear.cpp", "a test kernel", "none")
    before = extension.module_name()
    assert not isinstance(extension.get(), str)
    assert extension.module_name() == before
    assert compiled.LDFLAGS == ["-fopenmp"] and "-DX" not in compiled.CFLAGS
