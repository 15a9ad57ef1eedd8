"""int4 and fp8 MoE expert kernels for a denoise step with the weights as wgmma's register A operand (Gluon).

The Triton kernels of `triton_moe` load a quantized tile through TMA into shared memory, decode it in registers,
and the compiler then stores the decoded tile back to shared memory and reads it with `ldmatrix` to make wgmma's
operand: bound by issue and latency, not bytes (docs/performance.md, "Quantized weights"). Here the product is
transposed (swap-AB: an expert's 64 weight rows are wgmma's M side, its <= BLOCK_M pairs the N side) and the
weights are pre-shuffled (`moe_shuffle`) so that one 128-bit load (fp8: two) gives each thread exactly the values
of its A fragment: the packed bytes go from HBM to registers, are decoded there by the inline PTX of
`triton_moe` (int4) or a conversion (fp8), and feed wgmma with no shared-memory trip. Only the activations (B)
go through shared memory, as wgmma requires.

A tile is 64 rows x 64 inputs. Thread t of warp w holds, in wgmma's register order (k0 fastest), rows
16w + q, 16w + q + 8 and inputs 2l, 2l + 1 (+ 8, 16, 32) of it, where t = 4q + l: the layout
`DotOperandLayout(0, NVMMA v3, k_width=2)` has, as a linear layout, registers (k0, n3, k3, k4, k5), lanes
(k1, k2, n0, n1, n2) and warps (n4, n5). The kernel loads the tile as [warp, lane, bytes] and reaches that
layout by reshapes and one permute, which move no data (`convert_layout(..., assert_trivial=True)` checks it
at compile time). Grid and rounding as in `triton_moe`: gate_up stores gelu_tanh(gate) * up in x's dtype in
sorted pair order, down stores its rows in sorted order for `sum_sorted_pairs`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from diffgemma.kernels import moe_shuffle, pdl
from diffgemma.kernels.torch_ref import sum_sorted_pairs
from diffgemma.kernels.triton_moe import sort_pairs

TILE = moe_shuffle.TILE  # rows and inputs of a weight tile
BLOCK_M = 32  # pairs a program multiplies at once (wgmma's N); a denoise step has ~16 an expert
MAX_PAIRS_PER_EXPERT = 32  # beyond, `triton_moe` serves (each further block of pairs re-reads the weights)
# steps ahead that the weights are prefetched into L2 (0: none), by format: fp8 0.435 against 0.466 ms a layer,
# int4 0.354 against 0.348 (H100; docs/performance.md, "Quantized weights")
PREFETCH = {"int4": 0, "fp8": 4}
_INT4 = gl.constexpr(1)
_FP8 = gl.constexpr(2)
FORMATS = {"int4": 1, "fp8": 2}


@gluon.jit
def _gelu_tanh(g):
    # g * sigmoid(2z), as triton_moe's
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g / (1.0 + gl.exp(-2.0 * z))


@gluon.jit
def _prefetch_l2(q_ptr, tile, TILE_BYTES: gl.constexpr):
    """Tile `tile`'s bytes into L2, 16 a thread (no registers held)."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    per16: gl.constexpr = 128 // q_ptr.dtype.element_ty.primitive_bitwidth  # elements in 16 bytes
    ptrs = q_ptr + tile * (TILE_BYTES // 16 * per16) + gl.arange(0, TILE_BYTES // 16, layout=L) * per16
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], gl.int32, False, 1)


@gluon.jit
def _load_int4(q_ptr, s_ptr, z_ptr, tile):
    """Tile `tile`'s packed words [4 warps, 32 lanes, 4] (int32: one 128-bit load a thread), its scales [4, 32, 4]
    (bf16, a thread's two rows x two groups) and zero words [4, 32] (those four zero nibbles)."""
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    t = gl.load(q_ptr + tile * 512 + w[:, None, None] * 128 + lane[None, :, None] * 4 + j[None, None, :])
    quad = lane // 4  # lanes 4q..4q+3 share their scales and zero points
    s = gl.load(s_ptr + tile * 128 + w[:, None, None] * 32 + quad[None, :, None] * 4 + j[None, None, :])
    zw = gl.load(z_ptr + tile * 32 + w[:, None] * 8 + quad[None, :])
    return t, s, zw


# A packed word to eight bf16 values (four bf16x2 pairs, each one wgmma A register): the pair p of nibbles at bits
# 4p and 16 + 4p, or'd into 128.0's mantissa, is (128 + q0, 128 + q1) exactly (lop3); + -(128 + z) is q - z
# exactly, times the scale one rounding (two bf16x2 FMAs). Pairs 0 and 2 are the thread's first row (scale $9,
# zero $11), 1 and 3 its second (+8: $10, $12).
_INT4_WORD = gl.constexpr(
    """{ .reg .b32 t, u, one, mz; mov.b32 one, 0x3F803F80; mov.b32 mz, 0x80008000;
"""
    + "".join(
        f"""    {"mov.b32 u, $8;" if p == 0 else f"shr.u32 u, $8, {4 * p};"}
    lop3.b32 t, u, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 t, t, one, ${11 + p % 2};
    fma.rn.bf16x2 t, t, ${9 + p % 2}, mz;
    mov.b32 {{${2 * p}, ${2 * p + 1}}}, t;
"""
        for p in range(4)
    )
    + "}"
)


@gluon.jit
def _pairs(x, LW5: gl.constexpr):
    """[4, 32, 4] 16-bit values, a thread's (group c, row a) at 2c + a, as bf16x2 words of two equal halves for
    each of its packed words [4, 8, 4, c, j0] (LW5): (row 0, row 1)."""
    v = x.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    v = gl.convert_layout((v | (v << 16)).reshape([4, 8, 4, 2, 2]), LW5, assert_trivial=True)
    r0, r1 = gl.split(v)
    r0 = gl.convert_layout(r0, gl.SliceLayout(4, LW5), assert_trivial=True)
    r1 = gl.convert_layout(r1, gl.SliceLayout(4, LW5), assert_trivial=True)
    return (
        gl.expand_dims(r0, 4).broadcast_to([4, 8, 4, 2, 2]),
        gl.expand_dims(r1, 4).broadcast_to([4, 8, 4, 2, 2]),
    )


@gluon.jit
def _decode_int4(t, s, zw, DOT: gl.constexpr):
    """`_load_int4`'s tile as bf16 in wgmma's A layout DOT [64, 64]: (q - z) * s rounded once, as
    `formats.decode` (`_INT4_WORD`, in the registers wgmma reads)."""
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    # dims (warp, quad, lane % 4, j1, j0): word 2 j1 + j0 of a thread, inputs 32 j1 + 16 j0 + ...
    LW5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, 2], [1, 8, 4, 1, 1], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    z = (zw.to(gl.int32)[:, :, None] >> (4 * j)[None, None, :]) & 15  # group c, row a at nibble 2c + a
    nz0, nz1 = _pairs((z | 0xC300).to(gl.int16), LW5)  # -(128 + z) in bf16, exactly
    s0, s1 = _pairs(s, LW5)
    t = gl.convert_layout(t.reshape([4, 8, 4, 2, 2]), LW5, assert_trivial=True)
    v = gl.inline_asm_elementwise(
        _INT4_WORD, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [t, s0, s1, nz0, nz1], (gl.bfloat16,) * 8, True, 1
    )
    # v[2p + b], pair p = n3 + 2 k3, b the pair's half: row + 8 n3, input + 8 k3 + b. Each join adds the fastest
    # register dimension: (..., k3, n3, b), b fastest, as wgmma's registers (k0, n3, k3, k4, k5)
    w = gl.join(
        gl.join(gl.join(v[0], v[4]), gl.join(v[2], v[6])), gl.join(gl.join(v[1], v[5]), gl.join(v[3], v[7]))
    )
    # (warp, q, l, j1, j0, k3, n3, b) -> row 16 warp + 8 n3 + q, input 32 j1 + 16 j0 + 8 k3 + 2 l + b
    w = gl.permute(w, [0, 6, 1, 3, 4, 5, 2, 7]).reshape([64, 64])
    return gl.convert_layout(w, DOT, assert_trivial=True)


@gluon.jit
def _load_fp8(q_ptr, tile):
    """Tile `tile`'s fp8 values [4 warps, 32 lanes, 32] (two 128-bit loads a thread)."""
    LT: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LT)))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LT)))
    r = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, LT)))
    return gl.load(
        q_ptr + tile * 4096 + w[:, None, None] * 1024 + lane[None, :, None] * 32 + r[None, None, :]
    )


@gluon.jit
def _decode_fp8(t, s_rows, DOT: gl.constexpr):
    """`_load_fp8`'s tile times its rows' fp32 scales s_rows [64] (SliceLayout(1, DOT)), rounded to bf16 once,
    as `formats.decode`, in wgmma's A layout DOT [64, 64]."""
    L8: gl.constexpr = gl.BlockedLayout(
        [1, 1, 1, 2, 2, 2, 2, 2], [1, 8, 4, 1, 1, 1, 1, 1], [4, 1, 1, 1, 1, 1, 1, 1], [7, 6, 5, 4, 3, 2, 1, 0]
    )
    t = gl.convert_layout(t.reshape([4, 8, 4, 2, 2, 2, 2, 2]), L8, assert_trivial=True)
    # (warp, quad, l, r4, r3, r2, r1, r0) -> row 16 warp + 8 r1 + quad, input 32 r4 + 16 r3 + 8 r2 + 2 l + r0
    w = gl.permute(t, [0, 6, 1, 3, 4, 5, 2, 7]).reshape([64, 64])
    w = gl.convert_layout(w, DOT, assert_trivial=True)
    return (w.to(gl.float32) * s_rows[:, None]).to(gl.bfloat16)


@gluon.jit
def _experts_kernel(
    a_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    perm_ptr,
    bounds_ptr,
    TOP_K,
    stride_an,
    stride_on,
    stride_se,
    K: gl.constexpr,
    R: gl.constexpr,
    N_OUT: gl.constexpr,
    GATE_UP: gl.constexpr,
    WFMT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    PREFETCH: gl.constexpr,
    PDL: gl.constexpr,
):
    """One program: expert program_id(0)'s output columns program_id(1) * 64.. (gate_up: of gate and of up).
    a: x [N, K] (gate_up, rows gathered through perm) or act [N*k, K] (down, sorted); out [N*k, N_OUT]."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    OL: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    X_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
    TILE_BYTES: gl.constexpr = 2048 if WFMT == _INT4 else 4096
    KB: gl.constexpr = K // 64
    RB: gl.constexpr = R // 64
    e = gl.program_id(0)
    nb = gl.program_id(1)
    tile_g = (e * RB + nb) * KB  # the first tile of this program's (gate) row block
    tile_u = (e * RB + nb + N_OUT // 64) * KB  # gate_up: the up rows' block
    # the first steps' weights into L2 while the kernel before drains: no kernel writes them, so this may run
    # before PDL's wait (a prefetch returns nothing); everything else waits
    for k0 in gl.static_range(PREFETCH):
        _prefetch_l2(q_ptr, tile_g + k0, TILE_BYTES)
        if GATE_UP:
            _prefetch_l2(q_ptr, tile_u + k0, TILE_BYTES)
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], gl.int32, False, 1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], gl.int32, False, 1)
    start = gl.load(bounds_ptr + e)
    end = gl.load(bounds_ptr + e + 1)
    if WFMT == _FP8:
        n = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, DOT))
        s_g = gl.load(s_ptr + e * stride_se + n)
        s_u = gl.load(s_ptr + e * stride_se + n + N_OUT) if GATE_UP else s_g
    x_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 64], X_SMEM)
    ks = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
    m0 = start
    while m0 < end:
        pos = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        row_ok = pos < end
        rows = gl.load(perm_ptr + pos, mask=row_ok, other=0) // TOP_K if GATE_UP else pos
        a_rows = a_ptr + rows.to(gl.int64)[:, None] * stride_an + ks[None, :]
        mask = row_ok[:, None]
        acc_g = gl.full([64, BLOCK_M], 0.0, gl.float32, MMA)
        acc_u = gl.full([64, BLOCK_M], 0.0, gl.float32, MMA)
        # step kb's loads are issued before step kb - 1's decode and MMAs, their latency behind that work
        xa = gl.load(a_rows, mask=mask, other=0.0)
        if WFMT == _INT4:
            tg, sg, zg = _load_int4(q_ptr, s_ptr, z_ptr, tile_g)
            if GATE_UP:
                tu, su, zu = _load_int4(q_ptr, s_ptr, z_ptr, tile_u)
        else:
            tg = _load_fp8(q_ptr, tile_g)
            if GATE_UP:
                tu = _load_fp8(q_ptr, tile_u)
        for kb in range(KB):
            kn = gl.minimum(kb + 1, KB - 1)  # the last step re-reads its own
            # the weights PREFETCH steps ahead into L2: more bytes in flight than registers hold
            if PREFETCH > 0:
                kp = gl.minimum(kb + PREFETCH, KB - 1)
                _prefetch_l2(q_ptr, tile_g + kp, TILE_BYTES)
                if GATE_UP:
                    _prefetch_l2(q_ptr, tile_u + kp, TILE_BYTES)
            xa_n = gl.load(a_rows + kn * 64, mask=mask, other=0.0)
            x_s.store(xa)
            fence_async_shared()
            if WFMT == _INT4:
                tg_n, sg_n, zg_n = _load_int4(q_ptr, s_ptr, z_ptr, tile_g + kn)
                wg = _decode_int4(tg, sg, zg, DOT)
            else:
                tg_n = _load_fp8(q_ptr, tile_g + kn)
                wg = _decode_fp8(tg, s_g, DOT)
            acc_g = warpgroup_mma(wg, x_s.permute((1, 0)), acc_g, is_async=True)
            if GATE_UP:  # up's tile decodes while gate's MMAs run
                if WFMT == _INT4:
                    tu_n, su_n, zu_n = _load_int4(q_ptr, s_ptr, z_ptr, tile_u + kn)
                    wu = _decode_int4(tu, su, zu, DOT)
                    tu, su, zu = tu_n, su_n, zu_n
                else:
                    tu_n = _load_fp8(q_ptr, tile_u + kn)
                    wu = _decode_fp8(tu, s_u, DOT)
                    tu = tu_n
                acc_u = warpgroup_mma(wu, x_s.permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
            else:
                acc_g = warpgroup_mma_wait(0, deps=[acc_g])
            if WFMT == _INT4:
                tg, sg, zg = tg_n, sg_n, zg_n
            else:
                tg = tg_n
            xa = xa_n
        # round where the grouped path rounds: its GEMM output, the gelu, the product
        odt = out_ptr.dtype.element_ty
        if GATE_UP:
            gate = acc_g.to(odt).to(gl.float32)
            up = acc_u.to(odt).to(gl.float32)
            res = (_gelu_tanh(gate).to(odt).to(gl.float32) * up).to(odt)
        else:
            res = acc_g.to(odt)
        res = gl.convert_layout(res, OL)  # [64 columns, BLOCK_M pairs], a thread's columns contiguous
        cols = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, OL))
        opos = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OL))
        dst = out_ptr + opos.to(gl.int64)[None, :] * stride_on + cols[:, None]
        gl.store(dst, res, mask=(opos < end)[None, :])
        m0 += BLOCK_M


def _launch(
    a, w: moe_shuffle.Shuffled, out, perm, bounds, top_k: int, gate_up: bool, prefetch: int | None = None
) -> None:
    n_exp, r, k = w.shape
    n_out = r // 2 if gate_up else r
    scale = w.scale
    pdl_on = pdl.enabled(a.device)
    _experts_kernel[(n_exp, n_out // TILE)](
        a,
        w.data.view(torch.int32) if w.fmt == "int4" else w.data,
        scale,
        w.zero if w.zero is not None else scale,
        out,
        perm,
        bounds,
        top_k,
        a.stride(0),
        out.stride(0),
        scale.stride(0),
        K=k,
        R=r,
        N_OUT=n_out,
        GATE_UP=gate_up,
        WFMT=FORMATS[w.fmt],
        BLOCK_M=BLOCK_M,
        PREFETCH=PREFETCH[w.fmt] if prefetch is None else prefetch,
        PDL=pdl_on,
        launch_pdl=pdl_on,
        num_warps=4,
    )


def experts_sorted(
    x: torch.Tensor,
    gate_up: moe_shuffle.Shuffled,
    down: moe_shuffle.Shuffled,
    perm: torch.Tensor,
    bounds: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """The two kernels on routed pairs already sorted by expert (`sort_pairs`' perm and bounds): y [N*k, H] in
    sorted pair order, what `triton_moe.down_sorted` returns, for `sum_sorted_pairs` or the step's combine."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"gluon_moe takes bf16 activations, got {x.dtype}")
    h = gate_up.shape[2]
    act = torch.empty(perm.shape[0], gate_up.shape[1] // 2, device=x.device, dtype=x.dtype)
    _launch(x, gate_up, act, perm, bounds, top_k, True)
    y = torch.empty(perm.shape[0], h, device=x.device, dtype=x.dtype)
    _launch(act, down, y, perm, bounds, 1, False)
    return y


def moe_experts_gluon(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: moe_shuffle.Shuffled,
    down: moe_shuffle.Shuffled,
) -> torch.Tensor:
    """`triton_moe.moe_experts_triton` on pre-shuffled int4 / fp8 experts (`moe_shuffle.shuffle`): x [N, H] bf16;
    weights, ids [N, k]; gate_up [E, 2I, H]; down [E, H, I] -> [N, H] bf16."""
    perm, bounds = sort_pairs(ids, gate_up.shape[0])
    y = experts_sorted(x, gate_up, down, perm, bounds, ids.shape[1])
    return sum_sorted_pairs(y, perm, weights).to(x.dtype)
