"""The Triton MoE kernels on quantized experts (int4, fp8; `QuantWeight`) pinned to dequantize-then-matmul at a
denoise step's real shape and at a prefill chunk's, for every quantized candidate config (skipped without CUDA or
triton). The kernels dequantize each weight tile as `formats.decode` does, so against the grouped path on the
weights dequantized to bf16 they differ only in fp32 accumulation order, as the bf16 kernels do."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels import dispatch
from diffgemma.kernels import library as fast
from diffgemma.kernels import torch_ref as ref
from diffgemma.quant.weight import QuantWeight
from tests.conftest import rel
from tests.gpu.conftest import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
tm = pytest.importorskip("diffgemma.kernels.triton_moe", reason="needs triton")
gm = pytest.importorskip("diffgemma.kernels.gluon_moe", reason="needs triton with gluon")
from diffgemma.kernels import moe_shuffle  # noqa: E402

DEV = "cuda"
N, K, E, H, INTER = 256, 8, 128, 2816, 704
PREFILL_N = 4096
FORMATS = ("int4", "fp8")
BF16_CANDIDATES = tm.QUANT_CANDIDATES
PREFILL_CANDIDATES = [c for c in BF16_CANDIDATES if "prefill" in c]
FP32_CANDIDATES = [tm.SPLIT3_CONFIG, tm.QUANT_CONFIG["int4"]]


_QUANTIZED: dict[str, tuple[QuantWeight, QuantWeight]] = {}


def _weights(fmt: str) -> tuple[QuantWeight, QuantWeight]:
    """Random experts quantized on the GPU, once a format (0.4 GB int4, 0.8 GB fp8)."""
    if fmt not in _QUANTIZED:
        g = torch.Generator(device=DEV).manual_seed(0)
        gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
        down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
        _QUANTIZED[fmt] = QuantWeight.quantize(gate_up, fmt), QuantWeight.quantize(down, fmt)
    return _QUANTIZED[fmt]


def _inputs(seed: int, n: int = N, dtype: torch.dtype = torch.bfloat16):
    """x, router weights and ids as the router makes them (softmax, top-k, renormalised)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, H, generator=g, device=DEV, dtype=torch.bfloat16)
    if dtype == torch.float32:
        x = x.float() + 1e-3 * torch.randn(x.shape, generator=g, device=DEV)  # values no bf16 can hold
    w, ids = torch.softmax(torch.randn(n, E, generator=g, device=DEV), dim=-1).topk(K, dim=-1)
    return x.to(dtype), w / w.sum(-1, keepdim=True), ids


def _check_16bit(got: torch.Tensor, x, w, ids, gate_up: QuantWeight, down: QuantWeight) -> None:
    """As tests/gpu/test_triton_moe.py's `_check`, on the weights dequantized to x's dtype: the same roundings
    as the grouped path, so within 2e-3 of it (one-ulp flips where the accumulation order crosses a rounding
    boundary), and as close to the fp32 reference as it is."""
    dq = gate_up.dequantize(x.dtype), down.dequantize(x.dtype)
    grouped = fast.moe_experts_grouped(x, w, ids, *dq)
    want = ref.moe_experts(x.float(), w, ids, dq[0].float(), dq[1].float())
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel(got, grouped) < 2e-3
    assert rel(got, want) < 1e-2
    assert rel(got, want) < 1.25 * rel(grouped, want) + 1e-4


@pytest.mark.parametrize("name", BF16_CANDIDATES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_denoise_matches_dequantized(fmt, name):
    gate_up, down = _weights(fmt)
    x, w, ids = _inputs(1)
    got = tm.moe_experts_triton(x, w, ids, gate_up, down, tm.CONFIGS[name])
    _check_16bit(got, x, w, ids, gate_up, down)


@pytest.mark.parametrize("name", sorted({*PREFILL_CANDIDATES, *(tm.QUANT_CONFIG[f] for f in FORMATS)}))
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_prefill_chunk_matches_dequantized(fmt, name):
    """A 4,096-token prefill chunk (256 pairs an expert) on the prefill tiles and the denoise step's."""
    gate_up, down = _weights(fmt)
    x, w, ids = _inputs(2, n=PREFILL_N)
    got = tm.moe_experts_triton(x, w, ids, gate_up, down, tm.CONFIGS[name])
    _check_16bit(got, x, w, ids, gate_up, down)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_fp16_activations(fmt):
    gate_up, down = _weights(fmt)
    x, w, ids = _inputs(3, dtype=torch.float16)
    _check_16bit(fast.moe_experts(x, w, ids, gate_up, down), x, w, ids, gate_up, down)
    assert "triton_moe" not in dispatch.failed


@pytest.mark.parametrize("n", [N, PREFILL_N])
@pytest.mark.parametrize("name", FP32_CANDIDATES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_fp32_activations_match_the_bf16_tile_reference(fmt, name, n):
    """fp32 activations (a short prompt's prefill): the tile rounded to bf16 and x split into three bf16 parts, so
    fp32-grade products on `decode(fmt, parts, bf16)`: against that reference in fp64, the accumulation only; against
    the fp32 decode, only the bf16 rounding of the weights (2^-9 relative at most, far below the format's error)."""
    gate_up, down = _weights(fmt)
    x, w, ids = _inputs(4, n=n, dtype=torch.float32)
    got = tm.moe_experts_triton(x, w, ids, gate_up, down, tm.CONFIGS[name])
    assert got.dtype == torch.float32
    dq16 = gate_up.dequantize(torch.bfloat16).double(), down.dequantize(torch.bfloat16).double()
    # the tensor cores' fp32 accumulation is coarser than an SGEMM's: 2e-5 measured, as on bf16 experts
    # (tests/gpu/test_triton_moe.py); bf16 activations are off by ~2e-3
    assert rel(got, ref.moe_experts(x.double(), w.double(), ids, *dq16)) < 1e-4
    exact = ref.moe_experts(
        x.double(), w.double(), ids, gate_up.dequantize().double(), down.dequantize().double()
    )
    assert rel(got, exact) < 4e-3


@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatch_takes_triton_for_quantized_experts(fmt):
    """library.moe_experts serves int4 / fp8 experts through the kernels, on the tiles config_for picks."""
    gate_up, down = _weights(fmt)
    for n, want_cfg in ((N, tm.QUANT_CONFIG[fmt]), (PREFILL_N, tm.QUANT_PREFILL_CONFIG[fmt])):
        x, w, ids = _inputs(5, n=n)
        assert fast.triton_moe_for(x, ids.numel(), gate_up) is tm
        assert tm.config_for_weights(ids.numel(), x, gate_up) is tm.CONFIGS[want_cfg]
        got = fast.moe_experts(x, w, ids, gate_up, down)
        assert "triton_moe" not in dispatch.failed and "gluon_moe" not in dispatch.failed
        if fmt == "int4" and n == N:  # a denoise step's int4 experts: gluon_moe on the shuffled copy
            want = gm.moe_experts_gluon(x, w, ids, moe_shuffle.cached(gate_up), moe_shuffle.cached(down))
        else:
            want = tm.moe_experts_triton(x, w, ids, gate_up, down, tm.CONFIGS[want_cfg])
        assert torch.equal(got, want)
    x, w, ids = _inputs(6, dtype=torch.float32)
    assert tm.config_for_weights(ids.numel(), x, gate_up) is tm.CONFIGS[tm.QUANT_CONFIG[fmt]]
    assert fast.triton_moe_for(x, ids.numel(), gate_up) is tm
    x, w, ids = _inputs(
        6, n=PREFILL_N, dtype=torch.float32
    )  # fp32 beyond the denoise tiles: the grouped path
    assert fast.triton_moe_for(x, ids.numel(), gate_up) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_in_cuda_graph(fmt):
    """Captured once, replayed with new routing in the same buffers."""
    gate_up, down = _weights(fmt)
    x, w, ids = (t.clone() for t in _inputs(7))
    graph, out = capture(lambda: fast.moe_experts(x, w, ids, gate_up, down))
    for seed in (8, 9):
        for buf, val in zip((x, w, ids), _inputs(seed), strict=True):
            buf.copy_(val)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(
            out, fast.moe_experts(x, w, ids, gate_up, down)
        )  # int4: gluon_moe, fp8: triton_moe
