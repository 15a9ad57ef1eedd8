"""Session 26: where an expert kernel's power goes. One layer's gate_up bytes (1 GB bf16) streamed by Triton kernels
on the kept kernel's grid (128 experts x 22 tiles of 64 rows, 22 K steps of 128), each sustained ~3 s with the
board's power sampled: through TMA into shared memory or by plain loads into registers, summed on the CUDA cores
or multiplied on the tensor cores (against a fixed [32, 128] x tile, wgmma with the weights as A)."""

# ruff: noqa: B023 - the closures run within their loop iteration
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path("bench").resolve()))
sys.path.insert(0, str(Path(__file__).parent))
from moe_kernels import DEV, INTER, E, H, time_graph  # noqa: E402
from packed_probe4 import sustained  # noqa: E402


@triton.jit
def _stream(w_ptr, x_ptr, out_ptr, H: tl.constexpr, TMA: tl.constexpr, MMA: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile * 64 + tl.arange(0, 64)
    ks = tl.arange(0, 128)
    xs = tl.load(x_ptr + tl.arange(0, 32)[:, None] * H + ks[None, :])
    acc = tl.zeros((64, 32), dtype=tl.float32)
    s = tl.zeros((64,), dtype=tl.float32)
    for k0 in range(0, H, 128):
        if TMA:
            w = w_ptr.load([tile * 64, k0])
        else:
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * H + (k0 + ks)[None, :])
        if MMA:
            acc = tl.dot(w, tl.trans(xs), acc)
        else:
            s += tl.sum(w.to(tl.float32), axis=1)
    if MMA:
        s = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, s)


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    w = torch.randn(E * 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(32, H, generator=g, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(w.shape[0], device=DEV)
    desc = TensorDescriptor(w, list(w.shape), [H, 1], [64, 128])
    res = {}
    for tma in (True, False):
        for mma in (False, True):
            for stages in (1, 3):
                name = f"{'tma' if tma else 'ldg'}_{'mma' if mma else 'sum'}_s{stages}"

                def fn():
                    _stream[(w.shape[0] // 64,)](
                        desc if tma else w, x, out, H=H, TMA=tma, MMA=mma, num_warps=4, num_stages=stages
                    )

                try:
                    alone = 1e3 * time_graph(fn)
                    r = sustained(fn)
                    r["alone_us"] = alone
                    res[name] = r
                    print(f"{name:12s} alone {alone:6.1f} us; sustained {json.dumps(r)}", flush=True)
                except Exception as ex:  # noqa: BLE001 - report and go on
                    print(f"{name:12s} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
