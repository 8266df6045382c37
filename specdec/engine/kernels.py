"""CPU linear layers: a compiled kernel that streams each weight once, or prepacked oneDNN.

`--linear-kernel` chooses: auto (the compiled kernel, `StreamedLinear`, where it builds and
every layer agrees with `F.linear`; else oneDNN where present and agreeing; else torch's
own), compiled (the compiled kernel, or fail), packed (oneDNN, or fail), default (torch's).

**The compiled kernel** (`csrc/streamed_linear.cpp`, built once per machine like the
attention kernel, `specdec.engine.compiled`). At the few rows of a step or a verify pass a
layer is bound by reading its weight from memory; laid out as groups of 64 outputs, input by
input, the weights stream at 13-15 GB/s on this machine's cores against oneDNN's 9 and
torch's 11 (all 113 layers of the code target at one row: 9.3 ms against 14.2 and 11.1; at
five rows 8.8 against 13.4 and 14.2; docs/benchmarks.md, "A linear kernel that streams its
weight"). Each output is one sum over the inputs in order, so a row's result does not depend
on the rows batched with it.

**oneDNN.** On CPU, torch's `F.linear` runs MKL's sgemm, which repacks the weight on every
call and, for the few rows a decode step or a verify pass has (1 to a few dozen), costs
about one weight pass per row: verifying γ+1 = 5 tokens of SmolLM2 took 1.8 target steps on one thread. oneDNN
with the weight reordered once at load (the same prepacking torch's inductor uses when it
freezes a model) reads each weight once per call, so a verify pass costs little more than a
step, and a step itself gets faster (measured in docs/benchmarks.md, "CPU linear kernels").

The packed product is the same linear map in float32 with another summation order: logits
move by ~1e-6 relative, as between a batched and an unbatched forward, so lossless still
holds relative to the target as loaded (README, "Limits of lossless"). `pack_linears` checks
every layer against `F.linear` and keeps the stock layers when anything disagrees or oneDNN
is missing. CUDA and non-float32 models keep their own kernels.
"""

from __future__ import annotations

import torch

from specdec.engine.compiled import Extension

KERNELS = ("auto", "compiled", "packed", "default")
EXTENSION = Extension(
    "specdec_linear", "streamed_linear.cpp", "the streamed linear kernel", "oneDNN's or torch's"
)
PACK_ROWS_HINT = 8  # the row count oneDNN tunes the reorder for; any count works
CHECK_RTOL = 1e-4  # agreement with F.linear a packed layer must show at load
# Fewer rows than this are padded with zero rows up to it: oneDNN's kernel for one or two
# rows streams a weight that is not in cache more slowly than its kernel for four (whole
# forwards at 1 thread, weights from memory: a SmolLM2 step 54.5 -> 47.3 ms, a 2-token
# verify 66.4 -> 49.8 ms, the code target's 20.7 -> 19.3 and 22.7 -> 19.9 ms; one layer
# alone, its weight in cache, is not slower at one row). docs/benchmarks.md, "Four rows".
MIN_ROWS = 4


class PackedLinear(torch.nn.Module):
    """A bias-optional `nn.Linear` whose weight is held reordered for oneDNN (inference only)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if 0 < count < MIN_ROWS:  # zero rows below: each output row depends on its own row only
            rows = torch.nn.functional.pad(rows, (0, 0, 0, MIN_ROWS - count))
        out = torch.ops.mkldnn._linear_pointwise(
            rows.contiguous(), self.packed, self.bias, "none", [], ""
        )
        return out[:count].reshape(*x.shape[:-1], self.out_features)


class StreamedLinear(torch.nn.Module):
    """A bias-optional `nn.Linear` whose weight is held in the compiled kernel's layout
    (inference only)."""

    def __init__(self, linear: torch.nn.Linear, module):
        super().__init__()
        self.kernel = module
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = module.pack(linear.weight.detach())  # a copy in the kernel's layout
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear(x, self.packed, self.bias, self.out_features)


def cpu_float32(model: torch.nn.Module) -> bool:
    """Whether the model's weights are float32 on the CPU (the kernels here apply)."""
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.float32


def packing_supported(model: torch.nn.Module) -> bool:
    """Packed linears apply to float32 models on the CPU with oneDNN compiled in."""
    return (
        cpu_float32(model)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _linear_children(module: torch.nn.Module):
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            yield module, name, child
        else:
            yield from _linear_children(child)


def _agrees(linear: torch.nn.Linear, packed: torch.nn.Module, generator: torch.Generator) -> bool:
    """The replacement computes F.linear's map within CHECK_RTOL on 1, 5 and 13 rows: one row
    (padded to MIN_ROWS by oneDNN's), more than MIN_ROWS, and several row groups of the
    compiled kernel's (groups of at most 6 rows, 2 without AVX-512)."""
    for rows in (1, MIN_ROWS + 1, 13):
        x = torch.randn(rows, linear.in_features, generator=generator)
        want = torch.nn.functional.linear(x, linear.weight, linear.bias)
        got = packed(x)
        scale = float(want.abs().max()) or 1.0
        if not torch.isfinite(got).all() or float((got - want).abs().max()) > CHECK_RTOL * scale:
            return False
    return True


def compiled_module(kernel: str):
    """The compiled kernel's module for `kernel` (auto | compiled), or None where it cannot
    be built (auto; compiled raises, naming why)."""
    return EXTENSION.module("linear_kernel", required=kernel == "compiled")


@torch.no_grad()
def pack_linears(model: torch.nn.Module, kernel: str = "auto") -> int:
    """Replace every `nn.Linear` of a CPU float32 model by a `StreamedLinear` or a
    `PackedLinear`; returns how many (`kernel_of` says which).

    `kernel`: auto = the compiled kernel where it builds and agrees, else oneDNN where
    supported and agreeing, else none (0); compiled / packed = that one or raise; default = 0.
    Every replaced layer is checked against `F.linear` on random rows first, then the model
    runs one forward of two tokens; a disagreement or a failure keeps the whole model on the
    next kernel (auto) or raises.
    """
    if kernel not in KERNELS:
        raise ValueError(f"linear_kernel: expected one of {list(KERNELS)}, got {kernel!r}")
    if kernel == "default":
        return 0
    if kernel in ("auto", "compiled"):
        if not cpu_float32(model):
            if kernel == "compiled":
                raise ValueError("linear_kernel: compiled needs a float32 model on a CPU")
            return 0
        module = compiled_module(kernel)
        if module is not None:
            strict = kernel == "compiled"
            swapped = _swap(model, "compiled", strict, lambda lin: StreamedLinear(lin, module))
            if swapped or kernel == "compiled":
                return swapped
    if not packing_supported(model):
        if kernel == "packed":
            raise ValueError("linear_kernel: packed needs a float32 model on a CPU with oneDNN")
        return 0
    return _swap(model, "packed", kernel == "packed", PackedLinear)


LINEAR_LABELS = {
    "compiled": "the compiled streamed kernel",
    "packed": "prepacked oneDNN kernels",
    "default": "torch's own linear kernels",
}


def kernel_of(model: torch.nn.Module) -> str:
    """Which kernel runs the model's linear layers: compiled, packed or default."""
    for module in model.modules():
        if isinstance(module, StreamedLinear):
            return "compiled"
        if isinstance(module, PackedLinear):
            return "packed"
    return "default"


def _swap(model: torch.nn.Module, name: str, strict: bool, make) -> int:
    """Every `nn.Linear` replaced by `make(linear)` where each agrees and the model then runs;
    else none (0), or ValueError with `strict`."""
    generator = torch.Generator().manual_seed(0)
    swaps = []
    for parent, child, linear in list(_linear_children(model)):
        try:
            packed = make(linear)
            ok = _agrees(linear, packed, generator)
        except RuntimeError:
            ok = False
        if not ok:
            if strict:
                raise ValueError(f"linear_kernel: the {name} kernel disagrees on layer {child}")
            return 0
        swaps.append((parent, child, packed))
    originals = [(parent, child, getattr(parent, child)) for parent, child, _ in swaps]
    for parent, child, packed in swaps:
        setattr(parent, child, packed)
    try:  # a model whose code reads a linear's .weight directly cannot run packed
        model(input_ids=torch.tensor([[0, 1]]), use_cache=False)
    except Exception as error:  # noqa: BLE001 - any failure: put torch's layers back
        for parent, child, linear in originals:
            setattr(parent, child, linear)
        if strict:
            raise ValueError(f"linear_kernel: the model does not run {name} ({error})") from None
        return 0
    return len(swaps)
