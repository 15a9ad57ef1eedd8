"""The expert kernels alone (graphs of 10 calls) around the kept tiles (gate_up at 5 stages since this session):
K blocks, stages, warps, M-slots. Uniform and skewed routing. (Call 4 ran this file's first version: 16 pairs a
tile at block_k 256, 512-byte weight rows, which a plain read takes faster; all slower.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
from moe_kernels import DEV, INTER, E, H, K, N, routing, time_graph  # noqa: E402

from diffgemma.kernels import triton_moe as tm  # noqa: E402

g = torch.Generator(device=DEV).manual_seed(0)
gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
kept = tm.CONFIGS[tm.DEFAULT_CONFIG]
T = tm.Tiles
gate_up_tiles = {"kept": kept.gate_up}
for bk, st in ((128, 5), (64, 6), (64, 8), (64, 10)):
    for w in (4, 8):
        gate_up_tiles[f"k{bk}_s{st}_w{w}"] = T(
            32, 64, bk, num_warps=w, num_stages=st, m_slots=2, swap_ab=True, tma=True
        )
for slots in (1, 3):
    gate_up_tiles[f"k128_s5_slots{slots}"] = T(
        32, 64, 128, num_stages=5, m_slots=slots, swap_ab=True, tma=True
    )
down_tiles = {"kept": kept.down}
for bk, st in ((128, 4), (64, 6), (64, 8)):
    for w in (4, 8):
        down_tiles[f"k{bk}_s{st}_w{w}"] = T(
            32, 64, bk, num_warps=w, num_stages=st, m_slots=2, swap_ab=True, tma=True, cols_fast=True
        )
down_tiles["k128_s3_w8"] = T(
    32, 64, 128, num_warps=8, num_stages=3, m_slots=2, swap_ab=True, tma=True, cols_fast=True
)
res = {}
for scen in ("uniform", "skewed"):
    w, ids = routing(scen, None, g)
    perm, bounds = tm.sort_pairs(ids, E)
    ref_act = tm.gate_up_act(x, gate_up, perm, bounds, K, kept.gate_up)
    ref_y = tm.down_sorted(ref_act, down, bounds, kept.down)
    for name, t in gate_up_tiles.items():
        try:
            same = bool(torch.equal(tm.gate_up_act(x, gate_up, perm, bounds, K, t), ref_act))
            us = 1e3 * time_graph(lambda t=t, p=perm, b=bounds: tm.gate_up_act(x, gate_up, p, b, K, t))
            res[f"{scen}/gate_up/{name}"] = {"us": us, "same": same}
            print(f"{scen:8s} gate_up {name:20s} {us:7.1f} us  same {same}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{scen:8s} gate_up {name:20s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
    for name, t in down_tiles.items():
        try:
            same = bool(torch.equal(tm.down_sorted(ref_act, down, bounds, t), ref_y))
            us = 1e3 * time_graph(lambda t=t, a=ref_act, b=bounds: tm.down_sorted(a, down, b, t))
            res[f"{scen}/down/{name}"] = {"us": us, "same": same}
            print(f"{scen:8s} down    {name:20s} {us:7.1f} us  same {same}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{scen:8s} down    {name:20s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
# fp32 activations on the 5-stage gate_up tiles: x's fp32 tiles should not fit in shared memory (SPLIT3_CONFIG)
w, ids = routing("uniform", None, g)
perm, bounds = tm.sort_pairs(ids, E)
try:
    tm.gate_up_act(x.float(), gate_up, perm, bounds, K, kept.gate_up)
    torch.cuda.synchronize()
    print("fp32 x on the 5-stage gate_up tiles: ran", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"fp32 x on the 5-stage gate_up tiles: {type(e).__name__}: {str(e)[:160]}", flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
