"""The census's trace: the engine's StepInfo carries each row's p_max (the hook), the recorder turns a reply's
steps and commits into blocks, and the metrics count contested, hard and duplicated rows and the steps."""

from __future__ import annotations

import pytest
import torch

import diffgemma
from diffgemma.census.metrics import CONTESTED_P_MAX, metrics, trace_counts
from diffgemma.census.trace import BlockTrace, Trace, TraceRecorder
from diffgemma.config import SamplerConfig
from diffgemma.engine.generate import StepInfo, denoise_block
from tests.fake_model import FakeKV, FakeModel, peaked

V, C = 32, 8


def test_step_info_p_max_is_the_row_max_and_the_commits_confidence():
    script = lambda i, c: peaked(list(range(C)), [0.5 + 0.5 * r + i for r in range(C)], V)  # noqa: E731
    infos: list[StepInfo] = []
    res = denoise_block(
        FakeModel(V, C, script), FakeKV(), SamplerConfig(max_denoising_steps=4), 3, C, infos.append
    )
    for info in infos:
        probs = torch.softmax(script(info.step - 1, None) / info.temperature, dim=-1)
        assert torch.allclose(info.p_max, probs.max(-1).values, atol=1e-6)
    assert infos[-1].p_max.tolist() == pytest.approx(res.p_max)  # the last step's is what the block commits


def _info(step: int, p_max: list[float], accepted: list[bool]) -> StepInfo:
    n = len(p_max)
    z = torch.zeros(n)
    return StepInfo(
        0,
        step,
        0.5,
        torch.zeros(n, dtype=torch.long),
        torch.tensor(accepted),
        z.mean(),
        z,
        torch.tensor(p_max),
    )


def test_recorder_keeps_the_committed_rows_and_counts_rerolled_canvases():
    rec = TraceRecorder()
    for step in (1, 2, 3):  # a canvas re-rolled after 3 steps (no commit followed it)
        rec.on_step(_info(step, [0.1, 0.2, 0.3], [False, False, False]))
    rec.on_step(_info(1, [0.5, 0.99, 0.7], [True, True, False]))
    rec.on_step(_info(2, [0.95, 0.99, 0.5], [True, True, False]))
    rec.on_block([5, 6])  # the confidence trim kept two rows of three
    t = rec.trace
    assert (t.retries, t.retry_steps) == (1, 3)
    assert len(t.blocks) == 1 and t.blocks[0].tokens == [5, 6] and t.blocks[0].steps == 2
    assert t.blocks[0].p_max == pytest.approx([0.95, 0.99]) and t.blocks[0].accepted == [True, True]


def test_counts_on_a_hand_built_trace():
    low = CONTESTED_P_MAX - 0.01
    trace = Trace(
        blocks=[
            BlockTrace([7, 7, 0, 0, 9], [0.99, low, 0.95, 0.2, 0.99], [True, True, True, False, True], 4),
            BlockTrace([9, 3], [0.99, 0.99], [True, False], 2),  # 9 after 9 across the block boundary: a dup
        ],
        retry_steps=5,
        retries=1,
    )
    c = trace_counts(trace, pad_id=0)
    assert c == {
        "tokens": 7, "contested": 2, "hard": 2, "dup": 2, "blocks": 2, "steps_committed": 6, "steps_retry": 5,
        "steps_run": 11, "retries": 1,
    }  # fmt: skip
    m = metrics([{**c, "passed": True}, {**trace_counts(Trace(), 0), "passed": False}])
    assert m["pass_rate"] == 0.5 and m["contested_per_1k"] == pytest.approx(2000 / 7)
    assert m["steps_per_block"] == 3 and m["steps_run_per_reply"] == 5.5 and m["steps_retry_per_reply"] == 2.5


def test_a_demo_reply_trace_matches_the_engines_output():
    eng = diffgemma.load(diffgemma.demo_model(), device="cpu")
    rec = TraceRecorder()
    out = eng.generate("Count from 3 to 20.", seed=1, on_step=rec.on_step, on_block=rec.on_block)
    assert [t for b in rec.trace.blocks for t in b.tokens] == out.token_ids
    assert [b.steps for b in rec.trace.blocks] == out.block_steps and out.blocks == len(rec.trace.blocks) > 1
    assert trace_counts(rec.trace, 0)["steps_run"] == out.steps
    assert all(0 < p <= 1 for b in rec.trace.blocks for p in b.p_max)
