"""Top-k sparse attention over materialized fp32 score rows (the full layers' `library._attend_materialized`): the
seed's selection, each row keeping its `keep` highest scores, ties at the threshold to the lower column.

`select_rows`: one program a row finds the keep-th largest score exactly, by a radix select over the scores'
order-preserving 32-bit keys (held in int64) (four passes of 8 bits, each a 256-bin histogram of the columns still in the race),
then emits the kept columns in column order with exp(score - row max) and the row's sum (a count and prefix sum:
deterministic, no atomics). The row limits are `triton_softmax.exp_rows`': causal (base, period), a count of
valid columns read on the device, a causal tail counted back from it. `keep` is a number, or read on the device
as the seed's clamp(valid / 128, 64, 512) so that a CUDA graph serves any cache length.

`gather_pv`: out = sum_j p_j v[idx_j] / sum, one program a row and a slice of head_dim, the kept V rows gathered
(fp32 products of p and the value dtype, fp32 accumulation), written once in out's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffgemma.kernels.torch_ref import TOPK_DIVISOR, TOPK_MAX, TOPK_MIN

BLOCK = 1024
NUM_WARPS = 8
PV_KEYS = 32  # kept keys a gather step
PV_DIMS = 128  # head_dim columns a program


@triton.jit
def _order_key(x):
    """fp32 -> a key in [0, 2**32) (int64) in the floats' order: a negative float's magnitude bits flipped, then
    shifted past the sign."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648


@triton.jit
def _select_kernel(
    x_ptr,
    idx_ptr,
    p_ptr,
    sum_ptr,
    count_ptr,
    valid_ptr,
    n_cols,
    stride_x,
    base,
    period,
    keep,
    BLOCK: tl.constexpr,
    KEEP_MAX: tl.constexpr,
    HAS_VALID: tl.constexpr,
    TAIL: tl.constexpr,
    KEEP_FROM_VALID: tl.constexpr,
    K_DIV: tl.constexpr,
    K_MIN: tl.constexpr,
    K_MAX: tl.constexpr,
):
    row = tl.program_id(0)
    if TAIL:  # the causal limits count back from the valid columns
        base += tl.load(valid_ptr)
    limit = tl.minimum(n_cols, base + row % period)
    if HAS_VALID:
        limit = tl.minimum(limit, tl.load(valid_ptr))
    if KEEP_FROM_VALID:  # the seed's k of the keys in all (`torch_ref.topk_keys`)
        keep = tl.minimum(tl.maximum(tl.load(valid_ptr) // K_DIV, K_MIN), K_MAX)
    keep = tl.minimum(keep, limit)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    # the keep-th largest key, 8 bits a pass from the top; `need` is its rank among the keys equal to it
    prefix = tl.zeros((), tl.int64)
    high = tl.zeros((), tl.int64)  # the bits of prefix decided so far
    need = keep
    m = tl.full((BLOCK,), -float("inf"), tl.float32)
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        hist = tl.zeros((256,), tl.int32)
        start = 0
        while start < limit:
            ok = start + cols < limit
            x = tl.load(x_row + start + cols, mask=ok, other=-float("inf"))
            if level == 0:
                m = tl.maximum(m, x)
            key = _order_key(x)
            ok = ok & ((key & high) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=ok)
            start += BLOCK
        # the largest digit d with at least `need` keys at or above it
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
        above = tl.sum(tl.where(bins == digit, at_or_above - hist, 0), axis=0)
        need -= above
        prefix = prefix | (digit.to(tl.int64) << shift)
        high = high | (tl.full((), 255, tl.int64) << shift)

    # the kept columns in column order: every key above the threshold, and the first `need` equal to it
    row_max = tl.maximum(tl.max(m, axis=0), -1.0e30)
    count = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    s = tl.zeros((BLOCK,), tl.float32)
    start = 0
    out_row = row.to(tl.int64) * KEEP_MAX
    while start < limit:
        ok = start + cols < limit
        x = tl.load(x_row + start + cols, mask=ok, other=-float("inf"))
        key = _order_key(x)
        eq = ok & (key == prefix)
        rank = ties + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = (ok & (key > prefix)) | (eq & (rank < need))
        pos = count + tl.cumsum(take.to(tl.int32), axis=0) - 1
        p = tl.exp(x - row_max)
        tl.store(idx_ptr + out_row + pos, start + cols, mask=take)
        tl.store(p_ptr + out_row + pos, p, mask=take)
        s += tl.where(take, p, 0.0)
        count += tl.sum(take.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)
        start += BLOCK
    tl.store(sum_ptr + row, tl.sum(s, axis=0))
    tl.store(count_ptr + row, count)


def select_rows(
    x: torch.Tensor,
    keep: int | None,
    causal: tuple[int, int] | None = None,
    valid: torch.Tensor | None = None,
    tail: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx int32, p fp32, sums, counts) for fp32 score rows x [..., n]: each row's kept columns (at most `keep`,
    None: clamp(valid[0] / 128, 64, 512)) in column order in idx [..., KEEP] with p = exp(x - row max) beside
    them (entries past a row's count are undefined), the row sums of p and the counts. `causal`, `valid`, `tail`
    limit the columns a row may keep as in `triton_softmax.exp_rows`."""
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"select_rows wants fp32 rows with unit stride, got {x.dtype} {x.stride()}")
    if valid is not None and (valid.dtype != torch.int32 or valid.numel() != 1 or valid.device != x.device):
        raise ValueError(
            f"select_rows: valid must be one int32 on {x.device}, got {valid.dtype} {valid.shape}"
        )
    if keep is None and valid is None:
        raise ValueError("select_rows: keep=None reads the number of keys from valid")
    if tail is not None and (valid is None or causal is not None):
        raise ValueError("select_rows: tail counts back from valid, and replaces causal")
    keep_max = TOPK_MAX if keep is None else min(keep, TOPK_MAX)
    if keep is not None and not 1 <= keep <= TOPK_MAX:
        raise ValueError(f"select_rows: keep must lie in [1, {TOPK_MAX}], got {keep}")
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    idx = torch.empty(n, keep_max, device=x.device, dtype=torch.int32)
    p = torch.empty(n, keep_max, device=x.device, dtype=torch.float32)
    sums = torch.empty(n, device=x.device, dtype=torch.float32)
    counts = torch.empty(n, device=x.device, dtype=torch.int32)
    base, period = (1 - tail, tail) if tail is not None else causal or (rows.shape[1], 1)
    _select_kernel[(n,)](
        rows,
        idx,
        p,
        sums,
        counts,
        rows if valid is None else valid,  # not read without a count
        rows.shape[1],
        rows.stride(0),
        base,
        period,
        keep_max if keep is not None else 0,
        BLOCK=BLOCK,
        KEEP_MAX=keep_max,
        HAS_VALID=valid is not None,
        TAIL=tail is not None,
        KEEP_FROM_VALID=keep is None,
        K_DIV=TOPK_DIVISOR,
        K_MIN=TOPK_MIN,
        K_MAX=TOPK_MAX,
        num_warps=NUM_WARPS,
    )
    lead = x.shape[:-1]
    return idx.view(*lead, keep_max), p.view(*lead, keep_max), sums.view(lead), counts.view(lead)


@triton.jit
def _gather_pv_kernel(
    idx_ptr,
    p_ptr,
    sum_ptr,
    count_ptr,
    v_ptr,
    y_ptr,
    G,
    T,
    stride_vh,
    stride_vn,
    stride_yh,
    stride_yg,
    stride_yt,
    KEEP_MAX: tl.constexpr,
    KEYS: tl.constexpr,
    DIMS: tl.constexpr,
):
    row = tl.program_id(0)  # of the rows [Hkv, G * T]
    ds = tl.program_id(1) * DIMS + tl.arange(0, DIMS)
    h, r = row // (G * T), row % (G * T)
    count = tl.load(count_ptr + row)
    acc = tl.zeros((DIMS,), tl.float32)
    js = tl.arange(0, KEYS)
    j = 0
    while j < count:
        ok = j + js < count
        at = row.to(tl.int64) * KEEP_MAX + j + js
        col = tl.load(idx_ptr + at, mask=ok, other=0)
        p = tl.load(p_ptr + at, mask=ok, other=0.0)
        v = tl.load(v_ptr + h.to(tl.int64) * stride_vh + col.to(tl.int64)[:, None] * stride_vn + ds[None, :])
        acc += tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        j += KEYS
    dst = y_ptr + h.to(tl.int64) * stride_yh + (r // T) * stride_yg + (r % T) * stride_yt + ds
    tl.store(dst, (acc / tl.load(sum_ptr + row)).to(y_ptr.dtype.element_ty))


def gather_pv(
    idx: torch.Tensor,
    p: torch.Tensor,
    sums: torch.Tensor,
    counts: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [Hkv, G, T, d] = sum_j p[r, j] v[h, idx[r, j]] / sums[r] over the first counts[r] entries of each row r
    of the [Hkv, G * T] rows (`select_rows`' output); v [Hkv, S, d] with unit stride along d, d a multiple of
    PV_DIMS or smaller than it and a power of two."""
    hkv, g, t, d = out.shape
    if idx.shape[:2] != (hkv, g * t) or v.shape[0] != hkv or v.shape[2] != d or v.stride(2) != 1:
        raise ValueError(
            f"gather_pv: rows {tuple(idx.shape)}, v {tuple(v.shape)} and out {tuple(out.shape)} differ"
        )
    if out.stride(3) != 1:
        raise ValueError(f"gather_pv: out needs unit stride along head_dim, got {out.stride()}")
    dims = min(PV_DIMS, d)
    if d % dims or dims & (dims - 1):
        raise ValueError(f"gather_pv: head_dim {d} is not a multiple of {dims} (a power of two)")
    _gather_pv_kernel[(hkv * g * t, d // dims)](
        idx,
        p,
        sums,
        counts,
        v,
        out,
        g,
        t,
        v.stride(0),
        v.stride(1),
        *out.stride()[:3],
        KEEP_MAX=idx.shape[-1],
        KEYS=PV_KEYS,
        DIMS=dims,
        num_warps=4,
    )
    return out
