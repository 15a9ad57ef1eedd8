"""The scheduler on the fast kernels and CUDA graphs (skipped without CUDA). Turns interleaved one canvas a forward
give each request its solo tokens: the graphs of one canvas length share one SC input buffer, so an interleaved
canvas keeps its next SC input in a buffer of its own. Turns batched several canvases a forward give, replayed from
the graphs of their set of caches, the tokens of the same batch run eagerly."""

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
    from diffgemma.engine.generate import drive
    from diffgemma.weights.download import bundled_model

    eng = diffgemma.load(bundled_model(), device="cuda")
    assert eng.runner.fast and eng.runner.graphs_on
    texts = ("What is 17 + 25?", "Count from 37 to 55.", "Is 7 larger than 3?", "Count from 10 to 30.")
    prompts = [eng.prompt_ids(t) for t in texts]
    solo = [drive(eng.turn(p, eng.runner.new_cache(2048), None, i)).token_ids for i, p in enumerate(prompts)]
    sched = Scheduler(eng.runner, max_batch=1)
    reqs = [
        sched.submit(Request(eng.turn(p, eng.runner.new_cache(2048), None, i))) for i, p in enumerate(prompts)
    ]
    sched.run()
    assert [r.turn.out.token_ids for r in reqs] == solo
    assert max(sched.forwards) == 1 and len(sched.forwards) == sum(r.turn.out.steps for r in reqs)


def test_batched_turns_replayed_from_graphs_give_the_tokens_of_the_batch_run_eagerly():
    import diffgemma
    from diffgemma.engine.batch import Request, Scheduler
    from diffgemma.engine.generate import drive
    from diffgemma.weights.download import bundled_model

    eng = diffgemma.load(bundled_model(), device="cuda")
    texts = ("What is 17 + 25?", "Count from 37 to 55.", "Is 7 larger than 3?", "Count from 10 to 30.")
    prompts = [eng.prompt_ids(t) for t in texts]
    caches = [eng.runner.new_cache(2048) for _ in prompts]

    def run(graphs: bool):
        eng.runner.graphs_on = graphs
        sched = Scheduler(eng.runner, max_batch=8)
        reqs = []
        for i, (p, kv) in enumerate(zip(prompts, caches, strict=True)):
            kv.reset()
            reqs.append(sched.submit(Request(eng.turn(p, kv, None, i))))
        sched.run()
        return [r.turn.out.token_ids for r in reqs], sched.forwards

    eager, forwards = run(False)
    graphed, _ = run(True)  # a set's first pass eager, its second captured, the rest replayed
    assert max(forwards) == len(prompts)
    assert any(step is not None for _, step in eng.runner.graphs._batch.values())
    assert graphed == eager
    solo = [drive(eng.turn(p, eng.runner.new_cache(2048), None, i)).token_ids for i, p in enumerate(prompts)]
    print(
        f"batched = solo for {sum(a == b for a, b in zip(graphed, solo, strict=True))} of {len(solo)} requests"
    )
