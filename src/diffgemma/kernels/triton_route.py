"""The router's top-k and the expert sort, from the router logits [N, E] to what the MoE kernels take (the
routing weights, the pairs sorted by expert, each expert's bounds), in two Triton kernels.

On an H200 the same work as torch ops (`fused.route`: softmax, top-k, its sort, renormalise, and a counting
sort by cumsum over a one-hot) took 25 us a denoise layer (N = 256) in 7 kernels, 132 us at N = 4096.

Pass 1, a program per block of rows: softmax in fp32, the top k by repeated argmax (the lowest column among
equal values, as torch.topk on CUDA picks them), renormalise, times per_expert_scale; weights and ids stored,
and for the block its count per expert and each pair's rank among its earlier pairs of the same expert.
Pass 2, again a program per block of rows: it sums all blocks' counts (each expert's start, an exclusive
cumsum of them: bounds) and the counts of the blocks before its own (its first slot per expert); a pair's slot
= that + its rank. That is the order of torch.sort(ids.flatten(), stable=True). (A version with one program
for pass 2 took 71 us a layer at N = 4096, in its loop over the 32,768 pairs.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffgemma.kernels import pdl

NUM_WARPS = 4


def block_rows(n: int) -> int:
    """Rows a program: about one program an SM (132 on an H200), 4 to 32 rows. bench/layer_kernels.py on an H200
    (bench/results/route_rows_sweep/), both passes: at N = 256, 4 rows 7.4 us against 12.0 for 16; at
    N = 4,096, 32 rows 22.0 us against 25.1 for 16 and 189 for 4 (at 4 warps)."""
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
    E: tl.constexpr,
    E_P2: tl.constexpr,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Pass 1 for BLOCK_ROWS rows: softmax, top-k, weights; each pair's rank among this block's earlier pairs
    of its expert, and the block's count per expert."""
    pdl.start(PDL)
    block = tl.program_id(0)
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < N
    cols = tl.arange(0, E_P2)
    col_ok = cols < E
    slots = tl.arange(0, K_P2)
    x = tl.load(
        logits_ptr + rows[:, None] * stride_ln + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=-float("inf"),
    ).to(tl.float32)
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
    logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From router logits [N, E]: (weights [N, k] fp32, ids [N, k] int32, bounds int32 [E + 1], perm [N*k],
    slot [N*k]), as `torch_ref.route_weights` and `fused.route` give them."""
    n, n_exp = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("route_sort: the logits' rows must be contiguous")
    dev = logits.device
    e_p2 = triton.next_power_of_2(n_exp)
    rows = block_rows(n)
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
        logits,
        per_expert_scale,
        weights,
        ids,
        rank,
        counts,
        n,
        logits.stride(0),
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        BLOCK_ROWS=rows,
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
