"""One process, the real shape (random weights, init hf), run from the fold tree (.dev/fold_tree/src): denoise graphs
with three versions of moe_layer_ffn, captured on one model and cache in the order given and replayed alternately
in rounds: "main" (.dev/fused_main.py: the dense MLP forked onto its side stream after the routing), "fork"
(.dev/fused_fork.py: forked before the routing), "fold" (this tree: the dense MLP inside the expert kernels'
launches). "main" twice: the control for an order effect."""

import importlib.util
import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._side_streams = fused._side_streams  # one side stream for all
    return mod


versions = {
    "main": load("fused_main", ".dev/fused_main.py").moe_layer_ffn,
    "fork": load("fused_fork", ".dev/fused_fork.py").moe_layer_ffn,
    "fold": fused.moe_layer_ffn,
    "serial": load("fused_serial", ".dev/fused_serial.py").moe_layer_ffn,
    "after_gu": load("fused_after_gu", ".dev/fused_after_gu.py").moe_layer_ffn,
}
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
        fused.moe_layer_ffn = versions[name]
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, p, kv=kv: model._denoise_forward(ids, kv, p, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    fused.moe_layer_ffn = versions["fold"]
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
            f"ctx {ctx}: {k:8s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    del steps, outs
    torch.cuda.empty_cache()
