"""One process, the real shape (random weights, init hf): denoise graphs captured with triton_moe.DEFAULT_CONFIG
set per variant (names from CONFIGS), on one model and cache, replayed alternately in rounds; the first name
again last: the control for an order effect."""

import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import triton_moe as tm

order = sys.argv[1].split(",")
ROUNDS, REPS = 7, 20
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
for ctx in [int(a) for a in sys.argv[2:]] or [1024]:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, name in enumerate(order):
        tm.DEFAULT_CONFIG = name
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, p, kv=kv: model._denoise_forward(ids, kv, p, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = {k: s(canvas, s.sc).clone() for k, s in steps.items()}
    first = next(iter(outs.values()))
    print(
        f"ctx {ctx}: the same logits as the first: {[torch.equal(first, o) for o in outs.values()]}",
        flush=True,
    )
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
            f"ctx {ctx}: {k:16s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    del steps, outs
    torch.cuda.empty_cache()
