"""One process, the real shape (random weights, init hf): the denoise graph with the dense MLP inside the expert
kernels' launches (as shipped on this branch) against one with it beside them on a side stream (the path before),
both captured on the same model and cache and replayed alternately; the same logits check."""

import statistics
import sys

import torch
import torch.nn.functional as F

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import torch_ref as ref
from diffgemma.kernels import triton_moe as tm

ROUNDS, REPS = 7, 20
folded = tm.experts_and_dense
side = torch.cuda.Stream()


def beside(x2, gate_up, down, perm, bounds, top_k, x, dense_gate_up, dense_down, config=None):
    """The path before: the dense MLP's cuBLAS GEMMs and gelu on a side stream, the expert kernels alone."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gu = F.linear(x, dense_gate_up)
        di = dense_gate_up.shape[0] // 2
        dense = F.linear((ref.gelu_tanh(gu[:, :di]) * gu[:, di:]), dense_down)
    cfg = tm.CONFIGS[tm.DEFAULT_CONFIG]
    act = tm.gate_up_act(x2, gate_up, perm, bounds, top_k, cfg.gate_up)
    y = tm.down_sorted(act, down, bounds, cfg.down)
    torch.cuda.current_stream().wait_stream(side)
    return y, dense


model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v, c = model.cfg.vocab_size, 256
for ctx in [int(a) for a in sys.argv[1:]] or [1024, 32768]:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for name, fn in (("dense in the expert launches", folded), ("dense on a side stream", beside)):
        tm.experts_and_dense = fn
        steps[name] = fast_ops.GraphStep(
            lambda ids, p, kv=kv: model._denoise_forward(ids, kv, p, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    tm.experts_and_dense = folded
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = {k: s(canvas, s.sc).clone() for k, s in steps.items()}
    a, b = outs.values()
    print(
        f"ctx {ctx}: logits max |d| {float((a - b).abs().max()):.4g}, argmax agree "
        f"{float((a.argmax(-1) == b.argmax(-1)).float().mean()):.4f}",
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
            f"ctx {ctx}: {k:30s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}"
        )
    del steps, outs
    torch.cuda.empty_cache()
