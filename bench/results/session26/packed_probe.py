"""Session 26 probe: expert weights stored losslessly in 12 bits (an 8-bit plane of sign + mantissa, a 4-bit plane of
exponent codes relative to each row's largest exponent), decoded in the gate_up kernel before its MMA. Does the
kernel read the 25% fewer bytes at the same rate? One layer's gate_up alone (graphs of 10 calls), uniform and
skewed routing, against the kept kernel on the bf16 weights.

Codes: c = exp - (row_max_exp - 15), 1..15 in range; c = 0 (sign + mantissa 0) for the rare weights below the
range (exceptions, ~1e-4 of N(0, s)), which this probe decodes as the kernel would and does not correct.
DECODE 0: the same kernel on bf16 halves (control); 1: Triton integer ops with the row base, zero for c = 0;
2: PTX (prmt / mad / lop3, 4 weights a call) with a fixed bias, the row's power of two applied to the fp32
accumulator after the K loop (exact: every product of a row scales by the same power of two).

Ran as calls 1-4, edited between them (this file is call 4's): call 1 swept DECODE 0-2 at block_m 32 (DECODE 2 did
not compile: a Python string assigned in a constexpr branch; the PTX now lives in module constants); call 2 ran
DECODE 2, plus block_n 128 tiles whose stores lacked a column mask (704 is not a multiple of 128: "same False"
there is that bug); call 3 added DECODE 3 (the A-fragment column order), whose accumulators then missed the rows'
power of two (the `DECODE >= 2` test below was `== 2`: "same False" in call 3); call 4 is this sweep.

    PYTHONPATH=src:bench python packed_probe.py OUT.json"""

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

SWEEP = [(bm, st, ms) for bm in (16, 32, 64) for st in (2, 3, 4) for ms in (1, 3)]
B0 = tl.constexpr(111)  # decoded exponent field = code + B0: the scaled weights lie in [2^-15, 1)


def permute_cols(t: torch.Tensor) -> torch.Tensor:
    """Within each 64 columns: physical j*16 + c*4 + h*2 + q holds column c*16 + h*8 + j*2 + q, so that a thread's
    bytes of the wgmma A fragment (columns 2j, 2j+1, 2j+8, 2j+9 of each 16) lie together (DECODE 3)."""
    r, k = t.shape
    v = t.reshape(r, k // 64, 4, 2, 4, 2)  # (c, h, j, q)
    return v.permute(0, 1, 4, 2, 3, 5).reshape(r, k)  # (j, c, h, q)


def encode(w: torch.Tensor, block_k: int = 128):
    """w [R, Kd] bf16 -> (sm [R, Kd] u8, codes [R, Kd/2] u8, base [R] i32, exceptions mask [R, Kd])."""
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    base = (exp.amax(-1, keepdim=True) - 15).clamp(min=0)
    c = exp - base
    exc = c <= 0
    c = torch.where(exc, 0, c)
    sm = torch.where(exc, 0, ((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    r, kd = c.shape
    half = block_k // 2
    cc = c.reshape(r, kd // block_k, 2, half)
    codes = (cc[:, :, 0] | (cc[:, :, 1] << 4)).reshape(r, kd // 2).to(torch.uint8)
    return sm, codes, base[:, 0], exc


def kernel_view(w: torch.Tensor, exc: torch.Tensor, base: torch.Tensor, decode: int) -> torch.Tensor:
    """The weights the kernel multiplies: exceptions as zero (DECODE 1) or as 2^(base - 127) (DECODE 2)."""
    fill = (
        torch.zeros_like(w)
        if decode == 1
        else torch.exp2(base.float() - 127).to(w.dtype)[:, None].expand_as(w)
    )
    return torch.where(exc, fill, w)


@triton.jit
def _decode_ops(sm, c, base):
    s = sm.to(tl.uint16)
    bits = ((s & 0x80) << 8) | ((c.to(tl.uint16) + base) << 7) | (s & 0x7F)
    bits = tl.where(c == 0, 0, bits)
    return bits.to(tl.bfloat16, bitcast=True)


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
# 4 weights a call: sign + mantissa bytes spread into 16-bit lanes with the sign replicated (prmt), the code
# nibbles spread likewise and masked, code * 128 + (B0 << 7) per lane (mad), then (s & 0x807F) | e (lop3).
ASM_LOW = tl.constexpr(_ASM.replace("MASK", "0x000F000F").replace("MUL", "128"))
ASM_HIGH = tl.constexpr(_ASM.replace("MASK", "0x00F000F0").replace("MUL", "8"))


@triton.jit
def _decode_asm(sm, cb, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,=r,r,r", [sm, cb], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _weights(w_desc, c_desc, row, k0, base, HALF: tl.constexpr, DECODE: tl.constexpr):
    if DECODE == 0:
        wa = w_desc.load([row, k0])
        wb = w_desc.load([row, k0 + HALF])
    else:
        sa = w_desc.load([row, k0])
        sb = w_desc.load([row, k0 + HALF])
        cb = c_desc.load([row, k0 // 2])
        if DECODE == 1:
            wa = _decode_ops(sa, cb & 15, base)
            wb = _decode_ops(sb, cb >> 4, base)
        else:
            wa = _decode_asm(sa, cb, ASM_LOW)
            wb = _decode_asm(sb, cb, ASM_HIGH)
            if DECODE == 3:
                wa = _unpermute(wa)
                wb = _unpermute(wb)
    return wa, wb


@triton.jit
def _unpermute(w):
    # (r, j, c, h, q) -> (r, c, h, j, q): `permute_cols` undone in registers
    n: tl.constexpr = w.shape[0]
    w = tl.reshape(w, [n, 4, 4, 2, 2])
    w = tl.permute(w, [0, 2, 3, 1, 4])
    return tl.reshape(w, [n, 64])


@triton.jit
def _gate_up_packed(
    x_ptr,
    w_desc,
    c_desc,
    base_ptr,
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
    DECODE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    slot_id = tl.program_id(0)
    col_block = tl.program_id(1)
    e = slot_id // M_SLOTS
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    HALF: tl.constexpr = BLOCK_K // 2
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_gate = e * (2 * INTER) + col_block * BLOCK_N
    rn = tl.arange(0, BLOCK_N)
    base_g = tl.load(base_ptr + row_gate + rn)
    base_u = tl.load(base_ptr + row_gate + INTER + rn)
    bg = base_g.to(tl.uint16)[:, None]
    bu = base_u.to(tl.uint16)[:, None]
    ks = tl.arange(0, HALF)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        rows = tl.load(perm_ptr + pos, mask=row_ok, other=0) // TOP_K
        x_tile = x_ptr + rows[:, None] * stride_xn + ks[None, :]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            xa = tl.load(x_tile + k0, mask=row_ok[:, None], other=0.0)
            xb = tl.load(x_tile + k0 + HALF, mask=row_ok[:, None], other=0.0)
            ga, gb = _weights(w_desc, c_desc, row_gate, k0, bg, HALF, DECODE)
            ua, ub = _weights(w_desc, c_desc, row_gate + INTER, k0, bu, HALF, DECODE)
            acc_g = tl.dot(ga, tl.trans(xa), acc_g)
            acc_g = tl.dot(gb, tl.trans(xb), acc_g)
            acc_u = tl.dot(ua, tl.trans(xa), acc_u)
            acc_u = tl.dot(ub, tl.trans(xb), acc_u)
        if DECODE >= 2:
            acc_g = acc_g * tl.exp2((base_g - B0).to(tl.float32))[:, None]
            acc_u = acc_u * tl.exp2((base_u - B0).to(tl.float32))[:, None]
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
        gate = acc_g.to(tl.bfloat16).to(tl.float32)
        up = acc_u.to(tl.bfloat16).to(tl.float32)
        act = (tm._gelu_tanh(gate).to(tl.bfloat16).to(tl.float32) * up).to(tl.bfloat16)
        dst = act_ptr + pos[:, None] * stride_an + cols[None, :]
        tl.store(dst, act, mask=row_ok[:, None])
        m0 += M_SLOTS * BLOCK_M


def gate_up_packed(
    x, planes, perm, bounds, decode, block_n=64, block_k=128, stages=5, warps=4, m_slots=3, block_m=32
):
    w, codes, base = planes
    act = torch.empty(perm.shape[0], INTER, device=x.device, dtype=x.dtype)
    half = block_k // 2
    w_desc = TensorDescriptor(w, list(w.shape), [w.shape[1], 1], [block_n, half])
    c_desc = TensorDescriptor(codes, list(codes.shape), [codes.shape[1], 1], [block_n, half])
    grid = (E * m_slots, triton.cdiv(INTER, block_n))
    _gate_up_packed[grid](
        x, w_desc, c_desc, base, act, perm, bounds, K, x.stride(0), act.stride(0),
        BLOCK_M=block_m, M_SLOTS=m_slots, BLOCK_N=block_n, BLOCK_K=block_k, H=H, INTER=INTER, DECODE=decode,
        PDL=True, launch_pdl=True, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return act


def main() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    flat = gate_up.reshape(E * 2 * INTER, H)
    sm, codes, base, exc = encode(flat)
    base = base.to(torch.int32).contiguous()
    res: dict = {"exceptions": float(exc.float().mean()), "exc_max_per_64_rows": 0, "alone": {}}
    per_tile = exc.reshape(-1, 64, H).sum((1, 2))
    res["exc_max_per_64_rows"] = int(per_tile.max())
    res["exc_mean_per_64_rows"] = float(per_tile.float().mean())
    print(f"exceptions {res['exceptions']:.2e}; per 64-row tile mean {res['exc_mean_per_64_rows']:.1f} max "
          f"{res['exc_max_per_64_rows']}", flush=True)  # fmt: skip
    # a round trip of the encoding outside the exceptions
    bits = ((sm.to(torch.int32) & 0x80) << 8) | (sm.to(torch.int32) & 0x7F)
    cb = codes.reshape(flat.shape[0], H // 128, 64)
    c_full = torch.stack([cb & 15, cb >> 4], 2).reshape(flat.shape[0], H).to(torch.int32)
    dec = (bits | ((c_full + base[:, None]) << 7)).to(torch.int16).view(torch.bfloat16)
    res["roundtrip_ok"] = bool(torch.equal(torch.where(exc, 0, dec), torch.where(exc, 0, flat)))
    print(f"round trip outside exceptions: {res['roundtrip_ok']}", flush=True)
    sm_p = permute_cols(sm).contiguous()
    codes_p = permute_cols(codes.reshape(-1, 64)).reshape(codes.shape).contiguous()
    kept = tm.CONFIGS[tm.DEFAULT_CONFIG].gate_up
    gb = flat.numel() * 2
    for scen in ("uniform", "skewed"):
        _, ids = routing(scen, None, g)
        perm, bounds = tm.sort_pairs(ids, E)
        us = 1e3 * time_graph(lambda p=perm, b=bounds: tm.gate_up_act(x, gate_up, p, b, K, kept))
        res["alone"][f"{scen}/kept"] = us
        print(f"{scen:8s} kept            {us:7.1f} us  {gb / us / 1e6:.2f} TB/s", flush=True)
        refs = {}
        for decode in (1, 2):
            view = kernel_view(flat, exc, base, decode).reshape(gate_up.shape)
            refs[decode] = tm.gate_up_act(x, view, perm, bounds, K, kept)
        refs[3] = refs[2]
        variants = [(0, 32, 5, 3), (2, 32, 4, 3)] + [(3, bm, st, ms) for bm, st, ms in SWEEP]
        for decode, bm, stages, ms in variants:
            planes = {0: (flat, codes, base), 3: (sm_p, codes_p, base)}.get(decode, (sm, codes, base))
            name = f"d{decode}_m{bm}_s{stages}_slots{ms}"
            if True:
                fn = lambda p=perm, b=bounds, pl=planes, d=decode, s=stages, bm=bm, ms=ms: gate_up_packed(  # noqa: E731
                    x, pl, p, b, d, stages=s, m_slots=ms, block_m=bm
                )
                try:
                    out = fn()
                    ref = refs.get(decode, tm.gate_up_act(x, gate_up, perm, bounds, K, kept))
                    same = bool(torch.equal(out, ref))
                    diff = float((out.float() - ref.float()).abs().max())
                    us = 1e3 * time_graph(fn)
                    res["alone"][f"{scen}/{name}"] = {"us": us, "same": same, "max_diff": diff}
                    rate = gb * (0.75 if decode else 1.0) / us / 1e6  # noqa: F841
                    print(f"{scen:8s} {name:20s} {us:7.1f} us  {rate:.2f} TB/s of its bytes  same {same} "
                          f"(max diff {diff:.3g})", flush=True)  # fmt: skip
                except Exception as ex:  # noqa: BLE001 - report and go on
                    print(f"{scen:8s} {name:20s} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
