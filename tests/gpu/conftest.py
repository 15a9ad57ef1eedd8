"""Fixtures of the device tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def graph_captures(monkeypatch) -> list[int]:
    """A list that grows by one with each denoise or commit graph captured (`DenoiseGraphs` building a
    `GraphStep`) while the test runs; a padded prefill's graph is not counted."""
    from diffgemma.runner import graphs

    captures: list[int] = []
    real_step = graphs.GraphStep

    def graph_step(*args, **kwargs):
        captures.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(graphs, "GraphStep", graph_step)
    return captures
