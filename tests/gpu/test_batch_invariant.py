"""The batch-invariant mode on the GPU (`RuntimeConfig.batch_invariant`, skipped without CUDA): 16 canvases in one
pass give each canvas's solo logits bit for bit, eager and replayed from the batch's CUDA graph, on the demo model
and on random weights of the real shape (six layers: five sliding, one full); 16 requests through the scheduler
give their solo tokens on the demo model. `diffgemma bench --concurrency 1,16` measures the same on the real
shape's 30 layers (`solo_equal`) and the mode's cost."""

from __future__ import annotations

import pytest
import torch

from diffgemma.config import RuntimeConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

INVARIANT = RuntimeConfig(batch_invariant=True)


def _solo_and_batched_logits(runner, n: int = 16, seed: int = 0) -> None:
    """n caches with prompts of different lengths, a canvas each (half with SC probabilities, half seeded): each
    canvas alone, then all n in one pass three times (eager, captured, replayed): every pass's logits equal the
    solo ones bit for bit."""
    from diffgemma.runner.runner import DenoiseInput

    cfg, dev = runner.model.cfg, runner.device
    c, v = cfg.canvas_length, cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    caches, canvases = [], []
    for i in range(n):
        kv = runner.new_cache(1024 + 2 * c)
        runner.prefill(torch.randint(0, v, (64 + 37 * i,), generator=g), kv)
        ids = torch.randint(0, v, (c,), generator=g).to(dev)
        probs = None
        if i % 2:
            probs = torch.softmax(torch.randn(c, v, generator=g) * 4, -1).to(dev, runner.dtype)
        caches.append(kv)
        canvases.append(DenoiseInput(ids, kv, probs, probs is None, False))
    solo = []
    for cv in canvases:
        for _ in range(2):  # a cache's first pass eager, its second captured
            out = runner.denoise(cv.ids[None], cv.kv, sc_probs=cv.probs, sc_seed=cv.seed, raw=True)
        solo.append(out[0].clone())
    for rep in range(3):  # eager, captured, replayed from the graph of this set of caches
        batched = runner.denoise_many(canvases)
        same = [torch.equal(batched[i], solo[i]) for i in range(n)]
        assert all(same), f"pass {rep}: {sum(same)} of {n} canvases give their solo logits"
    if runner.graphs_on:
        assert any(step is not None for _, step in runner.graphs._batch.values())


def test_sixteen_canvases_give_their_solo_logits_on_the_demo_model():
    import diffgemma
    from diffgemma.weights.download import bundled_model

    eng = diffgemma.load(bundled_model(), device="cuda", runtime=INVARIANT)
    assert eng.runner.fast and eng.runner.graphs_on and eng.model.steps.invariant
    _solo_and_batched_logits(eng.runner)


def test_sixteen_canvases_give_their_solo_logits_at_the_real_shape():
    from diffgemma.bench.shapes import REAL_CONFIG
    from diffgemma.bench.weights import random_model
    from diffgemma.runner.runner import ModelRunner

    text = dict(REAL_CONFIG["text_config"], num_hidden_layers=6)
    text["layer_types"] = text["layer_types"][:6]
    model = random_model({**REAL_CONFIG, "text_config": text}, "cuda", torch.bfloat16)
    runner = ModelRunner(model, INVARIANT)
    assert runner.fast and runner.graphs_on
    _solo_and_batched_logits(runner)


def test_sixteen_requests_through_the_scheduler_give_their_solo_tokens():
    import diffgemma
    from diffgemma.engine.batch import Request, Scheduler
    from diffgemma.engine.generate import drive
    from diffgemma.weights.download import bundled_model

    eng = diffgemma.load(bundled_model(), device="cuda", runtime=INVARIANT)
    texts = [f"Count from {a} to {a + 9 + a % 7}." for a in range(3, 19)]
    prompts = [eng.prompt_ids(t) for t in texts]
    solo = [drive(eng.turn(p, eng.runner.new_cache(2048), None, i)).token_ids for i, p in enumerate(prompts)]
    sched = Scheduler(eng.runner, max_batch=16)
    reqs = [
        sched.submit(Request(eng.turn(p, eng.runner.new_cache(2048), None, i))) for i, p in enumerate(prompts)
    ]
    sched.run()
    assert max(sched.forwards) == 16
    batched = [r.turn.out.token_ids for r in reqs]
    same = sum(a == b for a, b in zip(batched, solo, strict=True))
    assert same == len(solo), f"{same} of {len(solo)} batched requests give their solo tokens"
