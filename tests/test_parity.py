"""Our forward pinned to transformers 5.23's DiffusionGemma on tiny random checkpoints (fp32, max |Δ| <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from diffgemma.kernels.torch_ref import softcap
from diffgemma.weights.loader import load_model

transformers = pytest.importorskip("transformers")
from transformers import DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

TOL = 1e-4


def hf_model(path):
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def hf_cache(model):
    return DynamicCache(config=model.config.get_text_config(decoder=True))


@torch.no_grad()
def test_prefill_denoise_logits_match_transformers(tiny):
    ours = load_model(tiny, "cpu", torch.float32)
    ref = hf_model(tiny)
    cfg = ours.cfg
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, 3 * cfg.sliding_window + 5), generator=g)
    assert prompt.shape[1] > cfg.sliding_window
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)

    kv = ours.new_cache(256)
    ours.prefill(prompt, kv)
    cache = hf_cache(ref)
    ref.model.encoder(input_ids=prompt, past_key_values=cache)

    # Step 1: no self-conditioning.
    a = ours.denoise(canvas, kv)
    b = ref(decoder_input_ids=canvas, past_key_values=cache).logits
    assert (a - b).abs().max() <= TOL
    # raw=True (what generation reads): the LM head's output, which the sampler softcaps as it reads it
    raw = ours.denoise(canvas, kv, raw=True)
    assert torch.equal(softcap(raw, cfg.final_logit_softcapping), a) and (raw - a).abs().max() > 1e-3

    # A later step: self-conditioning from the previous step's tempered logits.
    sc = b / 0.7
    a = ours.denoise(canvas, kv, sc_logits=sc)
    b = ref(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc).logits
    assert (a - b).abs().max() <= TOL
    assert (a - ours.denoise(canvas, kv)).abs().max() > 1e-3  # SC really changes the logits

    # After a second block was committed and prefilled (the window now spans prompt and block).
    block = b.argmax(-1)
    ours.prefill(block, kv)
    ref.model.encoder(input_ids=block, past_key_values=cache)
    assert kv.length == prompt.shape[1] + cfg.canvas_length
    canvas2 = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    a = ours.denoise(canvas2, kv, sc_logits=sc)
    b = ref(decoder_input_ids=canvas2, past_key_values=cache, self_conditioning_logits=sc).logits
    assert (a - b).abs().max() <= TOL


@torch.no_grad()
def test_chunked_prefill_equals_one_shot(tiny_a):
    ours = load_model(tiny_a, "cpu", torch.float32)
    prompt = torch.randint(0, ours.cfg.vocab_size, (1, 37), generator=torch.Generator().manual_seed(3))
    canvas = torch.randint(
        0, ours.cfg.vocab_size, (1, ours.cfg.canvas_length), generator=torch.Generator().manual_seed(4)
    )
    kv1, kv2 = ours.new_cache(128), ours.new_cache(128)
    ours.prefill(prompt, kv1)
    for s in range(0, prompt.shape[1], 5):  # the same prompt in passes of 5 tokens
        ours.prefill(prompt[:, s : s + 5], kv2)
    assert (ours.denoise(canvas, kv1) - ours.denoise(canvas, kv2)).abs().max() <= 1e-4


@torch.no_grad()
def test_nontrivial_weights_matter(tiny_a):
    """Norm weights, layer scalars and per-expert scales are not identity in the test checkpoints."""
    ours = load_model(tiny_a, "cpu", torch.float32)
    layer = ours.layers[0]
    for t in (layer.input_layernorm, layer.q_norm, layer.per_expert_scale, layer.router_scale):
        assert (t - 1).abs().max() > 0.05
    assert abs(float(layer.layer_scalar) - 1) > 1e-3
