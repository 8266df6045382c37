"""The sampling hot path as CUDA graphs: one launch a verify, one a draft step (`--sampling-graphs`).

`specdec.core.fixed` computes a verify's sampling sessions and a draft step's sampled rows in
shapes that depend only on the batch's shape, with nothing read back to the host. On a CUDA
device `SamplingGraphs` captures each such call once per shape bucket — sessions and q̃
entries rounded up to a power of two, γ, vocabulary and window as they are — and replays it:
a sampling verify goes to the GPU as one graph of ~420 kernels instead of ~1,500 operators
launched from Python with stalls between them (docs/benchmarks.md, "Sampling math as one
CUDA graph": 2.6 against 7.5 ms at 128k × 16 on an H200). Inputs are copied into
the graph's own buffers (rows past the live batch keep neutral processors: temperature 1,
everything kept, so they neither fail nor change a live row's sums), and the results read
back in one copy. A session the fixed shapes flag (`redo`: rare, see `specdec.core.fixed`)
sends the whole verify to the eager path, so every result is the eager path's.

Each bucket's graph keeps its own memory (inputs, outputs and the intermediates of its
capture), kept within a budget (`--sampling-graphs-mb`, see `SamplingGraphs`). On a CPU
nothing is captured: the same padded calls run eagerly (what the tests exercise).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdec.core import fixed
from specdec.core.processed import WINDOW, Processed, ProcessorParams, repeat_each

log = logging.getLogger(__name__)

# neutral values of padding rows, by input name (others are zeros)
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "q_weights": 1.0}


def for_device(mode: str, device, budget_mb: int = 4096) -> SamplingGraphs | None:
    """The workers' `--sampling-graphs` (and `--sampling-graphs-mb`): auto = on a CUDA device
    only; on = any device (a CPU runs the fixed shapes eagerly); off = None (the eager path)."""
    device = torch.device(device)
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"sampling_graphs: expected one of auto, on, off, got {mode!r}")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    return SamplingGraphs(device, budget_mb=budget_mb)


def _host(pp: ProcessorParams) -> tuple:
    """Which processors the rows use, as the fixed shapes see it (part of a graph's key):
    (top-k bound, top-p used, min-p used), the bound only as 'any top-k' (the window
    already follows the largest top-k)."""
    return (int(pp.largest_top_k() > 0), pp.top_p_used is not False, pp.min_p_used is not False)


def _bucket(n: int) -> int:
    """n rounded up to a power of two (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _Graph:
    """One captured (or, on a CPU, padded eager) call: its input buffers and outputs."""

    fn: object
    inputs: dict[str, torch.Tensor]  # name -> buffer, padded leading dimension
    live: dict[str, int] = field(default_factory=dict)  # rows written by the last call
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple = ()

    def feed(self, values: dict[str, torch.Tensor]) -> None:
        """Copy the live inputs in; rows a previous call wrote past them back to neutral."""
        for name, value in values.items():
            buffer, rows = self.inputs[name], value.shape[0]
            if value.shape[1:] == buffer.shape[1:]:
                buffer[:rows].copy_(value)
            else:  # a narrower last dimension (q̃ entries): the rest neutral
                buffer[:rows].fill_(0)
                buffer[:rows, ..., : value.shape[-1]].copy_(value)
            stale = self.live.get(name, buffer.shape[0])
            if stale > rows:
                buffer[rows:stale].fill_(_NEUTRAL.get(name, 0))
            self.live[name] = rows

    def run(self, capture: bool) -> tuple:
        if not capture:
            return self.fn(**self.inputs)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.outputs

    def _capture(self) -> None:
        side = torch.cuda.Stream(device=next(iter(self.inputs.values())).device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation off the graph
                self.fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self.fn(**self.inputs)
        self.graph = graph


BYTES_PER_LOGIT = 48  # a graph's memory, estimated per logit of its padded rows (see below)


class SamplingGraphs:
    """Fixed-shape sampling verify and draft steps for one device (see the module docstring).

    capture: None = on a CUDA device only. A graph holds its inputs, outputs and the
    intermediates of its capture: about `BYTES_PER_LOGIT` bytes per logit of its padded rows
    (the float32 rows and z, the float64 masses and int64 bins of the histogram, masks and
    temporaries); graphs are kept while their estimate stays within `budget_mb` and their
    number within `capacity`, the least recently used released beyond, and a shape whose
    graph alone exceeds the budget runs on the eager path. `counts` says how the calls went
    (graphs captured; calls replayed, of which sent back to the eager path; calls of a shape
    too large; calls after a failed capture): `specdec_worker_sampling_graph_calls`."""

    def __init__(
        self, device, capture: bool | None = None, capacity: int = 16, budget_mb: int = 4096
    ):
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.capacity = capacity
        self.budget_mb = budget_mb
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._mb: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self.counts = {"captures": 0, "calls": 0, "eager": 0, "too_large": 0, "off": 0}
        self.broken = False  # a capture failed: every call takes the eager path

    def _run(self, key: tuple, graph: _Graph) -> tuple | None:
        """The graph's outputs; None where its capture failed (an operator this torch or
        GPU cannot capture, memory): then no graph is tried again on this device, the reason
        logged once, and every call takes the eager path."""
        try:
            return graph.run(self.capture)
        except Exception as exc:
            if graph.graph is not None or not self.capture:
                raise  # a replay, or no capture at all: not a capture failure
            log.warning("sampling graphs off on %s: capture failed (%s)", self.device, exc)
            self.broken = True
            self.counts["off"] += 1
            self._graphs.pop(key, None)
            self._mb.pop(key, None)
            return None

    def held_mb(self) -> float:
        """The estimated memory of the graphs kept (0 where nothing is captured)."""
        return sum(self._mb.values())

    def _graph(self, key: tuple, fn, shapes: dict[str, tuple], logits: int) -> _Graph | None:
        """The graph of `key` (made on first use); None: too large for the budget, or no
        capture works here."""
        if self.broken:
            self.counts["off"] += 1
            return None
        graph = self._graphs.get(key)
        if graph is None:
            mb = logits * BYTES_PER_LOGIT / 2**20 if self.capture else 0.0
            if mb > self.budget_mb:
                self.counts["too_large"] += 1
                return None
            while self._graphs and (
                len(self._graphs) >= self.capacity or self.held_mb() + mb > self.budget_mb
            ):
                old, _ = self._graphs.popitem(last=False)
                del self._mb[old]
            inputs = {}
            for name, (shape, dtype) in shapes.items():
                inputs[name] = torch.full(
                    shape, _NEUTRAL.get(name, 0), dtype=dtype, device=self.device
                )
            graph = self._graphs[key] = _Graph(fn, inputs)
            self._mb[key] = mb
            self.counts["captures"] += self.capture
        self._graphs.move_to_end(key)
        return graph

    def _call(self, key: tuple, fn, inputs: dict[str, tuple], logits: int, take):
        """take(outputs) of the graph of `key` fed `inputs` ({name: (value, padded shape,
        dtype)}; `logits`: its padded logits, for the memory estimate), under the lock: the
        outputs are the graph's own buffers. None where the eager path must run."""
        with self._lock:
            shapes = {name: (shape, dtype) for name, (_, shape, dtype) in inputs.items()}
            graph = self._graph(key, fn, shapes, logits)
            if graph is None:
                return None
            graph.feed({name: value for name, (value, _, _) in inputs.items()})
            outputs = self._run(key, graph)
            if outputs is None:
                return None
            self.counts["calls"] += 1
            return take(outputs)

    def verify(
        self, rows: torch.Tensor, pp: ProcessorParams, block, seeds, base_positions
    ) -> tuple[torch.Tensor, torch.Tensor, Processed] | None:
        """(accepted counts [S], next tokens [S], processed rows) of S sampling sessions, as
        `specdec.core.verify._accept_sampling` and `sample_next` give them; None where a
        session needs the eager path, or the shape is too large for the budget (the caller
        runs the eager path)."""
        sessions, gamma = block.candidates.shape
        slots, vocab = gamma + 1, rows.shape[1]
        width = fixed.width_for(pp, vocab)
        pad, k = _bucket(sessions), _bucket(block.q_ids.shape[2])
        host = _host(pp)

        def fn(
            rows, temperature, top_k, top_p, min_p, candidates, num, q_ids, q_weights, seeds, base
        ):
            params = ProcessorParams(temperature, top_k, top_p, min_p, *host)
            draft = fixed.DraftBlock(candidates, num, q_ids, q_weights)
            n, tokens, redo, processed = fixed.verify_sampling(
                rows, params, draft, seeds, base, width
            )
            packed = torch.stack([n, tokens, redo.long()])
            return packed, processed.tau, processed.log_z, processed.top_z, processed.top_ids

        def take(outputs):
            packed, tau, log_z, top_z, top_ids = outputs
            n, tokens, redo = packed[:, :sessions].tolist()
            if any(redo):
                self.counts["eager"] += 1
                return None
            live = sessions * slots
            temperature = repeat_each(pp.temperature, slots)
            kept = (x[:live].clone() for x in (tau, log_z, top_z, top_ids))
            return n, tokens, Processed(rows, temperature, *kept)

        i64 = torch.int64
        inputs = {
            "rows": (rows, (pad * slots, vocab), torch.float32),
            **_processor_inputs(pp, pad),
            "candidates": (block.candidates, (pad, gamma), i64),
            "num": (block.num_candidates, (pad,), i64),
            "q_ids": (block.q_ids, (pad, gamma, k), i64),
            "q_weights": (block.q_weights, (pad, gamma, k), torch.float64),
            "seeds": (seeds, (pad,), i64),
            "base": (base_positions, (pad,), i64),
        }
        key = ("verify", pad, slots, vocab, k, width, host)
        done = self._call(key, fn, inputs, pad * slots * vocab, take)
        if done is None:
            return None
        n, tokens, processed = done
        device = rows.device
        return torch.tensor(n, device=device), torch.tensor(tokens, device=device), processed

    def propose(
        self, logits: torch.Tensor, pp: ProcessorParams, seeds, positions, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(candidates [S], q̃ ids [S, k], wire weights [S, k]) of S sampled draft rows, as
        `specdec.core.proposal.propose_step` gives them; None: a shape too large for the
        budget (the caller runs the eager path)."""
        sessions, vocab = logits.shape
        width = fixed.width_for(pp, vocab, max(WINDOW, k))
        pad = _bucket(sessions)
        host = _host(pp)

        def fn(rows, temperature, top_k, top_p, min_p, seeds, positions):
            params = ProcessorParams(temperature, top_k, top_p, min_p, *host)
            return fixed.propose_sampling(rows, params, seeds, positions, k, width)

        inputs = {
            "rows": (logits, (pad, vocab), torch.float32),
            **_processor_inputs(pp, pad),
            "seeds": (seeds, (pad,), torch.int64),
            "positions": (positions, (pad,), torch.int64),
        }
        key = ("propose", pad, vocab, k, width, host)
        return self._call(
            key, fn, inputs, pad * vocab, lambda out: tuple(x[:sessions].clone() for x in out)
        )


def _processor_inputs(pp: ProcessorParams, pad: int) -> dict[str, tuple]:
    """The processors' row tensors as graph inputs: (value, padded shape, dtype)."""
    return {
        "temperature": (pp.temperature, (pad,), torch.float32),
        "top_k": (pp.top_k, (pad,), torch.int64),
        "top_p": (pp.top_p, (pad,), torch.float64),
        "min_p": (pp.min_p, (pad,), torch.float64),
    }
