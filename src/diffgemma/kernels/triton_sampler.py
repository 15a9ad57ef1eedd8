"""The sampler's row pass (`engine.sampler.row_stats`) as one Triton kernel: per canvas row of fp32 logits, the
tempered softmax, its entropy, argmax and top probability.

The torch ops make ~10 passes over the [C, V] fp32 logits (divide, log_softmax, exp, the entropy's product and
sum, max), 1 GB a denoise step at C = 256 and V = 262,144. Here one program owns a row and reads it twice.
Pass 1 keeps per lane a running max m, the rescaled sum s of exp(z - m) and t of exp(z - m) * (z - m), and the
first index of the lane's largest z; lanes are merged at the end. With S and T the row's sums at its max M,
log p = (z - M) - log S (log_softmax's order of operations), the entropy is log S - T / S. Pass 2 writes p = exp((z - M) - log S) in fp32, and the top probability is
the largest p written.

z = logits * (1 / temp) with the reciprocal rounded to fp32 first: what torch computes for `logits / temp` on
CUDA with a Python float divisor, so z matches it bit for bit and so does the argmax.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _row_stats_kernel(
    x_ptr,
    probs_ptr,
    entropy_ptr,
    argmax_ptr,
    p_max_ptr,
    n_cols,
    stride_x,
    stride_p,
    inv_temp,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    p_row = probs_ptr + row.to(tl.int64) * stride_p
    cols = tl.arange(0, BLOCK)
    # A finite floor for m: a lane that has seen only masked columns rescales by exp(0) * 0, never inf - inf.
    m = tl.full((BLOCK,), -1.0e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    t = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), -float("inf"), tl.float32)
    best_col = tl.zeros((BLOCK,), tl.int32)
    # while, not range(0, n_cols, BLOCK): Triton 3.6's interpreter cannot bound a range by a runtime argument.
    start = 0
    while start < n_cols:
        ok = start + cols < n_cols
        z = tl.load(x_row + start + cols, mask=ok, other=-float("inf")) * inv_temp
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        d = tl.where(ok, z - m_new, 0.0)  # masked columns: e = 0, and 0 * -inf would be NaN
        e = tl.exp(z - m_new)
        t = scale * (t + (m - m_new) * s) + e * d
        s = s * scale + e
        m = m_new
        first = z > best  # strict: a lane keeps its earliest column among equal values
        best = tl.where(first, z, best)
        best_col = tl.where(first, start + cols, best_col)
        start += BLOCK
    m_row = tl.max(m, axis=0)
    w = tl.exp(m - m_row)
    s_row = tl.sum(s * w, axis=0)
    t_row = tl.sum(w * (t + (m - m_row) * s), axis=0)
    log_s = tl.log(s_row)
    tl.store(entropy_ptr + row, log_s - t_row / s_row)
    tl.store(argmax_ptr + row, tl.min(tl.where(best == m_row, best_col, n_cols), axis=0).to(tl.int64))
    # p_max as the max of the stored p, not exp(-log S): on the H200 the two differed by an ulp in some rows.
    p_max = tl.zeros((BLOCK,), tl.float32)
    start = 0
    while start < n_cols:
        ok = start + cols < n_cols
        z = tl.load(x_row + start + cols, mask=ok, other=-float("inf")) * inv_temp
        p = tl.exp((z - m_row) - log_s)
        tl.store(p_row + start + cols, p, mask=ok)
        p_max = tl.maximum(p_max, p)
        start += BLOCK
    tl.store(p_max_ptr + row, tl.max(p_max, axis=0))


def row_stats(
    logits: torch.Tensor, temp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [C, V] fp32, entropy [C], argmax [C] int64, p_max [C]) of softmax(logits / temp); logits [C, V]
    fp32 with unit column stride."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"row_stats wants [C, V] fp32 rows with unit stride, got {logits.dtype} {logits.stride()}"
        )
    c, v = logits.shape
    dev = logits.device
    probs = torch.empty(c, v, device=dev, dtype=torch.float32)
    entropy = torch.empty(c, device=dev, dtype=torch.float32)
    argmax = torch.empty(c, device=dev, dtype=torch.int64)
    p_max = torch.empty(c, device=dev, dtype=torch.float32)
    inv_temp = float(np.float32(1.0) / np.float32(temp))
    _row_stats_kernel[(c,)](
        logits,
        probs,
        entropy,
        argmax,
        p_max,
        v,
        logits.stride(0),
        probs.stride(0),
        inv_temp,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    return probs, entropy, argmax, p_max
