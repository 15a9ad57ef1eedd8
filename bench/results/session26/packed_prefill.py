# ruff: noqa: B023 - the closures run within their loop iteration
"""Session 26: 12-bit experts (packed_probe4's kernels, decode v2) on a prefill chunk's routing (4,096 tokens x 8
pairs, ~256 an expert), against the kept "prefill" tiles on bf16 weights; each kernel alone (graphs of 10 calls)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
sys.path.insert(0, str(Path(__file__).parent))
import packed_probe4 as pp  # noqa: E402
from moe_kernels import DEV, INTER, E, H, K, routing, time_graph  # noqa: E402

from diffgemma.kernels import triton_moe as tm  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
g = torch.Generator(device=DEV).manual_seed(0)
gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
x = torch.randn(n, H, generator=g, device=DEV, dtype=torch.bfloat16)
gt, gb, gx = pp.pack(gate_up, 128, True)
dt, db, dx = pp.pack(down, 128, True)
gv, dv = pp.kernel_view(gate_up, gx, gb), pp.kernel_view(down, dx, db)
pre = tm.CONFIGS["prefill"]
for scen in ("uniform", "skewed"):
    _, ids = routing(scen, None, g, n)
    perm, bounds = tm.sort_pairs(ids, E)
    act = tm.gate_up_act(x, gv, perm, bounds, K, pre.gate_up)
    y = tm.down_sorted(act, dv, bounds, pre.down)
    us = 1e3 * time_graph(lambda: tm.gate_up_act(x, gate_up, perm, bounds, K, pre.gate_up))
    print(f"{scen:8s} gate_up kept prefill        {us:8.1f} us", flush=True)
    us = 1e3 * time_graph(lambda: tm.down_sorted(act, down, bounds, pre.down))
    print(f"{scen:8s} down    kept prefill        {us:8.1f} us", flush=True)
    for bm, st, w, ms in (
        (64, 3, 4, 6),
        (128, 3, 4, 6),
        (128, 3, 8, 6),
        (128, 2, 8, 6),
        (64, 2, 4, 6),
        (64, 3, 4, 3),
    ):
        name = f"m{bm}_s{st}_w{w}_slots{ms}"
        try:
            out = pp.gate_up_packed(x, (gt, gb), perm, bounds, bm, ms, st, w, v2=True)
            d = float((out.float() - act.float()).abs().max())
            us = 1e3 * time_graph(
                lambda: pp.gate_up_packed(x, (gt, gb), perm, bounds, bm, ms, st, w, v2=True)
            )
            print(f"{scen:8s} gate_up packed {name:14s} {us:8.1f} us  max |d| vs kept {d:.3g}", flush=True)
        except Exception as ex:  # noqa: BLE001 - report and go on
            print(
                f"{scen:8s} gate_up packed {name:14s} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True
            )
        try:
            out = pp.down_packed(act, (dt, db), bounds, bm, ms, st, w, v2=True)
            d = float((out.float() - y.float()).abs().max())
            us = 1e3 * time_graph(lambda: pp.down_packed(act, (dt, db), bounds, bm, ms, st, w, v2=True))
            print(f"{scen:8s} down    packed {name:14s} {us:8.1f} us  max |d| vs kept {d:.3g}", flush=True)
        except Exception as ex:  # noqa: BLE001 - report and go on
            print(
                f"{scen:8s} down    packed {name:14s} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True
            )
