"""The processed distribution of many rows, without materialising it (the hot path).

Every processor keeps a TOP set of the temperature-scaled logits z = logits / T: top-k the
k largest (ties at the k-th value kept), top-p the smallest top set whose mass reaches
top_p, min-p the tokens with exp(z − z_max) ≥ min_p. Applied in order (top-p on the
top-k-renormalised distribution, min-p on what is left) they keep {v : z_v ≥ τ} for one
threshold τ per row, and

    p(v) = exp(z_v − log Z)   for z_v ≥ τ,   0 otherwise,   log Z = log Σ_{z ≥ τ} exp(z).

So a row is described by (τ, log Z): O(1) numbers instead of a dense [vocab] float64 row.
Finding τ needs only the row's largest values: the top of a small window (`WINDOW`;
`torch.topk`, or on a CPU the compiled kernel's `top`).
Rows whose top-p nucleus does not fit are finished together (`specdec.core.nucleus`, in
blocks of rows small enough to stay in cache) from a histogram of their mass and an ordering
of the one bin where each nucleus ends, never a sort of the vocabulary; their log Z comes
from the same float64 masses. Otherwise log Z comes from the window when the kept set fits in
it, else from one pass over the row (`specdec.core.logsum`: float32 exps added in float64, p
then sums to 1 within ~1e-7).

A few rows on a CPU (`few_rows`: a round at low concurrency) cost far more in per-op dispatch
than in arithmetic; their decisions are made on Python floats (`specdec.core.few_rows`) while every exp,
log and sum stays torch's op on the same values, so they get the same τ and log Z bit for bit
(tests/unit/test_small_batch_math.py). Larger batches and other devices take the tensor ops.

Precision: logits and z stay float32 on the model's device, as the model produced them; the
threshold decisions are made in float32 as `specdec.core.sampling.apply_processors` (the
dense reference) makes them. log Z, p(v) and everything sampled from are float64: the
inverse-CDF sampling and the residual max(p − q̃, 0) need float64 so that the probabilities
of small tokens are not rounded away. Where top-p's cut falls on tokens of exactly equal
logit, all of them are kept (the dense reference keeps whichever its sort puts first).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from specdec.core import row_kernel
from specdec.core.few_rows import cuts_few, few_rows, row_index
from specdec.core.logsum import WIDE, full_lse, masked_lse, row_lse
from specdec.core.nucleus import wide_rows
from specdec.core.params import SamplingParams

WINDOW = 64  # top values examined for every sampling row (more only where a nucleus needs it)


_ROWS = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class ProcessorParams:
    """The processors of R rows as tensors (sampling rows only: temperature > 0)."""

    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float64, 1 = off
    min_p: torch.Tensor  # [R] float64, 0 = off
    # Known on the host for the rows or a batch they were taken from (None: not known): the
    # largest top_k (a bound for fixed shapes, `specdec.core.fixed`), and whether any row uses
    # top-p / min-p (the fixed shapes leave out what no row uses)
    top_k_max: int | None = None
    top_p_used: bool | None = None
    min_p_used: bool | None = None

    @classmethod
    def of(cls, params: list[SamplingParams], device=None) -> ProcessorParams:
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device),
            max((p.top_k for p in params), default=0),
            any(p.top_p < 1.0 for p in params),
            any(p.min_p > 0.0 for p in params),
        )

    def _with(self, f) -> ProcessorParams:
        """f applied to each row tensor; what is known on the host kept."""
        rows = (self.temperature, self.top_k, self.top_p, self.min_p)
        return dataclasses.replace(self, **dict(zip(_ROWS, map(f, rows))))

    def __getitem__(self, rows) -> ProcessorParams:
        if rows == slice(0, len(self.temperature)):  # every row (one session's): as is
            return self
        return self._with(lambda t: t[rows])

    def repeat_rows(self, n: int) -> ProcessorParams:
        """Each row n times in a row (one per verified position of a session)."""
        return self._with(lambda t: repeat_each(t, n))

    def largest_top_k(self) -> int:
        """`top_k_max`, or (not known) the rows' largest top_k, read from the device."""
        if self.top_k_max is not None:
            return self.top_k_max
        return int(self.top_k.max()) if len(self.top_k) else 0


def repeat_each(x: torch.Tensor, n: int) -> torch.Tensor:
    """Each value of x [R] n times in a row, [R·n] (`repeat_interleave(n)` without its
    read-back of the output size on a GPU, so a CUDA graph can capture it)."""
    return x[:, None].expand(-1, n).reshape(-1)


@dataclass
class Processed:
    """Rows [R, vocab] of processed distributions as (z, τ, log Z) and their top window."""

    logits: torch.Tensor  # [R, vocab] float32, unscaled
    temperature: torch.Tensor  # [R] float32 (z = logits / temperature, as the reference divides)
    tau: torch.Tensor  # [R] float32, smallest kept z (−inf: everything kept)
    log_z: torch.Tensor  # [R] float64
    top_z: torch.Tensor  # [R, W] float32, the largest z, descending
    top_ids: torch.Tensor  # [R, W] int64
    # [R] float32: the smallest z of each row's own window (rows gathered from windows of
    # several widths pad theirs with −inf); −inf where the window is the whole row. None: the
    # window's last column (`window_edge`)
    edge: torch.Tensor | None = None

    def window_edge(self) -> torch.Tensor:
        """[R]: each row's `edge`."""
        if self.edge is not None:
            return self.edge
        if self.top_z.shape[1] >= self.logits.shape[1]:
            return torch.full_like(self.tau, float("-inf"))
        return self.top_z[:, -1]

    def inside(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(rows)] bool: nothing of the row's kept set lies past its own window — its
        window's smallest value is below τ, or nothing lies past the window at all."""
        edge = self.window_edge()[rows]
        return (edge < self.tau[rows]) | torch.isneginf(edge)

    @classmethod
    def gather(cls, logits: torch.Tensor, parts) -> Processed:
        """The rows of `logits` [R, vocab] processed in `parts` — (row indices, Processed of
        those rows) — as one Processed over all R rows; rows no part covers are left
        unprocessed (τ = +inf: nothing kept, p = 0)."""
        device, count = logits.device, logits.shape[0]
        width = max((part.top_z.shape[1] for _, part in parts), default=1)
        tau = torch.full((count,), float("inf"), device=device)
        log_z = torch.zeros(count, dtype=torch.float64, device=device)
        top_z = torch.full((count, width), float("-inf"), device=device)
        top_ids = torch.zeros(count, width, dtype=torch.int64, device=device)
        temps = torch.ones(count, device=device)
        edge = torch.full((count,), float("-inf"), device=device)
        for index, part in parts:
            w = part.top_z.shape[1]
            tau[index], log_z[index], temps[index] = part.tau, part.log_z, part.temperature
            top_z[index, :w], top_ids[index, :w] = part.top_z, part.top_ids
            edge[index] = part.window_edge()
        return cls(logits, temps, tau, log_z, top_z, top_ids, edge)

    def prob(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p(tokens) for rows (same shapes), float64."""
        z = self.logits[rows, tokens].float() / self.temperature[rows]
        p = torch.exp(z.double() - self.log_z[rows])
        return torch.where(z >= self.tau[rows], p, torch.zeros_like(p))

    def prob_of(self, rows: list[int], tokens: list[int]) -> list[float]:
        """`prob` on Python lists, for a few rows on a CPU: the same float32 division and
        torch's exp, so the same values."""
        logits, temperature = self.logits.numpy(), self.temperature.numpy()
        z = [float(logits[r, t] / temperature[r]) for r, t in zip(rows, tokens)]
        log_z, tau = self.log_z.tolist(), self.tau.tolist()
        shifted = torch.tensor([zv - log_z[r] for r, zv in zip(rows, z)], dtype=torch.float64)
        return [pv if zv >= tau[r] else 0.0 for r, zv, pv in zip(rows, z, shifted.exp().tolist())]

    def top(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest tokens of rows and their log p, float64 ([len(rows), k] each; a
        kept set smaller than k pads with −inf). From the top window: k ≤ its width."""
        if k > self.top_z.shape[1]:
            raise ValueError(f"top: k = {k} exceeds the window of {self.top_z.shape[1]}")
        z, ids = self.top_z[rows, :k], self.top_ids[rows, :k]
        log_p = z.double() - self.log_z[rows, None]
        kept = z >= self.tau[rows, None]
        return torch.where(kept, log_p, torch.full_like(log_p, float("-inf"))), ids

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        """Whole distributions [len(rows), vocab] float64: one row per session, never all."""
        z = self.logits[rows].float() / self.temperature[rows, None]
        p = torch.exp(z.double() - self.log_z[rows, None])
        return torch.where(z >= self.tau[rows, None], p, torch.zeros_like(p))


def top_window(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(logits, width)` of rows [R, vocab] float32; on a CPU the compiled kernel's
    where it is in use (`specdec.core.row_kernel`: ~2.7× faster at a 64-value window, tokens of
    equal logit by id where torch orders them as it likes; every path of a process uses the
    same one, so the small-batch and batched paths still agree)."""
    kernel = row_kernel.for_device(logits.device) if logits.dtype == torch.float32 else None
    if kernel is not None and logits.numel():
        return kernel.top(logits, width)
    return torch.topk(logits, width, dim=-1)


def _thresholds(
    logits: torch.Tensor, pp: ProcessorParams, width: int, with_log_z: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[bool], torch.Tensor]:
    """(τ, log Z, top z, top ids, fits, log_k) for rows of logits, looking at `width` top values.
    Without `with_log_z`, log Z is NaN (not computed: the draft's q̃ needs only τ and the
    window, and a row keeping tokens past it — temperature alone — would cost a whole-row pass).

    `fits` is False for a row whose top-p nucleus may extend past the window: its τ and
    log Z are not final (the caller finishes those rows). `log_k`: the log-mass top-p is
    relative to (the top-k set's; the whole row's when top-k is off), for rows with top-p.

    On a CPU where the compiled sampling kernel is in use, rows of more than `WIDE` values
    (any number of them: the small-batch and batched paths alike) take its `window`, one call
    for the window and every cut (`specdec.core.row_kernel`; log_k NaN without top-p).
    """
    rows, vocab = logits.shape
    width = min(vocab, max(width, int(pp.top_k.max()) + 1 if rows else 1))
    kernel = row_kernel.for_device(logits.device) if logits.dtype == torch.float32 else None
    if kernel is not None and rows and width <= WIDE < vocab:  # each row in one call
        tau, log_z, fits, log_k, z, ids = kernel.window(
            logits, pp.temperature, pp.top_k, pp.top_p, pp.min_p, width, with_log_z
        )
        return tau, log_z, z, ids, fits.tolist(), log_k
    values, ids = top_window(logits, width)  # [R, W], descending: order is z's
    z = values.float() / pp.temperature.to(logits.device)[:, None]
    if few_rows(rows, logits.device) and width <= WIDE:
        tau, log_z, fits, log_k = cuts_few(logits, pp, z, with_log_z)
    else:
        tau, log_z, fits, log_k, _ = cuts(logits, pp, z, with_log_z)
        fits = fits.tolist()
    return tau, log_z, z, ids, fits, log_k


def cuts(
    logits: torch.Tensor,
    pp: ProcessorParams,
    z: torch.Tensor,
    with_log_z: bool = True,
    fixed: bool = False,
):
    """(τ, log Z, fits [R] bool, log_k, τ of top-k) of rows of logits from their top window
    z [R, W] (see `_thresholds`): the processors' cuts as tensor ops, for any batch on any
    device. With `fixed` (`specdec.core.fixed`) nothing is read back: a whole-row sum is
    computed for every row and selected (`_past_lse`), the same bits in shapes a CUDA graph
    can capture. A processor no row uses (`ProcessorParams.top_k_max`, `top_p_used`,
    `min_p_used`, known on the host) is left out: its cut is −inf, as computing it gives."""
    rows, vocab = logits.shape
    width = z.shape[1]
    narrow = width < vocab
    temperature = pp.temperature.to(logits.device)
    ninf = torch.full((rows,), float("-inf"), device=logits.device)
    z_max = z[:, 0]
    k_used = pp.top_k_max is None or pp.top_k_max > 0

    tau_k = ninf
    if k_used:
        k_on = (pp.top_k > 0) & (pp.top_k < vocab)
        kth = z.gather(1, (pp.top_k.clamp(1, width) - 1)[:, None]).squeeze(1)
        tau_k = torch.where(k_on, kth, ninf)
    tau_p, fits, log_k = ninf, torch.ones(rows, dtype=torch.bool, device=z.device), None
    if pp.top_p_used is not False:
        p_on = pp.top_p < 1.0
        # top-p renormalises over the top-k set: its log-mass, from the window when it fits
        log_k = masked_lse(z, tau_k, z_max)
        if narrow:  # a top-k set running past the window: summed over the row
            past = p_on & (z[:, -1] >= tau_k)
            cut = tau_k if k_used else None
            log_k = _past_lse(log_k, past, logits, temperature, cut, z_max, True, fixed)
        mass = torch.exp(z.double() - log_k[:, None])  # top-k-renormalised p of the window
        before = mass.cumsum(dim=-1) - mass  # mass strictly above each rank
        keep = (before < pp.top_p[:, None]) & (z >= tau_k[:, None])
        n_p = keep.sum(dim=-1).clamp(min=1)
        tau_p = torch.where(p_on, z.gather(1, (n_p - 1)[:, None]).squeeze(1), ninf)
        fits = ~(p_on & (n_p == width) & narrow)
    tau = torch.maximum(tau_k, tau_p)
    if pp.min_p_used is not False:
        m_on = pp.min_p > 0.0
        log_min = torch.log(pp.min_p.clamp(min=1e-300))
        tau_m = torch.where(m_on, (z_max.double() + log_min).float(), ninf)
        tau = torch.maximum(tau, tau_m)
    if not with_log_z:
        nan = torch.full((rows,), math.nan, dtype=torch.float64, device=z.device)
        return tau, nan, fits, log_k, tau_k
    log_z = masked_lse(z, tau, z_max)
    if narrow:  # kept tokens past the window
        past = (z[:, -1] >= tau) & fits
        log_z = _past_lse(log_z, past, logits, temperature, tau, z_max, False, fixed)
    return tau, log_z, fits, log_k, tau_k


def _past_lse(current, past, logits, temperature, tau, z_max, scaled: bool, fixed: bool):
    """`current` (log-sums over the window) with the rows `past` replaced by their whole-row
    log-sum (`full_lse`; τ None: every token kept). Eager: only those rows summed. `fixed`:
    every row summed and the right one selected, nothing read back; with `scaled` a row
    without a threshold takes the scaled sum, as `full_lse` chooses it row by row."""
    if fixed:
        whole = None if tau is None else row_lse(logits, temperature, z_max, tau, False)
        if scaled or tau is None:
            free = row_lse(logits, temperature, z_max, None, scaled)
            whole = free if whole is None else torch.where(torch.isinf(tau), free, whole)
        return torch.where(past, whole, current)
    if bool(past.any()):  # usually every row (top-p alone): then no copy of the rows
        r = slice(None) if bool(past.all()) else past.nonzero().squeeze(1)
        cut = None if tau is None else tau[r]
        current[r] = full_lse(logits[r], temperature[r], cut, z_max[r], scaled)
    return current


def process(
    logits: torch.Tensor, pp: ProcessorParams, window: int = WINDOW, window_only: bool = False
) -> Processed:
    """The processed distributions of sampling rows [R, vocab] (see the module docstring).

    Rows whose top-p nucleus does not fit the window are finished together from a
    histogram of their mass (`specdec.core.nucleus`): a few passes over the row and a sort of one
    bin, never of the whole vocabulary (rows with top-k as well, rare, take the whole row).
    With `window_only` (the draft: q̃ is the top window's kept part) such rows are not
    finished: the whole window is inside their nucleus, so the τ `_thresholds` found (at
    most the window's last value) keeps exactly the window tokens top-k and min-p keep; and
    no row's log Z is computed (NaN: q̃ needs only τ and the window, and a row keeping
    tokens past it, temperature alone, would pay a whole-row pass) — exact for every token
    of the window, not beyond."""
    logits = logits if logits.dtype == torch.float32 else logits.float()
    tau, log_z, top_z, top_ids, fits, log_k = _thresholds(
        logits, pp, window, with_log_z=not window_only
    )
    unfinished = [] if window_only else [i for i, row_fits in enumerate(fits) if not row_fits]
    vocab, top_k = logits.shape[-1], pp.top_k.tolist()
    with_k = [i for i in unfinished if 0 < top_k[i] < vocab]
    for i in with_k:  # rare: the whole row as the window
        t, lz, *_ = _thresholds(logits[i : i + 1], pp[i : i + 1], vocab)
        tau[i], log_z[i] = t[0], lz[0]
    wide = [i for i in unfinished if not 0 < top_k[i] < vocab]
    if wide:
        index = row_index(wide)
        tau[index], log_z[index] = wide_rows(
            logits[index], pp[index], log_k[index], top_z[index, 0]
        )
    return Processed(logits, pp.temperature.to(logits.device), tau, log_z, top_z, top_ids)
