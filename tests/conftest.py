"""Shared fixtures: tiny checkpoints in the real on-disk format, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffgemma.testing import write_tiny_checkpoint

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

# Config A: prompt longer than the sliding window (8), two full layers, the real checkpoint's key spelling.
TINY_A: dict = {}
# Config B: transformers' per_layer_config spelling, three full layers, window 4, a wider canvas.
TINY_B: dict = dict(
    config_style="transformers",
    sliding_window=4,
    canvas_length=24,
    num_hidden_layers=5,
    layer_types=[
        "full_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    num_experts=6,
    top_k_experts=3,
)


@pytest.fixture(scope="session")
def tiny_a(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_a"), seed=1, **TINY_A)


@pytest.fixture(scope="session")
def tiny_b(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_b"), seed=2, **TINY_B)


@pytest.fixture(params=["tiny_a", "tiny_b"])
def tiny(request) -> Path:
    return request.getfixturevalue(request.param)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against b: the norm of their difference over b's, in fp64."""
    return float((a.double() - b.double()).norm() / b.double().norm())
