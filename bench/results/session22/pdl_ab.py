"""Session 22: inductor's programmatic dependent launch (`triton.enable_pdl`) for the compiled regions.

One process, the real shape (random weights, init hf): denoise graphs captured with the regions compiled as
committed (main) and with triton.enable_pdl (pdl, fresh compiles), replayed alternately in rounds; main again
last (an order-effect control)."""

import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused

print("inductor has triton.enable_pdl:", hasattr(torch._inductor.config.triton, "enable_pdl"), flush=True)
ctxs = [int(a) for a in sys.argv[1:]] or [1024]
ROUNDS, REPS = 7, 20
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
main_regions = model.fused_regions
pdl_regions = fused.make_regions()
for r in pdl_regions.values():
    opts = {"emulate_precision_casts": True, "triton.enable_pdl": True}
    r.compiled = torch.compile(r.fn, dynamic=False, fullgraph=False, options=opts)
v, c = model.cfg.vocab_size, 256
for ctx in ctxs:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, name in enumerate(["main", "pdl", "main"]):
        model.fused_regions = pdl_regions if name == "pdl" else main_regions
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    model.fused_regions = main_regions
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    print({k: (r.failed, len(r._seen)) for k, r in pdl_regions.items()}, flush=True)
    outs = {k: s(canvas, s.sc).float().clone() for k, s in steps.items()}
    first = next(iter(outs.values()))
    print(
        f"ctx {ctx}: logits equal to the first: {[torch.equal(first, o) for o in outs.values()]}", flush=True
    )
    if ctx == ctxs[0]:
        s = steps["1:pdl"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            s.graph.replay()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    res = {k: [] for k in steps}
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
            res[k].append(statistics.median(ms))
    for k, r in res.items():
        print(
            f"ctx {ctx}: {k:8s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    del steps, outs
    torch.cuda.empty_cache()
