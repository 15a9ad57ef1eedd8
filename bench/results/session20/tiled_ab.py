"""Probe: gate_up's weights in a tiled layout, each TMA box (block_n rows x block_k columns) one contiguous
16 KB run, against the real [E * 2I, H] layout whose boxes are 64 rows of 256 B, 5.5 KB apart (a pattern
read at 3.99 against 4.40 TB/s, bench/results README). A copy of the gate_up kernel's TMA + swap_ab path
with a TILED switch; the default kernel, the copy on the real layout (control) and the copy on the tiled layout,
each alone (graphs of 10 calls, medians of 20 replays), uniform and skewed routing, outputs compared bit for bit."""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path("bench").resolve()))
import moe_kernels as mk  # noqa: E402

from diffgemma.kernels import pdl  # noqa: E402

tm = mk.tm


@triton.jit
def _gu_probe(
    x_ptr,
    gu,
    act_ptr,
    perm_ptr,
    bounds_ptr,
    TOP_K,
    stride_xn,
    stride_an,
    BLOCK_M: tl.constexpr,
    M_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    TILED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    slot_id = tl.program_id(0)
    col_block = tl.program_id(1)
    e = slot_id // M_SLOTS
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    KB: tl.constexpr = H // BLOCK_K
    NB: tl.constexpr = 2 * INTER // BLOCK_N
    if TILED:  # tile (e, rb, kb) at row ((e * NB + rb) * KB + kb) * BLOCK_N of a [*, BLOCK_K] matrix
        t_gate = (e * NB + col_block) * KB * BLOCK_N
        t_up = (e * NB + INTER // BLOCK_N + col_block) * KB * BLOCK_N
    else:
        row_gate = e * (2 * INTER) + col_block * BLOCK_N
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        rows = tl.load(perm_ptr + pos, mask=row_ok, other=0) // TOP_K
        x_tile = x_ptr + rows[:, None] * stride_xn + ks[None, :]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, KB):
            xs = tl.load(x_tile + kb * BLOCK_K, mask=row_ok[:, None], other=0.0)
            if TILED:
                wg = gu.load([t_gate + kb * BLOCK_N, 0])
                wu = gu.load([t_up + kb * BLOCK_N, 0])
            else:
                wg = gu.load([row_gate, kb * BLOCK_K])
                wu = gu.load([row_gate + INTER, kb * BLOCK_K])
            acc_g = tl.dot(wg, tl.trans(xs), acc_g)
            acc_u = tl.dot(wu, tl.trans(xs), acc_u)
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
        adt = act_ptr.dtype.element_ty
        gate = acc_g.to(adt).to(tl.float32)
        up = acc_u.to(adt).to(tl.float32)
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = ((gate * tl.sigmoid(2.0 * z)).to(adt).to(tl.float32) * up).to(adt)
        tl.store(act_ptr + pos[:, None] * stride_an + cols[None, :], act, mask=row_ok[:, None])
        m0 += M_SLOTS * BLOCK_M


def tile(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    e, r, k = w.shape
    return w.view(e, r // bn, bn, k // bk, bk).permute(0, 1, 3, 2, 4).contiguous().view(-1, bk)


def probe(x, w2d, perm, bounds, tiled, bn=64, bk=128, bm=32, slots=2, stages=4, warps=4):
    inter = mk.INTER
    act = torch.empty(perm.shape[0], inter, device=x.device, dtype=x.dtype)
    desc = TensorDescriptor(w2d, list(w2d.shape), [w2d.shape[1], 1], [bn, bk])
    on = pdl.enabled(x.device)
    _gu_probe[(mk.E * slots, inter // bn)](
        x,
        desc,
        act,
        perm,
        bounds,
        mk.K,
        x.stride(0),
        act.stride(0),
        BLOCK_M=bm,
        M_SLOTS=slots,
        BLOCK_N=bn,
        BLOCK_K=bk,
        H=mk.H,
        INTER=inter,
        TILED=tiled,
        PDL=on,
        launch_pdl=on,
        num_warps=warps,
        num_stages=stages,
    )
    return act


g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(mk.E, 2 * mk.INTER, mk.H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(mk.N, mk.H, generator=g, device="cuda", dtype=torch.bfloat16)
flat = gate_up.view(-1, mk.H)
tiled = {(bn, bk): tile(gate_up, bn, bk) for bn, bk in ((64, 128), (64, 64))}
gu_bytes = gate_up.numel() * 2
cfg = tm.CONFIGS[tm.DEFAULT_CONFIG].gate_up
print(f"default gate_up tiles: {cfg}")
VARIANTS = {
    "default": lambda p, b: tm.gate_up_act(x, gate_up, p, b, mk.K, cfg),
    "copy_flat": lambda p, b: probe(x, flat, p, b, False),
    "tiled": lambda p, b: probe(x, tiled[64, 128], p, b, True),
    "tiled_s5": lambda p, b: probe(x, tiled[64, 128], p, b, True, stages=5),
    "tiled_s3": lambda p, b: probe(x, tiled[64, 128], p, b, True, stages=3),
    "tiled_k64_s8": lambda p, b: probe(x, tiled[64, 64], p, b, True, bk=64, stages=8),
    "copy_flat_k64_s8": lambda p, b: probe(x, flat, p, b, False, bk=64, stages=8),
    "tiled_s1slot": lambda p, b: probe(x, tiled[64, 128], p, b, True, slots=1, stages=4),
}
for scen in ("uniform", "skewed"):
    w, ids = mk.routing(scen, None, g)
    counts = torch.bincount(ids.reshape(-1), minlength=mk.E)
    print(
        f"\n[{scen}] pairs per expert: max {int(counts.max())}, empty {int((counts == 0).sum())}", flush=True
    )
    perm, bounds = tm.sort_pairs(ids, mk.E)
    ref = VARIANTS["default"](perm, bounds)
    for rnd in range(2):
        for name, fn in VARIANTS.items():
            try:
                same = torch.equal(fn(perm, bounds), ref)
                ms = mk.time_graph(lambda f=fn, p=perm, b=bounds: f(p, b))
                print(f"  r{rnd} {name:16s} {ms * 1e3:7.1f} us {mk.tbps(gu_bytes, ms):5.2f} TB/s same {same}")
            except Exception as e:  # noqa: BLE001
                print(f"  r{rnd} {name:16s} FAILED {type(e).__name__}: {str(e)[:300]}")
