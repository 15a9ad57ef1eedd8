"""Generation parity: with the `reference` options, our block loop emits transformers' tokens when its
denoiser draw is replaced by argmax and its canvas noise by our LCG stream (monkeypatched here)."""

from __future__ import annotations

import pytest
import torch

import diffgemma
from diffgemma.engine.rng import Rng, block_seed
from diffgemma.testing import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")
from transformers import DiffusionGemmaForBlockDiffusion  # noqa: E402
from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf_gen  # noqa: E402

SEED = 7


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # A generous entropy bound so that many rows are accepted per step: a trajectory that exercises the sampler.
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("genparity"),
        seed=11,
        tokenizer=False,
        generation={
            "sampler_config": {"entropy_bound": 40.0, "_cls_name": "EntropyBoundSamplerConfig"},
            "max_denoising_steps": 5,
        },
    )


def test_generation_matches_transformers_over_two_blocks(ckpt, monkeypatch):
    # float64 on both sides, and few steps per block: with random weights the SC feedback loop amplifies any
    # rounding about 5x per step (transformers rounds its logits to fp32), which would turn into argmax flips.
    eng = diffgemma.load(ckpt, device="cpu", dtype="float64")
    cfg = eng.sampler.reference().replace(denoiser_argmax=True)
    canvas = eng.config.canvas_length
    prompt = torch.randint(3, eng.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(5))
    # Our stop ids never occur in this prompt's reply for this seed; if they did, the test would compare less.
    ours = eng.generate(prompt[0].tolist(), max_new_tokens=2 * canvas, seed=SEED, sampler=cfg)

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(
        ckpt, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="eager"
    ).eval()
    state = {"block": -1, "rng": None}
    original_prepare = hf_gen.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs

    def prepare(self, *args, **kwargs):
        state["block"] += 1
        state["rng"] = Rng(block_seed(SEED, state["block"]))
        return original_prepare(self, *args, **kwargs)

    def noise(self, batch_size, device):
        ids = state["rng"].tokens(self.canvas_length, self.vocab_size)
        return torch.from_numpy(ids).reshape(1, -1).to(device)

    monkeypatch.setattr(hf_gen.DiffusionGemmaGenerationMixin, "_prepare_denoiser_inputs", prepare)
    monkeypatch.setattr(hf_gen.EntropyBoundSampler, "initialize_canvas", noise)
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples: probs.argmax(-1, keepdim=True))
    out = ref.generate(prompt, max_new_tokens=2 * canvas)
    theirs = out.sequences[0, prompt.shape[1] :].tolist()
    stops = set(cfg.stop_token_ids)
    end = next((i for i, t in enumerate(theirs) if t in stops), len(theirs))

    assert state["block"] == 1, "transformers ran two blocks"
    assert len(ours.token_ids) == end > canvas, "the reply spans two blocks"
    assert ours.token_ids == theirs[:end]
    assert ours.blocks == 2
