"""Many canvases per forward on CPU (fp32): a mixed batch of turns (prompt lengths, seeds, sampler settings, canvas
lengths, one cancelled midway) through the scheduler gives every request the tokens and the cache bytes of its solo
run; a forward holds several canvases. On the reference kernels and on the fast ones (their batched denoise and
commit passes: attention row by row, K/V written to each cache's canvas slots)."""

from __future__ import annotations

import functools

import pytest
import torch

import diffgemma
from diffgemma.config import RuntimeConfig
from diffgemma.engine import batch
from diffgemma.engine.batch import Request, Scheduler
from diffgemma.engine.generate import CancelToken, Canvas, generate
from diffgemma.model.steps import Steps
from diffgemma.runner.runner import DenoiseInput, StepPlan


class AfterSteps(CancelToken):
    """Cancels its own request after n of its denoise steps."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.seen = n, 0

    def step(self, info) -> None:
        self.seen += 1

    @property
    def cancelled(self) -> bool:
        return self.seen >= self.n


@pytest.fixture(scope="module", params=["reference", "fast"])
def eng(tiny_a, request):
    runtime = RuntimeConfig(kernels=request.param, compile=False)
    eng = diffgemma.load(tiny_a, device="cpu", dtype="float32", max_tokens=512, runtime=runtime)
    if eng.runner.fast:
        # The CPU's grouped GEMM sums an expert's rows in an order that depends on how many it has (~1e-6 here);
        # the reference's per-expert GEMMs, padded to EXPERT_MIN_ROWS, do not. The rest of the fast batched pass
        # (attention row by row, K/V to each cache's canvas slots, the commits) runs as it is.
        eng.runner.model.steps.experts = functools.partial(Steps.experts, eng.runner.model.steps)
    return eng


def _mix(eng):
    base = eng.sampler
    texts = [
        "Hi",
        "What is 17 + 25?",
        "Tell me about the sea " * 6,
        "Count to ten.",
        "ok",
        "A list of fruits " * 3,
    ]
    cfgs = [
        base,
        base.replace(entropy_bound=0.3, max_denoising_steps=6),
        base.replace(first_step_sc_seed=False),
        base.replace(sc_sparse=False),
        base.replace(denoiser_argmax=False),  # categorical draws from the block's own uniforms
        base.replace(canvas_shrink=True),  # a shorter last canvas: a forward of its own length
        base.replace(commit_conf_trim=0.0, plateau_steps=0),
        base,
    ]
    return [
        (eng.prompt_ids(texts[i % len(texts)] + f" ({i})"), cfgs[i], 100 + i, 24 + 5 * i, i == 6)
        for i in range(8)
    ]


def _solo(eng, ids, cfg, seed, max_new, cancel_after):
    kv = eng.runner.new_cache(512)
    cancel = AfterSteps(7) if cancel_after else None
    out = generate(
        eng.runner, ids, kv, cfg, seed, max_new, on_step=cancel.step if cancel else None, cancel=cancel
    )
    return out, kv.fingerprint()


def test_a_mixed_batch_gives_every_request_its_solo_tokens_and_cache(eng, monkeypatch):
    mix = _mix(eng)
    commits = []  # the fast kernels' batched commits: rows a pass
    commit_many = eng.runner.commit_many
    monkeypatch.setattr(
        eng.runner, "commit_many", lambda items: (commits.append(len(items)), commit_many(items))
    )
    shared = []  # row passes over several canvases' rows: rows a pass
    row_stats = batch.row_stats
    monkeypatch.setattr(
        batch, "row_stats", lambda logits, *a: (shared.append(logits.shape[0]), row_stats(logits, *a))[1]
    )
    sched = Scheduler(eng.runner, max_batch=8)
    reqs = []
    for ids, cfg, seed, max_new, cancel_after in mix:
        kv = eng.runner.new_cache(512)
        cancel = AfterSteps(7) if cancel_after else None
        turn = eng.turn(ids, kv, cfg, seed, max_new)
        reqs.append(sched.submit(Request(turn, on_step=cancel.step if cancel else None, cancel=cancel)))
    sched.run()
    assert max(sched.forwards) >= 6 and len(sched.forwards) < sum(r.turn.out.steps for r in reqs)
    for (ids, cfg, seed, max_new, cancel_after), r in zip(mix, reqs, strict=True):
        solo, fingerprint = _solo(eng, ids, cfg, seed, max_new, cancel_after)
        got = r.turn.out
        assert (got.token_ids, got.finish_reason, got.steps, got.blocks, got.retries) == (
            solo.token_ids, solo.finish_reason, solo.steps, solo.blocks, solo.retries
        )  # fmt: skip
        assert r.turn.kv.fingerprint() == fingerprint
    assert reqs[6].turn.out.finish_reason == "cancelled"
    assert (max(commits) >= 2) if eng.runner.fast else not commits
    assert shared and max(shared) >= 2 * eng.runner.cfg.canvas_length  # one row pass for several canvases
    assert (
        sum(len(r.turn.out.token_ids) > 16 for r in reqs) >= 3
    )  # several blocks, committed while others denoise


def test_max_batch_bounds_a_forward(eng):
    if eng.runner.fast:
        pytest.skip("the bound is the scheduler's, whatever the kernels: the reference run checks it")
    mix = _mix(eng)[:5]
    sched = Scheduler(eng.runner, max_batch=2)
    reqs = _submit(eng, sched, mix)
    sched.run()
    assert max(sched.forwards) <= 2
    _assert_solo_tokens(eng, mix, reqs)


def _submit(eng, sched: Scheduler, mix) -> list[Request]:
    """Each of mix's requests as a turn (uncancelled) in the scheduler."""
    return [
        sched.submit(Request(eng.turn(ids, eng.runner.new_cache(512), cfg, seed, n)))
        for ids, cfg, seed, n, _ in mix
    ]


def _assert_solo_tokens(eng, mix, reqs: list[Request]) -> None:
    for (ids, cfg, seed, n, _), r in zip(mix, reqs, strict=True):
        assert r.turn.out.token_ids == _solo(eng, ids, cfg, seed, n, False)[0].token_ids


def test_a_plan_refuses_canvases_of_two_lengths(eng):
    kv = eng.runner.new_cache(64)
    eng.runner.prefill([5, 6, 7], kv)
    a = Canvas(eng.config.vocab_size, eng.sampler, 1, 16, torch.device("cpu"))
    b = Canvas(eng.config.vocab_size, eng.sampler, 1, 8, torch.device("cpu"))
    plan = StepPlan(canvases=[DenoiseInput(cv.ids, kv, *cv.sc_input()) for cv in (a, b)])
    with pytest.raises(ValueError, match="one length"):
        eng.runner.execute(plan)


def test_a_long_prompt_joining_running_requests_prefills_a_budget_a_step(eng, monkeypatch):
    from diffgemma.engine import batch

    monkeypatch.setattr(batch, "PREFILL_BUDGET", 20)
    mix = _mix(eng)[:3]
    sched = Scheduler(eng.runner, max_batch=8)
    reqs = _submit(eng, sched, mix)
    sched.step()
    long_ids = eng.prompt_ids("Tell me about the sea and the sky " * 4)
    assert len(long_ids) > 50
    kv = eng.runner.new_cache(512)
    late = sched.submit(Request(eng.turn(long_ids, kv, eng.sampler, 5, 40, prefill_now=False)))
    assert kv.length == 0  # nothing prefilled until the scheduler steps
    lengths = []
    while late.turn.unprefilled:
        sched.step()
        lengths.append(kv.length)
    assert lengths[:2] == [20, 40] and len(lengths) >= 3  # a budget a step while the others denoise
    assert all(r.canvas is not None or r.done for r in reqs)
    sched.run()
    solo, fingerprint = _solo(eng, long_ids, eng.sampler, 5, 40, False)
    assert kv.tokens[: len(long_ids)] == long_ids
    if (
        not eng.runner.fast
    ):  # the reference prefills at fixed positions whatever the chunks: the same K/V bytes
        assert late.turn.out.token_ids == solo.token_ids and kv.fingerprint() == fingerprint
    # (the fast kernels' routes for a chunk, padded, commit-shaped or plain, sum in other orders than one whole
    # prefill's: a prompt within the budget goes whole, as a lone turn's)
    _assert_solo_tokens(eng, mix, reqs)


def test_a_prompt_alone_in_the_scheduler_prefills_whole(eng, monkeypatch):
    from diffgemma.engine import batch

    monkeypatch.setattr(batch, "PREFILL_BUDGET", 8)
    ids = eng.prompt_ids("Tell me about the sea " * 3)
    kv = eng.runner.new_cache(512)
    sched = Scheduler(eng.runner)
    sched.submit(Request(eng.turn(ids, kv, eng.sampler, 1, 20, prefill_now=False)))
    sched.step()
    assert kv.length == len(ids)  # nothing else running: no budget
