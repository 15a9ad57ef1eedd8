"""Session 25: the dense MLP's side stream at a higher priority. In the graphed step (call 3's trace) the dense
MLP runs late: its GEMM waits for SMs until the gate_up kernel's last wave, its gelu until the down kernel ends,
and its second GEMM and norm then sit between the down kernel and post_ffn (~11-19 us a layer). A CUDA graph
keeps each kernel node's stream priority; the CTA scheduler then serves pending higher-priority CTAs first.
Variants in one process (graphs captured with each, replayed alternately in rounds): kept (priority 0), hi (the
whole dense MLP on a high-priority stream), hi2 (its first GEMM as now, the gelu, second GEMM and norm on a
high-priority stream). Then one traced replay each: per layer, the dense GEMM's start after gate_up's, and
post_ffn's start after the down kernel's end.

    PYTHONPATH=src python priority_ab.py OUT.json

Lint-only edits after call 4: with-blocks, zip(strict=False)."""

import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused

dev = torch.device("cuda", 0)
normal = torch.cuda.Stream(dev)
high = torch.cuda.Stream(dev, priority=-100)  # mapped to the device's highest
print(
    f"priorities: normal {normal.priority}, high {high.priority}, range {torch.cuda.Stream.priority_range()}"
)
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
regions = model.fused_regions
orig_dense = regions["dense_mlp"]


def dense_split(x, w_gu, w_dn, w_post, eps):
    gu = F.linear(x, w_gu)
    cur = torch.cuda.current_stream()
    high.wait_stream(cur)
    with torch.cuda.stream(high):
        out = regions["norm"](F.linear(regions["gelu_mul"](gu), w_dn), w_post, eps)
    cur.wait_stream(high)
    return out


variants = {"kept": (normal, orig_dense), "hi": (high, orig_dense), "hi2": (normal, dense_split)}
order = ["kept", "hi", "hi2", "kept"]
res = {}
v, c = model.cfg.vocab_size, 256


def layer_stats(step):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace("/tmp/prio.json")
    with open("/tmp/prio.json") as f:
        ev = json.load(f)["traceEvents"]
    k = sorted((e for e in ev if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    gu = [e for e in k if e["name"] == "_gate_up_kernel"]
    dn = [e for e in k if e["name"] == "_down_kernel"]
    pf = [e for e in k if e["name"] == "_post_ffn_kernel"]
    dense1 = [e for e in k if e["name"].startswith("nvjet") and "128x64_64x8" in e["name"]]
    after_down = [p["ts"] - (d["ts"] + d["dur"]) for d, p in zip(dn, pf, strict=False)]
    dense_start = (
        [d["ts"] - g["ts"] for g, d in zip(gu, dense1, strict=False)] if len(dense1) == len(gu) else []
    )
    span = k[-1]["ts"] + k[-1]["dur"] - k[0]["ts"]
    return {
        "span_us": span,
        "post_ffn_after_down_us": statistics.median(after_down),
        "dense_gemm_after_gate_up_us": statistics.median(dense_start) if dense_start else None,
        "gate_up_us": statistics.median(e["dur"] for e in gu),
        "down_us": statistics.median(e["dur"] for e in dn),
    }


for ctx in (1024, 32768):
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, name in enumerate(order):
        stream, dense = variants[name]
        fused._side_streams[dev] = stream
        regions["dense_mlp"] = dense
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False, raw=True),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    fused._side_streams[dev] = normal
    regions["dense_mlp"] = orig_dense
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
            f"ctx {ctx}: {k:8s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}",
            flush=True,
        )
    stats = {k: layer_stats(s) for k, s in steps.items()}
    for k, st in stats.items():
        print(f"ctx {ctx}: {k:8s} traced {st}", flush=True)
    res[str(ctx)] = {"equal": eq, "rounds_ms": times, "traced": stats}
    del steps, outs
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
