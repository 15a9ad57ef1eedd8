# ruff: noqa: B023 - each closure is timed within its own loop iteration
"""Triton softmax variants on the prefill's causal blocks and the denoise's rows, on an H200: a183d0e's kernel after
a masked_fill pass; 4e8ba3e's (the causal limit in the kernel, loads masked by the limit); the working tree's.
Run from the repository root with a183d0e's kernels/triton_softmax.py as .dev/softmax_a183.py and 4e8ba3e's src
in .dev/oldsrc/src. microbench_run1.txt: the tree's kernel with an int32 limit, loads still masked by it;
microbench_run2.txt: the committed kernel (loads masked by n_cols, the limit applied after)."""

import importlib.util

import torch


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


old = load("sm_old", ".dev/softmax_a183.py")
head = load("sm_head", ".dev/oldsrc/src/diffgemma/kernels/triton_softmax.py")
new = load("sm_new", "src/diffgemma/kernels/triton_softmax.py")


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


for hkv, n, g, p, s in [(2, 1024, 8, 4096, 3072), (2, 1024, 8, 0, 0), (2, 1024, 8, 4096, 0)]:
    e = s + n
    x = torch.randn(hkv, g * n, p + e, device="cuda") * 3
    causal = (p + s + 1, n)

    def masked_fill_then_softmax():
        y = x.clone()
        above = torch.ones(n, n, dtype=torch.bool, device="cuda").triu_(1)
        y.view(hkv, g, n, p + e)[..., p + s :].masked_fill_(above, float("-inf"))
        return old.softmax_rows(y, torch.bfloat16)

    ref = masked_fill_then_softmax()
    hb = head.softmax_rows(x, torch.bfloat16, causal)
    nb = new.softmax_rows(x, torch.bfloat16, causal)
    a183 = timed(masked_fill_then_softmax) - timed(x.clone)
    t_head = timed(lambda: head.softmax_rows(x, torch.bfloat16, causal))
    t_new = timed(lambda: new.softmax_rows(x, torch.bfloat16, causal))
    d_head = (hb.float() - ref.float()).abs().max().item()
    d_new = (nb.float() - ref.float()).abs().max().item()
    print(
        f"causal block p={p} s={s} cols={p + e}: a183 masked_fill+softmax {a183:.3f} ms (clone excluded) | "
        f"head {t_head:.3f} | new {t_new:.3f} | max|d| head {d_head:.2e} new {d_new:.2e}",
        flush=True,
    )
x = torch.randn(2, 2048, 33024, device="cuda") * 3
rows = [timed(lambda m=m: m.softmax_rows(x, torch.bfloat16)) for m in (old, head, new)]
print(f"denoise 32k rows: a183 {rows[0]:.3f} | head {rows[1]:.3f} | new {rows[2]:.3f}", flush=True)
