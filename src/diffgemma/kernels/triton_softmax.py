"""Row softmax of long fp32 score rows, written straight to bf16: the middle of the head_dim-512 attention of a
denoise step (`cuda.attention_nomask`), whose scores are materialized as [Hkv, g*C, S] fp32.

On an H200 at 32k context, `torch.softmax(scores).to(bf16)` took 0.89 ms + 0.11 ms a layer. Here one program
owns a row and reads it twice: pass 1 keeps a per-lane running max and rescaled sum (an online softmax), pass 2
writes exp(x - max) / sum in the output dtype: 2 reads of fp32 and 1 write of bf16, no separate cast kernel,
0.33 ms a layer (~4.1 TB/s). S is a runtime argument (it grows every
block), so there is one compile per block size, not per context length.

The full layers' causal prefill blocks (`cuda.attention_causal_scores`) pass a causal limit per row: the
columns past it count as -inf and are written as 0 (whole blocks past it without a read), in place of a
masked_fill pass over the fp32 scores (57 us a call in a 4096-token chunk on an H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _softmax_rows_kernel(
    x_ptr,
    y_ptr,
    valid_ptr,
    n_cols,
    stride_x,
    stride_y,
    base,
    period,
    BLOCK: tl.constexpr,
    HAS_VALID: tl.constexpr,
):
    row = tl.program_id(0)
    limit = tl.minimum(n_cols, base + row % period)  # columns >= limit count as -inf (int32, as n_cols)
    if HAS_VALID:  # a count of valid columns read on the device (a CUDA graph's, whatever the cache length)
        limit = tl.minimum(limit, tl.load(valid_ptr))
    x_row = x_ptr + row.to(tl.int64) * stride_x
    y_row = y_ptr + row.to(tl.int64) * stride_y
    cols = tl.arange(0, BLOCK)
    # A finite floor instead of -inf: lanes that only ever see masked (-inf) entries then give
    # exp(floor - floor) * 0 = 0, never inf - inf.
    m = tl.full((BLOCK,), -1.0e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    # while, not range(0, n_cols, BLOCK): Triton 3.6's interpreter cannot bound a range by a runtime argument.
    # Loads are masked by n_cols (a multiple of 16 lets them vectorize) and the limit applied after: masked by
    # the limit itself, the loads of a causal block ran ~15% slower than a masked_fill pass plus this kernel.
    start = 0
    while start < limit:
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float("inf"))
        x = tl.where(start + cols < limit, x, -float("inf"))
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
        start += BLOCK
    m_row = tl.max(m, axis=0)
    inv = 1.0 / tl.sum(s * tl.exp(m - m_row), axis=0)
    start = 0
    while start < limit:
        ok = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=ok, other=-float("inf"))
        x = tl.where(start + cols < limit, x, -float("inf"))
        p = tl.exp(x - m_row) * inv
        tl.store(y_row + start + cols, p.to(y_ptr.dtype.element_ty), mask=ok)
        start += BLOCK
    while start < n_cols:  # whole blocks past the limit: zeros, nothing read
        tl.store(y_row + start + cols, tl.zeros((BLOCK,), y_ptr.dtype.element_ty), mask=start + cols < n_cols)
        start += BLOCK


def softmax_rows(
    x: torch.Tensor,
    dtype: torch.dtype,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(x, dim=-1) in fp32, returned in `dtype`; x is fp32 with a contiguous last dimension. `causal` =
    (base, period): row r (of the rows flattened) keeps its first base + r % period columns, the rest is 0.
    `valid` (int32 [1] on x's device): every row keeps at most its first valid[0] columns, the rest is 0."""
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"softmax_rows wants fp32 rows with unit stride, got {x.dtype} {x.stride()}")
    if valid is not None and (valid.dtype != torch.int32 or valid.numel() != 1 or valid.device != x.device):
        raise ValueError(
            f"softmax_rows: valid must be one int32 on {x.device}, got {valid.dtype} {valid.shape}"
        )
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, device=x.device, dtype=dtype)
    base, period = causal or (rows.shape[1], 1)
    _softmax_rows_kernel[(rows.shape[0],)](
        rows,
        out,
        rows if valid is None else valid,  # not read without a count
        rows.shape[1],
        rows.stride(0),
        out.stride(0),
        base,
        period,
        BLOCK=BLOCK,
        HAS_VALID=valid is not None,
        num_warps=NUM_WARPS,
    )
    return out.view(x.shape)
