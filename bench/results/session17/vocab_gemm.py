"""The step's two vocabulary GEMMs at the real shape, cuBLAS as called now against the transposed problem:
the LM head h [256, 2816] @ E^T (M=256 on cuBLAS's 320-row tiles) and the SC embedding p [256, V] @ E; with
the softcap region after the LM head (reading the transposed product when the GEMM is transposed)."""

import statistics

import torch
import torch.nn.functional as F

from diffgemma.kernels import fused

torch.manual_seed(0)
V, H, C = 262144, 2816, 256
E = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.02
h = torch.randn(C, H, device="cuda", dtype=torch.bfloat16)
p = torch.softmax(torch.randn(C, V, device="cuda"), -1).to(torch.bfloat16)
softcap = fused.make_regions()["softcap"]


def timed(fn, reps=20, rounds=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        ms = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b) * 1000)
        out.append(statistics.median(ms))
    return statistics.median(out)


cands = {
    "lm head F.linear(h, E)": lambda: F.linear(h, E),
    "lm head mm(E, h^T)^T": lambda: torch.mm(E, h.T).T,
    "lm head + softcap, F.linear": lambda: softcap(F.linear(h, E), 30.0),
    "lm head + softcap, transposed": lambda: softcap(torch.mm(E, h.T).T, 30.0),
    "sc embed p @ E": lambda: p @ E,
    "sc embed mm(E^T, p^T)^T": lambda: torch.mm(E.T, p.T).T,
}
ref_l = F.linear(h, E).float()
print("transposed lm head max |d|", float((torch.mm(E, h.T).T.float() - ref_l).abs().max()))
ref_s = (p @ E).float()
print("transposed sc max |d|", float((torch.mm(E.T, p.T).T.float() - ref_s).abs().max()))
for k, fn in cands.items():
    print(f"{k:32s} {timed(fn):8.1f} us", flush=True)
