"""Session 25: the down kernel overlapping gate_up's tail (`MoeConfig.overlap`). Part 1: the experts alone at
the real shape (route_sort + both kernels, graphs of 10 calls), uniform and skewed routing, for the kept tiles,
gate_up expert by expert (cf), and cf with the overlap (ov); the same bits asserted. Part 2: the denoise step in
one process, graphs captured with each and replayed alternately in rounds (the first again last).

    PYTHONPATH=src python overlap_ab.py OUT.json 1024 32768

It runs on the tree of `overlap.diff` (call 1). Lint-only edits after the run: names, a with-block, the
weights freed by rebinding instead of del."""

import dataclasses
import json
import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import triton_moe as tm
from diffgemma.kernels import triton_route as tr

out_path = sys.argv[1]
ctxs = [int(a) for a in sys.argv[2:]] or [1024]
kept = tm.CONFIGS[tm.DEFAULT_CONFIG]
cf = tm.MoeConfig(dataclasses.replace(kept.gate_up, cols_fast=True), kept.down)
ov = tm.CONFIGS["m32_tma_swap_g5s3_ov"]
ov_rows = dataclasses.replace(
    kept, overlap=True
)  # the overlap on the kept (column-block-major) gate_up order
variants = {"kept": kept, "cf": cf, "ov": ov, "ov_rows": ov_rows}
res = {"alone": {}, "step": {}}


def time_graph(fn, reps=10, rounds=15):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / reps)
    return statistics.median(ts)


E, H, INTER, N, K = 128, 2816, 704, 256, 8
g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(E, 2 * INTER, H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, INTER, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(N, H, generator=g, device="cuda", dtype=torch.bfloat16)
pes = torch.rand(E, generator=g, device="cuda") + 0.5
for scen, bias in (("uniform", 0.0), ("skewed", 1.5)):
    logits = torch.randn(N, E, generator=g, device="cuda") + bias * torch.randn(E, generator=g, device="cuda")
    logits = logits.bfloat16()
    _, _, bounds, perm, _, ready = tr.route_sort(logits, pes, K)
    ref_y = tm.experts_sorted(x, gate_up, down, perm, bounds, K, kept)
    print(f"{scen}: busiest expert {int(bounds.diff().max())} pairs, empty {int((bounds.diff() == 0).sum())}")
    route_us = 1e3 * time_graph(lambda lg=logits: tr.route_sort(lg, pes, K))
    res["alone"][f"{scen}/route"] = route_us
    print(f"{scen:8s} route alone {route_us:7.1f} us", flush=True)
    for name, cfg in variants.items():

        def call(cfg=cfg, lg=logits):
            _, _, b, p, _, r = tr.route_sort(lg, pes, K)
            return tm.experts_sorted(x, gate_up, down, p, b, K, cfg, r)

        same = bool(torch.equal(call(), ref_y))
        us = 1e3 * time_graph(call)
        res["alone"][f"{scen}/{name}"] = {"us": us, "same": same}
        print(f"{scen:8s} {name:8s} route+experts {us:7.1f} us  same {same}", flush=True)
torch.cuda.synchronize()
gate_up = down = None  # freed before the model is built
torch.cuda.empty_cache()

ROUNDS, REPS = 7, 20
order = ["kept", "cf", "ov", "kept"]
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
for ctx in ctxs:
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
    for _ in range(ROUNDS):
        for k, s in steps.items():
            for _ in range(3):
                s.graph.replay()
            torch.cuda.synchronize()
            ms = []
            for _ in range(REPS):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                s.graph.replay()
                e1.record()
                e1.synchronize()
                ms.append(e0.elapsed_time(e1))
            times[k].append(statistics.median(ms))
    for k, r in times.items():
        print(
            f"ctx {ctx}: {k:8s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}",
            flush=True,
        )
    res["step"][str(ctx)] = {"equal": eq, "rounds_ms": times}
    del steps, outs
    torch.cuda.empty_cache()
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
