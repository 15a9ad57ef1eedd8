"""The trainer's compiled layers on CUDA, under its bf16 autocast: the gradients of eager layers (under autocast the
compiled layer's backward was wrong, a gradient norm 5e4 times eager's; it now runs in fp32), measured against
eager fp32, with eager under autocast as the yardstick of bf16's own distance."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tokenizers import Tokenizer

from diffgemma.train import batches, trainer
from diffgemma.train.checkpoint import make_trainable
from diffgemma.weights.download import bundled_model
from diffgemma.weights.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_compiled_training_step_has_the_eager_gradients():
    demo = bundled_model()
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    # the schema task, which the bundled model has not learned: a loss of ~2 and gradients well above bf16's noise
    cfg = trainer.TrainConfig(out="unused", batch=64, mix="schema=0.5", lookup_weight=1.0, seed=24)
    micro = [b.to("cuda") for b in batches.batches_for_step(cfg, tok, 5)]
    model = make_trainable(load_model(demo, "cuda", torch.float32))
    bf16 = trainer.autocast_for("cuda")

    def grad(compiled: bool, autocast) -> torch.Tensor:
        trainer.set_compile(compiled)
        model.zero_grad()
        for sc in (False, True):
            torch.manual_seed(0)  # the same canvas noise in every run
            for b in micro:
                loss, _ = trainer.loss_on(model, b, sc, True, 0.7, autocast, cfg.lookup_weight)
                loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    try:
        exact = grad(False, contextlib.nullcontext)  # eager, fp32 throughout: the yardstick
        eager = grad(False, bf16)  # eager under the trainer's autocast
        comp = grad(True, bf16)  # the trainer's own: compiled layers (fp32 inside) under its autocast
    finally:
        trainer.set_compile(True)
    # eager bf16 sits a few percent off fp32 (a norm 0.94x it on an H200); the compiled layers, in fp32, no further
    assert (comp - exact).norm() <= (eager - exact).norm()
    assert 0.95 < (comp.norm() / exact.norm()).item() < 1.05
    assert torch.nn.functional.cosine_similarity(comp, exact, dim=0).item() > 0.99
