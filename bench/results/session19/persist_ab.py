"""Ran in session 19's calls 1-3 with `persistent.diff` applied (calls 1-2; not kept). Persistent expert kernels (Tiles.persistent programs an SM walking the (pair block, column block) tiles,
with or without one software pipeline across tiles) against the default grid, each kernel alone at the real
shape (graphs of 10 calls, medians of 20 replays; bench/moe_kernels.time_graph), uniform and skewed routing;
every output compared bit for bit with the default's. The list runs twice (drift between variants)."""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
import moe_kernels as mk  # noqa: E402

tm = mk.tm
cfg = tm.CONFIGS[tm.DEFAULT_CONFIG]
R = dataclasses.replace
SETS = {
    "call1": lambda: (
        {
            "default": cfg.gate_up,
            "p1": R(cfg.gate_up, persistent=1),
            "p1_flat": R(cfg.gate_up, persistent=1, flatten=True),
            "p1_flat_s5": R(cfg.gate_up, persistent=1, flatten=True, num_stages=5),
            "p2_flat_s2": R(cfg.gate_up, persistent=2, flatten=True, num_stages=2),
            "p1_flat_w8": R(cfg.gate_up, persistent=1, flatten=True, num_warps=8),
        },
        {
            "default": cfg.down,
            "p3": R(cfg.down, persistent=3),
            "p1_flat": R(cfg.down, persistent=1, flatten=True),
            "p2_flat": R(cfg.down, persistent=2, flatten=True),
            "p3_flat": R(cfg.down, persistent=3, flatten=True),
            "p1_flat_s6": R(cfg.down, persistent=1, flatten=True, num_stages=6),
            "p2_flat_s4": R(cfg.down, persistent=2, flatten=True, num_stages=4),
            "p1_flat_s8": R(cfg.down, persistent=1, flatten=True, num_stages=8),
        },
    ),
    # 512-byte weight rows (block_k 256) with 32-row boxes, so that 4 stages fit (gate, up and x: 48 KB a stage)
    "call2": lambda: (
        {
            "default": cfg.gate_up,
            "n32_k256_s4": R(cfg.gate_up, block_n=32, block_k=256, num_stages=4),
            "n32_k256_s3": R(cfg.gate_up, block_n=32, block_k=256, num_stages=3),
            "n32_k256_s4_noswap": R(cfg.gate_up, block_n=32, block_k=256, num_stages=4, swap_ab=False),
            "n32_k256_s4_w8": R(cfg.gate_up, block_n=32, block_k=256, num_stages=4, num_warps=8),
            "n32_k128_s6": R(cfg.gate_up, block_n=32, block_k=128, num_stages=6),
            "n32_k256_s4_p1": R(cfg.gate_up, block_n=32, block_k=256, num_stages=4, persistent=1),
            "n32_k256_s4_p1_flat": R(
                cfg.gate_up, block_n=32, block_k=256, num_stages=4, persistent=1, flatten=True
            ),
            "p1": R(cfg.gate_up, persistent=1),
        },
        {
            "default": cfg.down,
            "n32_k256_s4": R(cfg.down, block_n=32, block_k=256, num_stages=4),
            "n32_k256_s6": R(cfg.down, block_n=32, block_k=256, num_stages=6),
            "k256_s3": R(cfg.down, block_k=256, num_stages=3),
            "p2_flat_s4": R(cfg.down, persistent=2, flatten=True, num_stages=4),
        },
    ),
}
SETS["call3"] = lambda: (  # 512-byte rows with 16 pairs a tile: gate, up and x in 72 KB a stage, 3 stages
    {
        "default": cfg.gate_up,
        "m16_k256_s3": R(cfg.gate_up, block_m=16, block_k=256, num_stages=3),
        "m16_k256_s3_slots3": R(cfg.gate_up, block_m=16, block_k=256, num_stages=3, m_slots=3),
        "m16_k128_s5": R(cfg.gate_up, block_m=16, num_stages=5),
        "m16_k256_s3_w8": R(cfg.gate_up, block_m=16, block_k=256, num_stages=3, num_warps=8),
    },
    {
        "default": cfg.down,
        "m16_s4": R(cfg.down, block_m=16, num_stages=4),
        "m16_k256_s3": R(cfg.down, block_m=16, block_k=256, num_stages=3),
    },
)
GU, DN = SETS[sys.argv[1] if len(sys.argv) > 1 else "call1"]()
g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(mk.E, 2 * mk.INTER, mk.H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(mk.E, mk.H, mk.INTER, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(mk.N, mk.H, generator=g, device="cuda", dtype=torch.bfloat16)
gu_bytes, dn_bytes = gate_up.numel() * 2, down.numel() * 2
for scen in ("uniform", "skewed"):
    w, ids = mk.routing(scen, None, g)
    counts = torch.bincount(ids.reshape(-1), minlength=mk.E)
    print(
        f"\n[{scen}] pairs per expert: max {int(counts.max())}, empty {int((counts == 0).sum())}", flush=True
    )
    perm, bounds = tm.sort_pairs(ids, mk.E)
    act0 = tm.gate_up_act(x, gate_up, perm, bounds, mk.K, GU["default"])
    y0 = tm.down_sorted(act0, down, bounds, DN["default"])
    for rnd in range(2):
        for name, tiles in GU.items():
            try:
                same = torch.equal(tm.gate_up_act(x, gate_up, perm, bounds, mk.K, tiles), act0)
                ms = mk.time_graph(
                    lambda t=tiles, p=perm, b=bounds: tm.gate_up_act(x, gate_up, p, b, mk.K, t)
                )
                print(
                    f"  r{rnd} gate_up {name:12s} {ms * 1e3:7.1f} us {mk.tbps(gu_bytes, ms):5.2f} TB/s same {same}"
                )
            except Exception as e:  # noqa: BLE001
                print(f"  r{rnd} gate_up {name:12s} FAILED {type(e).__name__}: {str(e)[:200]}")
        for name, tiles in DN.items():
            try:
                same = torch.equal(tm.down_sorted(act0, down, bounds, tiles), y0)
                ms = mk.time_graph(lambda t=tiles, a=act0, b=bounds: tm.down_sorted(a, down, b, t))
                print(
                    f"  r{rnd} down    {name:12s} {ms * 1e3:7.1f} us {mk.tbps(dn_bytes, ms):5.2f} TB/s same {same}"
                )
            except Exception as e:  # noqa: BLE001
                print(f"  r{rnd} down    {name:12s} FAILED {type(e).__name__}: {str(e)[:200]}")
