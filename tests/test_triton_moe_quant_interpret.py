"""The Triton MoE kernels (kernels/triton_moe.py) on quantized experts (int4, fp8; `QuantWeight`) run by Triton's
CPU interpreter at small shapes, against torch_ref on the dequantized weights (`formats.decode`). Skipped without
triton; the check runs in a subprocess with TRITON_INTERPRET=1 (tests/test_triton_interpret.py says why)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.test_triton_interpret import run_under_interpreter  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_moe_quant() -> None:
    """Runs in the subprocess. H = 192 (6 groups of 32) and I = 96 (3 groups: int4's last zero byte holds one
    nibble): partial K blocks at block_k 64 and 128, partial column blocks. Expert 0 gets no pair, expert 1 one
    pair per row (40: several M-tiles, several per slot), experts 2-4 the rest; x is a strided view. fp32 runs
    every quantized candidate on int4 and the picked ones on fp8 (the interpreter's time)."""
    from diffgemma.kernels import library
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_moe as tm
    from diffgemma.quant.weight import QuantWeight

    assert tm._UPCAST_DOT, "the interpreter is not on"
    g = torch.Generator().manual_seed(0)
    n, k, e, h, i = 40, 3, 5, 192, 96
    x = torch.randn(n, h + 8, generator=g)[:, :h]
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    gate_up[2, 5, 32:64] = 0.25  # a constant group: its zero point at the range's end
    others = torch.stack([2 + torch.randperm(3, generator=g)[: k - 1] for _ in range(n)])
    ids = torch.cat([torch.ones(n, 1, dtype=torch.long), others], dim=1)
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=-1)

    T = tm.Tiles
    configs = {
        # gate_up: K = 192 at 128 a step (one partial block); down: 96 at 64
        "partial_k": tm.MoeConfig(T(block_n=64, block_k=128), T(block_n=64, block_k=64)),
        # one group a step; 16-pair tiles, two programs an expert taking them in turn
        "k32_slots": tm.MoeConfig(
            T(block_n=64, block_k=32, m_slots=2), T(block_n=128, block_k=32, m_slots=3)
        ),
        "swap": tm.MoeConfig(T(block_n=32, block_k=64, swap_ab=True), T(block_k=128, swap_ab=True)),
        "cols_fast": tm.MoeConfig(
            T(block_n=32, block_k=64, m_slots=2, cols_fast=True), T(block_n=32, block_k=64, cols_fast=True)
        ),
        # TMA configs run their quantized weights through plain loads
        "bf16_default": tm.CONFIGS[tm.DEFAULT_CONFIG],
        "bf16_prefill": tm.CONFIGS["prefill"],
        **{name: tm.CONFIGS[name] for name in tm.QUANT_CANDIDATES},
        tm.SPLIT3_CONFIG: tm.CONFIGS[tm.SPLIT3_CONFIG],  # the fp32 split on the bf16 weights' tiles
    }
    features = ["partial_k", "k32_slots", "swap", "cols_fast", "bf16_default", "bf16_prefill"]
    for fmt in ("int4", "fp8"):
        qg, qd = QuantWeight.quantize(gate_up, fmt), QuantWeight.quantize(down, fmt)
        dq = qg.dequantize(), qd.dequantize()  # formats.decode in fp32
        picked = [tm.QUANT_CONFIG[fmt], tm.QUANT_PREFILL_CONFIG[fmt], tm.SPLIT3_CONFIG]
        names = features + (tm.QUANT_CANDIDATES if fmt == "int4" else picked)

        # fp32 activations: the tile rounded to bf16, x cut into three bf16 parts (exact products): the reference on
        # decode(fmt, parts, bf16). The interpreter rounds fp32 -> bf16 by truncation where torch rounds to nearest
        # (every weight pulled toward zero by up to an ulp, 2^-8: ~1e-2 of the result, tests/gpu pins the GPU's
        # rounding at 1e-5); a wrong scale or zero is off by the format's whole error or more
        dq16 = qg.dequantize(torch.bfloat16).double(), qd.dequantize(torch.bfloat16).double()
        want = ref.moe_experts(x.double(), weights.double(), ids, *dq16)
        exact = ref.moe_experts(x.double(), weights.double(), ids, dq[0].double(), dq[1].double())
        ran: list[tm.MoeConfig] = []
        for name in names:
            if configs[name] in ran:  # the same tiles under another name (bf16_prefill is q_prefill_tma)
                continue
            ran.append(configs[name])
            got = tm.moe_experts_triton(x, weights, ids, qg, qd, configs[name])
            assert got.dtype == torch.float32 and got.shape == (n, h)
            assert _rel(got, want) < 3e-2, (fmt, name, _rel(got, want))
            assert _rel(got, exact) < 3e-2, (fmt, name, _rel(got, exact))

        # fp16: the tile dequantized in fp32 and rounded to fp16 as decode(fmt, parts, fp16) is, then the same
        # roundings as the grouped path on those weights (it differs in accumulation order only)
        x16 = x.half()
        grouped = library.moe_experts_grouped(
            x16, weights, ids, qg.dequantize(x16.dtype), qd.dequantize(x16.dtype)
        )
        for name in ["partial_k", "swap", "cols_fast", tm.QUANT_CONFIG[fmt], tm.QUANT_PREFILL_CONFIG[fmt]]:
            got = tm.moe_experts_triton(x16, weights, ids, qg, qd, configs[name])
            assert got.dtype == torch.float16
            assert _rel(got, grouped) < 3e-4, (fmt, name, _rel(got, grouped))

        # bf16: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): the plumbing only, as in
        # tests/test_triton_interpret.py (tests/gpu/test_triton_moe_quant.py pins the rounding)
        xb = x.bfloat16()
        grouped = library.moe_experts_grouped(
            xb, weights, ids, qg.dequantize(xb.dtype), qd.dequantize(xb.dtype)
        )
        for name in (tm.QUANT_CONFIG[fmt], tm.QUANT_PREFILL_CONFIG[fmt]):
            got = tm.moe_experts_triton(xb, weights, ids, qg, qd, configs[name])
            assert got.dtype == torch.bfloat16
            assert _rel(got, grouped) < 4e-2, (fmt, name, _rel(got, grouped))

        # the tiles picked for quantized experts
        assert tm.config_for(32 * e, e, fmt=fmt) is tm.CONFIGS[tm.QUANT_CONFIG[fmt]]
        assert tm.config_for(32 * e + 1, e, fmt=fmt) is tm.CONFIGS[tm.QUANT_PREFILL_CONFIG[fmt]]
        assert tm.config_for(32 * e, e, fmt=fmt, fp32=True) is tm.CONFIGS[tm.QUANT_CONFIG[fmt]]
        assert tm.config_for_weights(n * k, x, qg) is tm.CONFIGS[tm.QUANT_CONFIG[fmt]]
        assert tm.config_for_weights(n * k, xb, qg) is tm.CONFIGS[tm.QUANT_CONFIG[fmt]]
    assert tm.config_for_weights(n * k, x.bfloat16(), gate_up.bfloat16()) is tm.CONFIGS[tm.DEFAULT_CONFIG]

    with pytest.raises(ValueError, match="int4 or fp8"):
        tm.moe_experts_triton(x, weights, ids, QuantWeight.quantize(gate_up, "q8"), qd, configs["partial_k"])
    with pytest.raises(ValueError, match="int4 or fp8"):
        tm.moe_experts_triton(x.double(), weights, ids, qg, qd, configs["partial_k"])


def test_triton_moe_quantized_under_interpreter():
    run_under_interpreter("tests.test_triton_moe_quant_interpret", "_check_moe_quant")
