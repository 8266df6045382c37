"""Counter-based randomness: every draw is a pure function of (seed, position, stream).

docs/architecture.md, invariant 5. A uniform in [0, 1) is the SplitMix64 finaliser applied to a
key built from the session seed, the absolute token position and the stream, so a replay
after a failover (or a batch of a different shape, or another machine) draws the same
numbers. Implemented on int64 tensors with logical shifts emulated by masks, so it runs
vectorised on any device and gives bit-identical results everywhere.
"""

from __future__ import annotations

import enum

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


class Stream(enum.IntEnum):
    """Independent random streams per position."""

    DRAFT = 1  # the draft's sample of candidate y_i from q̃_i
    ACCEPT = 2  # the accept test u < p(y)/q̃(y)
    RESIDUAL = 3  # the recovered token (residual) or the bonus token (p_{γ+1})


def _to_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _srl(x, 30)) * _to_signed(_M1)
    x = (x ^ _srl(x, 27)) * _to_signed(_M2)
    return x ^ _srl(x, 31)


def seed_tensor(seeds, device=None) -> torch.Tensor:
    """uint64 seeds (Python ints) as an int64 tensor holding the same 64 bits."""
    return torch.tensor([_to_signed(int(s)) for s in seeds], dtype=torch.int64, device=device)


def _mix_int(x: int) -> int:
    """`_mix` on one unsigned 64-bit Python int (the same bits)."""
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _uniform_int(seed: int, position: int, stream: int) -> float:
    key = _mix_int((seed + _GOLDEN * (stream + 1)) & _MASK64)
    x = _mix_int(key ^ ((position * _GOLDEN) & _MASK64))
    return (x >> 11) * (1.0 / (1 << 53))


SMALL = 64  # up to this many draws on a CPU, Python ints beat ~15 tensor ops' dispatch


def uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform float64 in [0, 1) for each (seed, position) pair; shapes broadcast.

    53 random bits, so u < 1 always and every value is exactly representable. A few draws
    on a CPU (the usual round: one per session and position) are computed on Python ints,
    bit for bit the same (tests/unit/test_sampling_core.py)."""
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    if seed.device.type == "cpu" and max(seed.numel(), position.numel()) <= SMALL:
        s, p = torch.broadcast_tensors(seed, position)
        stream = int(stream)
        values = [
            _uniform_int(a & _MASK64, b & _MASK64, stream)
            for a, b in zip(s.reshape(-1).tolist(), p.reshape(-1).tolist())
        ]
        return torch.tensor(values, dtype=torch.float64).reshape(s.shape)
    return _uniform_tensor(seed, position, stream)


def _uniform_tensor(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    key = _mix(seed + _to_signed(_GOLDEN * (int(stream) + 1)))
    x = _mix(key ^ (position * _to_signed(_GOLDEN)))
    return _srl(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def uniform_scalar(seed: int, position: int, stream: int) -> float:
    """One draw; the same value `uniform` gives for these arguments."""
    return _uniform_int(int(seed) & _MASK64, int(position) & _MASK64, int(stream))
