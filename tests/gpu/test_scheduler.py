"""The scheduler on the fast kernels and CUDA graphs (skipped without CUDA): turns interleaved step by step, one
canvas a forward there, give each request its solo tokens. The graphs of one canvas length share one SC input
buffer, so an interleaved canvas keeps its next SC input in a buffer of its own."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_interleaved_turns_on_graphs_give_their_solo_tokens():
    import diffgemma
    from diffgemma.engine.batch import Request, Scheduler
    from diffgemma.weights.download import bundled_model

    eng = diffgemma.load(bundled_model(), device="cuda")
    assert eng.runner.fast and eng.runner.graphs_on
    texts = ("What is 17 + 25?", "Count from 37 to 55.", "Is 7 larger than 3?", "Count from 10 to 30.")
    prompts = [eng.prompt_ids(t) for t in texts]
    solo = [eng.generate(p, seed=i, kv=eng.runner.new_cache(2048)).token_ids for i, p in enumerate(prompts)]
    sched = Scheduler(eng.runner, max_batch=8)
    reqs = [
        sched.submit(Request(eng.turn(p, eng.runner.new_cache(2048), None, i))) for i, p in enumerate(prompts)
    ]
    sched.run()
    assert [r.turn.out.token_ids for r in reqs] == solo
    assert max(sched.forwards) == 1 and len(sched.forwards) == sum(r.turn.out.steps for r in reqs)
