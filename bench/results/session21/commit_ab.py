"""Session 21: a block's commit at the real shape (random weights, init hf), the graphed commit on the canvas
slots (`DiffusionGemma._commit`, via prefill) against the eager chunk path (`_encode`, what prefill ran
before), 256 and 200 tokens after 1,024 cached: wall time (median of 7 after 3 warm-ups, synchronized), the
first commit after a denoise step (eager, then graphed: warm-up + capture + replay) with torch.compile's
counters, and the K/V each leaves per layer (relative difference), beside the same for `_encode` in one chunk
against two (the same path, other shapes: how far rounding alone carries through 30 random layers)."""

import statistics
import time

import torch

from diffgemma.bench import REAL_CONFIG, random_model

model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
v = model.cfg.vocab_size
kv = model.new_cache(4096)
model.prefill(torch.randint(0, v, (1, 1024)), kv)
model.denoise(torch.randint(0, v, (1, 256)), kv)  # compiles the fused regions a commit shares
torch.cuda.synchronize()


def wall(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def state(n):
    out = []
    for i in range(model.cfg.num_layers):
        k, vv, _ = kv.read(i)
        out.append(torch.cat([k, vv])[:, :, -n:].float().clone())
    return out


for t in (256, 200):
    block = torch.randint(0, v, (1, t))

    def new(block=block):
        kv.length = 1024
        model.prefill(block, kv)

    def old(block=block):
        kv.length = 1024
        model._encode(block[0].cuda(), kv, model.dtype)

    first = None
    if t == 256:
        from torch._dynamo.utils import counters

        before = {k: dict(v) for k, v in counters.items()}
        model.use_graphs = False
        first_eager = wall(new)
        model.use_graphs = True
        first = wall(new)
        after = {
            k: {kk: vv - before.get(k, {}).get(kk, 0) for kk, vv in v.items()} for k, v in counters.items()
        }
        print(
            f"first commit after a denoise step: eager {first_eager:.1f} ms, then graphed {first:.1f} ms; "
            f"dynamo counters moved: { {k: {kk: vv for kk, vv in v.items() if vv} for k, v in after.items()} }"
        )
    res = {"graphed commit": [], "eager _encode": []}
    for _ in range(3):
        wall(new), wall(old)
    for _ in range(7):
        res["graphed commit"].append(wall(new))
        res["eager _encode"].append(wall(old))
    for k, r in res.items():
        print(f"t={t}: {k:15s} median {statistics.median(r):.2f} ms  ({' '.join(f'{x:.1f}' for x in r)})")
    if first is not None:
        print(f"t={t}: the first graphed call (warm-up run + capture + replay) {first:.1f} ms")
    old()
    a = state(t)
    new()
    b = state(t)
    rels = [float((x - y).norm() / y.norm()) for x, y in zip(b, a, strict=True)]
    print(
        f"t={t}: K/V of the committed positions, graphed vs _encode, rel per layer: "
        + " ".join(f"{r:.4f}" for r in rels)
    )
    assert kv.length == 1024 + t
    if t == 256:  # rounding alone: _encode in one chunk against two of 128
        kv.length = 1024
        model._encode(block[0, :128].cuda(), kv, model.dtype)
        model._encode(block[0, 128:].cuda(), kv, model.dtype)
        c = state(t)
        rels = [float((x - y).norm() / y.norm()) for x, y in zip(c, a, strict=True)]
        print(
            f"t={t}: _encode in two chunks of 128 vs one of 256, rel per layer: "
            + " ".join(f"{r:.4f}" for r in rels)
        )
