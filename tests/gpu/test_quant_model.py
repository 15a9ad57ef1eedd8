"""Quantized weights on the GPU: the fp8 GEMM (`library.linear_fp8`) against dequantize-then-matmul, and packs
loaded on CUDA: which weights stay quantized, the graphed denoise step on them against the same step run eagerly,
and the fast kernels against the reference kernels on the same quantized model (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from diffgemma.config import RuntimeConfig
from diffgemma.kernels import library
from diffgemma.quant.weight import QuantWeight
from diffgemma.runner.runner import ModelRunner
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights import pack
from diffgemma.weights.loader import load_model
from tests.conftest import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEV = "cuda"


@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize("n, k", [(8192, 2816), (2816, 4096), (2816, 2112)])
def test_linear_fp8_matches_dequantize_then_matmul(m, n, k):
    """The fp8 GEMM on the activations quantized per row: against those same fp8 activations and the fp8 weight
    dequantized, multiplied in fp32 (the kernel's only own rounding is its bf16 output: 2^-9 relative)."""
    g = torch.Generator(device=DEV).manual_seed(m + n)
    x = torch.randn(m, k, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=g, device=DEV, dtype=torch.bfloat16) * k**-0.5
    q = QuantWeight.quantize(w, "fp8")
    got = library.linear_fp8(x, q)
    xq, sx = library.quantize_rows_fp8(x)
    want = (xq.float() * sx) @ q.dequantize(torch.float32).T
    assert got.dtype == torch.bfloat16 and rel(got, want) < 4e-3
    # against the bf16 product: what fp8 weights and activations cost (reported by the bench, bounded here)
    assert rel(got, x.float() @ w.float().T) < 0.06


def _pack(tmp_path, profile: str, sets: list[str]):
    src = write_tiny_checkpoint(tmp_path / "src", seed=3, moe_intermediate_size=64)
    return pack.quantize(src, tmp_path / profile, profile, sets, quiet=True)


@pytest.mark.parametrize(
    "profile, sets", [("int4", []), ("fp8", []), ("fp8", ["attn=fp8", "dense=fp8", "sc=fp8"])]
)
def test_a_pack_on_cuda_keeps_its_fast_formats_and_graphs_match_eager(tmp_path, capfd, profile, sets):
    out = _pack(tmp_path, profile, sets)
    model = load_model(out, DEV, torch.bfloat16)
    err = capfd.readouterr().err
    layer = model.layers[1]
    assert isinstance(layer.experts_gate_up, QuantWeight) and layer.experts_gate_up.fmt == profile
    if not sets:  # the SC MLP's q8 has no CUDA kernel: dequantized at load, with one line
        assert not isinstance(model.sc_gate, QuantWeight) and model.sc_gate.dtype == torch.bfloat16
        assert err.count("no CUDA kernel for") == 1 and "q8 (sc)" in err
    else:
        assert isinstance(layer.q_proj, QuantWeight) and isinstance(model.sc_down, QuantWeight)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=g)
    canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g)
    eager = ModelRunner(model, RuntimeConfig(graphs=False))
    kv = eager.new_cache(128)
    eager.prefill(prompt, kv)
    want = eager.denoise(canvas, kv)
    graphed = ModelRunner(model, RuntimeConfig())
    for _ in range(2):  # capture, then replay
        assert rel(graphed.denoise(canvas, kv), want) < 1e-3
    if (
        sets
    ):  # fp8 GEMMs quantize their activations too: test_linear_fp8_matches_dequantize_then_matmul pins them
        return
    # the reference kernels on the same quantized weights (dequantize, then the torch ops): in bf16 the tiny
    # model's top-k flips dominate (as for bf16 weights, tests/gpu/test_kernels.py), so an O(1) error is caught
    reference = ModelRunner(model, RuntimeConfig(kernels="reference"))
    assert rel(reference.denoise(canvas, kv), want) < 0.25
