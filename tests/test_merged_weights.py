"""The fused denoise layer's merged weights ([q; k; v] and the dense [gate; up], one GEMM each) and its
in-place attention over the cache, against the unfused fast path on CPU."""

from __future__ import annotations

import torch

from diffgemma.kernels import fused
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights.loader import load_model, load_weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _denoise(model, canvas, kv, path: str) -> list[torch.Tensor]:
    """Logits without self-conditioning, with the seed, and with SC probs (all three decoder inputs), on
    the reference path ("ref": the cache read in position order, torch_ref attention), the unfused fast one
    ("fast") or the fused one ("fused")."""
    model.fast, model.fuse = path != "ref", path == "fused"
    plain = model.denoise(canvas, kv)
    sc = torch.softmax(plain[0] / 0.7, -1)
    out = [plain, model.denoise(canvas, kv, sc_seed=True), model.denoise(canvas, kv, sc_probs=sc)]
    model.fast, model.fuse = True, False
    return out


def _prefill(model, ids, kv) -> None:
    model.fast, model.fuse = True, False
    model.prefill(ids, kv)


# fp32 on CPU: the three paths compute the same products and sums; only the merged GEMMs (wider outputs), the
# attention kernels and the keys' order in the cache may add them in another order, ~1e-7 relative per op,
# which five layers keep well under 1e-5. A flipped top-k expert or a wrong key shows as ~1e-2 or more.
TOL = 1e-5


@torch.no_grad()
def test_fused_denoise_matches_unfused_across_ring_wraps_and_rewinds(tiny_a):
    model = load_model(tiny_a, "cpu", torch.float32)
    # The regions' eager selves (no compile time here; tests/gpu pin the compiled regions to them).
    model.fused_regions = fused.make_regions(enabled=False)
    kv = model.new_cache(256, ring_size=12)  # window 8, canvas 16: the rings wrap every 28 positions
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g)
    for t in (5, 20, 9, 31, 3, 14):
        _prefill(model, torch.randint(3, 1000, (1, t), generator=g), kv)
        fp = kv.fingerprint()
        want = _denoise(model, canvas, kv, "ref")
        for path in ("fast", "fused"):
            for a, b in zip(_denoise(model, canvas, kv, path), want, strict=True):
                assert rel(a, b) < TOL, (path, kv.length)
        assert kv.fingerprint() == fp  # the canvases' K/V went to free slots only
        if kv.can_truncate(kv.length - 4):  # rewind: the fused path reads the rewound window
            kv.truncate(kv.length - 4)
            got, want = _denoise(model, canvas, kv, "fused")[0], _denoise(model, canvas, kv, "ref")[0]
            assert rel(got, want) < TOL, kv.length


@torch.no_grad()
def test_merged_weights_are_the_parameters_and_follow_a_reload(tiny_a, tmp_path):
    model = load_model(tiny_a, "cpu", torch.float32)
    model.fused_regions = fused.make_regions(enabled=False)
    kv = model.new_cache(64)
    g = torch.Generator().manual_seed(2)
    _prefill(model, torch.randint(3, 1000, (1, 20), generator=g), kv)
    canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g)
    ref_before = _denoise(model, canvas, kv, "ref")[0]
    _denoise(model, canvas, kv, "fused")  # builds the merged weights
    for layer in model.layers:
        qkv = layer.merged(*layer.qkv_names)
        gate_up = layer.merged("mlp_gate", "mlp_up")
        assert qkv.shape[0] == sum(getattr(layer, n).shape[0] for n in layer.qkv_names)
        # the parameters are views into the merged weights: no second copy, and in-place writes reach them
        assert layer.q_proj.data_ptr() == qkv.data_ptr() and layer.mlp_gate.data_ptr() == gate_up.data_ptr()
        assert torch.equal(qkv[-layer.k_proj.shape[0] :], getattr(layer, layer.qkv_names[-1]))
        assert torch.equal(gate_up[layer.mlp_gate.shape[0] :], layer.mlp_up)
    assert torch.equal(_denoise(model, canvas, kv, "ref")[0], ref_before)  # same values, same reference

    # a checkpoint loaded into the model (the loader sets new parameters) replaces the merged weights
    other = write_tiny_checkpoint(tmp_path / "other", seed=7)
    load_weights(model, other, "cpu", torch.float32)
    fresh = load_model(other, "cpu", torch.float32)
    kv_new, kv_fresh = model.new_cache(64), fresh.new_cache(64)
    ids = torch.randint(3, 1000, (1, 20), generator=g)
    _prefill(model, ids, kv_new)
    _prefill(fresh, ids, kv_fresh)
    got = _denoise(model, canvas, kv_new, "fused")[0]
    assert rel(got, _denoise(fresh, canvas, kv_fresh, "ref")[0]) < TOL
    layer = model.layers[0]
    assert torch.equal(
        layer.merged("mlp_gate", "mlp_up")[: layer.mlp_gate.shape[0]], fresh.layers[0].mlp_gate
    )
    layer.v_proj.neg_()  # an in-place update of a parameter (an optimizer step) reaches the fused path
    assert torch.equal(layer.merged(*layer.qkv_names)[-layer.v_proj.shape[0] :], layer.v_proj)
    assert rel(_denoise(model, canvas, kv_new, "fused")[0], got) > TOL
