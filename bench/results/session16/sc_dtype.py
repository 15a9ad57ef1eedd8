"""The SC buffer's dtype: (1) the sampler's bf16 store against torch's cast of the same fp32 probs (where they
differ, the fp32 bits); (2) at the real shape, 1k context: the bench's step (softmax, copy in, replay, clone), the
replay alone (SC probs already in the graph's buffer, no copy), and the eager step's kernel list for the SC part."""

import statistics
import sys

import torch

from diffgemma.bench import REAL_CONFIG, random_model
from diffgemma.kernels import triton_sampler as ts

torch.manual_seed(0)
if "sampler" in sys.argv:
    logits = torch.randn(256, 262144, device="cuda") * 3
    for floor in (-10.0, None):
        probs, sc, *_ = ts.row_stats(logits, 0.7, floor)
        out = torch.empty(256, 262144, device="cuda", dtype=torch.bfloat16)
        ts.row_stats(logits, 0.7, floor, need_probs=False, sc_out=out)
        want = (sc if floor is not None else probs).to(torch.bfloat16)
        bad = (out.view(torch.int16) != want.view(torch.int16)).nonzero()
        print(f"floor {floor}: {len(bad)} of {out.numel()} differ", flush=True)
        for r, c in bad[:6].tolist():
            x = (sc if floor is not None else probs)[r, c]
            print(
                f"  fp32 {x.item():.6e} bits {x.view(torch.int32).item() & 0xFFFFFFFF:08x} -> kernel "
                f"{out[r, c].view(torch.int16).item() & 0xFFFF:04x} torch {want[r, c].view(torch.int16).item() & 0xFFFF:04x}"
            )
    sys.exit()

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
cfg = model.cfg
kv = model.new_cache(1024 + 1024)
model.prefill(torch.randint(0, cfg.vocab_size, (1, 1024)), kv, chunk=4096)
canvas = torch.randint(0, cfg.vocab_size, (1, 256))
sc_logits = torch.randn(256, cfg.vocab_size, device="cuda")


def med(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


bench_step = med(
    lambda: model.denoise(canvas, kv, sc_probs=torch.softmax(sc_logits, -1, dtype=torch.float32))
)
buf = model.sc_input_buffer(kv, 256)
print(f"SC buffer {buf.dtype}", flush=True)
replay = med(lambda: model.denoise(canvas, kv, sc_probs=buf, copy=False))
print(f"bench step {bench_step:.3f} ms, replay alone {replay:.3f} ms", flush=True)
print(
    f"again: bench step {med(lambda: model.denoise(canvas, kv, sc_probs=torch.softmax(sc_logits, -1, dtype=torch.float32))):.3f}, replay {med(lambda: model.denoise(canvas, kv, sc_probs=buf, copy=False)):.3f}"
)
