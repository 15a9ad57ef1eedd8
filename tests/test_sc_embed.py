"""The SC soft embedding as a survivor gather (kernels/triton_sc_embed.py): its kernels under Triton's CPU
interpreter against the torch twin (`torch_ref.soft_embedding_survivors`: the gather's rows bit for bit in fp32)
and against the masked GEMM they replace; the twin against that GEMM; and the CPU paths, which keep the GEMM."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels import library
from diffgemma.kernels import torch_ref as ref
from diffgemma.model.steps import FastSteps, Steps
from tests.test_triton_interpret import run_under_interpreter


def sparse_rows(n: int, v: int, cap: int, g: torch.Generator) -> torch.Tensor:
    """probs [n, v] fp32 with rows of every kind the kernels tell apart: a few survivors, none, exactly `cap`,
    `cap` + 1, all of them (flat), and more than `cap` in one column chunk."""
    probs = torch.rand(n, v, generator=g)
    probs[probs < 0.995] = 0
    probs[1] = 0
    probs[2] = torch.rand(v, generator=g) + 0.01
    for row, k in ((3, cap), (4, cap + 1)):
        probs[row] = 0
        cols = torch.randperm(v, generator=g)[:k]
        probs[row, cols] = torch.rand(k, generator=g) + 0.01
    probs[5] = 0
    probs[5, : cap + 8] = torch.rand(cap + 8, generator=g) + 0.01  # all in the first chunk
    return probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart the elements are (same-sign values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _check_sc_embed() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1)."""
    from diffgemma.kernels import triton_sc_embed as se

    g = torch.Generator().manual_seed(0)
    cap = 32
    # (vocab, hidden, tiles, splits): a K tail and ragged H blocks; then every K and N block whole
    cases = ((3000, 40, se.DenseTiles(16, 16, 32, 4, 2), 3), (2048, 48, se.DenseTiles(16, 16, 32, 4, 2), 4))
    for v, h, tiles, splits in cases:
        probs = sparse_rows(11, v, cap, g)
        embed = torch.randn(v, h, generator=g)
        count = (probs != 0).sum(-1)
        gather = count <= cap
        assert gather.any() and (~gather).sum() >= 3
        got = se.soft_embedding(probs, embed, cap=cap, chunks=3, tiles=tiles, splits=splits)
        want = ref.soft_embedding_survivors(probs, embed, cap)
        assert torch.equal(got[gather], want[gather]), "the gather sums as the twin does"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the dense rows: another order
        torch.testing.assert_close(got, probs @ embed, rtol=1e-5, atol=1e-6)
        # bf16: the products exact, the sums in fp32 in another order, one rounding; the interpreter truncates
        # where the GPU rounds to nearest, so one bf16 step from the twin
        p16, e16 = probs.bfloat16(), embed.bfloat16()
        got16 = se.soft_embedding(p16, e16, cap=cap, chunks=3, tiles=tiles, splits=splits)
        want16 = ref.soft_embedding_survivors(p16, e16, cap)
        assert got16.dtype == torch.bfloat16
        assert int(bf16_ulps(got16, want16).max()) <= 1
        torch.testing.assert_close(got16.float(), (p16.float() @ e16.float()), rtol=2**-7, atol=1e-3)

    # the scan: each chunk's nonzero columns in order (several blocks a chunk), the first cap of them, and the
    # plan's overflow rows in ascending order
    probs = sparse_rows(7, 700, 8, g)
    idx, val, cnt = se.survivors(probs, cap=8, chunks=3, block=64)
    chunk_cols = -(-700 // 3)
    for r in range(7):
        for c in range(3):
            cols = probs[r, c * chunk_cols : (c + 1) * chunk_cols].nonzero().flatten() + c * chunk_cols
            assert int(cnt[r, c]) == cols.numel()
            k = min(8, cols.numel())
            assert torch.equal(idx[r, c, :k].long(), cols[:k])
            assert torch.equal(val[r, c, :k], probs[r, cols[:k]])
    total = torch.empty(7, dtype=torch.int32)
    rows = torch.full((7,), -1, dtype=torch.int32)
    n_over = torch.empty(1, dtype=torch.int32)
    se._plan_kernel[(1,)](cnt, total, rows, n_over, 7, CAP=8, CHUNKS=3, CHUNKS_P2=4, BLOCK=4)
    assert torch.equal(total, cnt.sum(1).int())
    over = (total > 8).nonzero().flatten().int()
    assert int(n_over) == over.numel() and torch.equal(rows[: over.numel()], over)


def test_sc_embed_kernels_under_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter("tests.test_sc_embed", "_check_sc_embed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_the_masked_gemm_up_to_summation_order(dtype):
    g = torch.Generator().manual_seed(1)
    probs = sparse_rows(9, 500, 16, g).to(dtype)
    embed = torch.randn(500, 24, generator=g).to(dtype)
    want = probs.float() @ embed.float()
    got = ref.soft_embedding_survivors(probs, embed, 16)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=1e-5)


def test_cpu_steps_keep_the_gemm_bit_for_bit():
    # on CPU (no Triton kernel serves) the reference and the fast steps compute today's GEMM
    g = torch.Generator().manual_seed(2)
    probs = sparse_rows(6, 300, 8, g)
    embed = torch.randn(300, 16, generator=g).bfloat16()
    want = probs.to(torch.bfloat16) @ embed
    assert torch.equal(Steps().soft_embedding(probs, embed), want)
    assert torch.equal(FastSteps(compile=False).soft_embedding(probs, embed), want)
    assert torch.equal(FastSteps(compile=False, sc_gather=True).soft_embedding(probs, embed), want)
    assert torch.equal(library.soft_embedding(probs, embed), want)


def test_exact_soft_embedding_is_unchanged(tiny_a):
    # sc_sparse=False (seed §5's exact path) bypasses the steps: fp32 probabilities times the embedding widened
    # to fp32 a vocabulary chunk at a time, accumulated in fp32, one rounding, on either steps
    from diffgemma.model.model import SC_VOCAB_CHUNK
    from diffgemma.weights.loader import load_model

    model = load_model(tiny_a, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    e = model.embed
    probs = torch.softmax(torch.randn(5, e.shape[0], generator=g) * 3, dim=-1)
    acc = torch.zeros(5, e.shape[1])
    for s in range(0, e.shape[0], SC_VOCAB_CHUNK):
        acc.addmm_(probs[:, s : s + SC_VOCAB_CHUNK], e[s : s + SC_VOCAB_CHUNK].float())
    for steps in (Steps(), FastSteps(compile=False)):
        model.steps = steps
        assert torch.equal(model.soft_embedding(probs, exact=True), acc.to(torch.bfloat16))


def test_sc_gather_is_a_runtime_switch_off_by_default(tiny_a):
    from diffgemma.config import RuntimeConfig, load_runtime_config
    from diffgemma.runner.runner import ModelRunner
    from diffgemma.weights.loader import load_model

    assert RuntimeConfig().sc_gather is False
    assert load_runtime_config({"DIFFGEMMA_SC_GATHER": "1"}).sc_gather is True
    model = load_model(tiny_a, "cpu", torch.bfloat16)
    for on in (False, True):
        ModelRunner(model, RuntimeConfig(kernels="fast", compile=False, sc_gather=on))
        assert model.steps.sc_gather is on
