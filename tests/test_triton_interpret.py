"""The Triton kernels run by Triton's CPU interpreter at small shapes: the MoE kernels (kernels/triton_moe.py)
against torch_ref in fp32 and the grouped-GEMM path in bf16, the row softmax (kernels/triton_softmax.py)
against torch.softmax. Skipped without triton.

The interpreter has to be on before triton wraps any kernel in the process, so the check runs in a
subprocess with TRITON_INTERPRET=1: nothing leaks into this pytest process or its other tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check_moe() -> None:
    """Runs in the subprocess. Expert 0 gets no pair, expert 1 one pair per row (40: several M-tiles and,
    with m_slots=2, several per slot), experts 2-5 the rest; x is a strided view."""
    from diffgemma.kernels import cuda
    from diffgemma.kernels import torch_ref as ref
    from diffgemma.kernels import triton_moe as tm

    assert tm._UPCAST_DOT, "the interpreter is not on"
    g = torch.Generator().manual_seed(0)
    n, k, e, h, i = 40, 3, 6, 64, 32
    x = torch.randn(n, h + 8, generator=g)[:, :h]
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    others = torch.stack([2 + torch.randperm(4, generator=g)[: k - 1] for _ in range(n)])
    ids = torch.cat([torch.ones(n, 1, dtype=torch.long), others], dim=1)
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=-1)

    configs = {
        "default": tm.CONFIGS[tm.DEFAULT_CONFIG],  # block_k 128 > H: the masked-K path
        "even_k_slots": tm.MoeConfig(
            tm.Tiles(block_n=16, block_k=32, m_slots=2), tm.Tiles(block_n=16, block_k=16, m_slots=2)
        ),
        "swap": tm.MoeConfig(tm.Tiles(block_n=16, swap_ab=True), tm.Tiles(block_k=16, swap_ab=True)),
    }
    want = ref.moe_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    for name, cfg in configs.items():
        got = tm.moe_experts_triton(x, weights, ids, gate_up, down, cfg)
        assert got.dtype == torch.float32 and got.shape == (n, h)
        assert _rel(got, want) < 1e-5, (name, _rel(got, want))

    # bf16: the interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest), which biases
    # every rounding toward zero (rel 1.7e-2 here); this pins the bf16 plumbing (a wrong row, column or
    # weight gives rel ~1), not the rounding, which tests/gpu/test_triton_moe.py pins
    bf = [t.bfloat16() for t in (x, gate_up, down)]
    grouped = cuda.moe_experts_grouped(bf[0], weights, ids, bf[1], bf[2])
    for name, cfg in configs.items():
        got = tm.moe_experts_triton(bf[0], weights, ids, bf[1], bf[2], cfg)
        assert got.dtype == torch.bfloat16
        assert _rel(got, grouped) < 4e-2, (name, _rel(got, grouped))


def _check_softmax() -> None:
    """Rows longer than one block and not a multiple of it, a wide range of scores, fp32 and bf16 out."""
    from diffgemma.kernels import triton_softmax as ts

    g = torch.Generator().manual_seed(0)
    for n_cols in (1, 700, ts.BLOCK, 2 * ts.BLOCK + 5):
        x = torch.randn(3, 2, n_cols, generator=g) * 8
        want = torch.softmax(x.double(), dim=-1)
        got = ts.softmax_rows(x, torch.float32)
        assert got.shape == x.shape and float((got.double() - want).abs().max()) < 1e-6, n_cols
        # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): within one bf16 ulp
        got_bf = ts.softmax_rows(x, torch.bfloat16).double()
        assert got_bf.shape == x.shape and bool(((got_bf - want).abs() <= want * 2**-7 + 1e-30).all()), n_cols
    # causal (base, period): row r keeps its first base + r % period columns (capped at the row), zeros after;
    # the causal blocks of a full-layer prefill chunk, limits on both sides of a block boundary
    for n_cols, base, period in ((700, 5, 3), (2 * ts.BLOCK + 5, ts.BLOCK - 1, 4), (40, 38, 5)):
        x = torch.randn(2, 2 * period, n_cols, generator=g) * 8
        r = torch.arange(2 * period)[:, None] % period
        keep = torch.arange(n_cols)[None, :] < base + r
        want = torch.softmax(x.double().masked_fill(~keep, float("-inf")), dim=-1)
        got = ts.softmax_rows(x, torch.float32, (base, period))
        assert float((got.double() - want).abs().max()) < 1e-6, (n_cols, base, period)
        assert bool((got.masked_select(~keep.expand_as(got)) == 0).all())  # exact zeros past the limit
    with pytest.raises(ValueError, match="fp32 rows"):
        ts.softmax_rows(torch.zeros(2, 4, dtype=torch.float64), torch.float32)


@pytest.mark.parametrize("check", ["_check_moe", "_check_softmax"])
def test_triton_kernels_under_interpreter(check: str):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from tests.test_triton_interpret import {check}; {check}()"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
