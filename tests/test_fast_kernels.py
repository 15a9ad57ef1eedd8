"""The fast kernels (`model.steps.FastSteps`: library kernels, the regions, K/V written to the cache's slots,
the geometry read on the device) pinned to the reference kernels on CPU in fp32, through every prefill route of
the runner, ring wraps and rewinds; the regions compiled for the CPU; the library's attention ops."""

from __future__ import annotations

import pytest
import torch

from diffgemma.config import RuntimeConfig
from diffgemma.kernels import library as fast
from diffgemma.kernels import regions
from diffgemma.kernels import torch_ref as ref
from diffgemma.model.steps import FastSteps, Steps
from diffgemma.runner.runner import ModelRunner
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights.loader import load_model, load_weights
from tests.conftest import rel


@pytest.mark.parametrize("past", [0, 37])
@pytest.mark.parametrize("block", [None, 7, 16, 64])
def test_attention_causal_scores_matches_reference(past, block):
    g = torch.Generator().manual_seed(past)
    h, hkv, t, d = 8, 2, 50, 16
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, past + t, d, generator=g)
    v = torch.randn(1, hkv, past + t, d, generator=g)
    qpos, kpos = torch.arange(past, past + t), torch.arange(past + t)
    want = ref.rows(ref.attention(q, k, v, kpos[None] <= qpos[:, None]))
    got = fast.attention_causal_scores(q, k, v, block=block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 all through: rounding only
    # the two-kernel path of attention_causal_past (CPU, or d <= 256), merged by log-sum-exp
    torch.testing.assert_close(fast.attention_causal_past(q, k, v), want, rtol=1e-5, atol=1e-5)
    # bf16: P rounded to bf16 before P @ V, as flash kernels do; ~3 significant digits
    got16 = fast.attention_causal_scores(q.bfloat16(), k.bfloat16(), v.bfloat16(), block=block)
    assert got16.dtype == torch.bfloat16
    assert float((got16.float() - want).norm() / want.norm()) < 1e-2


def _kv_state(kv) -> list[torch.Tensor]:
    return [t for i in range(kv.cfg.num_layers) for t in kv.read(i)[:2]]


def runner(model, kernels: str, **options) -> ModelRunner:
    """A runner on the CPU: no graphs, and the fast kernels' regions eager unless asked to compile."""
    return ModelRunner(
        model, RuntimeConfig(kernels=kernels, compile=options.pop("compile", False), **options)
    )


# fp32 on CPU: the two kernel sets compute the same products and sums; only the merged GEMMs (wider outputs), the
# attention kernels and the keys' order in the cache may add them in another order, ~1e-7 relative per op, which
# five layers keep well under 1e-5. A flipped top-k expert or a wrong key shows as ~1e-2 or more.
TOL = 1e-5


@pytest.fixture(autouse=True)
def _reference_experts_unpadded(monkeypatch):
    """The reference pads an expert's GEMM to 4 rows (`torch_ref.EXPERT_MIN_ROWS`: a row's result then does not
    depend on its batch); the CPU's grouped GEMMs do not, and a GEMM of 1-2 rows sums in another order (3e-5 here
    after five layers). Unpadded, the two differ only where the fast kernels' own logic does."""
    monkeypatch.setattr(ref, "EXPERT_MIN_ROWS", 1)


def _denoise(run: ModelRunner, canvas, kv) -> list[torch.Tensor]:
    """Logits without self-conditioning, with the seed, and with SC probs (all three decoder inputs)."""
    plain = run.denoise(canvas, kv)
    sc = torch.softmax(plain[0] / 0.7, -1)
    return [plain, run.denoise(canvas, kv, sc_seed=True), run.denoise(canvas, kv, sc_probs=sc)]


def _on(run: ModelRunner) -> ModelRunner:
    """`run`, its kernels on its model again (two runners share one model here)."""
    run.model.steps = FastSteps(compile=False) if run.fast else Steps()
    return run


@torch.no_grad()
def test_fast_denoise_matches_reference_across_ring_wraps_and_rewinds(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    ref_run, fast_run = runner(model, "reference"), runner(model, "fast")
    kv = model.new_cache(256, ring_size=12)  # window 8, canvas 16: the rings wrap every 28 positions
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g)
    for t in (5, 20, 9, 31, 3, 14):
        _on(ref_run).prefill(torch.randint(3, 1000, (t,), generator=g), kv)
        fp = kv.fingerprint()
        want = _denoise(ref_run, canvas, kv)
        for a, b in zip(_denoise(_on(fast_run), canvas, kv), want, strict=True):
            assert rel(a, b) < TOL, kv.length
        assert kv.fingerprint() == fp  # the canvases' K/V went to free slots only
        if kv.can_truncate(kv.length - 4):  # rewind: the fast kernels read the rewound window
            kv.truncate(kv.length - 4)
            got, want = _denoise(fast_run, canvas, kv)[0], _denoise(_on(ref_run), canvas, kv)[0]
            assert rel(got, want) < TOL, kv.length


@torch.no_grad()
def test_merged_weights_are_the_parameters_and_follow_a_reload(tiny_a, tmp_path):
    model = load_model(tiny_a, "cpu", torch.float32)
    ref_run, fast_run = runner(model, "reference"), runner(model, "fast")
    kv = model.new_cache(64)
    g = torch.Generator().manual_seed(2)
    _on(ref_run).prefill(torch.randint(3, 1000, (20,), generator=g), kv)
    canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g)
    ref_before = _denoise(ref_run, canvas, kv)[0]
    _denoise(_on(fast_run), canvas, kv)
    for layer in model.layers:
        qkv = layer.merged(*layer.qkv_names)
        gate_up = layer.merged("mlp_gate", "mlp_up")
        assert qkv.shape[0] == sum(getattr(layer, n).shape[0] for n in layer.qkv_names)
        # the parameters are views into the merged weights: no second copy, and in-place writes reach them
        assert layer.q_proj.data_ptr() == qkv.data_ptr() and layer.mlp_gate.data_ptr() == gate_up.data_ptr()
        assert torch.equal(qkv[-layer.k_proj.shape[0] :], getattr(layer, layer.qkv_names[-1]))
        assert torch.equal(gate_up[layer.mlp_gate.shape[0] :], layer.mlp_up)
    assert torch.equal(_denoise(_on(ref_run), canvas, kv)[0], ref_before)  # same values, same reference

    # a checkpoint loaded into the model (the loader sets new parameters) replaces the merged weights
    other = write_tiny_checkpoint(tmp_path / "other", seed=7)
    load_weights(model, other, "cpu", torch.float32)
    fresh = runner(load_model(other, "cpu", torch.float32), "reference")
    kv_new, kv_fresh = model.new_cache(64), fresh.new_cache(64)
    ids = torch.randint(3, 1000, (20,), generator=g)
    _on(ref_run).prefill(ids, kv_new)
    fresh.prefill(ids, kv_fresh)
    got = _denoise(_on(fast_run), canvas, kv_new)[0]
    assert rel(got, _denoise(fresh, canvas, kv_fresh)[0]) < TOL
    layer = model.layers[0]
    assert torch.equal(
        layer.merged("mlp_gate", "mlp_up")[: layer.mlp_gate.shape[0]], fresh.model.layers[0].mlp_gate
    )
    layer.v_proj.neg_()  # an in-place update of a parameter (an optimizer step) reaches the fast kernels
    assert torch.equal(layer.merged(*layer.qkv_names)[-layer.v_proj.shape[0] :], layer.v_proj)
    assert rel(_denoise(fast_run, canvas, kv_new)[0], got) > TOL


@torch.no_grad()
@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_every_fast_prefill_route_matches_reference(name, request):
    # The fast runner's routes (a padded prefill into an empty cache, a commit on the canvas slots for up to a
    # canvas after a cache, chunks of `prefill_chunk` otherwise) against the reference runner's aligned chunks,
    # fp32: the K/V every layer keeps through ring wraps and rewinds, and the (reference) denoise after each.
    ckpt = request.getfixturevalue(name)
    ref_m, fast_m = load_model(ckpt, "cpu", torch.float32), load_model(ckpt, "cpu", torch.float32)
    for model in (
        ref_m,
        fast_m,
    ):  # equal in the checkpoints: made to differ, so that the encoder's must be used
        for layer in model.layers:
            layer.encoder_layer_scalar.data.mul_(1.5)
    ref_run, fast_run = runner(ref_m, "reference"), runner(fast_m, "fast", prefill_chunk=7)
    c = fast_m.cfg.canvas_length
    kv_ref, kv = ref_m.new_cache(256, ring_size=3 * c), fast_m.new_cache(256, ring_size=3 * c)
    g = torch.Generator().manual_seed(5)
    canvas = torch.randint(0, fast_m.cfg.vocab_size, (1, c), generator=g)
    for t in (5, c, 3, 20, c, 7, 1, 31, c - 1, 2, c):
        ids = torch.randint(3, 1000, (t,), generator=g)
        ref_run.prefill(ids, kv_ref)
        fast_run.prefill(ids, kv)
        assert kv.length == kv_ref.length and kv.tokens == kv_ref.tokens
        for got, want in zip(_kv_state(kv), _kv_state(kv_ref), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            ref_run.denoise(canvas, kv), ref_run.denoise(canvas, kv_ref), rtol=1e-4, atol=1e-4
        )
        if t == 7:
            ref_run.rewind(kv_ref, kv_ref.length - 2)
            fast_run.rewind(kv, kv.length - 2)
    assert list(fast_run._prefill_graphs) == [256]  # the first prompt was padded to 256 (eager on the CPU)


@torch.no_grad()
def test_fast_prefill_regions_compile_once_for_all_lengths(tiny_a):
    # compiled for the CPU (inductor): one variant of each prefill region serves every chunk length; a commit runs
    # the denoise's fixed-shape regions instead
    fast_run = runner(load_model(tiny_a, "cpu", torch.float32), "fast", compile=True, prefill_chunk=8)
    kernels = fast_run.model.steps
    kv = fast_run.new_cache(128)
    g = torch.Generator().manual_seed(0)
    fast_run.prefill(torch.randint(3, 1000, (23,), generator=g), kv)  # padded, into the empty cache
    variants = {name: len(r._seen) for name, r in kernels.prefill_regions.items()}
    assert all(variants.values()), variants  # every prefill region was called (compiled)
    assert not any(r._seen for r in kernels.regions.values())  # not the denoise's fixed-shape set
    # Chunks of new lengths must reuse them: a recompile raises, which `Fused` turns into `failed` (and eager).
    with torch._dynamo.config.patch(error_on_recompile=True):
        fast_run.prefill(torch.randint(3, 1000, (21,), generator=g), kv)  # chunks of 8, 8 and 5
    assert not any(r.failed for r in kernels.prefill_regions.values())
    assert {name: len(r._seen) for name, r in kernels.prefill_regions.items()} == variants
    fast_run.prefill(torch.randint(3, 1000, (5,), generator=g), kv)  # a commit: the denoise's regions
    assert {name: len(r._seen) for name, r in kernels.prefill_regions.items()} == variants
    assert any(r._seen for r in kernels.regions.values())


@torch.no_grad()
def test_fp32_activations_on_16_bit_weights_take_the_reference_steps(tiny_a):
    # an fp32 compute dtype on a bf16 model (a short prompt's prefill, seed rule 7): no region is compiled for it
    fast_run = runner(load_model(tiny_a, "cpu", torch.bfloat16), "fast", compile=True)
    fast_run.prefill(torch.arange(3, 20), fast_run.new_cache(64), compute_dtype=torch.float32)
    assert not any(r._seen for r in fast_run.model.steps.prefill_regions.values())


@pytest.mark.parametrize("past", [0, 5, 7])
@pytest.mark.parametrize("block", [3, 8, 32])
def test_attention_window_matches_reference(past, block):
    # blocks of queries in one call, each over a strided view of one key buffer (ragged: 21 is no multiple of
    # 3, 8 or 32), GQA folded into the rows (4 query heads on 2 KV heads); the window (8) sees `past` cached
    # positions: 0 and 5 leave slots without a position (masked per block), 7 = window - 1 shares one mask
    g = torch.Generator().manual_seed(past)
    h, hkv, t, d, w = 4, 2, 21, 16, 8
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, past + t, d, generator=g)
    v = torch.randn(1, hkv, past + t, d, generator=g)
    qpos, kpos = torch.arange(100, 100 + t), torch.arange(100 - past, 100 + t)
    want = ref.attention(q, k, v, (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - w))
    kv = torch.cat([k, v])  # [2, hkv, past + t, d]
    bias = fast.window_bias(past, t, w, h // hkv, q.dtype, "cpu", block)
    assert bias.shape[0] == (1 if past == w - 1 else -(-t // block))
    got = fast.attention_window(q, kv[:, :, :past], kv[:, :, past:], bias)
    torch.testing.assert_close(got, ref.rows(want), rtol=1e-5, atol=1e-5)


def test_post_ffn_combines_the_expert_outputs_of_each_row():
    # eager post_ffn against the plain sum: the experts' output in expert-sorted order, gathered back by each
    # pair's sorted position and weighted
    g = torch.Generator().manual_seed(3)
    n, k, hid = 50, 3, 64
    h, dense = torch.randn(n, hid, generator=g), torch.randn(n, hid, generator=g)
    outs, w = torch.randn(n * k, hid, generator=g), torch.rand(n, k, generator=g)
    w2, w1, scalar = torch.rand(hid, generator=g) + 0.5, torch.rand(hid, generator=g) + 0.5, torch.tensor(0.7)
    perm = torch.randperm(n * k, generator=g)  # sorted position s holds pair perm[s]
    slot = torch.empty_like(perm)
    slot[perm] = torch.arange(n * k)
    got, _ = regions.post_ffn(h, dense, outs[perm], slot, w, w2, w1, scalar, None, 1e-6)
    moe = (outs.view(n, k, hid) * w[:, :, None]).sum(1)
    want = (h + ref.rms_norm(dense + ref.rms_norm(moe, w2, 1e-6), w1, 1e-6)) * scalar
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
