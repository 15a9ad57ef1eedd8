"""The batch-invariant mode's kernels (`RuntimeConfig.batch_invariant`) under Triton's CPU interpreter: the
fixed-tile GEMM (kernels/triton_gemm.py) gives a row the same bits in batches of 1, 7, 64 and 300 rows whatever
the other rows hold, and torch's product within bf16 rounding; the experts on their pinned tiles, the top-k on
fixed row blocks and the FFN combine give a row the same bits whatever else is routed to its experts. The GPU
side (the whole forward, batched requests against solo ones): tests/gpu/test_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch

from diffgemma.config import load_runtime_config
from tests.test_triton_interpret import run_under_interpreter

pytest.importorskip("triton")


def _scatter_rows(target: torch.Tensor, m: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of m rows (m >= len(target)): target's rows at random places among random others of its scale;
    returns (batch, where each target row went)."""
    others = torch.randn(m, target.shape[1], generator=g).to(target.dtype) * 3
    where = torch.randperm(m, generator=g)[: target.shape[0]]
    others[where] = target
    return others, where


def _check_gemm() -> None:
    """Runs in the subprocess. K a multiple of BLOCK_K and not, N one column tile and several, the narrow and
    (with its threshold lowered) the wide tiles, bf16 and fp16, a strided a and a row-major b."""
    from diffgemma.kernels import triton_gemm as tg

    g = torch.Generator().manual_seed(0)
    for k, n, wide_from, dtype in (
        (128, 80, tg.WIDE_FROM_N, torch.bfloat16),
        (200, 300, tg.WIDE_FROM_N, torch.bfloat16),
        (96, 300, 256, torch.float16),
    ):
        tg.WIDE_FROM_N = wide_from
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
        target = torch.randn(3, k, generator=g).to(dtype)
        want = tg.linear(target, w)
        ref = target.double() @ w.double().t()
        assert want.dtype == dtype and want.shape == (3, n)
        # one rounding of an fp32 sum: within an ulp of the output dtype (the interpreter truncates to bf16
        # where the GPU rounds to nearest); a wrong row, column or K block is off by far more
        tol = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        assert bool(((want.double() - ref).abs() <= ref.abs() * tol + 1e-3).all()), (k, n, dtype)
        for m in (1, 7, 64, 300):
            rows = target[:1] if m == 1 else target
            batch, where = _scatter_rows(rows, m, g)
            wide = torch.empty(m, k + 24, dtype=dtype)  # a strided a: rows of a wider buffer
            wide[:, :k] = batch
            got = tg.linear(wide[:, :k], w)
            assert torch.equal(got[where], want[: rows.shape[0]]), (k, n, m, dtype)
        # b as a row-major [K, N] (the soft embedding's layout): the same sums as its transposed view
        got = tg.matmul(target, w.t().contiguous())
        assert torch.equal(got, want)


def _check_experts() -> None:
    """Runs in the subprocess. Six rows routed alone (where the unpinned choice takes the denoise tiles) and then
    among 250 others steered to their experts: on the pinned (prefill) tiles the routing weights, the expert
    outputs and the combined rows are the same bits."""
    from diffgemma.kernels import moe_tiles
    from diffgemma.kernels import triton_combine as tc
    from diffgemma.kernels import triton_moe as tm
    from diffgemma.kernels import triton_route as tr
    from diffgemma.model.steps import INVARIANT_ROUTE_ROWS

    g = torch.Generator().manual_seed(1)
    e, h, inter, k, eps = 8, 256, 128, 2, 1e-6
    bf = torch.bfloat16
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(bf)
    down = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(bf)
    scale = torch.rand(e, generator=g) + 0.5
    norms = [(torch.rand(h, generator=g) + 0.5).to(bf) for _ in range(3)]
    scalar = torch.tensor([0.7], dtype=bf)

    def layer_rows(x, logits, resid, dense):
        n = x.shape[0]
        cfg = moe_tiles.config_for_weights(n * k, x, gate_up, fixed=True)
        assert cfg is moe_tiles.CONFIGS["prefill"]
        weights, ids, bounds, perm, slot = tr.route_sort(logits, scale, k, rows=INVARIANT_ROUTE_ROWS)
        y = tm.down_sorted(tm.gate_up_act(x, gate_up, perm, bounds, k, cfg.gate_up), down, bounds, cfg.down)
        out, nxt = tc.post_ffn(resid, dense, y, slot, weights, norms[0], norms[1], scalar, norms[2], eps)
        return weights, ids, y[slot.view(n, k)], out, nxt

    n0, n1 = 6, 256
    x = torch.randn(n1, h, generator=g).to(bf)
    resid = torch.randn(n1, h, generator=g).to(bf)
    dense = torch.randn(n1, h, generator=g).to(bf)
    logits = torch.randn(n1, e, generator=g)
    logits[:, :2] += 4.0  # every row prefers experts 0 and 1: the six rows' experts are crowded when batched
    unpinned = moe_tiles.config_for_weights(n0 * k, x, gate_up)
    assert unpinned is moe_tiles.CONFIGS[moe_tiles.DEFAULT_CONFIG]  # what the six rows alone would pick
    fp32 = moe_tiles.config_for_weights(n1 * k, x.float(), gate_up, fixed=True)
    assert fp32 is moe_tiles.CONFIGS[moe_tiles.SPLIT3_CONFIG]  # fp32 activations: by dtype, not by count
    where = torch.randperm(n1, generator=g)[:n0]
    solo = layer_rows(x[where], logits[where], resid[where], dense[where])
    batched = layer_rows(x, logits, resid, dense)
    assert int(solo[1].min()) <= 1  # the rows do use the crowded experts
    for name, a, b in zip(("weights", "ids", "pair outputs", "h", "next input"), solo, batched, strict=True):
        assert torch.equal(a, b[where]), name


@pytest.mark.parametrize("check", ["_check_gemm", "_check_experts"])
def test_batch_invariant_kernels_under_interpreter(check: str):
    run_under_interpreter("tests.test_batch_invariant_interpret", check)


def test_batch_invariant_is_a_runtime_field_with_an_env_override():
    assert load_runtime_config({}).batch_invariant is False
    assert load_runtime_config({"DIFFGEMMA_BATCH_INVARIANT": "1"}).batch_invariant is True
    given = load_runtime_config({"DIFFGEMMA_BATCH_INVARIANT": "1"}, batch_invariant=False)
    assert (
        given.batch_invariant is False
    )  # a field given (serve's --log-dir sets it) wins over the environment
