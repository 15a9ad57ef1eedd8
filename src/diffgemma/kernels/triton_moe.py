"""The MoE expert computation as two Triton kernels, replacing the two grouped GEMMs of
`cuda.moe_experts_grouped` on CUDA for a denoise step and for prefill chunks of up to 512 pairs an expert. A
denoise step routes only ~N*k/E = 16 (row, expert) pairs to each expert while every expert is touched, so the
work is a batched GEMV bound by reading the 1.5 GB of expert weights; the grouped GEMMs read them at about half
the H200's bandwidth. Here each program streams one weight slice once and applies it to the whole (small)
segment of pairs of its expert. A prefill chunk takes larger tiles (`config_for`); there the kernels win by
gathering x and applying gelu*up inside, which the grouped path does in kernels of their own.

Design. The pairs are sorted by expert (stable sort of the flat ids) and the segment bounds found by
`searchsorted`, sync-free. Kernel 1, grid (E * m_slots, cdiv(I, BLOCK_N)): a program of expert e loops over
BLOCK_M-pair tiles of e's segment (none if it is empty; with m_slots > 1 the expert's programs take the tiles
in turn), gathers the x rows inside the kernel, accumulates gate (rows nb*BLOCK_N.. of gate_up[e]) and up
(rows I + nb*BLOCK_N..) in fp32 over H, rounds both to x's dtype as the grouped GEMM's output is, and
stores gelu_tanh(gate) * up (rounded like the eager ops) to `act` [N*k, I] in sorted order. Kernel 2,
grid (E * m_slots, cdiv(H, BLOCK_N)): act @ down[e][cols].T, rounded to x's dtype, stored to `y`
[N*k, H] in sorted order, as the grouped GEMM's output is; the combine (`regions.post_ffn`) weights each row's
k outputs in fp32 and sums them: deterministic (no atomics), and the same rounding sequence as the grouped
path. (Kernel 2 used to weight its outputs and store them in fp32 in (row, j) order: twice the bytes written
and read back.) H and I are compile-time constants (one compile per model shape). Tile sizes come from a fixed table
(`moe_tiles.CONFIGS`, chosen by `DEFAULT_CONFIG`), never autotuned at run time: the step is captured in a CUDA graph.
`bench/moe_kernels.py` times the candidates. fp32 activations on bf16 weights (a short prompt's prefill, seed rule
7) keep fp32 throughout, with fp32-grade products from three bf16 MMAs (`_mma`).

Quantized experts (a `QuantWeight` of fmt "int4" or "fp8", weight-only): the same kernels with the weight format
a constexpr (WFMT). Each weight tile is loaded packed (through TMA where the tiles ask for it and the rows allow,
its scales and zero points by masked loads, int4's a step ahead), dequantized in registers exactly as
`formats.decode` does (int4 under bf16 activations in bf16 pairs by inline PTX, else in fp32), rounded to the
activations' dtype and multiplied as a plain weight is. Under fp32 activations the tile is rounded to
bf16 and takes the three-MMA split of bf16 weights (`_mma`): x to fp32 grade on `decode(fmt, parts, bf16)`, whose
rounding is far below the format's own error, on the tensor cores (IEEE fp32 dots on the CUDA cores measured
6.0 ms a layer at 256 rows: docs/performance.md, "Quantized weights").
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from diffgemma.kernels import pdl
from diffgemma.kernels.dispatch import INTERPRET
from diffgemma.kernels.moe_tiles import (  # noqa: F401 - the tile table, also read as triton_moe.* by benchmarks
    CONFIGS,
    DEFAULT_CONFIG,
    DENOISE_MAX_PAIRS_PER_EXPERT,
    QUANT_CANDIDATES,
    QUANT_CONFIG,
    QUANT_PREFILL_CONFIG,
    SPLIT3_CONFIG,
    WEIGHT_FORMATS,
    MoeConfig,
    Tiles,
    config_for,
    config_for_weights,
    few_pairs,
    split3,
)
from diffgemma.kernels.torch_ref import sum_sorted_pairs
from diffgemma.quant.weight import QuantWeight

# The interpreter multiplies bf16 operands of tl.dot as their raw uint16 bits; under it the operands go to
# the dot as fp32 (exact products, so the interpreter still checks the kernels' indexing and rounding).
_UPCAST_DOT = INTERPRET


@triton.jit
def _gelu_tanh(g):
    # 0.5 * g * (1 + tanh(z)) written as g * sigmoid(2z): the same function without the cancellation at g << 0
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g * tl.sigmoid(2.0 * z)


@triton.jit
def _dot(a, w, acc, SWAP_AB: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc += a [M, K] @ w [N, K].T, acc laid out [N, M] when SWAP_AB."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(w, tl.trans(a), acc) if SWAP_AB else tl.dot(a, tl.trans(w), acc)


@triton.jit
def _mma(
    a,
    w,
    acc,
    SWAP_AB: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SPLIT3: tl.constexpr,
):
    """acc += a @ w.T (`_dot`). SPLIT3: a is fp32 and w bf16; a is cut into three bf16 parts,
    a = hi + mid + lo to within 2^-24 relative (each part holds the next 8 bits of the remainder), and each part
    is multiplied exactly on the tensor cores: fp32-grade products at the price of three 16-bit MMAs, not of
    an fp32 copy of the weights or of CUDA-core fp32 dots."""
    if SPLIT3:
        hi = a.to(tl.bfloat16)
        r = a - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        acc = _dot(lo, w, acc, SWAP_AB, UPCAST_DOT)
        acc = _dot(mid, w, acc, SWAP_AB, UPCAST_DOT)
        acc = _dot(hi, w, acc, SWAP_AB, UPCAST_DOT)
    else:  # one return: code after a constexpr branch's return is still compiled
        acc = _dot(a, w, acc, SWAP_AB, UPCAST_DOT)
    return acc


# The kernels' weight format (WFMT): a plain tensor, or a `QuantWeight` (`formats` has the layouts). Plain is
# None, the value a compile that leaves WFMT out binds (tests/test_triton_ptx.py compiles the plain kernels so)
_PLAIN = tl.constexpr(None)
_INT4 = tl.constexpr(1)
_FP8 = tl.constexpr(2)


# int4 to bf16 in packed registers (4 bytes in, 4 bf16 out a call): bytes b0..b3 spread to two bf16 pairs
# (prmt), a nibble or'd into 128.0's mantissa is 128 + q exactly (lop3), + -(128 + z) is q - z exactly, and one
# rounding of (q - z) * s: two bf16x2 FMAs a pair, no int-to-float conversion. Not under the interpreter.
_ASM = tl.constexpr(not INTERPRET)
_INT4_PAIR = """
    prmt.b32 t, $2, 0, {sel};{shift}
    lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 t, t, one, {nz};
    fma.rn.bf16x2 {out}, t, {s}, mz;"""
_INT4_ASM = (
    "{{ .reg .b32 t, one, mz; mov.b32 one, 0x3F803F80; mov.b32 mz, 0x80008000;"
    + _INT4_PAIR.format(sel="0x5150", out="$0", nz="$3", s="$5", shift="{shift}")
    + _INT4_PAIR.format(sel="0x5352", out="$1", nz="$4", s="$6", shift="{shift}")
    + " }}"
)
_INT4_LO = tl.constexpr(_INT4_ASM.format(shift=""))
_INT4_HI = tl.constexpr(_INT4_ASM.format(shift="\n    shr.u32 t, t, 4;"))


@triton.jit
def _load_packed(
    q_ptr, rows, row_ok, k0, K: tl.constexpr, stride_qr, stride_qk, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
):  # fmt: skip
    """Inputs k0..k0 + BLOCK_K of rows `rows` of one expert's quantized data (masked loads, zeros past K and on
    rows not row_ok): int4's bytes [BLOCK_N, BLOCK_K / 2], fp8's values [BLOCK_N, BLOCK_K]."""
    if WFMT == _INT4:
        kk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        k_ok = kk < K // 2
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
    mask = row_ok[:, None] if K % BLOCK_K == 0 else row_ok[:, None] & k_ok[None, :]
    other = 0 if WFMT == _INT4 else 0.0
    return tl.load(q_ptr + rows[:, None] * stride_qr + kk[None, :] * stride_qk, mask=mask, other=other)


@triton.jit
def _load_groups(
    s_ptr, z_ptr, rows, row_ok, k0, K: tl.constexpr, stride_sr, stride_sg, stride_zr, stride_zg,
    BLOCK_K: tl.constexpr, WFMT: tl.constexpr,
):  # fmt: skip
    """The scales of inputs k0..k0 + BLOCK_K of rows `rows`, and int4's zero points (int32): int4's
    [BLOCK_N, BLOCK_K / 32] each; fp8's one scale a row [BLOCK_N] for every k0 (its zero points: the scales)."""
    if WFMT == _INT4:
        g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        g_mask = row_ok[:, None] if K % BLOCK_K == 0 else row_ok[:, None] & (g < K // 32)[None, :]
        s = tl.load(s_ptr + rows[:, None] * stride_sr + g[None, :] * stride_sg, mask=g_mask, other=0.0)
        zb = tl.load(z_ptr + rows[:, None] * stride_zr + (g // 2)[None, :] * stride_zg, mask=g_mask, other=0)
        z = (zb.to(tl.int32) >> ((g % 2) * 4)[None, :]) & 15
    else:
        s = tl.load(s_ptr + rows * stride_sr, mask=row_ok, other=0.0)
        z = s
    return s, z


@triton.jit
def _dequant(
    raw, s, z, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFMT: tl.constexpr, dtype: tl.constexpr
):
    """A quantized weight tile (`_load_packed`'s, or a TMA load's) with its scales and zero points
    (`_load_groups`'), dequantized as `formats.decode` does and rounded to dtype: [BLOCK_N, BLOCK_K]."""
    if WFMT == _INT4 and _ASM and dtype == tl.bfloat16:  # in bf16 pairs, one rounding (`_INT4_LO`)
        G: tl.constexpr = BLOCK_K // 32
        nz = (z | 0xC300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # -(128 + z), exactly
        nz3 = tl.broadcast_to(nz[:, :, None], (BLOCK_N, G, 16))
        s3 = tl.broadcast_to(s[:, :, None], (BLOCK_N, G, 16))
        raw3 = tl.reshape(raw, (BLOCK_N, G, 16))
        lo = tl.inline_asm_elementwise(_INT4_LO, "=r,=r,r,r,r,r,r", [raw3, nz3, s3], tl.bfloat16, True, 4)
        hi = tl.inline_asm_elementwise(_INT4_HI, "=r,=r,r,r,r,r,r", [raw3, nz3, s3], tl.bfloat16, True, 4)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    elif WFMT == _INT4:
        # raw: input 2j in byte j's low nibble, 2j + 1 in its high one; a scale and a zero nibble per 32 inputs.
        # Nibbles to fp32 by their bits: 0x4B000000 | v is 2^23 + v exactly, and (2^23 + q) - (2^23 + z) is
        # q - z exactly (int-to-float conversions run at a quarter of the fp32 rate)
        pi = raw.to(tl.int32)
        lo = ((pi & 15) | 0x4B000000).to(tl.float32, bitcast=True)
        hi = ((pi >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
        zf = (z | 0x4B000000).to(tl.float32, bitcast=True)
        q = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // 32, 32))
        w = (q - zf[:, :, None]) * s.to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    else:  # fp8 e4m3, one fp32 scale a row
        w = raw.to(tl.float32) * s[:, None]
    return w.to(dtype)


@triton.jit
def _k_mask(row_ok, k0, ks, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows row_ok of inputs k0 + ks, those past K masked off."""
    return row_ok[:, None] if K % BLOCK_K == 0 else row_ok[:, None] & ((k0 + ks) < K)[None, :]


@triton.jit
def _gate_up_kernel(
    x_ptr,
    gu_ptr,
    act_ptr,
    perm_ptr,
    bounds_ptr,
    TOP_K,
    stride_xn,
    stride_xh,
    stride_ge,
    stride_gr,
    stride_gh,
    stride_an,
    stride_ai,
    BLOCK_M: tl.constexpr,
    M_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    SWAP_AB: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SPLIT3: tl.constexpr,
    TMA: tl.constexpr,
    COLS_FAST: tl.constexpr,
    PDL: tl.constexpr,
    # a quantized gate_up (WFMT not _PLAIN): gu_ptr its data, ws_ptr / wz_ptr its scales / zero points
    ws_ptr=None,
    wz_ptr=None,
    stride_se=0,
    stride_sr=0,
    stride_sg=0,
    stride_ze=0,
    stride_zr=0,
    stride_zg=0,
    WFMT: tl.constexpr = _PLAIN,
):
    pdl.start(PDL)
    slot_id = tl.program_id(1) if COLS_FAST else tl.program_id(0)
    col_block = tl.program_id(0) if COLS_FAST else tl.program_id(1)
    e = slot_id // M_SLOTS
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    ks = tl.arange(0, BLOCK_K)
    if TMA:  # gu_ptr: a descriptor of gate_up as [E * 2I, H] (`_weight_descriptor`)
        row_gate = e * (2 * INTER) + col_block * BLOCK_N
    elif WFMT == _PLAIN:
        w_gate = gu_ptr + e.to(tl.int64) * stride_ge + cols[:, None] * stride_gr + ks[None, :] * stride_gh
        w_up = w_gate + INTER * stride_gr
    else:
        q_e = gu_ptr + e.to(tl.int64) * stride_ge
    if WFMT != _PLAIN:  # expert e's scales and zero points (fp8 has none)
        s_e = ws_ptr + e.to(tl.int64) * stride_se
        z_e = wz_ptr + e.to(tl.int64) * stride_ze if WFMT == _INT4 else wz_ptr
    adt = act_ptr.dtype.element_ty  # x's dtype: where the grouped path rounds
    wdt = tl.bfloat16 if SPLIT3 else adt  # a quantized tile's dtype: bf16 under the fp32 split
    acc_shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:  # not range(start, end, ..): the interpreter cannot index with loaded scalars
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        rows = tl.load(perm_ptr + pos, mask=row_ok, other=0) // TOP_K
        x_tile = x_ptr + rows[:, None] * stride_xn + ks[None, :] * stride_xh
        acc_g = tl.zeros(acc_shape, dtype=tl.float32)
        acc_u = tl.zeros(acc_shape, dtype=tl.float32)
        # int4's scales and zero points are loaded a step ahead, their latency behind this step's work (the
        # weights' TMA loads are pipelined by the compiler; x ahead too was slower): docs/performance.md,
        # "Quantized weights"
        if WFMT != _PLAIN:
            sg, zg = _load_groups(
                s_e, z_e, cols, col_ok, 0, H, stride_sr, stride_sg, stride_zr, stride_zg, BLOCK_K, WFMT
            )
            su, zu = _load_groups(
                s_e, z_e, cols + INTER, col_ok, 0, H, stride_sr, stride_sg, stride_zr, stride_zg, BLOCK_K, WFMT
            )  # fmt: skip
        for k0 in range(0, H, BLOCK_K):
            # the next step's inputs (the last re-reads its own)
            k1 = tl.where(k0 + BLOCK_K < H, k0 + BLOCK_K, k0)
            xs = tl.load(x_tile + k0 * stride_xh, mask=_k_mask(row_ok, k0, ks, H, BLOCK_K), other=0.0).to(adt)
            w_mask = _k_mask(col_ok, k0, ks, H, BLOCK_K)
            # rows past INTER (a partial column block) read the next rows: their columns are not stored
            if TMA:  # a quantized weight's packed bytes: int4 holds two inputs a byte
                kq = k0 // 2 if WFMT == _INT4 else k0
                wg = gu_ptr.load([row_gate, kq])
                wu = gu_ptr.load([row_gate + INTER, kq])
            elif WFMT == _PLAIN:
                wg = tl.load(w_gate + k0 * stride_gh, mask=w_mask, other=0.0)
                wu = tl.load(w_up + k0 * stride_gh, mask=w_mask, other=0.0)
            else:
                wg = _load_packed(q_e, cols, col_ok, k0, H, stride_gr, stride_gh, BLOCK_N, BLOCK_K, WFMT)
                wu = _load_packed(
                    q_e, cols + INTER, col_ok, k0, H, stride_gr, stride_gh, BLOCK_N, BLOCK_K, WFMT
                )
            if WFMT == _INT4:  # the next step's groups (fp8's scales are the rows': loaded once)
                sg_next, zg_next = _load_groups(
                    s_e, z_e, cols, col_ok, k1, H, stride_sr, stride_sg, stride_zr, stride_zg, BLOCK_K, WFMT
                )
                su_next, zu_next = _load_groups(
                    s_e, z_e, cols + INTER, col_ok, k1, H, stride_sr, stride_sg, stride_zr, stride_zg, BLOCK_K,
                    WFMT,
                )  # fmt: skip
            if WFMT != _PLAIN:
                wg = _dequant(wg, sg, zg, BLOCK_N, BLOCK_K, WFMT, wdt)
                wu = _dequant(wu, su, zu, BLOCK_N, BLOCK_K, WFMT, wdt)
            if WFMT == _INT4:
                sg, zg, su, zu = sg_next, zg_next, su_next, zu_next
            acc_g = _mma(xs, wg, acc_g, SWAP_AB, UPCAST_DOT, SPLIT3)
            acc_u = _mma(xs, wu, acc_u, SWAP_AB, UPCAST_DOT, SPLIT3)
        if SWAP_AB:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        # round where the grouped path rounds: its GEMM output, the gelu, the product
        gate = acc_g.to(adt).to(tl.float32)
        up = acc_u.to(adt).to(tl.float32)
        act = (_gelu_tanh(gate).to(adt).to(tl.float32) * up).to(adt)
        dst = act_ptr + pos[:, None] * stride_an + cols[None, :] * stride_ai
        tl.store(dst, act, mask=row_ok[:, None] & col_ok[None, :])
        m0 += M_SLOTS * BLOCK_M


@triton.jit
def _down_kernel(
    act_ptr,
    dn_ptr,
    bounds_ptr,
    y_ptr,
    stride_an,
    stride_ai,
    stride_de,
    stride_dh,
    stride_di,
    stride_yn,
    stride_yh,
    BLOCK_M: tl.constexpr,
    M_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    SWAP_AB: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    SPLIT3: tl.constexpr,
    TMA: tl.constexpr,
    COLS_FAST: tl.constexpr,
    PDL: tl.constexpr,
    # a quantized down (WFMT not _PLAIN): dn_ptr its data, ws_ptr / wz_ptr its scales / zero points
    ws_ptr=None,
    wz_ptr=None,
    stride_se=0,
    stride_sr=0,
    stride_sg=0,
    stride_ze=0,
    stride_zr=0,
    stride_zg=0,
    WFMT: tl.constexpr = _PLAIN,
):
    pdl.start(PDL)
    slot_id = tl.program_id(1) if COLS_FAST else tl.program_id(0)
    col_block = tl.program_id(0) if COLS_FAST else tl.program_id(1)
    e = slot_id // M_SLOTS
    start = tl.load(bounds_ptr + e)
    end = tl.load(bounds_ptr + e + 1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    if TMA:  # dn_ptr: a descriptor of down as [E * H, I]; columns past I load as zeros
        row0 = e * H + col_block * BLOCK_N
    elif WFMT == _PLAIN:
        w_tile = dn_ptr + e.to(tl.int64) * stride_de + cols[:, None] * stride_dh + ks[None, :] * stride_di
    else:
        q_e = dn_ptr + e.to(tl.int64) * stride_de
    if WFMT != _PLAIN:  # expert e's scales and zero points (fp8 has none)
        s_e = ws_ptr + e.to(tl.int64) * stride_se
        z_e = wz_ptr + e.to(tl.int64) * stride_ze if WFMT == _INT4 else wz_ptr
    wdt = tl.bfloat16 if SPLIT3 else act_ptr.dtype.element_ty  # a quantized tile's dtype (`_gate_up_kernel`)
    acc_shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:  # not range(start, end, ..): the interpreter cannot index with loaded scalars
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        a_tile = act_ptr + pos[:, None] * stride_an + ks[None, :] * stride_ai
        acc = tl.zeros(acc_shape, dtype=tl.float32)
        if WFMT != _PLAIN:
            s, z = _load_groups(
                s_e, z_e, cols, col_ok, 0, INTER, stride_sr, stride_sg, stride_zr, stride_zg, BLOCK_K, WFMT
            )
        for k0 in range(0, INTER, BLOCK_K):
            k1 = tl.where(k0 + BLOCK_K < INTER, k0 + BLOCK_K, k0)
            a = tl.load(a_tile + k0 * stride_ai, mask=_k_mask(row_ok, k0, ks, INTER, BLOCK_K), other=0.0)
            if TMA:  # a quantized weight's packed bytes: int4 holds two inputs a byte
                w = dn_ptr.load([row0, k0 // 2 if WFMT == _INT4 else k0])
            elif WFMT == _PLAIN:
                w = tl.load(w_tile + k0 * stride_di, mask=_k_mask(col_ok, k0, ks, INTER, BLOCK_K), other=0.0)
            else:
                w = _load_packed(q_e, cols, col_ok, k0, INTER, stride_dh, stride_di, BLOCK_N, BLOCK_K, WFMT)
            if WFMT == _INT4:
                s_next, z_next = _load_groups(
                    s_e,
                    z_e,
                    cols,
                    col_ok,
                    k1,
                    INTER,
                    stride_sr,
                    stride_sg,
                    stride_zr,
                    stride_zg,
                    BLOCK_K,
                    WFMT,
                )
            if WFMT != _PLAIN:
                w = _dequant(w, s, z, BLOCK_N, BLOCK_K, WFMT, wdt)
            if WFMT == _INT4:
                s, z = s_next, z_next
            acc = _mma(a, w, acc, SWAP_AB, UPCAST_DOT, SPLIT3)
        if SWAP_AB:
            acc = tl.trans(acc)
        dst = y_ptr + pos[:, None] * stride_yn + cols[None, :] * stride_yh
        tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        m0 += M_SLOTS * BLOCK_M


def sort_pairs(ids: torch.Tensor, n_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, bounds): perm sorts the flat (row, j) pairs by expert; expert e owns sorted positions
    bounds[e]:bounds[e+1] (int32, E+1 of them). No host sync."""
    sorted_ids, perm = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(n_exp + 1, device=ids.device, dtype=sorted_ids.dtype)
    return perm, torch.searchsorted(sorted_ids, experts, out_int32=True)


def _weight_descriptor(w: torch.Tensor, tiles: Tiles) -> TensorDescriptor:
    """A TMA descriptor of expert weights [E, R, K] as one [E * R, K] matrix, tiles of block_n x block_k."""
    e, r, k = w.shape
    if not w.is_contiguous():
        raise ValueError("the TMA expert kernels need contiguous expert weights")
    return TensorDescriptor(w, [e * r, k], [k, 1], [tiles.block_n, tiles.block_k])


def _quant_args(x: torch.Tensor, w: QuantWeight, tiles: Tiles) -> dict:
    """A quantized weight's scale and zero-point tensors, their strides and its format constants (`_dequant`);
    the data goes where a plain weight does."""
    split3(x, w)
    if w.fmt == "int4" and tiles.block_k % 32:
        raise ValueError(
            f"int4 experts take block_k a multiple of 32 (a scale a 32 inputs), not {tiles.block_k}"
        )
    scale, zero = w.parts["_scale"], w.parts.get("_zero")
    return dict(
        ws_ptr=scale,
        wz_ptr=zero,
        **dict(zip(("stride_se", "stride_sr", "stride_sg"), scale.stride(), strict=True)),
        **dict(
            zip(
                ("stride_ze", "stride_zr", "stride_zg"),
                zero.stride() if zero is not None else (0, 0, 0),
                strict=True,
            )
        ),
        WFMT=WEIGHT_FORMATS[w.fmt],
    )


def _weight_args(x: torch.Tensor, w: torch.Tensor | QuantWeight, tiles: Tiles) -> tuple:
    """(tiles, what the kernel takes as the weight, its strides, the quantized weight's extra arguments). A
    quantized weight's data goes through TMA (its scales through plain loads) where TMA can take it: contiguous,
    rows of a multiple of 16 bytes; else tma is turned off."""
    if not isinstance(w, QuantWeight):
        return tiles, _weight_descriptor(w, tiles) if tiles.tma else w, w.stride(), {}
    data = w.parts[""]
    if tiles.tma and not (data.is_contiguous() and data.shape[-1] * data.element_size() % 16 == 0):
        tiles = dataclasses.replace(tiles, tma=False)
    quant = _quant_args(x, w, tiles)
    if not tiles.tma:
        return tiles, data, data.stride(), quant
    pack = 2 if w.fmt == "int4" else 1  # inputs a stored element
    e, r, kb = data.shape
    desc = TensorDescriptor(data, [e * r, kb], [kb, 1], [tiles.block_n, tiles.block_k // pack])
    return tiles, desc, data.stride(), quant


def _launch_options(tiles: Tiles, h: int, inter: int, split3: bool, device: torch.device) -> dict:
    """The compile-time constants and launch shape both kernels take."""
    pdl_on = pdl.enabled(device)
    return dict(
        BLOCK_M=tiles.block_m,
        M_SLOTS=tiles.m_slots,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        H=h,
        INTER=inter,
        SWAP_AB=tiles.swap_ab,
        UPCAST_DOT=_UPCAST_DOT,
        SPLIT3=split3,
        TMA=tiles.tma,
        COLS_FAST=tiles.cols_fast,
        PDL=pdl_on,
        launch_pdl=pdl_on,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def gate_up_act(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantWeight,
    perm: torch.Tensor,
    bounds: torch.Tensor,
    top_k: int,
    tiles: Tiles,
) -> torch.Tensor:
    """Kernel 1: act [N*k, I] (x's dtype, sorted pair order) = gelu_tanh(gate) * up."""
    n_exp, two_i, h = gate_up.shape
    inter = two_i // 2
    act = torch.empty(perm.shape[0], inter, device=x.device, dtype=x.dtype)
    grid = (n_exp * tiles.m_slots, triton.cdiv(inter, tiles.block_n))
    tiles, w, w_strides, quant = _weight_args(x, gate_up, tiles)
    _gate_up_kernel[grid[::-1] if tiles.cols_fast else grid](
        x,
        w,
        act,
        perm,
        bounds,
        top_k,
        *x.stride(),
        *w_strides,
        *act.stride(),
        **_launch_options(tiles, h, inter, split3(x, gate_up), x.device),
        **quant,
    )
    return act


def down_sorted(
    act: torch.Tensor, down: torch.Tensor | QuantWeight, bounds: torch.Tensor, tiles: Tiles
) -> torch.Tensor:
    """Kernel 2: y [N*k, H] (act's dtype, sorted pair order) = act @ down[e].T."""
    n_exp, h, inter = down.shape
    y = torch.empty(act.shape[0], h, device=act.device, dtype=act.dtype)
    grid = (n_exp * tiles.m_slots, triton.cdiv(h, tiles.block_n))
    tiles, w, w_strides, quant = _weight_args(act, down, tiles)
    _down_kernel[grid[::-1] if tiles.cols_fast else grid](
        act,
        w,
        bounds,
        y,
        *act.stride(),
        *w_strides,
        *y.stride(),
        **_launch_options(tiles, h, inter, split3(act, down), act.device),
        **quant,
    )
    return y


def moe_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor | QuantWeight,
    down: torch.Tensor | QuantWeight,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """cuda.moe_experts as two Triton kernels. x [N, H]; weights [N, k]; ids [N, k]; gate_up [E, 2I, H];
    down [E, H, I], plain or quantized (`QuantWeight`, int4 or fp8) -> [N, H] in x's dtype. `config` overrides
    `config_for` (benchmarks)."""
    cfg = config or config_for_weights(ids.numel(), x, gate_up)
    k = ids.shape[1]
    perm, bounds = sort_pairs(ids, gate_up.shape[0])
    act = gate_up_act(x, gate_up, perm, bounds, k, cfg.gate_up)
    y = down_sorted(act, down, bounds, cfg.down)
    return sum_sorted_pairs(y, perm, weights).to(x.dtype)
