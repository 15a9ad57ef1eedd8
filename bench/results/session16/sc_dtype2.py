"""In one process: (1) the sampler kernel's bf16 SC store against torch's cast of its fp32 store, with Triton's
fp fusion on (as shipped) and off; (2) two denoise graphs of one model and cache, one with an fp32 SC input
buffer (main) and one with a bf16 buffer (branch), replayed alternately: 5 rounds of 20 replays each."""

import statistics

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import triton_sampler as ts

torch.manual_seed(0)
logits = torch.randn(256, 262144, device="cuda") * 3
c, v = logits.shape


def launch(sc_out, fusion):
    n = torch.empty(c, device="cuda")
    i = torch.empty(c, device="cuda", dtype=torch.int64)
    ts._row_stats_kernel[(c,)](
        logits, sc_out, sc_out, n, i, torch.empty(c, device="cuda"), v, logits.stride(0), v, v,
        float(1 / torch.tensor(0.7).item()), -10.0, BLOCK=ts.BLOCK, WRITE_PROBS=False, WRITE_SC=True,
        num_warps=ts.NUM_WARPS, enable_fp_fusion=fusion,
    )  # fmt: skip


for fusion in (True, False):
    p32 = torch.empty(c, v, device="cuda")
    p16 = torch.empty(c, v, device="cuda", dtype=torch.bfloat16)
    launch(p32, fusion)
    launch(p16, fusion)
    bad = int((p16.view(torch.int16) != p32.to(torch.bfloat16).view(torch.int16)).sum())
    print(f"fp fusion {fusion}: bf16 store differs from the cast of the fp32 store in {bad} of {p16.numel()}")
    if fusion:
        p32_on = p32.clone()
    else:
        d = (p32.view(torch.int32) - p32_on.view(torch.int32)).abs()
        print(f"  fp32 store, fusion off against on: {int((d > 0).sum())} differ, max {int(d.max())} ulp")

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
kv = model.new_cache(2048)
model.prefill(torch.randint(0, v, (1, 1024)), kv, chunk=4096)
canvas = torch.randint(0, v, (256,), device="cuda")
probs = torch.softmax(torch.randn(c, v, device="cuda"), -1)
model._load_geometry(kv, 256)
pool = torch.cuda.graph_pool_handle()
steps = {}
for name, dt in (("fp32 buffer", torch.float32), ("bf16 buffer", torch.bfloat16)):
    steps[name] = fast_ops.GraphStep(
        lambda ids, p: model._denoise_forward(ids, kv, p, False), canvas, probs.to(dt), pool
    )
outs = {k: s(canvas, s.sc).clone() for k, s in steps.items()}
print("same logits:", torch.equal(*outs.values()), flush=True)
res = {k: [] for k in steps}
for _ in range(5):
    for k, s in steps.items():
        for _ in range(3):
            s(canvas, s.sc)
        torch.cuda.synchronize()
        ms = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            s(canvas, s.sc)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        res[k].append(statistics.median(ms))
for k, r in res.items():
    print(f"{k}: replay medians {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}")
