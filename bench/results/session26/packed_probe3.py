"""Session 26 probe 3: probe 2 with the tile width a parameter (down here in tiles of 64 columns: no padding of its
704 columns to 768) and more M-slots. 12-bit expert weights in tiles contiguous in memory, decoded by PTX in
registers in the wgmma A-operand layout (`permute_cols`). gate_up and down alone (graphs of 10 calls), uniform and skewed routing, against
the kept kernels on bf16 weights. Exceptions (below a row's 15 exponents) are decoded as 2^(base - 127) and not
corrected here: the reference is the kept kernel on those decoded weights (`kernel_view`), compared bit for bit.

    PYTHONPATH=src:bench python packed_probe3.py OUT.json"""

from __future__ import annotations

import json
import sys
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
GATE_UP = [(32, 3, 1), (32, 3, 3), (32, 3, 4), (32, 3, 6), (32, 2, 6), (64, 3, 3), (64, 3, 6), (64, 2, 6)]
DOWN = [(32, st, ms) for st in (3, 4, 5, 6) for ms in (1, 2, 4)] + [(64, 3, 2), (64, 4, 2)]


def permute_cols(t: torch.Tensor, width: int) -> torch.Tensor:
    """Within each `width` columns: physical (j, c, h, q) holds column c*16 + h*8 + j*2 + q, so that a thread's
    bytes of the wgmma A fragment (columns 2j, 2j+1, 2j+8, 2j+9 of each 16) lie together."""
    r, k = t.shape
    v = t.reshape(r, k // width, width // 16, 2, 4, 2)  # (c, h, j, q)
    return v.permute(0, 1, 4, 2, 3, 5).reshape(r, k)  # (j, c, h, q)


def pack(w: torch.Tensor, tk: int = 128):
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


@triton.jit
def _unpermute(w):
    n: tl.constexpr = w.shape[0]
    half: tl.constexpr = w.shape[1]
    w = tl.reshape(w, [n, 4, half // 16, 2, 2])
    w = tl.permute(w, [0, 2, 3, 1, 4])
    return tl.reshape(w, [n, half])


@triton.jit
def _tile(desc, row, HALF: tl.constexpr):
    """The two halves of a tile, decoded to bf16 (times 2^(B0 - base) per row)."""
    sa = desc.load([row, 0])
    sb = desc.load([row, HALF])
    cb = desc.load([row, 2 * HALF])
    wa = tl.inline_asm_elementwise(ASM_LOW, "=r,=r,r,r", [sa, cb], dtype=tl.bfloat16, is_pure=True, pack=4)
    wb = tl.inline_asm_elementwise(ASM_HIGH, "=r,=r,r,r", [sb, cb], dtype=tl.bfloat16, is_pure=True, pack=4)
    return _unpermute(wa), _unpermute(wb)


@triton.jit
def _gate_up_packed(
    x_ptr, desc, base_ptr, act_ptr, perm_ptr, bounds_ptr, TOP_K, stride_xn, stride_an,
    BLOCK_M: tl.constexpr, M_SLOTS: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, PDL: tl.constexpr,
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
    scale_g = tl.exp2((tl.load(base_ptr + rb_g * 64 + tl.arange(0, 64)) - B0).to(tl.float32))
    scale_u = tl.exp2((tl.load(base_ptr + rb_u * 64 + tl.arange(0, 64)) - B0).to(tl.float32))
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
            ga, gb = _tile(desc, (rb_g * KB + kb) * 64, 64)
            ua, ub = _tile(desc, (rb_u * KB + kb) * 64, 64)
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
    HALF: tl.constexpr, PDL: tl.constexpr,
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
    scale = tl.exp2((tl.load(base_ptr + rb * 64 + tl.arange(0, 64)) - B0).to(tl.float32))
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
            wa, wb = _tile(desc, (rb * KB + kb) * 64, HALF)
            acc = tl.dot(wa, tl.trans(aa), acc)
            acc = tl.dot(wb, tl.trans(ab), acc)
        y = tl.trans(acc * scale[:, None])
        dst = y_ptr + pos[:, None] * stride_yn + cols[None, :]
        tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
        m0 += M_SLOTS * BLOCK_M


def _desc(tiles: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor(tiles, list(tiles.shape), [tiles.shape[1], 1], [64, tiles.shape[1] // 3])


def gate_up_packed(x, packed, perm, bounds, block_m=32, m_slots=3, stages=3, warps=4):
    tiles, base = packed
    act = torch.empty(perm.shape[0], INTER, device=x.device, dtype=x.dtype)
    _gate_up_packed[(E * m_slots, INTER // 64)](
        x, _desc(tiles), base, act, perm, bounds, K, x.stride(0), act.stride(0),
        BLOCK_M=block_m, M_SLOTS=m_slots, H=H, INTER=INTER, PDL=True, launch_pdl=True,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return act


def down_packed(act, packed, bounds, block_m=32, m_slots=2, stages=3, warps=4, cols_fast=True):
    tiles, base = packed
    y = torch.empty(act.shape[0], H, device=act.device, dtype=act.dtype)
    grid = (E * m_slots, H // 64)
    _down_packed[grid[::-1] if cols_fast else grid](
        act, _desc(tiles), base, bounds, y, act.stride(0), y.stride(0),
        BLOCK_M=block_m, M_SLOTS=m_slots, H=H, INTER=INTER, COLS_FAST=cols_fast, HALF=tiles.shape[1] // 3,
        PDL=True, launch_pdl=True,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    gu_tiles, gu_base, gu_exc = pack(gate_up)
    dn_tiles, dn_base, dn_exc = pack(down, 64)
    gu_view = kernel_view(gate_up, gu_exc, gu_base)
    dn_view = kernel_view(down, dn_exc, dn_base)
    res: dict = {
        "exceptions": {"gate_up": float(gu_exc.float().mean()), "down": float(dn_exc.float().mean())},
        "bytes": {"gate_up": gu_tiles.numel(), "down": dn_tiles.numel()},
        "alone": {},
    }
    print(res["exceptions"], res["bytes"], flush=True)
    kept = tm.CONFIGS[tm.DEFAULT_CONFIG]
    gu_bytes, dn_bytes = gate_up.numel() * 2, down.numel() * 2
    for scen in ("uniform", "skewed"):
        _, ids = routing(scen, None, g)
        perm, bounds = tm.sort_pairs(ids, E)
        ref_act = tm.gate_up_act(x, gu_view, perm, bounds, K, kept.gate_up)
        ref_y = tm.down_sorted(ref_act, dn_view, bounds, kept.down)
        rows = [
            (
                "gate_up",
                "kept",
                lambda p=perm, b=bounds: tm.gate_up_act(x, gate_up, p, b, K, kept.gate_up),
                None,
            ),
            ("down", "kept", lambda a=ref_act, b=bounds: tm.down_sorted(a, down, b, kept.down), None),
        ]
        for bm, st, ms in GATE_UP:
            fn = lambda p=perm, b=bounds, bm=bm, st=st, ms=ms: gate_up_packed(  # noqa: E731
                x, (gu_tiles, gu_base), p, b, bm, ms, st
            )
            rows.append(("gate_up", f"m{bm}_s{st}_slots{ms}", fn, ref_act))
        for bm, st, ms in DOWN:
            fn = lambda a=ref_act, b=bounds, bm=bm, st=st, ms=ms: down_packed(  # noqa: E731
                a, (dn_tiles, dn_base), b, bm, ms, st
            )
            rows.append(("down", f"m{bm}_s{st}_slots{ms}", fn, ref_y))
        for kind, name, fn, ref in rows:
            try:
                out = fn()
                same = None if ref is None else bool(torch.equal(out, ref))
                us = 1e3 * time_graph(fn)
                nbytes = gu_bytes if kind == "gate_up" else dn_bytes
                res["alone"][f"{scen}/{kind}/{name}"] = {"us": us, "same": same}
                print(f"{scen:8s} {kind:7s} {name:22s} {us:7.1f} us  {nbytes / us / 1e6:.2f} TB/s bf16-equivalent  "
                      f"same {same}", flush=True)  # fmt: skip
            except Exception as ex:  # noqa: BLE001 - report and go on
                print(
                    f"{scen:8s} {kind:7s} {name:22s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True
                )
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
