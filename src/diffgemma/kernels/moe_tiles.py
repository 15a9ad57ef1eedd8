"""The launch tiles of the Triton expert kernels (`triton_moe`): the named configs, the kept ones, and which one
serves a call (`config_for`). A fixed table, never autotuned at run time: the step is captured in a CUDA graph.
`bench/moe_kernels.py` times the candidates; what each measured: docs/performance.md, "Expert kernels" and
"Quantized weights"."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from diffgemma.quant.weight import QuantWeight


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

# Quantized experts (any config serves them): candidates for `bench/moe_kernels.py --quant`. At a denoise step on
# the H200 the packed data through TMA (scales by plain loads), 64 inputs a step and the transposed product (the
# dequantized weights as wgmma's register operand) measured fastest for int4 and fp8 alike (whole call 0.40 ms
# int4, 0.35 ms fp8, bf16's default 0.48 ms); 128 or 256 inputs a step, 8 warps, 128 weight rows, pointer loads or
# the plain product were slower. int4 is bound by its decode's issue and latency, not by HBM.
_Q = Tiles(block_m=32, block_n=64, block_k=64, num_stages=4, m_slots=2, swap_ab=True, tma=True)
CONFIGS["q_m32_k64_tma"] = MoeConfig(_Q, _Q)
CONFIGS["q_m32_k128_tma"] = MoeConfig(*[dataclasses.replace(_Q, block_k=128, num_stages=3)] * 2)
CONFIGS["q_m32_k64"] = MoeConfig(*[dataclasses.replace(_Q, tma=False)] * 2)
CONFIGS["q_m32_k64_tma_s1"] = MoeConfig(*[dataclasses.replace(_Q, m_slots=1)] * 2)
# A prefill chunk (4,096 rows): bf16's prefill tiles, transposed, measured fastest (int4 2.7 ms, fp8 2.2 ms; bf16 2.1)
CONFIGS["q_prefill_tma"] = MoeConfig(CONFIGS["prefill"].gate_up, CONFIGS["prefill"].down)
CONFIGS["q_prefill"] = MoeConfig(
    dataclasses.replace(CONFIGS["prefill"].gate_up, tma=False),
    dataclasses.replace(CONFIGS["prefill"].down, tma=False),
)
CONFIGS["q_prefill_swap_tma"] = MoeConfig(
    dataclasses.replace(CONFIGS["prefill"].gate_up, swap_ab=True),
    dataclasses.replace(CONFIGS["prefill"].down, swap_ab=True),
)
# The quantized tiles by format: a denoise step's (fp32 activations' too), a prefill chunk's (`config_for`)
QUANT_CONFIG = {"int4": "q_m32_k64_tma", "fp8": "q_m32_k64_tma"}
QUANT_PREFILL_CONFIG = {"int4": "q_prefill_swap_tma", "fp8": "q_prefill_swap_tma"}
# What `bench/moe_kernels.py --quant` times
QUANT_CANDIDATES = [name for name in CONFIGS if name.startswith("q_")]


def few_pairs(n_pairs: int, n_exp: int) -> bool:
    """Whether n_pairs (row, expert) pairs over n_exp experts take the denoise tiles."""
    return n_pairs <= DENOISE_MAX_PAIRS_PER_EXPERT * n_exp


def config_for(
    n_pairs: int, n_exp: int, split3: bool = False, fmt: str | None = None, fp32: bool = False
) -> MoeConfig:
    """The tiles for n_pairs (row, expert) pairs over n_exp experts: DEFAULT_CONFIG for a denoise step's few
    pairs an expert (SPLIT3_CONFIG for fp32 activations), "prefill" for more; for quantized experts (fmt
    "int4", "fp8") QUANT_CONFIG[fmt] and QUANT_PREFILL_CONFIG[fmt], QUANT_CONFIG[fmt] under fp32 activations."""
    if fmt is not None:
        # fp32 activations on the denoise tiles: 0.68 ms int4, 0.56 fp8 at 256 rows, SPLIT3_CONFIG's 0.95 and 0.82
        # (docs/performance.md, "Quantized weights")
        few = few_pairs(n_pairs, n_exp) or fp32
        return CONFIGS[(QUANT_CONFIG if few else QUANT_PREFILL_CONFIG)[fmt]]
    if not few_pairs(n_pairs, n_exp):
        return CONFIGS["prefill"]
    return CONFIGS[SPLIT3_CONFIG if split3 else DEFAULT_CONFIG]


# The Triton kernels' weight formats (their WFMT constexpr): a `QuantWeight` format's code; a plain tensor is None.
WEIGHT_FORMATS = {"int4": 1, "fp8": 2}


def split3(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> bool:
    """fp32 activations on bf16 weights (a short prompt's prefill, seed rule 7), or on a quantized weight (its tile
    rounded to bf16): `triton_moe._mma`'s three-way split."""
    if isinstance(w, QuantWeight):
        if w.fmt not in WEIGHT_FORMATS or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"triton_moe takes int4 or fp8 experts under bf16, fp16 or fp32 activations, got {w.fmt} "
                f"under {x.dtype}"
            )
        return x.dtype == torch.float32
    if x.dtype == w.dtype:
        return False
    if x.dtype == torch.float32 and w.dtype == torch.bfloat16:
        return True
    raise ValueError(
        f"triton_moe takes activations in the weights' dtype or fp32 on bf16, got {x.dtype} on {w.dtype}"
    )


def config_for_weights(
    n_pairs: int, x: torch.Tensor, gate_up: torch.Tensor | QuantWeight, fixed: bool = False
) -> MoeConfig:
    """`config_for` for activations x on these experts (plain or quantized). `fixed` (the batch-invariant mode):
    the tiles of many pairs whatever the pair count, so that a pair's sums run in one tile shape whichever other
    pairs share its expert; fp32 activations keep the denoise tiles, their only ones (the choice is by dtype, not
    by count). On the H100 the prefill tiles took 1.05 ms a layer at 16 canvases' rows, the denoise tiles 2.48;
    at one canvas's 0.62 against 0.53 (docs/performance.md, "Batch-invariant mode")."""
    fmt = gate_up.fmt if isinstance(gate_up, QuantWeight) else None
    fp32 = x.dtype == torch.float32
    if fixed:
        n_pairs = 0 if fp32 else (DENOISE_MAX_PAIRS_PER_EXPERT + 1) * gate_up.shape[0]
    return config_for(n_pairs, gate_up.shape[0], split3(x, gate_up), fmt, fp32)
