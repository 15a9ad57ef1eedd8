"""The entropy-bound sampler (seed Part II §6): schedule, row stats, accept mask, renoise, stop rules.

Everything stays on the device; the only host read per step is the stop flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffgemma.config import SamplerConfig
from diffgemma.kernels import dispatch
from diffgemma.kernels import torch_ref as ref_ops

SC_SPARSE_LOG_RATIO = -10.0  # seed §5: survivors have p >= e^-10 * row max
FILLER_TOKEN_ID = 262143  # seed §1's filler sentinel: the argmax of a row whose logits were not finite


def filler_id(vocab: int) -> int:
    """The filler sentinel inside this vocabulary (the last id of a smaller test vocabulary)."""
    return min(FILLER_TOKEN_ID, vocab - 1)


def temperature(cfg: SamplerConfig, remaining: int) -> float:
    """Linear schedule; `remaining` counts DOWN from max_steps (first step T = t_max) to 1."""
    return cfg.t_min + (cfg.t_max - cfg.t_min) * (remaining / cfg.max_denoising_steps)


@dataclass
class RowStats:
    probs: torch.Tensor | None  # [C, V] softmax(logits / T), fp32 (None when not asked for and sc is sparse)
    sc: torch.Tensor  # [C, V] the next step's SC probabilities (`sc_probs` of probs)
    entropy: torch.Tensor  # [C] nats
    argmax: torch.Tensor  # [C]
    p_max: torch.Tensor  # [C]


def row_stats(
    logits: torch.Tensor,
    temp: float,
    sc_sparse: bool = False,
    need_probs: bool = True,
    sc_out: torch.Tensor | None = None,
    softcap: float | None = None,
    fast: bool = True,
) -> RowStats:
    """Tempered softmax, entropy, argmax and top probability per canvas row, and the next step's SC
    probabilities (sparse or not; written into `sc_out` when given). logits [C, V]: fp32, or with `softcap`
    the model's output before its final softcap (any float dtype), softcapped here as `torch_ref.softcap`.

    With `fast` (the run's kernels) on CUDA one Triton kernel (`kernels.triton_sampler`), which skips the dense probs
    when they are not needed and sc is sparse; else (and after a Triton failure) the torch ops."""
    if fast and triton_rows(logits, softcap is not None):
        floor = SC_SPARSE_LOG_RATIO if sc_sparse else None
        out = dispatch.attempt(
            "triton_sampler", lambda m: m.row_stats(logits, temp, floor, need_probs, sc_out, softcap), logits
        )
        if out is not None:
            return RowStats(*out)
    if softcap is not None:
        logits = ref_ops.softcap(logits, softcap)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temp
    logp = torch.log_softmax(z, dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    p_max, argmax = probs.max(-1)
    sc = sc_probs(probs, sc_sparse, p_max)
    if sc_out is not None:
        sc = sc_out.copy_(sc)
    return RowStats(probs, sc, entropy, argmax, p_max)


def split_rows(stats: RowStats, n: int) -> list[RowStats]:
    """The row stats of n canvases' rows (one row pass over all of them) as each canvas's own, views."""
    c = stats.entropy.shape[0] // n

    def part(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
        return None if t is None else t[i * c : (i + 1) * c]

    return [
        RowStats(*(part(t, i) for t in (stats.probs, stats.sc, stats.entropy, stats.argmax, stats.p_max)))
        for i in range(n)
    ]


def guard_invalid_rows(stats: RowStats, filler: int) -> torch.Tensor:
    """The invalid-logits guard: a row whose logits were not finite (a degenerate forward's NaN) takes the filler
    sentinel as its argmax, the largest entropy a row can have (log V: accepted only as the lowest row, never
    converged) and top probability 0. Returns the rows' mask [C]."""
    bad = ~torch.isfinite(stats.entropy)
    log_v = math.log(stats.sc.shape[-1])
    stats.argmax = torch.where(bad, filler, stats.argmax)
    stats.entropy = torch.where(bad, log_v, stats.entropy)
    stats.p_max = torch.where(bad, 0.0, stats.p_max)
    return bad


def triton_rows(logits: torch.Tensor, softcapped_here: bool = False) -> bool:
    """Whether the Triton row pass takes these rows: 2-D with unit column stride, fp32 (any float dtype when the
    kernel softcaps them)."""
    dtype_ok = logits.dtype == torch.float32 or (softcapped_here and logits.dtype.is_floating_point)
    return dtype_ok and logits.dim() == 2 and logits.stride(1) == 1


def accept_mask(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accept the lowest-entropy rows while the sum of the accepted entropies, less the largest, stays
    within the bound (transformers' EntropyBoundSampler); the lowest row is always accepted."""
    sorted_h, order = torch.sort(entropy, dim=-1)
    keep = (torch.cumsum(sorted_h, dim=-1) - sorted_h) <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row by inverse CDF with the given uniforms in [0, 1)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target).clamp_max(probs.shape[-1] - 1)[:, 0]


def sc_probs(probs: torch.Tensor, sparse: bool, p_max: torch.Tensor | None = None) -> torch.Tensor:
    """The next step's SC probabilities; the sparse variant drops the tail below e^-10 of the row max (`p_max`,
    the rows' max when the caller has it: `RowStats.p_max`)."""
    if not sparse:
        return probs
    if p_max is None:
        p_max = probs.max(-1).values
    floor = p_max[:, None] * math.exp(SC_SPARSE_LOG_RATIO)
    return torch.where(probs >= floor, probs, torch.zeros_like(probs))


class StopState:
    """Early-stop rules of seed §6.6, evaluated on device tensors."""

    def __init__(self, cfg: SamplerConfig, pad_id: int, filler: int = FILLER_TOKEN_ID):
        self.cfg = cfg
        self.pad_id, self.filler = pad_id, filler
        self.history: list[torch.Tensor] = []  # previous argmax canvases, newest last
        self.prev_mask: torch.Tensor | None = None
        self.plateau_run: torch.Tensor | None = None  # consecutive steps with an unchanged accept mask

    def update(
        self, step: int, argmax: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """A 0-d bool tensor: stop after this step (`step` counts executed steps from 1)."""
        cfg = self.cfg
        mean_h = entropy.mean()
        k = cfg.stability_threshold
        if k == 0:
            stable = torch.ones((), dtype=torch.bool, device=argmax.device)
        elif len(self.history) < k:
            stable = torch.zeros((), dtype=torch.bool, device=argmax.device)
        else:
            stable = torch.stack([(h == argmax).all() for h in self.history[-k:]]).all()
        self.history = (self.history + [argmax])[-max(k, 1) :]
        stop = stable & (mean_h < cfg.confidence_threshold)

        if cfg.plateau_steps > 0:
            if self.prev_mask is None:
                self.plateau_run = torch.zeros((), device=mask.device)
            else:  # "unchanged for >= N consecutive steps": N equal transitions after the first mask
                same = (mask == self.prev_mask).all()
                self.plateau_run = torch.where(same, self.plateau_run + 1, torch.zeros_like(self.plateau_run))
            stop |= (self.plateau_run >= cfg.plateau_steps) & (mean_h < cfg.plateau_mean_entropy)
        self.prev_mask = mask

        if cfg.entropy_stop > 0 and step >= cfg.entropy_stop_min_steps:
            stop |= mean_h < cfg.entropy_stop
        if cfg.pad_gate:  # a canvas of nothing but pad and filler is a degenerate forward, not an answer
            stop &= ~((argmax == self.pad_id) | (argmax == self.filler)).all()
        return stop
