"""Ran in session 19's calls 5-6 at 32d44f5, where `cuda.softmax_to` (the old path) still existed. The full layers' denoise attention (head_dim 512): the softmax normalized before P @ V (two reads of the fp32
scores, `softmax_to`; "old") against exp_to + divide_rows (one read, the division after P @ V in fp32; "new").
1. One layer's attention alone at the real shape (graphs of 4 calls), and each path's error against fp64.
2. The denoise step in one process (random weights, init hf), graphs of each path replayed alternately, the
   first again last (the control for an order effect); max|diff| of the logits between paths."""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
from moe_kernels import time_graph  # noqa: E402

from diffgemma.bench import REAL_CONFIG, random_model  # noqa: E402
from diffgemma.kernels import cuda as fast  # noqa: E402

new_nomask = fast.attention_nomask


def old_nomask(q, k, v, span=None, valid=None):
    _, h, t, d = q.shape
    if d > 256 and span is None:
        hkv = k.shape[1]
        qf = q.reshape(1, hkv, (h // hkv) * t, d)
        scores = torch.bmm(qf[0], k[0].transpose(1, 2), out_dtype=torch.float32)
        return torch.bmm(fast.softmax_to(scores, v.dtype, valid=valid), v[0]).reshape(1, h, t, d)
    return new_nomask(q, k, v, span=span, valid=valid)


def kernels(ctx: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(ctx)
    n_valid = ctx + 256
    full = -(-n_valid // 1024) * 1024
    buf = torch.randn(2, 1, 2, full + 256, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    buf[0] *= 512**-0.25 * 2.0
    q = torch.randn(1, 16, 256, 512, generator=g, device="cuda", dtype=torch.bfloat16) * 512**-0.25 * 2.0
    k, v = buf[0][:, :, :full], buf[1][:, :, :full]
    valid = torch.tensor([n_valid], device="cuda", dtype=torch.int32)
    qd = q.double().reshape(2, 8 * 256, 512)
    s = qd @ k[0, :, :n_valid].double().transpose(1, 2)
    want = (torch.softmax(s, -1) @ v[0, :, :n_valid].double()).reshape(1, 16, 256, 512)
    del s
    line = f"ctx {ctx:6d} keys {full:6d} valid {n_valid:6d}:"
    for name, fn in (("old", old_nomask), ("new", new_nomask), ("old", old_nomask), ("new", new_nomask)):
        out = fn(q, k, v, valid=valid)
        err = float((out.double() - want).norm() / want.norm())
        us = time_graph(lambda fn=fn: fn(q, k, v, valid=valid), calls=4) * 1e3
        line += f"  {name} {us:7.1f} us (rel err {err:.3g})"
    print(line, flush=True)


def steps(ctxs: list[int]) -> None:
    model = random_model(REAL_CONFIG, "cuda", torch.bfloat16, init="hf")
    vocab, c = model.cfg.vocab_size, 256
    for ctx in ctxs:
        kv = model.new_cache(ctx + 2 * c)
        model.prefill(torch.randint(0, vocab, (1, ctx)), kv, chunk=4096)
        canvas = torch.randint(0, vocab, (c,), device="cuda")
        probs = torch.softmax(torch.randn(c, vocab, device="cuda"), -1).to(torch.bfloat16)
        model._load_geometry(kv, c)
        graphs = {}
        for i, name in enumerate(["new", "old", "new"]):
            fast.attention_nomask = new_nomask if name == "new" else old_nomask
            graphs[f"{i}:{name}"] = fast.GraphStep(
                lambda ids, p, kv=kv: model._denoise_forward(ids, kv, p, False),
                canvas,
                probs,
                torch.cuda.graph_pool_handle(),
            )
        fast.attention_nomask = new_nomask
        assert not fast.triton_failed_kernels, fast.triton_failed_kernels
        outs = {k: s(canvas, s.sc).float().clone() for k, s in graphs.items()}
        first = outs["0:new"]
        diffs = {k: float((o - first).abs().max()) for k, o in outs.items()}
        agree = float((outs["1:old"].argmax(-1) == first.argmax(-1)).float().mean())
        print(
            f"ctx {ctx}: logits max|diff| to 0:new {diffs}; argmax agreement old/new {agree:.4f}", flush=True
        )
        res = {k: [] for k in graphs}
        for _ in range(7):
            for k, s in graphs.items():
                for _ in range(3):
                    s.graph.replay()
                torch.cuda.synchronize()
                ms = []
                for _ in range(20):
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
        del graphs, outs, kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    for ctx in (1024, 8192, 32768, 131072):
        kernels(ctx)
        torch.cuda.empty_cache()
    steps([1024, 32768])
