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
(`CONFIGS`, chosen by `DEFAULT_CONFIG`), never autotuned at run time: the step is captured in a CUDA graph.
`bench/moe_kernels.py` times the candidates. fp32 activations on bf16 weights (a short prompt's prefill, seed rule
7) keep fp32 throughout, with fp32-grade products from three bf16 MMAs (`_mma`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from diffgemma.kernels import pdl
from diffgemma.kernels.dispatch import INTERPRET
from diffgemma.kernels.torch_ref import sum_sorted_pairs


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one kernel: a program owns block_n output columns of one expert and walks its
    segment block_m pairs at a time, block_k of the reduction dimension per step. m_slots programs share an
    expert's column block, taking its M-tiles in turn: they run side by side, so a busy expert's weight
    slice should come from HBM once and mostly from L2 for the others. swap_ab computes the transposed product (weights
    as the MMA's M side, the pairs as its N side), the shape Hopper's wgmma wants. cols_fast puts an expert's
    column blocks on the grid's fast axis: the programs that run together then read neighbouring slices of a few
    experts' weights, not the same slice of every expert."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    m_slots: int = 1
    swap_ab: bool = False
    tma: bool = False
    cols_fast: bool = False


@dataclass(frozen=True)
class MoeConfig:
    gate_up: Tiles
    down: Tiles


# An expert with more pairs than block_m * m_slots walks its weight slice more than once, and with every SM
# streaming its own slice the later walks mostly miss L2. At a denoise step's ~16 pairs per expert
# (binomial, sd ~4) that is ~40% of the experts for 16 x 1 and almost none for 32 x 1 or 16 x 2; padded rows
# cost masked (free) loads and idle MMA lanes only. "base" is the starting design; what each named config
# measured against the others: docs/performance.md, "Expert kernels".
CONFIGS: dict[str, MoeConfig] = {
    "base": MoeConfig(Tiles(), Tiles()),
    "m32": MoeConfig(Tiles(block_m=32, num_stages=3), Tiles(block_m=32)),
    "m16_s2": MoeConfig(Tiles(m_slots=2), Tiles(m_slots=2)),
    "m32_s2": MoeConfig(Tiles(block_m=32, m_slots=2, num_stages=3), Tiles(block_m=32, m_slots=2)),
    "m32_swap": MoeConfig(Tiles(block_m=32, swap_ab=True, num_stages=3), Tiles(block_m=32, swap_ab=True)),
    "m64_swap": MoeConfig(
        Tiles(block_m=64, swap_ab=True, num_stages=3), Tiles(block_m=64, swap_ab=True, num_stages=3)
    ),
    "m32_n32": MoeConfig(Tiles(block_m=32, block_n=32), Tiles(block_m=32, block_n=32)),
    "m32_k64": MoeConfig(Tiles(block_m=32, block_k=64), Tiles(block_m=32, block_k=64)),
    "m32_s2_tma": MoeConfig(
        Tiles(block_m=32, m_slots=2, num_stages=3, tma=True), Tiles(block_m=32, m_slots=2, tma=True)
    ),
    "m32_w8": MoeConfig(
        Tiles(block_m=32, num_warps=8, num_stages=3), Tiles(block_m=32, num_warps=8, num_stages=3)
    ),
    "m32_s2_tma_cf": MoeConfig(
        Tiles(block_m=32, m_slots=2, num_stages=3, tma=True),
        Tiles(block_m=32, m_slots=2, tma=True, cols_fast=True),
    ),
    "m32_s2_tma_swap": MoeConfig(
        Tiles(block_m=32, m_slots=2, num_stages=4, tma=True, swap_ab=True),
        Tiles(block_m=32, m_slots=2, num_stages=3, tma=True, cols_fast=True, swap_ab=True),
    ),
}
# The kept tiles: the transposed product through TMA (wgmma at 32 pairs a tile), down's column blocks on the
# grid's fast axis, gate_up at 5 stages and 3 M-slots (docs/performance.md, "Expert kernels").
CONFIGS["m32_tma_swap_g5s3"] = MoeConfig(
    dataclasses.replace(CONFIGS["m32_s2_tma_swap"].gate_up, num_stages=5, m_slots=3),
    CONFIGS["m32_s2_tma_swap"].down,
)
DEFAULT_CONFIG = "m32_tma_swap_g5s3"
# fp32 activations (a short prompt's prefill, three MMAs a step) take the 4-stage tiles: with x's fp32 tiles five
# stages of gate_up would need 240 KB of shared memory (docs/performance.md, "Expert kernels").
SPLIT3_CONFIG = "m32_s2_tma_swap"
# A prefill chunk routes hundreds of pairs to an expert: large tiles on the plain product, and m_slots 6 so that a
# popular expert's tiles spread over six programs (docs/performance.md, "Prefill and the pairs-per-expert limit").
CONFIGS["prefill"] = MoeConfig(
    Tiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, m_slots=6, tma=True),
    Tiles(
        block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, m_slots=6, tma=True, cols_fast=True
    ),
)
# Pairs per expert up to which DEFAULT_CONFIG serves (a denoise step has ~16); above, "prefill".
DENOISE_MAX_PAIRS_PER_EXPERT = 32

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
def _mma(a, w, acc, SWAP_AB: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT3: tl.constexpr):
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
    else:
        w_gate = gu_ptr + e.to(tl.int64) * stride_ge + cols[:, None] * stride_gr + ks[None, :] * stride_gh
        w_up = w_gate + INTER * stride_gr
    adt = act_ptr.dtype.element_ty  # x's dtype: where the grouped path rounds
    acc_shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:  # not range(start, end, ..): the interpreter cannot index with loaded scalars
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        rows = tl.load(perm_ptr + pos, mask=row_ok, other=0) // TOP_K
        x_tile = x_ptr + rows[:, None] * stride_xn + ks[None, :] * stride_xh
        acc_g = tl.zeros(acc_shape, dtype=tl.float32)
        acc_u = tl.zeros(acc_shape, dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if H % BLOCK_K == 0:
                x_mask = row_ok[:, None]
                w_mask = col_ok[:, None]
            else:
                k_ok = (k0 + ks) < H
                x_mask = row_ok[:, None] & k_ok[None, :]
                w_mask = col_ok[:, None] & k_ok[None, :]
            xs = tl.load(x_tile + k0 * stride_xh, mask=x_mask, other=0.0).to(adt)
            # rows past INTER (a partial column block) read the next rows: their columns are not stored
            if TMA:
                wg = gu_ptr.load([row_gate, k0])
                wu = gu_ptr.load([row_gate + INTER, k0])
            else:
                wg = tl.load(w_gate + k0 * stride_gh, mask=w_mask, other=0.0)
                wu = tl.load(w_up + k0 * stride_gh, mask=w_mask, other=0.0)
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
    else:
        w_tile = dn_ptr + e.to(tl.int64) * stride_de + cols[:, None] * stride_dh + ks[None, :] * stride_di
    acc_shape: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
    m0 = start + (slot_id % M_SLOTS) * BLOCK_M
    while m0 < end:  # not range(start, end, ..): the interpreter cannot index with loaded scalars
        pos = m0 + tl.arange(0, BLOCK_M)
        row_ok = pos < end
        a_tile = act_ptr + pos[:, None] * stride_an + ks[None, :] * stride_ai
        acc = tl.zeros(acc_shape, dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            if INTER % BLOCK_K == 0:
                a_mask = row_ok[:, None]
                w_mask = col_ok[:, None]
            else:
                k_ok = (k0 + ks) < INTER
                a_mask = row_ok[:, None] & k_ok[None, :]
                w_mask = col_ok[:, None] & k_ok[None, :]
            a = tl.load(a_tile + k0 * stride_ai, mask=a_mask, other=0.0)
            if TMA:  # noqa: SIM108 - w_tile exists only without TMA: one branch compiled
                w = dn_ptr.load([row0, k0])
            else:
                w = tl.load(w_tile + k0 * stride_di, mask=w_mask, other=0.0)
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


def _split3(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fp32 activations on bf16 weights (a short prompt's prefill, seed rule 7): `_mma`'s three-way split."""
    if x.dtype == w.dtype:
        return False
    if x.dtype == torch.float32 and w.dtype == torch.bfloat16:
        return True
    raise ValueError(
        f"triton_moe takes activations in the weights' dtype or fp32 on bf16, got {x.dtype} on {w.dtype}"
    )


def _weight_descriptor(w: torch.Tensor, tiles: Tiles) -> TensorDescriptor:
    """A TMA descriptor of expert weights [E, R, K] as one [E * R, K] matrix, tiles of block_n x block_k."""
    e, r, k = w.shape
    if not w.is_contiguous():
        raise ValueError("the TMA expert kernels need contiguous expert weights")
    return TensorDescriptor(w, [e * r, k], [k, 1], [tiles.block_n, tiles.block_k])


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
    gate_up: torch.Tensor,
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
    _gate_up_kernel[grid[::-1] if tiles.cols_fast else grid](
        x,
        _weight_descriptor(gate_up, tiles) if tiles.tma else gate_up,
        act,
        perm,
        bounds,
        top_k,
        *x.stride(),
        *gate_up.stride(),
        *act.stride(),
        **_launch_options(tiles, h, inter, _split3(x, gate_up), x.device),
    )
    return act


def down_sorted(act: torch.Tensor, down: torch.Tensor, bounds: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """Kernel 2: y [N*k, H] (act's dtype, sorted pair order) = act @ down[e].T."""
    n_exp, h, inter = down.shape
    y = torch.empty(act.shape[0], h, device=act.device, dtype=act.dtype)
    grid = (n_exp * tiles.m_slots, triton.cdiv(h, tiles.block_n))
    _down_kernel[grid[::-1] if tiles.cols_fast else grid](
        act,
        _weight_descriptor(down, tiles) if tiles.tma else down,
        bounds,
        y,
        *act.stride(),
        *down.stride(),
        *y.stride(),
        **_launch_options(tiles, h, inter, _split3(act, down), act.device),
    )
    return y


def few_pairs(n_pairs: int, n_exp: int) -> bool:
    """Whether n_pairs (row, expert) pairs over n_exp experts take the denoise tiles."""
    return n_pairs <= DENOISE_MAX_PAIRS_PER_EXPERT * n_exp


def config_for(n_pairs: int, n_exp: int, split3: bool = False) -> MoeConfig:
    """The tiles for n_pairs (row, expert) pairs over n_exp experts: DEFAULT_CONFIG for a denoise step's few
    pairs an expert (SPLIT3_CONFIG for fp32 activations), "prefill" for more."""
    if not few_pairs(n_pairs, n_exp):
        return CONFIGS["prefill"]
    return CONFIGS[SPLIT3_CONFIG if split3 else DEFAULT_CONFIG]


def moe_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """cuda.moe_experts as two Triton kernels. x [N, H]; weights [N, k]; ids [N, k]; gate_up [E, 2I, H];
    down [E, H, I] -> [N, H] in x's dtype. `config` overrides `config_for` (benchmarks)."""
    cfg = config or config_for(ids.numel(), gate_up.shape[0], _split3(x, gate_up))
    k = ids.shape[1]
    perm, bounds = sort_pairs(ids, gate_up.shape[0])
    act = gate_up_act(x, gate_up, perm, bounds, k, cfg.gate_up)
    y = down_sorted(act, down, bounds, cfg.down)
    return sum_sorted_pairs(y, perm, weights).to(x.dtype)
