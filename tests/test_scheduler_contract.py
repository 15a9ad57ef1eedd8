"""The scheduler against the runner's contract alone (issue #58 item 2): a stand-in runner that has nothing but the
contract (`execute`, and the cfg/device/dtype a turn's canvas needs) records the `StepPlan`s it is given and answers
each canvas with scripted logits; the scheduler drives three turns to their ends through it, with no model. The plans
are plain data, `schedule` runs nothing, and the replies are what the scripted logits say."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from diffgemma.config import SamplerConfig
from diffgemma.engine import batch
from diffgemma.engine.batch import Request, Scheduler
from diffgemma.engine.generate import CancelToken, Turn
from diffgemma.runner.runner import DenoiseInput, ModelOutput, Prefill, StepPlan
from tests.fake_model import FakeKV, peaked

V, C = 128, 16
STOP = 106
CFG = SamplerConfig()  # the seed's defaults: sparse SC, fp32 for a whole short prompt, the confidence trim


class ContractRunner:
    """Only the runner's side of the contract: `execute` grows each cache by what the plan prefills and gives every
    canvas logits peaked on the next tokens of its cache's scripted text. Anything else the scheduler reached for
    (prefill, denoise, graphs, capability checks) would be an AttributeError."""

    def __init__(self, texts: dict[int, list[int]], dtype: torch.dtype = torch.bfloat16) -> None:
        self.cfg = SimpleNamespace(vocab_size=V, canvas_length=C, final_logit_softcapping=None)
        self.device = torch.device("cpu")
        self.dtype = dtype
        self.fast = False  # the kernels a Turn reads once, for its sampler's row pass
        self.texts = texts  # id(kv) -> the prompt then the reply the "model" writes after it
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> ModelOutput:
        self.plans.append(plan)
        for p in plan.prompts + plan.commits:  # in the plan's order: the forward sees what was prefilled
            p.kv.length += len(p.ids)
        logits = []
        for x in plan.canvases:
            text = self.texts[id(x.kv)]
            rows = [text[i] if i < len(text) else 7 for i in range(x.kv.length, x.kv.length + C)]
            logits.append(peaked(rows, 30.0, V))
        return ModelOutput(logits, [0.0] * len(plan.prompts), [0.0] * len(plan.commits), 0.0)


def _assert_plain_data(plan: StepPlan) -> None:
    """A plan holds caches, token ids, dtypes, tensors and flags: no turn, canvas, request or callback."""
    assert type(plan) is StepPlan
    for p in plan.prompts + plan.commits:
        assert type(p) is Prefill and type(p.kv) is FakeKV and p.ids and all(type(t) is int for t in p.ids)
        assert p.compute_dtype in (None, torch.float32)
    for x in plan.canvases:
        assert type(x) is DenoiseInput and type(x.kv) is FakeKV and isinstance(x.ids, torch.Tensor)
        assert x.probs is None or isinstance(x.probs, torch.Tensor)
        assert type(x.seed) is bool and type(x.exact) is bool
    assert [f.name for f in dataclasses.fields(plan)] == ["prompts", "commits", "canvases"]


class CancelAfterFirstStep(CancelToken):
    def step(self, info) -> None:
        self.cancel()


def _three(runner_texts: dict[int, list[int]]):
    """Three turns (prompts not yet prefilled): A stops after 20 tokens, B runs out of its 24, C is cancelled."""
    specs = [
        ([2, 3, 4, 5, 6], list(range(10, 30)) + [STOP], 64),
        ([2, 3, 8], list(range(51, 91)), 24),  # no stop id (1, 50, 106) among them
        ([2, 9], list(range(90, 100)), 64),
    ]
    kvs = [FakeKV() for _ in specs]
    for kv, (prompt, reply, _) in zip(kvs, specs, strict=True):
        runner_texts[id(kv)] = prompt + reply
    return specs, kvs


def test_the_scheduler_runs_turns_through_the_contract_alone() -> None:
    texts: dict[int, list[int]] = {}
    runner = ContractRunner(texts)
    specs, kvs = _three(texts)
    sched = Scheduler(runner, max_batch=8)
    cancel = CancelAfterFirstStep()
    reqs = []
    for i, ((prompt, _, max_new), kv) in enumerate(zip(specs, kvs, strict=True)):
        turn = Turn(runner, prompt, kv, CFG, seed=i, max_new_tokens=max_new, prefill_now=False)
        watch = {"on_step": cancel.step, "cancel": cancel} if i == 2 else {}
        reqs.append(sched.submit(Request(turn, **watch)))

    plans = sched.schedule()  # a decision only: nothing ran
    assert not runner.plans and [kv.length for kv in kvs] == [0, 0, 0]
    assert len(plans) == 1 and [r.turn for r in plans[0].canvases] == [r.turn for r in reqs]
    for scheduled in plans:
        sched.update_from_output(scheduled, runner.execute(scheduled.plan))
    sched.run()

    for plan in runner.plans:
        _assert_plain_data(plan)
    first = runner.plans[0]
    # nothing was denoising: every prompt whole, each short one into an empty cache in fp32 (seed rule 7)
    assert [(p.kv, p.ids, p.compute_dtype) for p in first.prompts] == [
        (kv, prompt, torch.float32) for kv, (prompt, _, _) in zip(kvs, specs, strict=True)
    ]
    assert not first.commits and [x.kv for x in first.canvases] == kvs
    # step 1's SC input is the seed, the next steps' the sampler's own probabilities (sparse, in the runner's dtype)
    assert all(x.seed and x.probs is None for x in first.canvases)
    second = runner.plans[1]
    assert all(not x.seed and x.probs.dtype == torch.bfloat16 for x in second.canvases)

    # A's and B's first blocks commit in one plan, before their second canvases' forward, in the model's dtype
    committing = [p for p in runner.plans if p.commits]
    assert len(committing) == 1
    assert [(p.kv, p.ids, p.compute_dtype) for p in committing[0].commits] == [
        (kvs[0], list(range(10, 26)), None),
        (kvs[1], list(range(51, 67)), None),
    ]
    assert [x.kv for x in committing[0].canvases] == kvs[:2]  # C left after its first step

    a, b, c = (r.turn.out for r in reqs)
    assert (a.token_ids, a.finish_reason, a.blocks) == (list(range(10, 30)), "stop", 2)
    assert (b.token_ids, b.finish_reason, b.blocks) == (list(range(51, 75)), "length", 2)
    assert (c.token_ids, c.finish_reason) == ([], "cancelled")
    # each cache holds its prompt and every committed block but the last, as a lone turn leaves it
    assert [kv.length for kv in kvs] == [5 + 16, 3 + 16, 2]
    assert sched.forwards == [len(p.canvases) for p in runner.plans if p.canvases]
    assert not sched.requests


def test_a_round_runs_one_forward_a_plan_of_at_most_max_batch_canvases() -> None:
    texts: dict[int, list[int]] = {}
    runner = ContractRunner(texts)
    specs, kvs = _three(texts)
    sched = Scheduler(runner, max_batch=2)
    reqs = [
        sched.submit(Request(Turn(runner, prompt, kv, CFG, seed=i, max_new_tokens=n, prefill_now=False)))
        for i, ((prompt, _, n), kv) in enumerate(zip(specs, kvs, strict=True))
    ]
    sched.step()
    assert [len(p.canvases) for p in runner.plans] == [2, 1]
    assert len(runner.plans[0].prompts) == 3 and not runner.plans[1].prompts  # the round's prompts go first
    sched.run()
    assert max(sched.forwards) <= 2 and all(len(p.canvases) <= 2 for p in runner.plans)
    a, b, c = (r.turn.out for r in reqs)
    assert (a.token_ids, b.token_ids) == (list(range(10, 30)), list(range(51, 75)))
    assert (len(c.token_ids), c.finish_reason) == (64, "length")  # no stop token in its text: the budget


def test_a_prompt_joining_running_turns_is_planned_a_budget_a_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "PREFILL_BUDGET", 4)
    texts: dict[int, list[int]] = {}
    runner = ContractRunner(texts)
    specs, kvs = _three(texts)
    sched = Scheduler(runner)
    prompt, reply, max_new = specs[1]
    sched.submit(
        Request(Turn(runner, prompt, kvs[1], CFG, seed=0, max_new_tokens=max_new, prefill_now=False))
    )
    sched.step()
    long_prompt = list(range(2, 13))  # 11 tokens: three rounds of at most 4
    kv = FakeKV()
    texts[id(kv)] = long_prompt + reply
    late = sched.submit(
        Request(Turn(runner, long_prompt, kv, CFG, seed=1, max_new_tokens=16, prefill_now=False))
    )
    n = len(runner.plans)
    for _ in range(3):
        sched.step()
    chunks = [(p.ids, p.compute_dtype) for plan in runner.plans[n:] for p in plan.prompts if p.kv is kv]
    assert [ids for ids, _ in chunks] == [long_prompt[:4], long_prompt[4:8], long_prompt[8:]]
    assert all(dtype is None for _, dtype in chunks[1:])  # extending a cache: the model's dtype
    assert late.canvas is not None  # its first canvas opened in the round its prompt ended
    sched.run()
    assert late.turn.out.token_ids == reply[:16]
