"""Probe: the Triton expert kernels with large tiles (no swap, 64-128 pairs a tile) on a prefill chunk's
routing (4,096 tokens x 8 = 32k pairs, ~256 an expert), against the grouped-GEMM path (gather, grouped_mm,
gelu*up, grouped_mm) that prefill uses now; each end to end (with the sort and the weighted sum) and each kernel
alone, uniform and skewed routing, graphs of 10 calls (bench/moe_kernels.time_graph)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
import moe_kernels as mk  # noqa: E402

from diffgemma.kernels import cuda  # noqa: E402

tm = mk.tm
T = tm.Tiles
N = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
GU = {
    "m128_n64_k64_w8_s4": T(
        block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=4, m_slots=3, tma=True
    ),
    "m128_n128_k64_w8_s3": T(
        block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, m_slots=3, tma=True
    ),
    "m64_n128_k64_w4_s4": T(
        block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, m_slots=5, tma=True
    ),
    "m128_n64_k128_w8_s3": T(
        block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3, m_slots=3, tma=True
    ),
    "m64_n64_k64_w4_s5": T(
        block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=5, m_slots=5, tma=True
    ),
}
DN = {
    "m128_n128_k64_w8_s4": T(
        block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, m_slots=3, tma=True
    ),
    "m128_n256_k64_w8_s3": T(
        block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, m_slots=3, tma=True
    ),
    "m64_n128_k64_w4_s4": T(
        block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, m_slots=5, tma=True
    ),
    "m128_n128_k64_w8_s4_cf": T(
        block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, m_slots=3, tma=True, cols_fast=True
    ),
}
g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(mk.E, 2 * mk.INTER, mk.H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(mk.E, mk.H, mk.INTER, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(N, mk.H, generator=g, device="cuda", dtype=torch.bfloat16)
flops = 2 * N * mk.K * (2 * mk.INTER * mk.H + mk.H * mk.INTER)


def tf(ms: float, f: float = flops) -> float:
    return f / (ms * 1e-3) / 1e12


for scen in ("uniform", "skewed"):
    w, ids = mk.routing(scen, None, g, n=N)
    counts = torch.bincount(ids.reshape(-1), minlength=mk.E)
    print(
        f"\n[{scen} N={N}] pairs per expert: max {int(counts.max())}, empty {int((counts == 0).sum())}",
        flush=True,
    )
    ref = cuda.moe_experts_grouped(x, w, ids, gate_up, down)
    ms = mk.time_graph(lambda w=w, i=ids: cuda.moe_experts_grouped(x, w, i, gate_up, down))
    print(f"  grouped path end to end {ms * 1e3:8.1f} us {tf(ms):6.1f} TFLOP/s", flush=True)
    perm, bounds = tm.sort_pairs(ids, mk.E)
    best = {}
    for name, t in GU.items():
        try:
            act = tm.gate_up_act(x, gate_up, perm, bounds, mk.K, t)
            ms = mk.time_graph(lambda t=t, p=perm, b=bounds: tm.gate_up_act(x, gate_up, p, b, mk.K, t))
            best.setdefault("gu", (ms, name, act))
            if ms < best["gu"][0]:
                best["gu"] = (ms, name, act)
            print(f"  gate_up {name:24s} {ms * 1e3:8.1f} us {tf(ms, flops * 2 / 3):6.1f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  gate_up {name:24s} FAILED {type(e).__name__}: {str(e)[:300]}")
    act = best["gu"][2]
    for name, t in DN.items():
        try:
            tm.down_sorted(act, down, bounds, t)
            ms = mk.time_graph(lambda t=t, a=act, b=bounds: tm.down_sorted(a, down, b, t))
            best.setdefault("dn", (ms, name))
            if ms < best["dn"][0]:
                best["dn"] = (ms, name)
            print(f"  down    {name:24s} {ms * 1e3:8.1f} us {tf(ms, flops / 3):6.1f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  down    {name:24s} FAILED {type(e).__name__}: {str(e)[:300]}")
    cfg = tm.MoeConfig(GU[best["gu"][1]], DN[best["dn"][1]])
    out = tm.moe_experts_triton(x, w, ids, gate_up, down, config=cfg)
    ms = mk.time_graph(lambda w=w, i=ids, c=cfg: tm.moe_experts_triton(x, w, i, gate_up, down, config=c))
    d = (out.float() - ref.float()).abs()
    print(
        f"  triton path end to end ({best['gu'][1]}, {best['dn'][1]}) {ms * 1e3:8.1f} us {tf(ms):6.1f} TFLOP/s;"
        f" against grouped max |d| {d.max().item():.3g} mean {d.mean().item():.3g}, ref mean |y| {ref.float().abs().mean().item():.3g}"
    )
    # the grouped GEMMs alone on pre-gathered inputs, for the kernels' share
    k = mk.K
    sorted_ids = ids.reshape(-1)[perm]
    offs = torch.cumsum(torch.bincount(sorted_ids, minlength=mk.E), 0).to(torch.int32)
    xs = x[perm // k]
    ms = mk.time_graph(lambda xs=xs, o=offs: cuda._grouped_mm(xs, gate_up.transpose(1, 2), offs=o))
    print(f"  grouped_mm gate_up alone {ms * 1e3:8.1f} us {tf(ms, flops * 2 / 3):6.1f} TFLOP/s")
    ms = mk.time_graph(lambda a=act, o=offs: cuda._grouped_mm(a, down.transpose(1, 2), offs=o))
    print(f"  grouped_mm down alone    {ms * 1e3:8.1f} us {tf(ms, flops / 3):6.1f} TFLOP/s")
