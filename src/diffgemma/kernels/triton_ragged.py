"""The batched denoise pass's kernels over several canvases in one launch, each after its own cache: the sliding
layers' split-KV attention (`attention_ragged`, `triton_attn`'s kernel with a canvas index in its grid) and the
Q/K norms and RoPE that write each canvas's K/V into its cache's canvas slots (`norm_rope_ragged`, `triton_qkv`'s
kernel likewise). Each canvas's K/V live in a cache of their own (another allocation, another slot count), so the
kernels read them through a table on the device: per canvas the layer buffer's address ([2, Hkv, slots, d],
contiguous) and its slot count (`model.steps.kv_tables`); and each canvas's key span and canvas slot from the
pass's geometry rows ([B, 5], `KVCache.denoise_geometry`), so that a CUDA graph of the batched pass serves every
cache length. Each canvas's arithmetic is its lone call's, op for op.

Each canvas is split over its keys as a lone canvas's call is (`triton_attn._auto_splits` of one canvas's
programs), not by the batch's program count: every canvas then runs the tiles, the key ranges and the merge order
of its lone call, the same sums batched or alone (batch invariance), where a split chosen from B canvases'
programs (one split from 3 canvases up) would change them with the batch size."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffgemma.kernels import pdl
from diffgemma.kernels.triton_attn import (
    BLOCK_M,
    BLOCK_N,
    COMBINE_ROWS,
    NUM_STAGES,
    NUM_WARPS,
    SPLITS,
    _auto_splits,
    _combine_kernel,
    sm_count,
)
from diffgemma.kernels.triton_qkv import BLOCK_T, LAUNCH_OPTIONS, _norm_rope_kernel


@triton.jit
def _ragged_kernel(
    q_ptr,
    table_ptr,
    geo_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    M,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_geo,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    b = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ds = tl.arange(0, D)
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + head * stride_qh + rows[:, None] * stride_qm + ds[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    # canvas b's layer buffer [2, Hkv, slots, D]: K of head h at (h * slots) * D, V at ((Hkv + h) * slots) * D
    base = tl.load(table_ptr + 2 * b).to(tl.pointer_type(q_ptr.dtype.element_ty))
    slots = tl.load(table_ptr + 2 * b + 1)
    first = tl.load(geo_ptr + b * stride_geo + 1).to(tl.int64)
    S = tl.load(geo_ptr + b * stride_geo + 2)
    k_rows = base + (head * slots + first) * D + ds[None, :]
    v_rows = base + ((heads + head) * slots + first) * D + ds[None, :]
    # From here `triton_attn._splitkv_kernel`'s loop, op for op: the same sums as a lone canvas's call.
    row_max = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    start = split * SPLIT_BLOCKS * BLOCK_N
    end = tl.minimum(start + SPLIT_BLOCKS * BLOCK_N, S)
    for i in range(SPLIT_BLOCKS):
        cols = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        k = tl.load(k_rows + cols[:, None] * D, mask=col_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * 1.4426950408889634
        s = tl.where(col_ok[None, :], s, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_rows + cols[:, None] * D, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        row_max = new_max
    out_rows = ((b * SPLITS + split) * heads + head).to(tl.int64) * M + rows  # [B, splits, Hkv, M]
    tl.store(max_ptr + out_rows, row_max, mask=row_ok)
    tl.store(sum_ptr + out_rows, row_sum, mask=row_ok)
    tl.store(acc_ptr + out_rows[:, None] * D + ds[None, :], acc, mask=row_ok[:, None])


def attention_ragged(
    q: torch.Tensor,
    table: torch.Tensor,
    geometry: torch.Tensor,
    n_max: int,
    hkv: int,
    out: torch.Tensor,
    splits: int | None = SPLITS,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """softmax(q k^T) v of B canvases, scale 1, no mask, canvas b over keys geometry[b, 1] .. + geometry[b, 2] of
    its own layer buffer, at most n_max keys each. `table` row b: that buffer's address ([2, Hkv, slots, d],
    contiguous) and its slots, int64 [B, 2] on q's device (`model.steps.kv_tables`). q [B, Hkv, M, d] (GQA folded
    into the rows, M = g * T, unit last stride); out [B, Hkv, g, T, d] (q's dtype, unit last stride): row r of a
    canvas's head goes to out[b, head, r // T, r % T]. Returns out. The tiling and splits are those of one
    canvas's `triton_attn.attention_splitkv` with a span of n_max keys."""
    if q.dim() != 4 or q.stride(3) != 1:
        raise ValueError(
            f"attention_ragged: want q [B, Hkv, M, d] with unit last stride, got {tuple(q.shape)}"
        )
    nb, heads, m_rows, d = q.shape
    if heads != hkv or table.shape != (nb, 2) or table.dtype != torch.int64 or table.device != q.device:
        raise ValueError(
            f"attention_ragged: want {nb} canvases of {hkv} KV heads and an int64 [{nb}, 2] table on {q.device}, "
            f"got q {tuple(q.shape)}, table {table.dtype} {tuple(table.shape)} on {table.device}"
        )
    if (
        geometry.dtype != torch.int32
        or geometry.shape[0] != nb
        or geometry.shape[1] < 3
        or geometry.stride(1) != 1
    ):
        raise ValueError(
            f"attention_ragged: geometry must be int32 [{nb}, >= 3] rows, got {tuple(geometry.shape)}"
        )
    if d < 16 or d > 256 or d & (d - 1) or n_max < 1:
        raise ValueError(
            f"attention_ragged: head_dim a power of two in [16, 256] and n_max >= 1, got {d}, {n_max}"
        )
    if (
        out.dim() != 5
        or out.shape[:2] != (nb, hkv)
        or out.shape[2] * out.shape[3] != m_rows
        or out.shape[4] != d
        or out.dtype != q.dtype
        or out.stride(4) != 1
    ):
        raise ValueError(
            f"attention_ragged: out must be [{nb}, {hkv}, g, T, d] with g*T = {m_rows} in {q.dtype}, got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    key_blocks = triton.cdiv(n_max, block_n)
    row_blocks = triton.cdiv(m_rows, block_m)
    if splits is None:  # a lone canvas's choice (see the module's docstring)
        splits = _auto_splits(row_blocks * hkv, key_blocks, sm_count(q.device))
    f32 = {"device": q.device, "dtype": torch.float32}
    pdl_on = pdl.enabled(q.device)
    acc = torch.empty(nb, splits, hkv, m_rows, d, **f32)
    maxes = torch.empty(nb, splits, hkv, m_rows, **f32)
    sums = torch.empty(nb, splits, hkv, m_rows, **f32)
    _ragged_kernel[(row_blocks, hkv, nb * splits)](
        q,
        table,
        geometry,
        acc,
        maxes,
        sums,
        m_rows,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        geometry.stride(0),
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLITS=splits,
        SPLIT_BLOCKS=triton.cdiv(key_blocks, splits),
        PDL=pdl_on,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl_on,
    )
    _combine_kernel[(triton.cdiv(m_rows, COMBINE_ROWS), hkv, nb)](
        acc,
        maxes,
        sums,
        out,
        m_rows,
        out.shape[3],
        out.stride(0),
        out.stride(1),
        out.stride(2),
        out.stride(3),
        SPLITS=splits,
        D=d,
        BLOCK_R=COMBINE_ROWS,
        PDL=pdl_on,
        num_warps=4,
        launch_pdl=pdl_on,
    )
    return out


def norm_rope_ragged(
    qkv: torch.Tensor,
    b: int,
    n_heads: int,
    n_kv: int,
    has_v: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    table: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`triton_qkv.norm_rope` of b canvases' rows in one launch: qkv [b * T, ...] (the merged GEMM's output), cos/sin
    [b * T, d] tables; canvas i's K/V go to its own layer buffer (`table` row i, as `attention_ragged` reads it),
    token t to slot slots[i, 0] + t (int32 rows on the device, a view of the pass's geometry column). Returns q
    [b, n_heads, T, d] contiguous."""
    rows = qkv.shape[0]
    t = rows // b
    d = qkv.shape[1] // (n_heads + n_kv * (2 if has_v else 1))
    if (
        rows % b
        or qkv.stride(1) != 1
        or cos.stride(1) != 1
        or sin.stride() != cos.stride()
        or cos.shape[0] != rows
    ):
        raise ValueError("norm_rope_ragged: qkv and cos/sin [b * T, ...] rows, contiguous within a row")
    if d < 2 or d & (d - 1):
        raise ValueError(f"norm_rope_ragged: head_dim must be a power of two, got {d}")
    if (
        table.shape != (b, 2)
        or table.dtype != torch.int64
        or slots.dtype != torch.int32
        or slots.shape[0] != b
    ):
        raise ValueError(f"norm_rope_ragged: want an int64 [{b}, 2] table and int32 slots of {b} rows")
    q = torch.empty(b, n_heads, t, d, device=qkv.device, dtype=qkv.dtype)
    _norm_rope_kernel[(triton.cdiv(t, BLOCK_T), n_heads + n_kv * (2 if has_v else 1), b)](
        qkv,
        cos,
        sin,
        q_norm,
        k_norm,
        q,
        qkv,  # each canvas's own buffer from `table`
        slots,
        t,
        eps,
        qkv.stride(0),
        cos.stride(0),
        q.stride(1),
        q.stride(2),
        0,
        0,
        0,
        table,
        slots.stride(0),
        NQ=n_heads,
        NKV=n_kv,
        HAS_V=has_v,
        D=d,
        BLOCK_T=BLOCK_T,
        HAS_SLOT=True,
        RAGGED=True,
        **LAUNCH_OPTIONS,
    )
    return q
