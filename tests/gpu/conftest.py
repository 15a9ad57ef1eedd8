"""Fixtures of the device tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


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


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn captured in a CUDA graph after one warm-up call outside capture (the JIT compile): (graph, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
