"""The register-operand expert kernels (`gluon_moe`) on pre-shuffled int4 / fp8 experts pinned to
dequantize-then-matmul at a denoise step's real shape (skipped without CUDA or triton): they decode each tile as
`formats.decode` does, so against the grouped path on the dequantized weights they differ only in fp32
accumulation order, as the Triton kernels do (tests/gpu/test_triton_moe_quant.py)."""

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
gm = pytest.importorskip("diffgemma.kernels.gluon_moe", reason="needs triton with gluon")
from diffgemma.kernels import moe_shuffle  # noqa: E402
from diffgemma.kernels import triton_moe as tm  # noqa: E402

DEV = "cuda"
N, K, E, H, INTER = 256, 8, 128, 2816, 704
_WEIGHTS: dict[str, tuple] = {}


def _weights(fmt: str):
    """Random experts quantized on the GPU and shuffled, once a format: (gate_up, down, their shuffles)."""
    if fmt not in _WEIGHTS:
        g = torch.Generator(device=DEV).manual_seed(0)
        gate_up = torch.randn(E, 2 * INTER, H, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
        down = torch.randn(E, H, INTER, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02
        qg, qd = QuantWeight.quantize(gate_up, fmt), QuantWeight.quantize(down, fmt)
        _WEIGHTS[fmt] = qg, qd, moe_shuffle.shuffle(qg), moe_shuffle.shuffle(qd)
    return _WEIGHTS[fmt]


def _inputs(seed: int, skew: float = 0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(N, H, generator=g, device=DEV, dtype=torch.bfloat16)
    logits = torch.randn(N, E, generator=g, device=DEV) + skew * torch.randn(E, generator=g, device=DEV)
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_shuffle_on_the_gpu_holds_the_weights(fmt):
    qg, qd, sg, sd = _weights(fmt)
    assert torch.equal(moe_shuffle.unshuffle(sg), qg.dequantize())
    assert torch.equal(moe_shuffle.unshuffle(sd), qd.dequantize())


@pytest.mark.parametrize("skew", [0.0, 1.5])
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_gluon_experts_match_dequantize_then_matmul(fmt, skew):
    """Uniform routing (~16 pairs an expert) and skewed (experts beyond 32 pairs walk their weights twice)."""
    qg, qd, sg, sd = _weights(fmt)
    x, w, ids = _inputs(1, skew)
    if skew:
        assert torch.bincount(ids.reshape(-1), minlength=E).max() > gm.BLOCK_M
    got = gm.moe_experts_gluon(x, w, ids, sg, sd)
    dq = qg.dequantize(x.dtype), qd.dequantize(x.dtype)
    grouped = fast.moe_experts_grouped(x, w, ids, *dq)
    want = ref.moe_experts(x.float(), w, ids, dq[0].float(), dq[1].float())
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel(got, grouped) < 2e-3
    assert rel(got, want) < 1.25 * rel(grouped, want) + 1e-4
    # the same roundings as the Triton kernels on the packed layout: only the accumulation order differs
    assert rel(got, tm.moe_experts_triton(x, w, ids, qg, qd)) < 2e-3


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_gluon_experts_in_cuda_graph(fmt):
    """Captured once, replayed with new routing in the same buffers."""
    _, _, sg, sd = _weights(fmt)
    x, w, ids = (t.clone() for t in _inputs(2))
    graph, out = capture(lambda: gm.moe_experts_gluon(x, w, ids, sg, sd))
    for seed in (3, 4):
        for buf, val in zip((x, w, ids), _inputs(seed), strict=True):
            buf.copy_(val)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gm.moe_experts_gluon(x, w, ids, sg, sd))


def test_dispatch_takes_gluon_for_int4_denoise_steps():
    """library.moe_experts: int4 experts at a denoise step on gluon_moe (the shuffled copy made once, kept on the
    weight); more pairs than its limit, or fp8, on triton_moe."""
    qg, qd, _, _ = _weights("int4")
    x, w, ids = _inputs(6)
    got = fast.moe_experts(x, w, ids, qg, qd)
    assert "gluon_moe" not in dispatch.failed
    sg, sd = moe_shuffle.cached(qg), moe_shuffle.cached(qd)
    assert moe_shuffle.cached(qg) is sg
    assert torch.equal(got, gm.moe_experts_gluon(x, w, ids, sg, sd))
    g = torch.Generator(device=DEV).manual_seed(7)
    xl = torch.randn(4096, H, generator=g, device=DEV, dtype=torch.bfloat16)
    wl, idsl = torch.softmax(torch.randn(4096, E, generator=g, device=DEV), -1).topk(K, dim=-1)
    assert torch.equal(fast.moe_experts(xl, wl, idsl, qg, qd), tm.moe_experts_triton(xl, wl, idsl, qg, qd))


def test_the_step_takes_gluon_for_int4_experts():
    """`FastSteps.experts` at a denoise step's real shape: an int4 layer's sorted pairs go through gluon_moe's
    kernels (the same bits as calling them), and the result is dequantize-then-matmul's up to summation order."""
    from types import SimpleNamespace

    from diffgemma.model.passes import DENOISE, Pass
    from diffgemma.model.steps import FastSteps, Routing

    qg, qd, _, _ = _weights("int4")
    x, w, ids = _inputs(8)
    bounds, perm, slot = ref.sort_pairs(ids, E)
    routing = Routing(w, ids, bounds, perm, slot)
    p = Pass(DENOISE, [], N, torch.arange(N, device=DEV), [0])
    got = FastSteps(compile=False).experts(
        x, routing, SimpleNamespace(experts_gate_up=qg, experts_down=qd), p
    )
    assert "gluon_moe" not in dispatch.failed
    sg, sd = moe_shuffle.cached(qg), moe_shuffle.cached(qd)
    assert torch.equal(got, gm.experts_sorted(x, sg, sd, perm, bounds, K))
    # dequantize-then-matmul in x's dtype (act rounded to bf16 between the two GEMMs, as the kernels do)
    want = ref.experts_sorted(x, perm, bounds, K, qg.dequantize(x.dtype), qd.dequantize(x.dtype))
    assert rel(got, want) < 2e-3
