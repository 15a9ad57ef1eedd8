"""Session 22: the dense MLP (side stream, beside the expert kernels) confined to few SMs, so that it runs
concurrently with the memory-bound expert kernels instead of taking every SM for ~24 us a layer.

One process, the real shape (random weights, init hf). Variants, each a denoise graph captured with:
  main     as committed
  prio     the side stream at high priority
  lt       the dense GEMMs through cuBLASLt (the backend the carveout needs), no carveout
  ltN      cuBLASLt with the SM count target 132 - carveout = N, normal priority
  ltNp     the same on the high-priority side stream
Replayed alternately in rounds; the first name again last (an order-effect control). First: the dense region
alone under each setting (does the carveout shrink the GEMMs' grid?)."""

import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused

order = sys.argv[1].split(",")
ctxs = [int(a) for a in sys.argv[2:]] or [1024]
ROUNDS, REPS = 7, 20
sms = torch.cuda.get_device_properties(0).multi_processor_count
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
regions = model.fused_regions
dense_orig = regions["dense_mlp"]
current = {"name": "main"}


def parse(name: str) -> tuple[bool, int | None, bool]:
    """(cublaslt, target SMs or None, high priority)"""
    if name == "main":
        return False, None, False
    if name == "prio":
        return False, None, True
    prio = name.endswith("p")
    n = name[2:].rstrip("p")
    return True, int(n) if n else None, prio


def dense_wrapped(*args):
    lt, target, _ = parse(current["name"])
    if not lt:
        return dense_orig(*args)
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    if target is not None:
        torch._C._set_sm_carveout_experimental(sms - target)
    try:
        return dense_orig(*args)
    finally:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(prev)


regions["dense_mlp"] = dense_wrapped
normal_side = torch.cuda.Stream()
high_side = torch.cuda.Stream(priority=-1)


def use(name: str) -> None:
    current["name"] = name
    fused._side_streams[torch.device("cuda", 0)] = high_side if parse(name)[2] else normal_side


# the dense region alone: 256 rows, the real weights of layer 0
layer = model.layers[0]
p = layer.ffn_params(torch.bfloat16)
x = torch.randn(256, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
args = (x, p["mlp_gate_up"], p["mlp_down"], p["post_feedforward_layernorm_1"], model.cfg.rms_norm_eps)
for name in dict.fromkeys(order):
    use(name)
    ref = dense_orig(*args)
    out = dense_wrapped(*args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            dense_wrapped(*args)
    for _ in range(3):
        g.replay()
    ms = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1) * 100)  # us a call
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dense_wrapped(*args)
        torch.cuda.synchronize()
    kernels = [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(
        f"dense alone {name:8s}: {statistics.median(ms):7.1f} us a call; max |d| vs main "
        f"{(out.float() - ref.float()).abs().max().item():.3g}; kernels {kernels}",
        flush=True,
    )
    del g

v, c = model.cfg.vocab_size, 256
for ctx in ctxs:
    kv = model.new_cache(ctx + 2 * c)
    model.prefill(torch.randint(0, v, (1, ctx)), kv, chunk=4096)
    canvas = torch.randint(0, v, (c,), device="cuda")
    probs = torch.softmax(torch.randn(c, v, device="cuda"), -1).to(torch.bfloat16)
    model._load_geometry(kv, c)
    steps = {}
    for i, name in enumerate(order):
        use(name)
        steps[f"{i}:{name}"] = fast_ops.GraphStep(
            lambda ids, sc, kv=kv: model._denoise_forward(ids, kv, sc, False),
            canvas,
            probs,
            torch.cuda.graph_pool_handle(),
        )
    use("main")
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = {k: s(canvas, s.sc).float().clone() for k, s in steps.items()}
    first = next(iter(outs.values()))
    print(
        f"ctx {ctx}: logits max |d| against the first: "
        f"{[round((first - o).abs().max().item(), 4) for o in outs.values()]}; argmax agreement "
        f"{[round((first.argmax(-1) == o.argmax(-1)).float().mean().item(), 3) for o in outs.values()]}",
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
            f"ctx {ctx}: {k:10s} rounds {' '.join(f'{x:.3f}' for x in r)} ms; median {statistics.median(r):.3f}",
            flush=True,
        )
    del steps, outs
    torch.cuda.empty_cache()
