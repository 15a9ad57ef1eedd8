"""The SC survivor gather (kernels/triton_sc_embed.py) on the device at the real vocabulary and hidden size:
the gather's rows bit for bit against the torch twin, every row against the cuBLAS GEMM it replaces within one
bf16 rounding, flat rows (all overflow) too, and a CUDA graph's replays equal to eager calls."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels import library
from diffgemma.kernels import torch_ref as ref
from diffgemma.kernels import triton_sc_embed as se
from tests.gpu.conftest import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEV = "cuda"
V, H = 262144, 2816


def rows_with(counts: list[int], g: torch.Generator) -> torch.Tensor:
    """bf16 probabilities [len(counts), V]: row r keeps counts[r] random columns (all V: a flat row), one of
    them the row's top, the rest within e^-10 of it, normalized; zero elsewhere."""
    probs = torch.zeros(len(counts), V, device=DEV)
    for r, k in enumerate(counts):
        cols = torch.randperm(V, device=DEV, generator=g)[:k]
        logp = torch.rand(k, device=DEV, generator=g) * -10.0
        probs[r, cols] = torch.softmax(logp, dim=0)
    return probs.bfloat16()


def within_one_rounding(got: torch.Tensor, probs: torch.Tensor, embed: torch.Tensor) -> None:
    """got equals the fp32-accumulated product up to one bf16 rounding and fp32 summation order: the bound is
    half a bf16 step of the exact value (2^-9 relative) twice over, plus the fp32 sums' error, well under 2^-20
    of the sum of |terms|."""
    exact = probs.float() @ embed.float()
    scale = probs.float().abs() @ embed.float().abs()
    assert bool(((got.float() - exact).abs() <= exact.abs() * 2**-8 + scale * 2**-20).all())


def near_gemm(got: torch.Tensor, probs: torch.Tensor, embed: torch.Tensor) -> None:
    """got against today's cuBLAS GEMM: two roundings apart (2^-7 relative), plus the GEMM's own split-K,
    whose partial sums cuBLAS may round to bf16 (torch's default reduced-precision reduction): 2^-8 of the sum
    of |terms|."""
    gemm = probs @ embed
    scale = probs.float().abs() @ embed.float().abs()
    assert bool(((got.float() - gemm.float()).abs() <= gemm.float().abs() * 2**-7 + scale * 2**-8).all())


@pytest.fixture(scope="module")
def embed() -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(0)
    return (torch.randn(V, H, device=DEV, generator=g) * 0.02).bfloat16()


def test_peaked_rows_gather_as_the_twin_and_the_gemm(embed):
    g = torch.Generator(device=DEV).manual_seed(1)
    counts = [1 + (r * 37) % se.CAP for r in range(250)] + [se.CAP, se.CAP + 1, V, V // 3, 0, 5000]
    probs = rows_with(counts, g)
    got = library.soft_embedding(probs, embed)
    want = ref.soft_embedding_survivors(probs, embed, se.CAP)
    n = (probs != 0).sum(-1)
    gather = n <= se.CAP
    assert int((~gather).sum()) == 4
    assert torch.equal(got[gather], want[gather])
    within_one_rounding(got, probs, embed)
    near_gemm(got, probs, embed)
    assert torch.equal(library.soft_embedding(probs, embed), got)  # deterministic


@pytest.mark.parametrize("n", [256, 4096])
def test_flat_rows_take_the_dense_rows_gemm(embed, n):
    g = torch.Generator(device=DEV).manual_seed(n)
    logits = torch.randn(n, V, device=DEV, generator=g)  # random weights' rows: every token survives e^-10
    probs = torch.softmax(logits, dim=-1).bfloat16()
    got = library.soft_embedding(probs, embed)
    if n == 256:  # three splits of the vocabulary
        within_one_rounding(got, probs, embed)
    # at 4,096 rows one split: 262,144 terms in one tensor-core accumulator, as cuBLAS sums them (bit-equal in
    # bench/sc_embed.py), beyond within_one_rounding's bound on an H100; pinned to the GEMM instead
    near_gemm(got, probs, embed)


def test_graph_replays_equal_eager_calls(embed):
    g = torch.Generator(device=DEV).manual_seed(2)
    peaked = rows_with([1 + (r * 11) % 300 for r in range(256)], g)
    flat = torch.softmax(torch.randn(256, V, device=DEV, generator=g), dim=-1).bfloat16()
    buf = peaked.clone()
    graph, out = capture(lambda: library.soft_embedding(buf, embed))
    for probs in (peaked, flat, peaked):
        buf.copy_(probs)
        graph.replay()
        assert torch.equal(out, library.soft_embedding(probs, embed))
