"""Session 25: the expert kernels alone (graphs of 10 calls) on tiles that fit two or more programs an SM
(gate_up's kept tiles hold 200 KB of shared memory: one program an SM, which drains its pipeline at each program's
end), plus a plain read of the same bytes. Uniform and skewed routing. Then the denoise step in one process with
the fastest gate_up / down tiles (uniform routing) against the kept ones, alternating graphs in rounds.

    PYTHONPATH=src:bench python occupancy_probe.py OUT.json

Lint-only edits after call 2: tensors freed by rebinding instead of del."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
from moe_kernels import DEV, INTER, E, H, K, N, routing, time_graph  # noqa: E402

from diffgemma.bench import REAL_CONFIG, random_model  # noqa: E402
from diffgemma.kernels import cuda as fast_ops  # noqa: E402
from diffgemma.kernels import triton_moe as tm  # noqa: E402

g = torch.Generator(device=DEV).manual_seed(0)
gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
kept = tm.CONFIGS[tm.DEFAULT_CONFIG]
T = tm.Tiles


def gu(bn, bk, st, w=4):
    return T(32, bn, bk, num_warps=w, num_stages=st, m_slots=3, swap_ab=True, tma=True)


def dn(bn, bk, st, w=4):
    return T(32, bn, bk, num_warps=w, num_stages=st, m_slots=2, swap_ab=True, tma=True, cols_fast=True)


gate_up_tiles = {"kept": kept.gate_up}
for bn, bk, st in (
    (64, 128, 2),
    (64, 64, 3),
    (64, 64, 4),
    (64, 64, 5),
    (64, 32, 8),
    (64, 32, 10),
    (32, 128, 4),
):
    gate_up_tiles[f"n{bn}_k{bk}_s{st}"] = gu(bn, bk, st)
down_tiles = {"kept": kept.down}
for bn, bk, st in (
    (64, 64, 3),
    (64, 64, 4),
    (64, 128, 2),
    (128, 64, 4),
    (128, 128, 3),
    (256, 64, 3),
    (256, 64, 2),
):
    down_tiles[f"n{bn}_k{bk}_s{st}"] = dn(bn, bk, st)
    if bn > 64:
        down_tiles[f"n{bn}_k{bk}_s{st}_w8"] = dn(bn, bk, st, 8)

res = {"alone": {}, "step": {}}
read_buf = torch.empty(E * 3 * INTER * H, device=DEV, dtype=torch.bfloat16)
read_buf.copy_(torch.cat([gate_up.reshape(-1), down.reshape(-1)]))
us = 1e3 * time_graph(lambda: read_buf.sum(dtype=torch.float32))
res["alone"]["plain_read_sum"] = us
print(f"plain read (torch sum) of gate_up+down: {us:7.1f} us, {read_buf.numel() * 2 / us / 1e6:.2f} TB/s")
read_buf = None
for scen in ("uniform", "skewed"):
    w, ids = routing(scen, None, g)
    perm, bounds = tm.sort_pairs(ids, E)
    ref_act = tm.gate_up_act(x, gate_up, perm, bounds, K, kept.gate_up)
    ref_y = tm.down_sorted(ref_act, down, bounds, kept.down)
    for kind, tiles in (("gate_up", gate_up_tiles), ("down", down_tiles)):
        for name, t in tiles.items():
            if kind == "gate_up":
                fn = lambda t=t, p=perm, b=bounds: tm.gate_up_act(x, gate_up, p, b, K, t)  # noqa: E731
                ref = ref_act
            else:
                fn = lambda t=t, a=ref_act, b=bounds: tm.down_sorted(a, down, b, t)  # noqa: E731
                ref = ref_y
            try:
                same = bool(torch.equal(fn(), ref))
                us = 1e3 * time_graph(fn)
                res["alone"][f"{scen}/{kind}/{name}"] = {"us": us, "same": same}
                print(f"{scen:8s} {kind:7s} {name:16s} {us:7.1f} us  same {same}", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{scen:8s} {kind:7s} {name:16s} FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)


def best(kind):
    tiles = gate_up_tiles if kind == "gate_up" else down_tiles
    times = {n: res["alone"].get(f"uniform/{kind}/{n}", {}).get("us", 1e9) for n in tiles}
    name = min(times, key=times.get)
    return name, tiles[name]


(gn, gt), (dname, dt) = best("gate_up"), best("down")
print(f"fastest alone (uniform): gate_up {gn}, down {dname}", flush=True)
variants = {"kept": kept, "both": tm.MoeConfig(gt, dt), "gate_up": tm.MoeConfig(gt, kept.down)}
if gn == "kept" and dname == "kept":
    variants = {}
order = ["kept", "both", "gate_up", "kept"] if variants else []
gate_up = down = None  # freed before the model is built
torch.cuda.empty_cache()
if order:
    model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
    v, c = model.cfg.vocab_size, 256
    for ctx in (1024, 32768):
        kv = model.new_cache(ctx + 2 * c)
        model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
        canvas = torch.randint(0, v, (c,), device="cuda")
        probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
        model._load_geometry(kv, c)
        steps = {}
        for i, name in enumerate(order):
            tm.CONFIGS[tm.DEFAULT_CONFIG] = variants[name]
            steps[f"{i}:{name}"] = fast_ops.GraphStep(
                lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False, raw=True),
                canvas,
                probs,
                torch.cuda.graph_pool_handle(),
            )
        tm.CONFIGS[tm.DEFAULT_CONFIG] = kept
        assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
        outs = {k: s(canvas, s.sc).float().clone() for k, s in steps.items()}
        first = next(iter(outs.values()))
        eq = [torch.equal(first, o) for o in outs.values()]
        print(f"ctx {ctx}: logits equal to the first {eq}", flush=True)
        times = {k: [] for k in steps}
        for _ in range(7):
            for k, s in steps.items():
                for _ in range(3):
                    s.graph.replay()
                torch.cuda.synchronize()
                ms = []
                for _ in range(20):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    s.graph.replay()
                    e1.record()
                    e1.synchronize()
                    ms.append(e0.elapsed_time(e1))
                times[k].append(statistics.median(ms))
        for k, r in times.items():
            print(
                f"ctx {ctx}: {k:10s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}",
                flush=True,
            )
        res["step"][str(ctx)] = {"equal": eq, "rounds_ms": times, "gate_up": gn, "down": dname}
        del steps, outs
        torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
