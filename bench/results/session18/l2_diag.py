"""Does data in L2 speed up the kernels the step's prefetches aimed at? Each timed kernel runs after a 256 MB
write (evicting L2), then optionally a warm-up of some of its weights into L2 (`pf`: route_sort's top-k kernel
with the first-wave box, i.e. the bulk prefetch; `read`: a torch reduction that loads the same bytes), then a
~30 us sleep, then the kernel alone between CUDA events. Variants alternate, 15 rounds of 10."""

import statistics

import torch
import torch.nn.functional as F

from diffgemma.kernels import l2
from diffgemma.kernels import triton_moe as tm
from diffgemma.kernels import triton_route as tr

torch.manual_seed(0)
dev = "cuda"
E, INTER, H = 128, 704, 2816
gu = torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16) * 0.02
x = torch.randn(256, H, device=dev, dtype=torch.bfloat16)
logits = torch.randn(256, E, device=dev)
pes = torch.ones(E, device=dev)
_, _, bounds, perm, _ = tr.route_sort(logits, pes, 8)
tiles = tm.CONFIGS[tm.DEFAULT_CONFIG].gate_up
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
o_proj = torch.randn(2816, 4096, device=dev, dtype=torch.bfloat16)
a_o = torch.randn(256, 4096, device=dev, dtype=torch.bfloat16)
qkv = torch.randn(8192, 2816, device=dev, dtype=torch.bfloat16)
a_q = torch.randn(256, 2816, device=dev, dtype=torch.bfloat16)


def box(k):
    tm.PREFETCH_K_STEPS = k
    return tm.first_wave(gu, tiles)


halves = gu.view(2 * E, INTER, H)
variants = {
    "gate_up none": (lambda: None, lambda: tm.gate_up_act(x, gu, perm, bounds, 8, tiles)),
    **{
        f"gate_up pf{k}": (
            (lambda b=box(k): tr.route_sort(logits, pes, 8, b)),
            lambda: tm.gate_up_act(x, gu, perm, bounds, 8, tiles),
        )
        for k in (4, 8, 16)
    },
    **{
        f"gate_up read{k}": (
            (lambda k=k: halves[:, :64, : 128 * k].sum(dtype=torch.float32)),
            lambda: tm.gate_up_act(x, gu, perm, bounds, 8, tiles),
        )
        for k in (4, 8, 16)
    },
    "gate_up route only": (
        (lambda: tr.route_sort(logits, pes, 8)),
        lambda: tm.gate_up_act(x, gu, perm, bounds, 8, tiles),
    ),
    "o_proj none": (lambda: None, lambda: F.linear(a_o, o_proj)),
    "o_proj read": ((lambda: o_proj.sum(dtype=torch.float32)), lambda: F.linear(a_o, o_proj)),
    "o_proj pf": (
        (lambda b=l2.whole(o_proj): tr.route_sort(logits, pes, 8, b)),
        lambda: F.linear(a_o, o_proj),
    ),
    "qkv none": (lambda: None, lambda: F.linear(a_q, qkv)),
    "qkv read": ((lambda: qkv.sum(dtype=torch.float32)), lambda: F.linear(a_q, qkv)),
}
res = {k: [] for k in variants}
for rnd in range(16):
    for name, (warm, kernel) in variants.items():
        for _ in range(10):
            flush.fill_(rnd)
            warm()
            torch.cuda._sleep(60_000)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            kernel()
            e1.record()
            e1.synchronize()
            if rnd:  # round 0: compiles, warm-up
                res[name].append(e0.elapsed_time(e1) * 1e3)
for name, r in res.items():
    print(f"{name:22s} median {statistics.median(r):7.1f} us  (p10 {sorted(r)[len(r) // 10]:7.1f})")
