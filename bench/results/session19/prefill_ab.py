"""Ran in session 19's call 7 at 936d44b, where `cuda.softmax_to` (the old path) still existed. The full layers' prefill attention (`cuda.attention_causal_scores`): the softmax normalized before P @ V (two
reads of the fp32 scores; "old") against exp_to + divide_rows (one read; "new").
1. One 4,096-token chunk's attention at the real shape after 4k, 28k and 124k cached tokens (graphs of 2 calls).
2. Prefill of 32,768 tokens on the real model (random weights), old and new alternately, 3 times each."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
from moe_kernels import time_graph  # noqa: E402

from diffgemma.bench import REAL_CONFIG, random_model  # noqa: E402
from diffgemma.kernels import cuda as fast  # noqa: E402

new_fn = fast.attention_causal_scores


def old_fn(q, keys, vals, block=None):
    _, h, t, d = q.shape
    hkv, p = keys.shape[1], keys.shape[2] - t
    g = h // hkv
    if block is None:
        fit = fast.SCORE_BYTES // (4 * h * (p + t))
        block = min(t, fast.MAX_QUERY_BLOCK, max(64, fit // 64 * 64))
    q4 = q.reshape(hkv, g, t, d)
    out = torch.empty(t, hkv, g, d, device=q.device, dtype=vals.dtype)
    for s in range(0, t, block):
        e = min(t, s + block)
        n = e - s
        scores = torch.bmm(
            q4[:, :, s:e].reshape(hkv, g * n, d), keys[0, :, : p + e].transpose(1, 2), out_dtype=torch.float32
        )
        probs = fast.softmax_to(scores, vals.dtype, causal=(p + s + 1, n))
        out[s:e] = torch.bmm(probs, vals[0, :, : p + e]).view(hkv, g, n, d).permute(2, 0, 1, 3)
    return out.view(t, h * d)


def chunk(past: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(past)
    t = 4096
    q = torch.randn(1, 16, t, 512, generator=g, device="cuda", dtype=torch.bfloat16) * 512**-0.25 * 2
    k = torch.randn(1, 2, past + t, 512, generator=g, device="cuda", dtype=torch.bfloat16) * 512**-0.25 * 2
    v = torch.randn(1, 2, past + t, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    a, b = old_fn(q, k, v).float(), new_fn(q, k, v).float()
    line = f"chunk 4096 after {past:6d}: rel diff new/old {float((a - b).norm() / a.norm()):.3g}"
    for name, fn in (("old", old_fn), ("new", new_fn), ("old", old_fn), ("new", new_fn)):
        line += f"  {name} {time_graph(lambda fn=fn: fn(q, k, v), calls=2):7.2f} ms"
    print(line, flush=True)


def prefill(ctx: int) -> None:
    model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
    ids = torch.randint(0, model.cfg.vocab_size, (1, ctx))
    for i, name in enumerate(["new", "old"] * 4):
        fast.attention_causal_scores = new_fn if name == "new" else old_fn
        kv = model.new_cache(ctx + 512)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.prefill(ids, kv, chunk=4096)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= 2:  # the first pair warms up (compiles)
            print(f"prefill {ctx}: {name} {dt * 1e3:8.1f} ms, {ctx / dt:8.0f} tok/s", flush=True)
    fast.attention_causal_scores = new_fn


if __name__ == "__main__":
    for past in (4096, 28672, 126976):
        chunk(past)
        torch.cuda.empty_cache()
    prefill(32768)
