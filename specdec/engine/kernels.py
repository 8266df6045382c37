"""CPU linear layers with prepacked oneDNN weights.

On CPU, torch's `F.linear` runs MKL's sgemm, which repacks the weight on every call and, for
the few rows a decode step or a verify pass has (1 to a few dozen), costs about one weight
pass per row: verifying γ+1 = 5 tokens of SmolLM2 took 1.8 target steps on one thread. oneDNN
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

KERNELS = ("auto", "packed", "default")
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


def packing_supported(model: torch.nn.Module) -> bool:
    """Packed linears apply to float32 models on the CPU with oneDNN compiled in."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _linear_children(module: torch.nn.Module):
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            yield module, name, child
        else:
            yield from _linear_children(child)


def _agrees(linear: torch.nn.Linear, packed: PackedLinear, generator: torch.Generator) -> bool:
    """The packed layer computes F.linear's map within CHECK_RTOL, on one row (padded) and on
    more rows than MIN_ROWS."""
    for rows in (1, MIN_ROWS + 1):
        x = torch.randn(rows, linear.in_features, generator=generator)
        want = torch.nn.functional.linear(x, linear.weight, linear.bias)
        got = packed(x)
        scale = float(want.abs().max()) or 1.0
        if not torch.isfinite(got).all() or float((got - want).abs().max()) > CHECK_RTOL * scale:
            return False
    return True


@torch.no_grad()
def pack_linears(model: torch.nn.Module, kernel: str = "auto") -> int:
    """Replace every `nn.Linear` of a CPU float32 model by a `PackedLinear`; returns how many.

    `kernel`: auto = pack when supported (0 otherwise), packed = pack or raise, default = 0.
    Every packed layer is checked against `F.linear` on random rows first, then the model
    runs one forward of two tokens packed; a disagreement or a failure keeps the whole model
    on the stock kernels (auto) or raises (packed).
    """
    if kernel not in KERNELS:
        raise ValueError(f"linear_kernel: expected one of {list(KERNELS)}, got {kernel!r}")
    if kernel == "default":
        return 0
    if not packing_supported(model):
        if kernel == "packed":
            raise ValueError("linear_kernel: packed needs a float32 model on a CPU with oneDNN")
        return 0
    generator = torch.Generator().manual_seed(0)
    swaps = []
    for parent, name, linear in list(_linear_children(model)):
        try:
            packed = PackedLinear(linear)
            ok = _agrees(linear, packed, generator)
        except RuntimeError:
            ok = False
        if not ok:
            if kernel == "packed":
                raise ValueError(f"linear_kernel: the packed kernel disagrees on layer {name}")
            return 0
        swaps.append((parent, name, packed))
    originals = [(parent, name, getattr(parent, name)) for parent, name, _ in swaps]
    for parent, name, packed in swaps:
        setattr(parent, name, packed)
    try:  # a model whose code reads a linear's .weight directly cannot run packed
        model(input_ids=torch.tensor([[0, 1]]), use_cache=False)
    except Exception as error:  # noqa: BLE001 - any failure: put torch's layers back
        for parent, name, linear in originals:
            setattr(parent, name, linear)
        if kernel == "packed":
            raise ValueError(f"linear_kernel: the model does not run packed ({error})") from None
        return 0
    return len(swaps)
