# ruff: noqa: B023 - the closures run within their loop iteration
"""Session 26 probe 4: probe 3's kernels plus an 8-instruction decode (v2), and each kernel run for ~3 s with the
board's power sampled while it runs. `main_call9` is call 9 (the kernels alone, then sustained; it printed watts and
MHz from `power.draw` and `clocks.sm`, before `sustained` took the fields below); `main` is call 10 (gate_up
sustained with zero activations and block_m 16, against a plain read, a copy and idle).

The v2 decode gives other outputs than the kept kernel ("same False"): its code-byte order assumes how Triton packs
a thread's four elements for the PTX call, which does not hold; its timings stand for its instruction count only.

    PYTHONPATH=src:bench python packed_probe4.py OUT.json [--call9]"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path("bench").resolve()))
from moe_kernels import DEV, INTER, E, H, K, N, routing, time_graph  # noqa: E402

from diffgemma.kernels import pdl  # noqa: E402
from diffgemma.kernels import triton_moe as tm  # noqa: E402

B0 = tl.constexpr(111)  # decoded exponent field = code + B0
TN = 64  # a tile: 64 weight rows
GATE_UP = [(32, 3, 6)]
DOWN = [(32, 3, 2)]


def permute_cols(t: torch.Tensor, width: int) -> torch.Tensor:
    """Within each `width` columns: physical (j, c, h, q) holds column c*16 + h*8 + j*2 + q, so that a thread's
    bytes of the wgmma A fragment (columns 2j, 2j+1, 2j+8, 2j+9 of each 16) lie together."""
    r, k = t.shape
    v = t.reshape(r, k // width, width // 16, 2, 4, 2)  # (c, h, j, q)
    return v.permute(0, 1, 4, 2, 3, 5).reshape(r, k)  # (j, c, h, q)


def pack(w: torch.Tensor, tk: int = 128, v2: bool = False):
    """w [E, R, Kd] bf16 -> (tiles [E*R/64 * Kd/tk * 64, tk * 3/2] u8, base [E*R] i32, exceptions [E, R, Kd])."""
    e, r, kd = w.shape
    kp = -(-kd // tk) * tk
    half = tk // 2
    flat = w.reshape(e * r, kd)
    bits = flat.view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    base = (exp.amax(-1, keepdim=True) - 15).clamp(min=0)
    c = exp - base
    exc = c <= 0
    c = torch.where(exc, 0, c)
    sm = torch.where(exc, 0, ((bits >> 8) & 0x80) | (bits & 0x7F))
    sm = torch.nn.functional.pad(sm, (0, kp - kd))
    c = torch.nn.functional.pad(c, (0, kp - kd))
    rows = e * r
    sm = permute_cols(sm, half).reshape(rows, kp // tk, tk)
    c = permute_cols(c, half).reshape(rows, kp // tk, 2, half)
    codes = c[:, :, 0] | (c[:, :, 1] << 4)
    if v2:  # each aligned 4 code bytes as elements (0, 2, 1, 3): ASM2 takes lanes (0, 1) from bytes 0 and 2
        codes = codes.reshape(*codes.shape[:-1], -1, 4)[..., [0, 2, 1, 3]].reshape(codes.shape)
    tile = torch.cat([sm, codes], -1).to(torch.uint8)  # [rows, KB, 3 * half]
    tile = tile.reshape(rows // TN, TN, kp // tk, 3 * half).transpose(1, 2).contiguous()
    return tile.reshape(-1, 3 * half), base[:, 0].to(torch.int32).contiguous(), exc.reshape(e, r, kd)


def kernel_view(w: torch.Tensor, exc: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The weights the kernels multiply: exceptions as 2^(base - 127)."""
    fill = torch.exp2(base.float() - 127).to(w.dtype).reshape(w.shape[0], w.shape[1], 1).expand_as(w)
    return torch.where(exc, fill, w)


_ASM = """{
        .reg .b32 t0, t1, u0, u1, z, m;
        mov.b32 z, 0;
        mov.b32 m, 0x807F807F;
        prmt.b32 t0, $2, z, 0x9180;
        prmt.b32 t1, $2, z, 0xB3A2;
        prmt.b32 u0, $3, z, 0x4140;
        prmt.b32 u1, $3, z, 0x4342;
        and.b32 u0, u0, MASK;
        and.b32 u1, u1, MASK;
        mad.lo.u32 u0, u0, MUL, 0x37803780;
        mad.lo.u32 u1, u1, MUL, 0x37803780;
        lop3.b32 $0, t0, m, u0, 0xEA;
        lop3.b32 $1, t1, m, u1, 0xEA;
        }"""
ASM_LOW = tl.constexpr(_ASM.replace("MASK", "0x000F000F").replace("MUL", "128"))
ASM_HIGH = tl.constexpr(_ASM.replace("MASK", "0x00F000F0").replace("MUL", "8"))
# v2: 8 instructions for 4 weights. Codes of elements (0, 1) sit in code bytes 0 and 2, (2, 3) in bytes 1 and 3
# (`pack(v2=True)`): one shift and mask puts both nibbles of a pair at their lanes' exponent bits, OR 0x3800
# (B0 = 112); then each lane takes sign and mantissa from t, exponent from u (lop3 0xE4: mux on m).
_ASM2 = """{
        .reg .b32 t0, t1, u0, u1, z, m, k, e;
        mov.b32 z, 0;
        mov.b32 m, 0x807F807F;
        mov.b32 e, 0x07800780;
        mov.b32 k, 0x38003800;
        prmt.b32 t0, $2, z, 0x9180;
        prmt.b32 t1, $2, z, 0xB3A2;
        SHIFT0;
        SHIFT1;
        lop3.b32 u0, u0, e, k, 0xEA;
        lop3.b32 u1, u1, e, k, 0xEA;
        lop3.b32 $0, t0, u0, m, 0xE4;
        lop3.b32 $1, t1, u1, m, 0xE4;
        }"""
ASM2_LOW = tl.constexpr(_ASM2.replace("SHIFT0", "shl.b32 u0, $3, 7").replace("SHIFT1", "shr.b32 u1, $3, 1"))
ASM2_HIGH = tl.constexpr(_ASM2.replace("SHIFT0", "shl.b32 u0, $3, 3").replace("SHIFT1", "shr.b32 u1, $3, 5"))


@triton.jit
def _unpermute(w):
    n: tl.constexpr = w.shape[0]
    half: tl.constexpr = w.shape[1]
    w = tl.reshape(w, [n, 4, half // 16, 2, 2])
    w = tl.permute(w, [0, 2, 3, 1, 4])
    return tl.reshape(w, [n, half])


@triton.jit
def _tile(desc, row, HALF: tl.constexpr, V2: tl.constexpr):
    """The two halves of a tile, decoded to bf16 (times 2^(B0 - base) per row)."""
    sa = desc.load([row, 0])
    sb = desc.load([row, HALF])
    cb = desc.load([row, 2 * HALF])
    if V2:
        wa = tl.inline_asm_elementwise(
            ASM2_LOW, "=r,=r,r,r", [sa, cb], dtype=tl.bfloat16, is_pure=True, pack=4
        )
        wb = tl.inline_asm_elementwise(
            ASM2_HIGH, "=r,=r,r,r", [sb, cb], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    else:
        wa = tl.inline_asm_elementwise(
            ASM_LOW, "=r,=r,r,r", [sa, cb], dtype=tl.bfloat16, is_pure=True, pack=4
        )
        wb = tl.inline_asm_elementwise(
            ASM_HIGH, "=r,=r,r,r", [sb, cb], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    return _unpermute(wa), _unpermute(wb)


@triton.jit
def _gate_up_packed(
    x_ptr, desc, base_ptr, act_ptr, perm_ptr, bounds_ptr, TOP_K, stride_xn, stride_an,
    BLOCK_M: tl.constexpr, M_SLOTS: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, V2: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(PDL)
    slot_id = tl.program_id(0)
    col_block = tl.program_id(1)
    e = slot_id // M_SLOTS
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    KB: tl.constexpr = H // 128
    cols = col_block * 64 + tl.arange(0, 64)
    rb_g = e * (2 * INTER // 64) + col_block
    rb_u = rb_g + INTER // 64
    scale_g = tl.exp2((tl.load(base_ptr + rb_g * 64 + tl.arange(0, 64)) - (B0 + V2)).to(tl.float32))
    scale_u = tl.exp2((tl.load(base_ptr + rb_u * 64 + tl.arange(0, 64)) - (B0 + V2)).to(tl.float32))
    ks = tl.arange(0, 64)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        rows = tl.load(perm_ptr + pos, mask=row_ok, other=0) // TOP_K
        x_tile = x_ptr + rows[:, None] * stride_xn + ks[None, :]
        acc_g = tl.zeros((64, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((64, BLOCK_M), dtype=tl.float32)
        for kb in range(KB):
            xa = tl.load(x_tile + kb * 128, mask=row_ok[:, None], other=0.0)
            xb = tl.load(x_tile + kb * 128 + 64, mask=row_ok[:, None], other=0.0)
            ga, gb = _tile(desc, (rb_g * KB + kb) * 64, 64, V2)
            ua, ub = _tile(desc, (rb_u * KB + kb) * 64, 64, V2)
            acc_g = tl.dot(ga, tl.trans(xa), acc_g)
            acc_g = tl.dot(gb, tl.trans(xb), acc_g)
            acc_u = tl.dot(ua, tl.trans(xa), acc_u)
            acc_u = tl.dot(ub, tl.trans(xb), acc_u)
        gate = tl.trans(acc_g * scale_g[:, None]).to(tl.bfloat16).to(tl.float32)
        up = tl.trans(acc_u * scale_u[:, None]).to(tl.bfloat16).to(tl.float32)
        act = (tm._gelu_tanh(gate).to(tl.bfloat16).to(tl.float32) * up).to(tl.bfloat16)
        dst = act_ptr + pos[:, None] * stride_an + cols[None, :]
        tl.store(dst, act, mask=row_ok[:, None])
        m0 += M_SLOTS * BLOCK_M


@triton.jit
def _down_packed(
    act_ptr, desc, base_ptr, bounds_ptr, y_ptr, stride_an, stride_yn,
    BLOCK_M: tl.constexpr, M_SLOTS: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, COLS_FAST: tl.constexpr,
    HALF: tl.constexpr, V2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.start(PDL)
    slot_id = tl.program_id(1) if COLS_FAST else tl.program_id(0)
    col_block = tl.program_id(0) if COLS_FAST else tl.program_id(1)
    e = slot_id // M_SLOTS
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    KB: tl.constexpr = (INTER + 2 * HALF - 1) // (2 * HALF)
    cols = col_block * 64 + tl.arange(0, 64)
    rb = e * (H // 64) + col_block
    scale = tl.exp2((tl.load(base_ptr + rb * 64 + tl.arange(0, 64)) - (B0 + V2)).to(tl.float32))
    ks = tl.arange(0, HALF)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        a_tile = act_ptr + pos[:, None] * stride_an + ks[None, :]
        acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
        for kb in range(KB):
            k0 = kb * 2 * HALF
            a_ok = row_ok[:, None] & ((k0 + ks) < INTER)[None, :]
            b_ok = row_ok[:, None] & ((k0 + HALF + ks) < INTER)[None, :]
            aa = tl.load(a_tile + k0, mask=a_ok, other=0.0)
            ab = tl.load(a_tile + k0 + HALF, mask=b_ok, other=0.0)
            wa, wb = _tile(desc, (rb * KB + kb) * 64, HALF, V2)
            acc = tl.dot(wa, tl.trans(aa), acc)
            acc = tl.dot(wb, tl.trans(ab), acc)
        y = tl.trans(acc * scale[:, None])
        dst = y_ptr + pos[:, None] * stride_yn + cols[None, :]
        tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
        m0 += M_SLOTS * BLOCK_M


def _desc(tiles: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor(tiles, list(tiles.shape), [tiles.shape[1], 1], [64, tiles.shape[1] // 3])


def gate_up_packed(x, packed, perm, bounds, block_m=32, m_slots=3, stages=3, warps=4, v2=False):
    tiles, base = packed
    act = torch.empty(perm.shape[0], INTER, device=x.device, dtype=x.dtype)
    _gate_up_packed[(E * m_slots, INTER // 64)](
        x, _desc(tiles), base, act, perm, bounds, K, x.stride(0), act.stride(0),
        BLOCK_M=block_m, M_SLOTS=m_slots, H=H, INTER=INTER, V2=v2, PDL=True, launch_pdl=True,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return act


def down_packed(act, packed, bounds, block_m=32, m_slots=2, stages=3, warps=4, cols_fast=True, v2=False):
    tiles, base = packed
    y = torch.empty(act.shape[0], H, device=act.device, dtype=act.dtype)
    grid = (E * m_slots, H // 64)
    _down_packed[grid[::-1] if cols_fast else grid](
        act, _desc(tiles), base, bounds, y, act.stride(0), y.stride(0),
        BLOCK_M=block_m, M_SLOTS=m_slots, H=H, INTER=INTER, COLS_FAST=cols_fast, HALF=tiles.shape[1] // 3, V2=v2,
        PDL=True, launch_pdl=True,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


FIELDS = ["power.draw", "power.draw.instant", "clocks.sm", "temperature.gpu"]


def smi() -> list[float]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=" + ",".join(FIELDS), "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return [float(v) if v.strip().replace(".", "").isdigit() else -1.0 for v in out.strip().split(",")]


def sustained(fn, seconds: float = 3.0, calls: int = 50) -> dict:
    """fn replayed back to back for ~`seconds` (graphs of `calls` calls): us a call, and the board's power and SM
    clock sampled while it runs (the step runs at the 700 W cap in steady state)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.time()
    graph.replay()
    torch.cuda.synchronize()
    n = max(2, int(seconds / (time.time() - t0)))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        graph.replay()
    e1.record()
    time.sleep(seconds * 0.6)
    samples = [smi() for _ in range(3)]
    e1.synchronize()
    us = 1e3 * e0.elapsed_time(e1) / (n * calls)
    out = {f: statistics.median(x[i] for x in samples) for i, f in enumerate(FIELDS)}
    del graph
    return {"us": us, **out, "uj_per_call": us * out["power.draw.instant"]}


def main_call9() -> None:
    """Call 9: each kernel alone (uniform and skewed), then sustained (uniform)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    packs = {v2: (pack(gate_up, 128, v2), pack(down, 128, v2)) for v2 in (False, True)}
    kept = tm.CONFIGS[tm.DEFAULT_CONFIG]
    res: dict = {"alone": {}, "sustained": {}}
    read_gu = gate_up.reshape(-1)
    for scen in ("uniform", "skewed"):
        _, ids = routing(scen, None, g)
        perm, bounds = tm.sort_pairs(ids, E)
        refs = {}
        for v2 in (False, True):
            (gt, gb, gx), (dt, db, dx) = packs[v2]
            gv, dv = kernel_view(gate_up, gx, gb), kernel_view(down, dx, db)
            act = tm.gate_up_act(x, gv, perm, bounds, K, kept.gate_up)
            refs[v2] = (act, tm.down_sorted(act, dv, bounds, kept.down))
        act0 = refs[False][0]
        fns = {
            "gate_up/kept": (lambda: tm.gate_up_act(x, gate_up, perm, bounds, K, kept.gate_up), None),
            "down/kept": (lambda: tm.down_sorted(act0, down, bounds, kept.down), None),
            "gate_up/read_sum": (lambda: read_gu.sum(dtype=torch.float32), None),
        }
        for v2 in (False, True):
            (gt, gb, _), (dt, db, _) = packs[v2]
            for ms in (3, 6):
                fns[f"gate_up/v{int(v2) + 1}_slots{ms}"] = (
                    lambda gt=gt, gb=gb, ms=ms, v2=v2: gate_up_packed(
                        x, (gt, gb), perm, bounds, 32, ms, 3, v2=v2
                    ),
                    refs[v2][0],
                )
            fns[f"down/v{int(v2) + 1}"] = (
                lambda dt=dt, db=db, v2=v2: down_packed(refs[v2][0], (dt, db), bounds, 32, 2, 3, v2=v2),
                refs[v2][1],
            )
        for name, (fn, ref) in fns.items():
            same = None if ref is None else bool(torch.equal(fn(), ref))
            us = 1e3 * time_graph(fn)
            res["alone"][f"{scen}/{name}"] = {"us": us, "same": same}
            print(f"{scen:8s} {name:22s} {us:7.1f} us  same {same}", flush=True)
        if scen == "uniform":
            for name, (fn, _) in fns.items():
                if "slots6" not in name:
                    res["sustained"][name] = r = sustained(fn)
                    print(f"sustained {name:22s} {json.dumps(r)}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    x0 = torch.zeros_like(x)
    gt, gb, _ = pack(gate_up, 128, True)
    kept = tm.CONFIGS[tm.DEFAULT_CONFIG]
    m16 = dataclasses.replace(kept.gate_up, block_m=16)
    res: dict = {"fields": FIELDS, "sustained": {}}
    read_gu = gate_up.reshape(-1)
    copy_dst = torch.empty_like(read_gu)
    _, ids = routing("uniform", None, g)
    perm, bounds = tm.sort_pairs(ids, E)
    fns = {
        "idle": None,
        "read_sum": lambda: read_gu.sum(dtype=torch.float32),
        "copy": lambda: copy_dst.copy_(read_gu),
        "kept": lambda: tm.gate_up_act(x, gate_up, perm, bounds, K, kept.gate_up),
        "kept_x0": lambda: tm.gate_up_act(x0, gate_up, perm, bounds, K, kept.gate_up),
        "kept_m16": lambda: tm.gate_up_act(x, gate_up, perm, bounds, K, m16),
        "packed_v2": lambda: gate_up_packed(x, (gt, gb), perm, bounds, 32, 3, 3, v2=True),
        "packed_v2_x0": lambda: gate_up_packed(x0, (gt, gb), perm, bounds, 32, 3, 3, v2=True),
        "packed_v2_m16": lambda: gate_up_packed(x, (gt, gb), perm, bounds, 16, 3, 3, v2=True),
    }
    for name, fn in fns.items():
        if fn is None:
            time.sleep(1.0)
            r = dict(zip(FIELDS, smi(), strict=True))
        else:
            r = sustained(fn)
        res["sustained"][name] = r
        print(f"{name:14s} {json.dumps(r)}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main_call9() if sys.argv[2:] == ["--call9"] else main()
