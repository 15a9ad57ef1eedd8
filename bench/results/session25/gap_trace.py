"""Session 25: where the graphed denoise step's time goes between kernels. The step at 1k (and 32k) context,
replayed under the profiler (CUPTI records the kernels a CUDA graph launches): per replay, the span from the
first kernel's start to the last one's end, the time some kernel runs (the union over streams), and on the main
stream each gap between a kernel's end and the next one's start, summed by the kernel that follows.

    PYTHONPATH=src python gap_trace.py OUT.json

Call 3 ran this file with one bug, mended here: the printing loops' variable `v` overwrote the vocabulary size,
so the 32k context's prefill raised (its trace is not in call 3). The main-stream gap analysis proved
meaningless (the graph spreads its branches over 31 streams); the span, union and idle figures stand, and
the per-kernel attribution in bench/results/README.md was computed from the saved 1k trace.
Lint-only edits after the run: a with-block for the trace file, zip(strict=False)."""

import collections
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops

out = {}
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
for ctx in (1024, 32768):
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    step = fast_ops.GraphStep(
        lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False, raw=True),
        canvas,
        probs,
        torch.cuda.graph_pool_handle(),
    )
    for _ in range(5):
        step.graph.replay()
    torch.cuda.synchronize()
    ev_ms = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step.graph.replay()
        b.record()
        b.synchronize()
        ev_ms.append(a.elapsed_time(b))
    reps = 6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step.graph.replay()
            torch.cuda.synchronize()
    path = f"/tmp/trace_{ctx}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kern = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    kern.sort(key=lambda e: e["ts"])
    # split into replays at host-side sync gaps (> 200 us with no kernel)
    replays, cur = [], [kern[0]]
    for e in kern[1:]:
        if e["ts"] - max(k["ts"] + k["dur"] for k in cur[-8:]) > 200:
            replays.append(cur)
            cur = []
        cur.append(e)
    replays.append(cur)
    rows = []
    gaps_by_next = collections.Counter()
    gaps_by_pair = collections.Counter()
    for r in replays[1:]:  # the first replay under the profiler may pay its setup
        start = r[0]["ts"]
        end = max(e["ts"] + e["dur"] for e in r)
        busy, cur_s, cur_e = 0.0, None, None
        for e in sorted(r, key=lambda e: e["ts"]):
            s, t = e["ts"], e["ts"] + e["dur"]
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, t
            else:
                cur_e = max(cur_e, t)
        busy += cur_e - cur_s
        streams = collections.Counter(e["args"].get("stream") for e in r)
        main = streams.most_common(1)[0][0]
        ms = [e for e in r if e["args"].get("stream") == main]
        gap_sum, neg = 0.0, 0
        for a, b in zip(ms, ms[1:], strict=False):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap > 0:
                gap_sum += gap
                gaps_by_next[b["name"][:60]] += gap
                gaps_by_pair[(a["name"][:40], b["name"][:40])] += gap
            else:
                neg += 1
        rows.append(
            {
                "kernels": len(r),
                "main_stream_kernels": len(ms),
                "streams": len(streams),
                "span_us": end - start,
                "busy_us": busy,
                "idle_us": end - start - busy,
                "main_gaps_us": gap_sum,
                "main_overlapping_starts": neg,
            }
        )
    n = len(rows)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["event_median_ms"] = statistics.median(ev_ms)
    print(
        f"ctx {ctx}: events median {summary['event_median_ms']:.3f} ms; {n} traced replays, medians: "
        + ", ".join(f"{k} {v:.1f}" for k, v in summary.items() if k != "event_median_ms"),
        flush=True,
    )
    top_next = [(k, v / n) for k, v in gaps_by_next.most_common(15)]
    top_pair = [(f"{a} -> {b}", v / n) for (a, b), v in gaps_by_pair.most_common(15)]
    print("  main-stream gaps a replay, by the kernel after the gap:")
    for name, us in top_next:
        print(f"    {us:8.1f} us  {name}")
    print("  by pair:")
    for name, us in top_pair:
        print(f"    {us:8.1f} us  {name}")
    out[str(ctx)] = {
        "summary": summary,
        "replays": rows,
        "gaps_by_next_us": top_next,
        "gaps_by_pair_us": top_pair,
    }
    del step
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
