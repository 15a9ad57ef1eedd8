"""CPU threads: one for a small model (its ops are too small for threads, which a busy machine makes far slower),
torch's default for a large one, and `threads` overrides either."""

from __future__ import annotations

import torch

import diffgemma
from diffgemma.bench import REAL_CONFIG
from diffgemma.config import ModelConfig
from diffgemma.runner.devices import SMALL_MODEL_ACTIVE_PARAMS, TORCH_THREADS, active_params, set_cpu_threads
from diffgemma.weights.download import bundled_model


def test_the_thread_count_follows_the_models_size(tiny_a) -> None:
    before = torch.get_num_threads()
    try:
        real = ModelConfig.from_dict(REAL_CONFIG)
        demo = ModelConfig.from_dir(bundled_model())
        assert 3.7e9 < active_params(real) < 3.9e9  # the 26B-A4B model: 3.8B active parameters a token
        assert active_params(demo) < SMALL_MODEL_ACTIVE_PARAMS < active_params(real)
        assert set_cpu_threads(demo) == 1 == torch.get_num_threads()
        assert set_cpu_threads(real) == TORCH_THREADS == torch.get_num_threads()
        assert set_cpu_threads(demo, 2) == 2 == torch.get_num_threads()
        diffgemma.load(tiny_a, "cpu")
        assert torch.get_num_threads() == 1
        diffgemma.load(tiny_a, "cpu", threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
