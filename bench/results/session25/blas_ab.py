"""Session 25: the step's cuBLAS GEMMs (the LM head on 320-row tiles for 256 rows, q/k/v, o_proj, the dense MLP,
the SC embedding) through cuBLASLt's heuristic instead of cuBLAS's (`torch.backends.cuda.preferred_blas_library`),
which may pick other kernels. Graphs captured under each, in one process, replayed alternately in rounds; then
the kernels each graph launched (one traced replay), by name.

    PYTHONPATH=src python blas_ab.py OUT.json"""

import collections
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops

print("default blas library:", torch.backends.cuda.preferred_blas_library())
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
order = ["cublas", "cublaslt", "cublas", "cublaslt"]
res = {}
for ctx in (1024, 32768):
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, lib in enumerate(order):
        torch.backends.cuda.preferred_blas_library(lib)
        steps[f"{i}:{lib}"] = fast_ops.GraphStep(
            lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False, raw=True),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    torch.backends.cuda.preferred_blas_library("cublas")
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
            f"ctx {ctx}: {k:11s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    kernels = {}
    for k in ("0:cublas", "1:cublaslt"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps[k].graph.replay()
            torch.cuda.synchronize()
        prof.export_chrome_trace("/tmp/blas.json")
        with open("/tmp/blas.json") as f:
            ev = json.load(f)["traceEvents"]
        per = collections.defaultdict(list)
        for e in ev:
            if (
                e.get("cat") == "kernel"
                and e.get("ph") == "X"
                and ("nvjet" in e["name"] or "gemm" in e["name"].lower())
            ):
                per[e["name"][:70]].append(e["dur"])
        kernels[k] = {n: [len(d), round(sum(d), 1)] for n, d in sorted(per.items(), key=lambda x: -sum(x[1]))}
        print(f"ctx {ctx}: {k} GEMM kernels (count, total us):")
        for n, (cnt, tot) in kernels[k].items():
            print(f"    {tot:9.1f} us {cnt:3d}x  {n}")
    res[str(ctx)] = {"equal": eq, "rounds_ms": times, "gemm_kernels": kernels}
    del steps, outs
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
