"""The batch-invariant GEMM (`RuntimeConfig.batch_invariant`): out [M, N] = a [M, K] @ b [K, N], 16-bit operands,
fp32 accumulation, rounded once to a's dtype, with tiles that never depend on M.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem's size, so a row's sums change with the
rows beside it: a canvas batched with 15 others got other logits than alone. Here each output element is one
fp32 dot product over K in BLOCK_K steps taken in order, in a tile whose shape is fixed by (N, K) only (`tiles`),
with no split of K: a row's result is the same whatever M is and whatever the other rows hold. M is not
specialized on (`do_not_specialize`; K is a constant: one kernel a weight shape), so one compiled kernel serves every row count and rows padded into a tile
are masked loads, never operands of another row's sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from diffgemma.kernels.dispatch import INTERPRET


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# One tile set a weight shape: 128 rows a tile (wgmma's), 64 inputs a step. The LM head's 262,144 columns take
# 256-column tiles (fewer re-reads of the rows); everything else 128. Chosen from N, never from M.
NARROW = GemmTiles(128, 128, 64, 8, 4)
WIDE = GemmTiles(128, 256, 64, 8, 3)
WIDE_FROM_N = 32768
GROUP_M = 8  # row tiles walked together per column band (L2 reuse of b); launch order only, not the sums


def tiles(n: int) -> GemmTiles:
    """The tiles of a GEMM with n output columns (the same for every row count)."""
    return WIDE if n >= WIDE_FROM_N else NARROW


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_rows = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_tile = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_tile = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in order, one accumulator: the same sum for a row at any M
        if K % BLOCK_K == 0:
            a = tl.load(a_tile + k0 * stride_ak, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_tile + k0 * stride_bk, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            a = tl.load(a_tile + k0 * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_tile + k0 * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    c = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (any strides, both 16-bit of one dtype) -> [M, N] in a's dtype, into `out` when given;
    batch invariant (module docstring)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: want a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        raise ValueError(f"matmul: want 16-bit operands of one dtype, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    elif out.shape != (m, n) or out.dtype != a.dtype:
        raise ValueError(f"matmul: out must be [{m}, {n}] {a.dtype}, got {tuple(out.shape)} {out.dtype}")
    if m == 0:
        return out
    # the interpreter multiplies bf16 dot operands as their raw bits: under it they go to the dot as fp32 (exact
    # products of the same values)
    t = tiles(n)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _gemm_kernel[grid](
        a,
        b,
        out,
        m,
        n,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        K=k,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        GROUP=GROUP_M,
        UPCAST=INTERPRET,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w) (x [..., K], w [N, K]) through `matmul`: batch invariant."""
    lead = x.shape[:-1]
    y = matmul(x.reshape(-1, x.shape[-1]), w.t(), out=out)
    return y.view(*lead, w.shape[0])
