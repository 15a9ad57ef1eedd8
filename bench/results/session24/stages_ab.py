"""Session 24: expert tiles in the denoise step: one process, the real shape (random weights, init hf), graphs
captured with each and replayed alternately in rounds (the first config again last: an order-effect control).
Call 5 ran `s4,g5,g5d4,s4` (gate_up at 5 pipeline stages, down at 4), printed there as kept,g5,g5d4,kept; call 7
`g5,g5s3,g5s3d3,g5` (gate_up with 3 M-slots, down too), printed as kept,s3,s3d3,kept (the kernel alone, call 6:
skewed 161.1 against 178.2 us, uniform 241.9 against 242.3).

    PYTHONPATH=src python stages_ab.py s4,g5,g5d4,s4 1024 32768"""

import dataclasses
import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import triton_moe as tm

order = sys.argv[1].split(",")
ctxs = [int(a) for a in sys.argv[2:]] or [1024]
ROUNDS, REPS = 7, 20
base = tm.CONFIGS["m32_s2_tma_swap"]  # the denoise tiles before this session
g5 = dataclasses.replace(base.gate_up, num_stages=5)
variants = {
    "s4": base,
    "g5": tm.MoeConfig(g5, base.down),
    "g5d4": tm.MoeConfig(g5, dataclasses.replace(base.down, num_stages=4)),
    "g5s3": tm.MoeConfig(dataclasses.replace(g5, m_slots=3), base.down),
    "g5s3d3": tm.MoeConfig(dataclasses.replace(g5, m_slots=3), dataclasses.replace(base.down, m_slots=3)),
}
kept = tm.CONFIGS[tm.DEFAULT_CONFIG]

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
    print(
        f"ctx {ctx}: logits equal to the first {[torch.equal(first, o) for o in outs.values()]}", flush=True
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
            f"ctx {ctx}: {k:8s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}",
            flush=True,
        )
    del steps, outs
    torch.cuda.empty_cache()
