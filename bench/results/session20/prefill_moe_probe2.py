"""Probe 2: the expert kernels of a prefill chunk as fused.moe_layer_ffn runs them, the grouped chain (gather
x2[perm // k], grouped_mm, the compiled gelu*up, grouped_mm) against the two Triton kernels (gather and gelu
inside) under candidate tiles, at N tokens (argv), uniform and skewed routing; graphs of 10 calls
(bench/moe_kernels.time_graph), the candidates twice. Outputs against the grouped chain's."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
import moe_kernels as mk  # noqa: E402

from diffgemma.kernels import (
    cuda,  # noqa: E402
    fused,  # noqa: E402
)

tm = mk.tm
T = tm.Tiles
gelu_mul = torch.compile(fused.gelu_mul, dynamic=False)


def cands(n: int) -> dict:
    c = {"denoise": tm.CONFIGS[tm.DEFAULT_CONFIG]}
    for s in (3, 6, 12):
        g = T(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, m_slots=s, tma=True)
        d = T(
            block_m=64,
            block_n=128,
            block_k=64,
            num_warps=4,
            num_stages=4,
            m_slots=s,
            tma=True,
            cols_fast=True,
        )
        c[f"m64_n128_s{s}"] = tm.MoeConfig(g, d)
    for s in (2, 4):
        g = T(
            block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, m_slots=s, tma=True, swap_ab=True
        )
        d = T(
            block_m=64,
            block_n=64,
            block_k=128,
            num_warps=4,
            num_stages=3,
            m_slots=s,
            tma=True,
            swap_ab=True,
            cols_fast=True,
        )
        c[f"swap_m64_s{s}"] = tm.MoeConfig(g, d)
    g = T(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, m_slots=6, tma=True)
    d = T(
        block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, m_slots=6, tma=True, cols_fast=True
    )
    c["m128_s6"] = tm.MoeConfig(g, d)
    g = T(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, m_slots=6, tma=True)
    c["m64_s6_dn256"] = tm.MoeConfig(g, d)
    return c


N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
gen = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(mk.E, 2 * mk.INTER, mk.H, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(mk.E, mk.H, mk.INTER, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(N, mk.H, generator=gen, device="cuda", dtype=torch.bfloat16)


def grouped(perm, bounds):
    offs = bounds[1:]
    gu = cuda._grouped_mm(x[perm // mk.K], gate_up.transpose(1, 2), offs=offs)
    return cuda._grouped_mm(gelu_mul(gu), down.transpose(1, 2), offs=offs)


def triton(perm, bounds, cfg):
    act = tm.gate_up_act(x, gate_up, perm, bounds, mk.K, cfg.gate_up)
    return tm.down_sorted(act, down, bounds, cfg.down)


for scen in ("uniform", "skewed"):
    w, ids = mk.routing(scen, None, gen, n=N)
    counts = torch.bincount(ids.reshape(-1), minlength=mk.E)
    print(
        f"\n[{scen} N={N}] pairs per expert: max {int(counts.max())}, empty {int((counts == 0).sum())}",
        flush=True,
    )
    perm, bounds = tm.sort_pairs(ids, mk.E)
    ref = grouped(perm, bounds)
    for rnd in range(2):
        ms = mk.time_graph(lambda p=perm, b=bounds: grouped(p, b))
        print(f"  r{rnd} grouped chain        {ms * 1e3:8.1f} us", flush=True)
        for name, cfg in cands(N).items():
            try:
                d = (triton(perm, bounds, cfg).float() - ref.float()).abs().max().item()
                ms = mk.time_graph(lambda p=perm, b=bounds, c=cfg: triton(p, b, c))
                print(f"  r{rnd} triton {name:14s} {ms * 1e3:8.1f} us  max|d| {d:.3g}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  r{rnd} triton {name:14s} FAILED {type(e).__name__}: {str(e)[:300]}")
