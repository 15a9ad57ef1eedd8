"""The self-conditioning soft embedding, probs [N, V] @ embed [V, H], as the seed's survivor gather (§5).

With `sc_sparse` the SC input keeps only the tokens with p >= e^-10 of the row max and is zero elsewhere; a
trained model's rows keep a handful of tokens (the demo model: median 1, at most 78 of 2,432), and the dense GEMM
multiplies 262,144 columns a row to add those few. Here, in five kernels with fixed grids and every count on the
device (a CUDA graph captures them):

1. `_survivors_kernel`, a program per (row, chunk of columns): the chunk's nonzero columns in ascending order,
   at most CAP of them, into idx / val [N, chunks, CAP], and their true count into count [N, chunks].
2. `_plan_kernel`, one program: each row's total count, and the rows with more than CAP survivors (overflow)
   compacted in ascending order into rows [N], their number into n_over [1].
3. `_gather_kernel`, a program per (row, H block), for rows of at most CAP survivors: out[r] = sum over the
   survivors in ascending column order of val * embed[idx], in fp32, each product rounded before its add (no
   fused multiply-add: `torch_ref.soft_embedding_survivors` sums the same way), rounded once to out's dtype.
4. `_dense_rows_kernel`: the overflow rows as a split-K GEMM over the vocabulary (fixed split, fp32 partials);
   programs past n_over do nothing, so a step where no row overflows pays only their launch.
5. `_reduce_kernel`: the overflow rows' partials summed in split order, rounded once, into their rows of out.

Zero columns add exactly zero to the GEMM, so this equals `probs @ embed` up to summation order for any probs
(flat rows, as random weights give, all overflow and take the GEMM of step 4).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from diffgemma.kernels.dispatch import INTERPRET

# Survivors a row may keep for the gather; a row with more takes the dense rows' GEMM. The demo model's rows
# keep at most 78 (docs/performance.md, "The SC soft embedding as a survivor gather").
CAP = 256
CHUNKS = 16  # column chunks a row in the survivor scan: 4,096 programs at 256 rows of 262,144
SCAN_BLOCK = 1024
GATHER_BLOCK_H = 256
UNROLL = 8  # survivors whose embedding rows a gather program loads before it adds them
REDUCE_BLOCK_H = 1024
SMS = 132  # an H100 / H200 SXM: the dense rows' split fills about one wave at the real shape
LAUNCH_OPTIONS = {"enable_fp_fusion": False}  # the gather's products rounded before their add, as the twin's


class DenseTiles(NamedTuple):
    """The dense rows' GEMM tiles."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


TILES = DenseTiles()

# The interpreter multiplies bf16 operands of tl.dot as their raw bits: there they go to the dot as fp32.
_UPCAST_DOT = INTERPRET


@triton.jit
def _survivors_kernel(
    p_ptr, idx_ptr, val_ptr, count_ptr, n_cols, chunk_cols, stride_p, CAP: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    p_row = p_ptr + row.to(tl.int64) * stride_p
    slot = (row * n_chunks + chunk).to(tl.int64) * CAP
    cols = tl.arange(0, BLOCK)
    start = chunk * chunk_cols
    end = tl.minimum(start + chunk_cols, n_cols)
    n = tl.zeros((), dtype=tl.int32)
    # while, not range(start, end, BLOCK): Triton 3.6's interpreter cannot bound a range by a runtime value.
    while start < end:
        ok = start + cols < end
        x = tl.load(p_row + start + cols, mask=ok, other=0.0)
        keep = (x != 0).to(tl.int32)
        k = tl.sum(keep, axis=0)
        if (k > 0) & (n < CAP):  # a peaked row's blocks are nearly all zero; a flat row's fill CAP at once
            pos = n + tl.cumsum(keep, axis=0) - 1
            put = (keep != 0) & (pos < CAP)
            tl.store(idx_ptr + slot + pos, start + cols, mask=put)
            tl.store(val_ptr + slot + pos, x, mask=put)
        n += k
        start += BLOCK
    tl.store(count_ptr + row * n_chunks + chunk, n)


@triton.jit
def _plan_kernel(
    count_ptr,
    total_ptr,
    rows_ptr,
    n_over_ptr,
    n_rows,
    CAP: tl.constexpr,
    CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.arange(0, BLOCK)
    c = tl.arange(0, CHUNKS_P2)
    n_over = tl.zeros((), dtype=tl.int32)
    start = tl.zeros((), dtype=tl.int32)
    while start < n_rows:
        ok = start + r < n_rows
        both = ok[:, None] & (c < CHUNKS)[None, :]
        counts = tl.load(count_ptr + (start + r)[:, None] * CHUNKS + c[None, :], mask=both, other=0)
        total = tl.sum(counts, axis=1)
        tl.store(total_ptr + start + r, total, mask=ok)
        over = ((total > CAP) & ok).to(tl.int32)
        pos = n_over + tl.cumsum(over, axis=0) - 1
        tl.store(rows_ptr + pos, start + r, mask=over != 0)
        n_over += tl.sum(over, axis=0)
        start += BLOCK
    tl.store(n_over_ptr, n_over)


@triton.jit
def _gather_kernel(
    idx_ptr,
    val_ptr,
    count_ptr,
    total_ptr,
    e_ptr,
    out_ptr,
    H,
    stride_e,
    stride_o,
    CAP: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UNROLL: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    if tl.load(total_ptr + row) <= CAP:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for c in range(CHUNKS):
            n = tl.load(count_ptr + row * CHUNKS + c)
            base = (row * CHUNKS + c).to(tl.int64) * CAP
            j = tl.zeros((), dtype=tl.int32)
            while j < n:
                for u in tl.static_range(UNROLL):
                    ok = j + u < n
                    t = tl.load(idx_ptr + base + j + u, mask=ok, other=0)
                    v = tl.load(val_ptr + base + j + u, mask=ok, other=0.0).to(tl.float32)
                    e = tl.load(e_ptr + t.to(tl.int64) * stride_e + h, mask=h_ok & ok, other=0.0)
                    acc = acc + v * e.to(tl.float32)  # a masked survivor adds 0 * 0
                j += UNROLL
        tl.store(out_ptr + row.to(tl.int64) * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _dense_rows_kernel(
    p_ptr,
    e_ptr,
    rows_ptr,
    n_over_ptr,
    part_ptr,
    n_rows,
    n_cols,
    H,
    stride_p,
    stride_e,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ITERS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    m = tl.program_id(0)  # the grid's fast axis: the programs that share a tile of embed run together
    nb = tl.program_id(1)
    s = tl.program_id(2)
    if m * BLOCK_M < tl.load(n_over_ptr):
        i = m * BLOCK_M + tl.arange(0, BLOCK_M)
        i_ok = i < tl.load(n_over_ptr)
        rows = tl.load(rows_ptr + i, mask=i_ok, other=0)  # a row past n_over reads row 0, never stored
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < H
        k = s * (ITERS * BLOCK_K) + tl.arange(0, BLOCK_K)
        a_ptrs = p_ptr + rows.to(tl.int64)[:, None] * stride_p + k[None, :]
        b_ptrs = e_ptr + k.to(tl.int64)[:, None] * stride_e + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(ITERS):
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            elif EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k < n_cols
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST_DOT:  # noqa: SIM108 - a constexpr branch: one side traced
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_e
            k += BLOCK_K
        part = part_ptr + (s * n_rows + i).to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(part, acc, mask=i_ok[:, None] & n_ok[None, :])


@triton.jit
def _reduce_kernel(
    part_ptr, rows_ptr, n_over_ptr, out_ptr, n_rows, H, stride_o, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr
):
    i = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    if i < tl.load(n_over_ptr):
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s in range(SPLITS):
            acc += tl.load(part_ptr + (s * n_rows + i).to(tl.int64) * H + h, mask=h_ok, other=0.0)
        row = tl.load(rows_ptr + i)
        tl.store(out_ptr + row.to(tl.int64) * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def splits_for(n_rows: int, h: int, v: int, tiles: DenseTiles = TILES) -> int:
    """The dense rows' split of the vocabulary: about one wave of programs when every row overflows, fixed by
    the shapes alone (never by the data), so a row's sums do not depend on how many rows overflow."""
    tiles_mn = triton.cdiv(n_rows, tiles.block_m) * triton.cdiv(h, tiles.block_n)
    return max(1, min(SMS // tiles_mn, triton.cdiv(v, tiles.block_k)))


def survivors(probs: torch.Tensor, cap: int = CAP, chunks: int = CHUNKS, block: int = SCAN_BLOCK):
    """(idx int32 [N, chunks, cap], val [N, chunks, cap] in probs' dtype, count int32 [N, chunks]): each chunk's
    nonzero columns of probs [N, V] in ascending order (the first `cap` of them; count is their true number)."""
    n, v = probs.shape
    chunks = max(1, min(chunks, triton.cdiv(v, block)))
    chunk_cols = triton.cdiv(v, chunks)
    idx = torch.empty(n, chunks, cap, device=probs.device, dtype=torch.int32)
    val = torch.empty(n, chunks, cap, device=probs.device, dtype=probs.dtype)
    count = torch.empty(n, chunks, device=probs.device, dtype=torch.int32)
    _survivors_kernel[(n, chunks)](
        probs, idx, val, count, v, chunk_cols, probs.stride(0), CAP=cap, BLOCK=block
    )
    return idx, val, count


def soft_embedding(
    probs: torch.Tensor,
    embed: torch.Tensor,
    cap: int = CAP,
    chunks: int = CHUNKS,
    tiles: DenseTiles = TILES,
    splits: int | None = None,
) -> torch.Tensor:
    """probs [N, V] @ embed [V, H] in embed's dtype (probs cast to it first, as the GEMM they replace): rows of
    at most `cap` nonzero probabilities by the survivor gather, the others by the dense rows' split-K GEMM
    (`splits` parts of the vocabulary; None: `splits_for`)."""
    if probs.dim() != 2 or embed.dim() != 2 or probs.shape[1] != embed.shape[0]:
        raise ValueError(
            f"soft_embedding wants probs [N, V] and embed [V, H], got {tuple(probs.shape)} and {tuple(embed.shape)}"
        )
    if embed.stride(1) != 1:
        raise ValueError(f"soft_embedding wants embed rows with unit stride, got strides {embed.stride()}")
    probs = probs.to(embed.dtype)
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    n, v = probs.shape
    h = embed.shape[1]
    dev = probs.device
    out = torch.empty(n, h, device=dev, dtype=embed.dtype)
    if n == 0:
        return out
    idx, val, count = survivors(probs, cap, chunks)
    total = torch.empty(n, device=dev, dtype=torch.int32)
    rows = torch.empty(n, device=dev, dtype=torch.int32)
    n_over = torch.empty(1, device=dev, dtype=torch.int32)
    n_chunks = count.shape[1]
    _plan_kernel[(1,)](
        count,
        total,
        rows,
        n_over,
        n,
        CAP=cap,
        CHUNKS=n_chunks,
        CHUNKS_P2=triton.next_power_of_2(n_chunks),
        BLOCK=256,
    )
    _gather_kernel[(n, triton.cdiv(h, GATHER_BLOCK_H))](
        idx, val, count, total, embed, out, h, embed.stride(0), out.stride(0),
        CAP=cap, CHUNKS=n_chunks, BLOCK_H=GATHER_BLOCK_H, UNROLL=UNROLL, num_warps=1, **LAUNCH_OPTIONS,
    )  # fmt: skip
    s = splits or splits_for(n, h, v, tiles)
    k_iters = triton.cdiv(v, tiles.block_k)
    iters = triton.cdiv(k_iters, s)
    part = torch.empty(s, n, h, device=dev, dtype=torch.float32)
    _dense_rows_kernel[(triton.cdiv(n, tiles.block_m), triton.cdiv(h, tiles.block_n), s)](
        probs, embed, rows, n_over, part, n, v, h, probs.stride(0), embed.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ITERS=iters,
        EVEN_K=v % tiles.block_k == 0 and iters * s == k_iters, EVEN_N=h % tiles.block_n == 0,
        UPCAST_DOT=_UPCAST_DOT, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    _reduce_kernel[(n, triton.cdiv(h, REDUCE_BLOCK_H))](
        part, rows, n_over, out, n, h, out.stride(0), SPLITS=s, BLOCK_H=REDUCE_BLOCK_H, num_warps=4
    )
    return out
