"""`Engine.warm_up` on the device, where the fast kernels' path also captures CUDA graphs (skipped without
CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_warm_up_captures_then_drops_its_graphs_and_changes_no_reply(tmp_path, graph_captures):
    """Two engines on one tiny bf16 checkpoint, one warmed up: the warm-up captures graphs (denoise steps, a
    commit) on caches of its own and keeps none; both then give the same replies to a prompt under the fp32
    rule and to a follow-up turn past it on the same cache."""
    from diffgemma.config import SamplerConfig
    from diffgemma.session.client import Engine, Session
    from diffgemma.testing import write_tiny_checkpoint
    from diffgemma.weights.loader import load_model

    ckpt = write_tiny_checkpoint(tmp_path / "c", seed=3)
    sampler = SamplerConfig(max_denoising_steps=4)  # prompts up to 256 tokens prefill in fp32
    warm, cold = (Engine(load_model(ckpt, "cuda", torch.bfloat16), sampler) for _ in range(2))
    assert warm.runner.fast and warm.runner.graphs_on
    assert warm.warm_up() > 0
    assert len(graph_captures) >= 3, (
        graph_captures
    )  # the first step's graph (SC seed), the later steps', a commit's
    assert not len(warm.runner.graphs) and warm.runner.graphs._pool is None and not warm.runner.graphs._io

    prompt, follow = list(range(3, 43)), list(range(50, 350))
    replies = []
    for eng in (warm, cold):
        s = Session(eng, ctx=1024)
        first = s.generate(prompt, max_new_tokens=40, seed=5).token_ids
        replies.append((first, s.generate(s.log + follow, max_new_tokens=40, seed=6).token_ids))
    assert replies[0] == replies[1]
