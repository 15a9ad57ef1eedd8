"""Fixtures of the device tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def graph_captures(monkeypatch) -> list[int]:
    """A list that grows by one with each CUDA graph captured (`GraphStep` built) while the test runs."""
    from diffgemma.kernels import cuda as fast_ops

    captures: list[int] = []
    real_step = fast_ops.GraphStep

    def graph_step(*args, **kwargs):
        captures.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(fast_ops, "GraphStep", graph_step)
    return captures
