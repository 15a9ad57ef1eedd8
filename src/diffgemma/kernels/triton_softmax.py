"""The softmax of long fp32 score rows in the head_dim-512 attention, whose scores are materialized as
[Hkv, g*C, S] fp32 (`cuda.attention_nomask` in a denoise step, `cuda.attention_causal_scores` in a prefill
chunk), held as flash kernels hold P: unnormalized, the division after P @ V.

`exp_rows`: one program owns a row and reads it once. It writes exp(x - c) in the value dtype, c the row's
first block's max, and the row's sum of it; `divide_rows` divides P @ V (fp32) by the sums and writes o_proj's
rows. The scores are read once, where a normalized softmax read them twice (docs/performance.md, "Attention
kernels"). A causal block passes a causal limit per row: the columns past it count as -inf and are written
as 0 (whole blocks past it without a read), in place of a masked_fill pass. S is a runtime argument (it grows
every block), so there is one compile per block size, not per context length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _exp_rows_kernel(
    x_ptr,
    y_ptr,
    sum_ptr,
    valid_ptr,
    n_cols,
    stride_x,
    stride_y,
    base,
    period,
    BLOCK: tl.constexpr,
    HAS_VALID: tl.constexpr,
    TAIL: tl.constexpr,
):
    row = tl.program_id(0)
    if TAIL:  # the causal limits count back from the valid columns (`exp_rows`' tail)
        base += tl.load(valid_ptr)
    limit = tl.minimum(n_cols, base + row % period)  # columns >= limit count as -inf (int32, as n_cols)
    if HAS_VALID:  # a count of valid columns read on the device (a CUDA graph's, whatever the cache length)
        limit = tl.minimum(limit, tl.load(valid_ptr))
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    cols = tl.arange(0, BLOCK)
    # c: the first block's max, with a finite floor so that a row of masked (-inf) entries gives 0, never nan.
    # Any c near the row's max gives the same softmax once divided by the sum; a row whose max exceeds c by more
    # than 64 (e^64 times a row's length still fits fp32) is written again from its max.
    x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"))
    c = tl.maximum(tl.max(tl.where(cols < limit, x, -float("inf")), axis=0), -1.0e30)
    start, s, m = _write_exp(x_row, y_row, cols, n_cols, limit, c, BLOCK)
    m_row = tl.max(m, axis=0)
    if m_row - c > 64.0:
        start, s, m = _write_exp(x_row, y_row, cols, n_cols, limit, m_row, BLOCK)
    tl.store(sum_ptr + row, tl.sum(s, axis=0))
    while start < n_cols:  # whole blocks past the limit: zeros, nothing read
        tl.store(y_row + start + cols, tl.zeros((BLOCK,), y_ptr.dtype.element_ty), mask=start + cols < n_cols)
        start += BLOCK


@triton.jit
def _write_exp(x_row, y_row, cols, n_cols, limit, c, BLOCK: tl.constexpr):
    """y = exp(x - c) over the columns below the limit (0 past it in the last partial block). Returns where the
    first whole block past the limit starts, and per lane the sum of exp(x - c) (fp32, before rounding) and
    the max of x."""
    s = tl.zeros((BLOCK,), tl.float32)
    m = tl.full((BLOCK,), -1.0e30, tl.float32)
    start = 0
    # while, not range(0, n_cols, BLOCK): Triton 3.6's interpreter cannot bound a range by a runtime argument.
    # Loads are masked by n_cols (a multiple of 16 lets them vectorize) and the limit applied after: masked by
    # the limit itself, the loads of a causal block ran ~15% slower than a masked_fill pass plus the kernel.
    while start < limit:
        ok = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=ok, other=-float("inf"))
        x = tl.where(start + cols < limit, x, -float("inf"))
        p = tl.exp(x - c)
        tl.store(y_row + start + cols, p.to(y_row.dtype.element_ty), mask=ok)
        s += p
        m = tl.maximum(m, x)
        start += BLOCK
    return start, s, m


def exp_rows(
    x: torch.Tensor,
    dtype: torch.dtype,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
    tail: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, sums) for fp32 x with a contiguous last dimension: p = exp(x - c) in `dtype`, c near each row's max
    (at most 64 below it), and sums [rows] fp32 its row sums before rounding, so that softmax(x) = p / sums;
    one read of x. `causal` = (base, period): row r (of the rows flattened) keeps its first base + r % period
    columns. `valid` (int32 [1] on x's device): every row keeps at most its first valid[0] columns. `tail`
    (with valid, without causal): the last `tail` valid columns are causal to the rows, row r keeping its
    first valid[0] - tail + 1 + r % tail (a block's commit, whose queries are the last keys). p is 0 past
    what a row keeps."""
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"exp_rows wants fp32 rows with unit stride, got {x.dtype} {x.stride()}")
    if valid is not None and (valid.dtype != torch.int32 or valid.numel() != 1 or valid.device != x.device):
        raise ValueError(f"exp_rows: valid must be one int32 on {x.device}, got {valid.dtype} {valid.shape}")
    if tail is not None and (valid is None or causal is not None):
        raise ValueError("exp_rows: tail counts back from valid, and replaces causal")
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, device=x.device, dtype=dtype)
    sums = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    base, period = (1 - tail, tail) if tail is not None else causal or (rows.shape[1], 1)
    _exp_rows_kernel[(rows.shape[0],)](
        rows,
        out,
        sums,
        rows if valid is None else valid,  # not read without a count
        rows.shape[1],
        rows.stride(0),
        out.stride(0),
        base,
        period,
        BLOCK=BLOCK,
        HAS_VALID=valid is not None,
        TAIL=tail is not None,
        num_warps=NUM_WARPS,
    )
    return out.view(x.shape), sums


@triton.jit
def _divide_rows_kernel(
    x_ptr, sums_ptr, y_ptr, G, T, n_cols, stride_yh, stride_yg, stride_yt, BLOCK: tl.constexpr
):
    row = tl.program_id(0)  # of x [H, G * T, n_cols]; y [H, G, T, n_cols] in any strides
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * n_cols + cols, mask=ok)
    h, r = row // (G * T), row % (G * T)
    dst = y_ptr + h.to(tl.int64) * stride_yh + (r // T) * stride_yg + (r % T) * stride_yt + cols
    tl.store(dst, (x / tl.load(sums_ptr + row)).to(y_ptr.dtype.element_ty), mask=ok)


def divide_rows(x: torch.Tensor, sums: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x / sums[..., None], one rounding to out's dtype: x fp32 [H, G*T, n] and sums [H, G*T] contiguous
    (P @ V on `exp_rows`' p, and its sums), out [H, G, T, n] with unit stride along n (o_proj's rows, say)."""
    hx, gt, n = x.shape
    h, g, t, n_out = out.shape
    if (
        x.dtype != torch.float32
        or not (x.is_contiguous() and sums.is_contiguous())
        or sums.shape != x.shape[:-1]
    ):
        raise ValueError(
            f"divide_rows wants contiguous fp32 x and its row sums, got {x.shape} and {sums.shape}"
        )
    if (hx, gt, n) != (h, g * t, n_out) or out.stride(3) != 1:
        raise ValueError(
            f"divide_rows: out {tuple(out.shape)} {out.stride()} does not hold x {tuple(x.shape)}"
        )
    _divide_rows_kernel[(sums.numel(),)](
        x, sums, out, g, t, n, *out.stride()[:3], BLOCK=triton.next_power_of_2(n)
    )
    return out
