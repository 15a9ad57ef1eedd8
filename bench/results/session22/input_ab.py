"""Session 22: the decoder's input under self-conditioning and the final norm as compiled regions (new: the
`sc_input` region, `norm` for the final norm) against the eager ops the denoise step ran before (old).

One process, the real shape (random weights, init hf): denoise graphs captured with each, replayed alternately
in rounds; the first again last (an order-effect control)."""

import statistics
import sys

import torch
import torch.nn.functional as F

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import cuda as fast_ops
from diffgemma.kernels import fused
from diffgemma.kernels import torch_ref as ops

order = sys.argv[1].split(",")
ctxs = [int(a) for a in sys.argv[2:]] or [1024]
ROUNDS, REPS = 7, 20
model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
new_regions = model.fused_regions
old_regions = dict(new_regions, sc_input=fused.sc_input)  # the eager ops


def old_logits(h):
    h = ops.rms_norm(h, model.norm, model.cfg.rms_norm_eps)
    logits = F.linear(h, model.embed.to(h.dtype))
    return model.fused_regions["softcap"](logits, model.cfg.final_logit_softcapping)


def use(name: str) -> None:
    model.fused_regions = old_regions if name == "old" else new_regions
    if name == "old":
        model._logits = old_logits
    elif "_logits" in model.__dict__:
        del model._logits


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
    use("new")
    assert not fast_ops.triton_failed_kernels, fast_ops.triton_failed_kernels
    outs = {k: s(canvas, s.sc).float().clone() for k, s in steps.items()}
    first = next(iter(outs.values()))
    print(
        f"ctx {ctx}: logits equal to the first {[torch.equal(first, o) for o in outs.values()]}; max |d| "
        f"{[round((first - o).abs().max().item(), 4) for o in outs.values()]}",
        flush=True,
    )
    if ctx == ctxs[0]:
        for name in ("old", "new"):
            s = next(st for k, st in steps.items() if k.endswith(name))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                s.graph.replay()
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"{name}: {len(ev)} kernels in a replay", flush=True)
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
