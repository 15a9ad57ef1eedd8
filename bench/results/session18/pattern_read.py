"""Is the expert kernels' access pattern what keeps them under the plain read's bandwidth? One layer's expert
weights (real shape, bf16), 10 calls in a CUDA graph timed between CUDA events, medians of 15 rounds of 5 (L2 holds 50 MB of the
1.5 GB, so each run streams from HBM):
- the real kernels (`triton_moe.gate_up_act`, `down_sorted`, DEFAULT_CONFIG) on uniform routing (16 pairs an expert);
- `pattern`: the same grid, program order, TMA boxes and pipelining, the MMA replaced by a sum of each tile;
- `plain`: a sequential read of the same bytes, 512 KB a program (session 17's read ceiling)."""

import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from diffgemma.kernels import triton_moe as tm


@triton.jit
def _pattern_kernel(
    desc,
    out_ptr,
    COLS_FAST: tl.constexpr,
    M_SLOTS: tl.constexpr,
    ROWS_E: tl.constexpr,
    HALF: tl.constexpr,
    TWO: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if (
        tl.program_id(0) % M_SLOTS == 0
    ):  # the other slots find no pairs at ~16 an expert, as in the real kernels
        e = tl.program_id(0) // M_SLOTS
        row = e * ROWS_E + tl.program_id(1) * BLOCK_N
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += desc.load([row, k0]).to(tl.float32)
            if TWO:
                acc += desc.load([row + HALF, k0]).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))


@triton.jit
def _plain_kernel(x_ptr, out_ptr, n, PER_PROG: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * PER_PROG
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, PER_PROG, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def pattern(w, tiles, two, stages, cols_fast=False):
    e, r, k = w.shape
    desc = TensorDescriptor(w, [e * r, k], [k, 1], [tiles.block_n, tiles.block_k])
    rows = r // 2 if two else r
    grid = (e * tiles.m_slots, triton.cdiv(rows, tiles.block_n))
    out = torch.empty(grid[0] * grid[1], device=w.device)
    _pattern_kernel[grid[::-1] if cols_fast else grid](
        desc,
        out,
        COLS_FAST=cols_fast,
        M_SLOTS=tiles.m_slots,
        ROWS_E=r,
        HALF=rows,
        TWO=two,
        K=k,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=stages,
    )
    return out


def plain(w, per_prog=1 << 18, block=4096):
    n = w.numel()
    grid = triton.cdiv(n, per_prog)
    out = torch.empty(grid, device=w.device)
    _plain_kernel[(grid,)](w, out, n, PER_PROG=per_prog, BLOCK=block, num_warps=8)


torch.manual_seed(0)
dev = "cuda"
E, INTER, H = 128, 704, 2816
gu = torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16) * 0.02
dn = torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16) * 0.02
x = torch.randn(256, H, device=dev, dtype=torch.bfloat16)
ids = torch.stack([torch.randperm(E, device=dev)[:8] for _ in range(256)]).int()
perm, bounds = tm.sort_pairs(ids, E)
cfg = tm.CONFIGS[tm.DEFAULT_CONFIG]
act = tm.gate_up_act(x, gu, perm, bounds, 8, cfg.gate_up)
gb_gu, gb_dn = gu.numel() * 2 / 1e9, dn.numel() * 2 / 1e9
T = tm.Tiles
cf_gu = T(block_m=32, m_slots=2, num_stages=3, tma=True, cols_fast=True)
cf_dn = T(block_m=32, m_slots=2, tma=True, cols_fast=True)
cases = {
    "gate_up real": (gb_gu, lambda: tm.gate_up_act(x, gu, perm, bounds, 8, cfg.gate_up)),
    "gate_up plain": (gb_gu, lambda: plain(gu)),
    "down real": (gb_dn, lambda: tm.down_sorted(act, dn, bounds, cfg.down)),
    "down real cols fast": (gb_dn, lambda: tm.down_sorted(act, dn, bounds, cf_dn)),
    "down plain": (gb_dn, lambda: plain(dn)),
}
GU = dict(block_m=32, m_slots=2, tma=True)
for bn, bk, st, w, cf in (
    (64, 256, 2, 4, True),
    (64, 256, 2, 8, False),
    (64, 256, 2, 8, True),
    (32, 256, 3, 4, True),
    (64, 128, 3, 8, False),
    (64, 128, 4, 4, False),
    (128, 64, 3, 4, False),
    (64, 64, 6, 4, False),
):
    t = T(block_n=bn, block_k=bk, num_stages=st, num_warps=w, cols_fast=cf, **GU)
    name = f"gate_up real n{bn} k{bk} s{st} w{w}{' cf' if cf else ''}"
    cases[name] = (gb_gu, lambda t=t: tm.gate_up_act(x, gu, perm, bounds, 8, t))
for bn, bk, st, w in (
    (64, 128, 3, 4),
    (64, 128, 5, 4),
    (128, 128, 3, 4),
    (128, 128, 3, 8),
    (64, 64, 8, 4),
    (32, 128, 6, 4),
):
    t = T(block_n=bn, block_k=bk, num_stages=st, num_warps=w, cols_fast=True, **GU)
    cases[f"down real n{bn} k{bk} s{st} w{w} cf"] = (gb_dn, lambda t=t: tm.down_sorted(act, dn, bounds, t))
# the same values in either order; the pattern kernels' sums against torch's
print("gate_up cols fast, same act:", torch.equal(tm.gate_up_act(x, gu, perm, bounds, 8, cf_gu), act))
y = tm.down_sorted(act, dn, bounds, cfg.down)
print("down cols fast, same y:", torch.equal(tm.down_sorted(act, dn, bounds, cf_dn), y))
graphs = {}
for name, (_, fn) in list(cases.items()):  # 10 calls a graph: no launch gaps in the timing
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - tiles that do not fit: reported, skipped
        print(f"{name}: {type(e).__name__}: {str(e)[:120]}")
        del cases[name]
        continue
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    graphs[name] = g
res = {k: [] for k in cases}
for rnd in range(16):
    for name, g in graphs.items():
        ms = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            ms.append(e0.elapsed_time(e1) / 10)
        if rnd:
            res[name].append(statistics.median(ms))
for name, r in res.items():
    us = statistics.median(r) * 1e3
    print(f"{name:26s} {us:7.1f} us  {cases[name][0] / us * 1e3:5.2f} TB/s")
