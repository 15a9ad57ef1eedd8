# ruff: noqa: B023 - each lambda is timed within its own loop iteration
"""Sliding-window prefill attention candidates, one layer at the real shape: time + max diff vs the then-current
`attention_window` (blocks of 1024 queries, one SDPA call each). Runs against commit a183d0e's src (its
`attention_window` and `window_blocks` are gone since): `git worktree add /tmp/a a183d0e`, then from /tmp/a
`python <this file>`. Output: attention_layer_microbench.txt (H200)."""

import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from diffgemma.kernels import cuda as fast

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
H, HKV, D, W = 16, 8, 256, 1024
G = H // HKV


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return sorted(ms)[len(ms) // 2]


def current(q, k_t, v_t, past_k, past_v, blocks):
    keys = torch.cat([past_k.clone(), k_t], dim=2)
    vals = torch.cat([past_v.clone(), v_t], dim=2)
    out = fast.attention_window(q, keys, vals, blocks)
    return out[0].transpose(0, 1).reshape(q.shape[2], -1)


def batched_bias(start, t, b, device):
    """[nb, 1, G*b, b+W] additive bf16 bias: query r of block n (chunk index n*b+r) sees buffer key n*b+j for
    j in [r+1, r+W], and only keys at buffer index >= W - start (real positions)."""
    nb = -(-t // b)
    r = torch.arange(b, device=device)[:, None]
    j = torch.arange(b + W, device=device)[None, :]
    n = torch.arange(nb, device=device)[:, None, None]
    ok = (j >= r + 1) & (j <= r + W) & (n * b + j >= W - min(start, W))
    bias = torch.zeros(nb, b, b + W, device=device, dtype=dt).masked_fill_(~ok, float("-inf"))
    return bias.repeat(1, G, 1)[:, None]  # [nb, 1, G*b, b+W]


def batched(q, kvs, past_kv, bias, b):
    """q [1,H,t,d] contiguous; kvs [2,HKV,t,d] contiguous; past_kv [2,HKV,W,d] (slots for positions start-W..)."""
    t = q.shape[2]
    nb = -(-t // b)
    tp = nb * b
    buf = torch.empty(2, HKV, W + tp, D, device=dev, dtype=dt)
    buf[:, :, :W] = past_kv
    buf[:, :, W : W + t] = kvs
    if tp > t:
        buf[:, :, W + t :].zero_()
    qp = q if tp == t else F.pad(q, (0, 0, 0, tp - t))
    qf = qp[0].view(HKV, G, nb, b, D).permute(2, 0, 1, 3, 4).reshape(nb, HKV, G * b, D)
    st = (b * D, (W + tp) * D, D, 1)
    k = buf[0].as_strided((nb, HKV, b + W, D), st)
    v = buf[1].as_strided((nb, HKV, b + W, D), st)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=1.0)
    return o.view(nb, HKV, G, b, D).permute(0, 3, 1, 2, 4).reshape(tp, H * D)[:t]


def main():
    res = {}
    for start, t in ((0, 4096), (4096, 4096), (4096, 2048), (4096, 3000)):
        q = torch.randn(1, H, t, D, device=dev, dtype=dt)
        kt = torch.randn(t, HKV, D, device=dev, dtype=dt)
        vt = torch.randn(t, HKV, D, device=dev, dtype=dt)
        k_t, v_t = kt.transpose(0, 1)[None], vt.transpose(0, 1)[None]
        npast = min(start, W - 1)
        past_k = torch.randn(1, HKV, npast, D, device=dev, dtype=dt)
        past_v = torch.randn(1, HKV, npast, D, device=dev, dtype=dt)
        positions = torch.arange(start, start + t, device=dev)
        key_pos = torch.cat([torch.arange(start - npast, start, device=dev), positions])
        blocks = fast.window_blocks(positions, key_pos, W, G)
        want = current(q, k_t, v_t, past_k, past_v, blocks)
        ms_cur = timed(lambda: current(q, k_t, v_t, past_k, past_v, blocks))
        kvs = torch.stack([k_t[0], v_t[0]]).contiguous()
        past_kv = torch.zeros(2, HKV, W, D, device=dev, dtype=dt)
        past_kv[0, :, W - npast :] = past_k[0]
        past_kv[1, :, W - npast :] = past_v[0]
        line = f"start {start} t {t}: current {ms_cur:.3f} ms"
        for b in (128, 256, 512):
            bias = batched_bias(start, t, b, dev)
            try:
                got = batched(q, kvs, past_kv, bias, b)
                err = (got.float() - want.float()).abs().max().item()
                ms = timed(lambda bias=bias, b=b: batched(q, kvs, past_kv, bias, b))
                line += f" | b{b} {ms:.3f} ms err {err:.4f}"
                res[(start, t, b)] = ms
            except Exception as e:  # noqa: BLE001
                line += f" | b{b} FAIL {type(e).__name__}: {str(e)[:200]}"
        # cost of just building the bias (once per chunk)
        ms_bias = timed(lambda: batched_bias(start, t, 256, dev))
        line += f" | bias build {ms_bias:.3f} ms"
        print(line, flush=True)
    # FlexAttention, for reference
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        start, t = 4096, 4096
        q = torch.randn(1, H, t, D, device=dev, dtype=dt)
        buf = torch.randn(2, 1, HKV, W + t, D, device=dev, dtype=dt)

        def mask_mod(b_, h_, qi, ki):
            return (ki >= qi + 1) & (ki <= qi + W)

        t0 = time.time()
        bm = create_block_mask(mask_mod, None, None, t, W + t, device=dev)
        o = flex(q, buf[0], buf[1], block_mask=bm, scale=1.0, enable_gqa=True)
        torch.cuda.synchronize()
        ms = timed(lambda: flex(q, buf[0], buf[1], block_mask=bm, scale=1.0, enable_gqa=True))
        print(
            f"flex start {start} t {t}: {ms:.3f} ms (first call {time.time() - t0:.1f} s)",
            o.shape,
            flush=True,
        )
    except Exception as e:  # noqa: BLE001
        print(f"flex FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)


main()
