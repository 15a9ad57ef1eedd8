"""The router's top-k and the expert sort, from the router logits [N, E] to what the MoE kernels take (the
routing weights, the pairs sorted by expert, each expert's bounds), in two Triton kernels.

On an H200 the same work as torch ops (`regions.route`: softmax, top-k, its sort, renormalise, and a counting
sort by cumsum over a one-hot) took 25 us a denoise layer (N = 256) in 7 kernels, 132 us at N = 4096.

Pass 1, a program per block of rows: softmax in fp32, the top k by repeated argmax (the lowest column among
equal values, as torch.topk on CUDA picks them), renormalise, times per_expert_scale; weights and ids stored,
and for the block its count per expert and each pair's rank among its earlier pairs of the same expert.
Pass 2, again a program per block of rows: it sums all blocks' counts (each expert's start, an exclusive
cumsum of them: bounds) and the counts of the blocks before its own (its first slot per expert); a pair's slot
= that + its rank. That is the order of torch.sort(ids.flatten(), stable=True). (A version with one program
for pass 2 took 71 us a layer at N = 4096, in its loop over the 32,768 pairs.)

`route_sort_from` starts from the router's input instead: a third kernel multiplies it by the router's weight in
splits of H (fp32 partial products), and pass 1 sums them in split order and rounds the sum as the GEMM's
output is rounded. It beats cuBLAS's split-K GEMM at a denoise step's 256 rows and loses at 4,096, so the fast
kernels take it up to 256 rows only (docs/performance.md, "Routing and the FFN combine").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffgemma.kernels import pdl
from diffgemma.kernels.triton_attn import sm_count

NUM_WARPS = 4
# (weights, ids, bounds, perm, slot): what the two passes give (`route_sort`)
Sorted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def block_rows(n: int) -> int:
    """Rows a program: about one program an SM (132 on an H200), 4 to 32 rows (docs/performance.md, "Routing and
    the FFN combine")."""
    return min(32, max(4, triton.next_power_of_2(triton.cdiv(n, 128))))


@triton.jit
def _topk_kernel(
    logits_ptr,
    scale_ptr,
    weights_ptr,
    ids_ptr,
    rank_ptr,
    counts_ptr,
    N,
    stride_ln,
    stride_split,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    SPLITS: tl.constexpr,
    LOGIT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Pass 1 for BLOCK_ROWS rows: softmax, top-k, weights; each pair's rank among this block's earlier pairs
    of its expert, and the block's count per expert. SPLITS > 0: the logits are the sum of SPLITS fp32 partial
    products (`_router_kernel`'s), added in split order and rounded to LOGIT_DTYPE, as the router's GEMM
    rounds its output."""
    pdl.start(PDL)
    block = tl.program_id(0)
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < N
    cols = tl.arange(0, E_P2)
    col_ok = cols < E
    slots = tl.arange(0, K_P2)
    ptrs = logits_ptr + rows[:, None] * stride_ln + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS > 0:
        x = tl.load(ptrs, mask=ok, other=0.0)
        for i in tl.static_range(1, SPLITS):
            x += tl.load(ptrs + i * stride_split, mask=ok, other=0.0)
        x = tl.where(col_ok[None, :], x.to(LOGIT_DTYPE).to(tl.float32), -float("inf"))
    else:
        x = tl.load(ptrs, mask=ok, other=-float("inf")).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # a padding row: finite, never stored
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(col_ok[None, :], p, -1.0)  # padding columns are never picked (probabilities are >= 0)
    w = tl.zeros((BLOCK_ROWS, K_P2), tl.float32)
    ids = tl.zeros((BLOCK_ROWS, K_P2), tl.int32)
    picked = tl.zeros((BLOCK_ROWS, E_P2), tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], cols[None, :], E_P2), axis=1)
        hit = (cols[None, :] == pick[:, None]) & row_ok[:, None]
        w = tl.where(slots[None, :] == j, best[:, None], w)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        picked += hit.to(tl.int32)
        p = tl.where(hit, -1.0, p)
    ok = row_ok[:, None] & (slots[None, :] < K)
    w = w / tl.sum(w, axis=1)[:, None] * tl.load(scale_ptr + ids, mask=ok, other=0.0).to(tl.float32)
    tl.store(weights_ptr + rows[:, None] * K + slots[None, :], w, mask=ok)
    tl.store(ids_ptr + rows[:, None] * K + slots[None, :], ids, mask=ok)
    # A row picks an expert at most once, so a pair's rank is the number of earlier rows of the block that
    # picked its expert: the exclusive cumsum of `picked` down the rows, read at the pair's expert.
    earlier = tl.cumsum(picked, axis=0) - picked
    rank = tl.zeros((BLOCK_ROWS, K_P2), tl.int32)
    for j in tl.static_range(K):
        ex = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
        r = tl.sum(tl.where(cols[None, :] == ex[:, None], earlier, 0), axis=1)
        rank = tl.where(slots[None, :] == j, r[:, None], rank)
    tl.store(rank_ptr + rows[:, None] * K + slots[None, :], rank, mask=ok)
    tl.store(counts_ptr + block * E_P2 + cols, tl.sum(picked, axis=0))


@triton.jit
def _slot_kernel(
    ids_ptr,
    rank_ptr,
    counts_ptr,
    bounds_ptr,
    perm_ptr,
    slot_ptr,
    N,
    n_blocks,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """Pass 2 for the pairs of one row block: its first slot per expert (each expert's start, from all blocks'
    counts, plus the counts of the blocks before it), each pair's slot = that + its rank; perm the inverse.
    Program 0 also writes the bounds."""
    pdl.start(PDL)
    block = tl.program_id(0)
    cols = tl.arange(0, E_P2)
    bs = tl.arange(0, BLOCK_B)
    total = tl.zeros((E_P2,), tl.int32)
    before = tl.zeros((E_P2,), tl.int32)
    # while, not range(0, n, ..): Triton's interpreter cannot bound a range by a runtime argument
    b0 = 0
    while b0 < n_blocks:
        c = tl.load(
            counts_ptr + (b0 + bs)[:, None] * E_P2 + cols[None, :],
            mask=(b0 + bs < n_blocks)[:, None],
            other=0,
        )
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((b0 + bs < block)[:, None], c, 0), axis=0)
        b0 += BLOCK_B
    start = tl.cumsum(total, axis=0) - total
    if block == 0:
        tl.store(bounds_ptr + cols, start, mask=cols < E)
        tl.store(bounds_ptr + E, tl.sum(total, axis=0))
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    slots = tl.arange(0, K_P2)
    ok = (rows < N)[:, None] & (slots < K)[None, :]
    pairs = rows[:, None] * K + slots[None, :]
    ex = tl.load(ids_ptr + pairs, mask=ok, other=0)
    first = start + before  # this block's first slot per expert
    # gather first[ex] from a register vector: a one-hot sum over the experts, a pair slot at a time
    slot = tl.load(rank_ptr + pairs, mask=ok, other=0)
    for j in tl.static_range(K):
        ex_j = tl.sum(tl.where(slots[None, :] == j, ex, 0), axis=1)
        f = tl.sum(tl.where(cols[None, :] == ex_j[:, None], first[None, :], 0), axis=1)
        slot += tl.where(slots[None, :] == j, f[:, None], 0)
    tl.store(slot_ptr + pairs, slot, mask=ok)
    tl.store(perm_ptr + slot, pairs, mask=ok)


def route_sort(
    logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int, rows: int | None = None
) -> Sorted:
    """From router logits [N, E]: (weights [N, k] fp32, ids [N, k] int32, bounds int32 [E + 1], perm [N*k],
    slot [N*k]), as `torch_ref.route_weights` and `regions.route` give them. `rows`: rows a program (None:
    `block_rows(N)`); the batch-invariant mode fixes it, so that a row's softmax sums run in one tile shape
    whatever N is."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"route_sort: want logits [N, E] with contiguous rows, got {tuple(logits.shape)}")
    return _sort(logits, logits.shape[1], 0, tl.float32, per_expert_scale, top_k, rows)


def route_sort_from(
    x: torch.Tensor, proj: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int
) -> Sorted:
    """`route_sort` of the router's logits F.linear(x, proj) (x [N, H] the router's input, proj [E, H], both
    16-bit), with the GEMM split over H (`router_partials`) and its partial products summed by the top-k pass:
    one kernel in place of cuBLAS's split-K GEMM and its reduction."""
    partials = router_partials(x, proj)
    dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    return _sort(partials, proj.shape[0], partials.shape[0], dtype, per_expert_scale, top_k)


def router_partials(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """x [N, H] @ proj [E, H].T as [splits, N, E_P2] fp32 partial products over consecutive ranges of H (columns
    E.. of zeros): `splits` fill about two waves of programs on the device (at most one per 256 columns)."""
    n, h = x.shape
    if x.dtype not in (torch.bfloat16, torch.float16) or proj.dtype != x.dtype:
        raise ValueError(f"router_partials: want 16-bit x and proj of one dtype, got {x.dtype}, {proj.dtype}")
    if proj.dim() != 2 or proj.shape[1] != h or x.stride(1) != 1 or proj.stride(1) != 1:
        raise ValueError(
            f"router_partials: want x [N, H], proj [E, H] with unit column strides, got {x.shape}, {proj.shape}"
        )
    e_p2 = max(16, triton.next_power_of_2(proj.shape[0]))  # tl.dot's smallest N
    block_m = 32 if n <= 1024 else 64
    block_k = min(ROUTER_BLOCK_K, max(16, triton.next_power_of_2(h)))
    row_blocks, k_blocks = triton.cdiv(n, block_m), triton.cdiv(h, block_k)
    want = min(k_blocks, ROUTER_MAX_SPLITS, triton.cdiv(2 * sm_count(x.device), row_blocks))
    per_split = triton.cdiv(k_blocks, max(1, want))
    splits = triton.cdiv(k_blocks, per_split)
    out = torch.empty(splits, n, e_p2, device=x.device, dtype=torch.float32)
    pdl_on = pdl.enabled(x.device)
    _router_kernel[(row_blocks, splits)](
        x,
        proj,
        out,
        n,
        h,
        x.stride(0),
        proj.stride(0),
        E=proj.shape[0],
        E_P2=e_p2,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        K_BLOCKS=per_split,
        num_warps=NUM_WARPS,
        PDL=pdl_on,
        launch_pdl=pdl_on,
    )
    return out


# Columns of H a router program multiplies at a time, and the most splits the top-k pass sums: at the real shape
# (H = 2,816) a denoise step's 256 rows are 8 row blocks x 11 splits of one block each.
ROUTER_BLOCK_K = 256
ROUTER_MAX_SPLITS = 11


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    H,
    stride_x,
    stride_w,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split's partial router logits for BLOCK_M rows: x[rows, ks] @ w[:, ks].T over its K_BLOCKS blocks of
    BLOCK_K columns, fp32, stored to out[split, rows, :E_P2]."""
    pdl.start(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    es = tl.arange(0, E_P2)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_M, E_P2), tl.float32)
    for i in tl.static_range(K_BLOCKS):
        ks = (split * K_BLOCKS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=row_ok[:, None] & (ks < H)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + es[:, None] * stride_w + ks[None, :],
            mask=(es < E)[:, None] & (ks < H)[None, :],
            other=0.0,
        )
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + (split * N + rows)[:, None] * E_P2 + es[None, :], acc, mask=row_ok[:, None])


def _sort(
    src: torch.Tensor,
    n_exp: int,
    splits: int,
    logit_dtype,
    per_expert_scale: torch.Tensor,
    top_k: int,
    rows: int | None = None,
) -> Sorted:
    """The two passes on logits src [N, >= E] (splits 0) or on partials [splits, N, >= E] (their sum), `rows` a
    program (None: `block_rows`)."""
    n = src.shape[-2]
    dev = src.device
    e_p2 = triton.next_power_of_2(n_exp)
    rows = rows or block_rows(n)
    n_blocks = triton.cdiv(n, rows)
    weights = torch.empty(n, top_k, device=dev, dtype=torch.float32)
    ids = torch.empty(n, top_k, device=dev, dtype=torch.int32)
    rank = torch.empty(n, top_k, device=dev, dtype=torch.int32)
    counts = torch.empty(n_blocks, e_p2, device=dev, dtype=torch.int32)
    bounds = torch.empty(n_exp + 1, device=dev, dtype=torch.int32)
    perm = torch.empty(n * top_k, device=dev, dtype=torch.int64)
    slot = torch.empty(n * top_k, device=dev, dtype=torch.int64)
    pdl_on = pdl.enabled(dev)
    consts = dict(E=n_exp, E_P2=e_p2, num_warps=NUM_WARPS, PDL=pdl_on, launch_pdl=pdl_on)
    _topk_kernel[(n_blocks,)](
        src,
        per_expert_scale,
        weights,
        ids,
        rank,
        counts,
        n,
        src.stride(-2),
        src.stride(0) if splits else 0,
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        BLOCK_ROWS=rows,
        SPLITS=splits,
        LOGIT_DTYPE=logit_dtype,
        **consts,
    )
    _slot_kernel[(n_blocks,)](
        ids,
        rank,
        counts,
        bounds,
        perm,
        slot,
        n,
        n_blocks,
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        BLOCK_ROWS=rows,
        BLOCK_B=32,
        **consts,
    )
    return weights, ids, bounds, perm, slot
