"""One process, the real shape (random weights, init hf): the denoise graph with the dense MLP forked onto its
side stream before the routing (this tree) against after it (main's moe_layer_ffn, loaded from .dev/fused_main.py),
both captured on the same model and cache and replayed alternately in rounds."""

import importlib.util
import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused

spec = importlib.util.spec_from_file_location("fused_main", ".dev/fused_main.py")
fused_main = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fused_main)
fused_main._side_streams = fused._side_streams  # one side stream for both

ROUNDS, REPS = 7, 20
this = fused.moe_layer_ffn
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
for ctx in [int(a) for a in sys.argv[1:]] or [1024, 32768]:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for name, fn in (
        ("fork before the routing", this),
        ("fork after the routing (main)", fused_main.moe_layer_ffn),
    ):
        fused.moe_layer_ffn = fn
        steps[name] = fast_ops.GraphStep(
            lambda ids, p, kv=kv: model._denoise_forward(ids, kv, p, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    fused.moe_layer_ffn = this
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = [s(canvas, s.sc).clone() for s in steps.values()]
    print(f"ctx {ctx}: the same logits: {torch.equal(*outs)}", flush=True)
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
            f"ctx {ctx}: {k:30s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    del steps, outs
    torch.cuda.empty_cache()
