"""`pad_block_stop`: a committed block of nothing but pad and filler ends the reply ("stop"), its blanks dropped, on
every path that commits blocks (the lone `Turn`, the `Scheduler`, the session's block ops), and only when on."""

from __future__ import annotations

import pytest
import torch

import diffgemma
from diffgemma.config import SamplerConfig, load_sampler_config
from diffgemma.engine.batch import Request, Scheduler
from diffgemma.engine.generate import generate
from diffgemma.engine.sampler import filler_id
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Pipeline, call
from diffgemma.weights.download import bundled_model
from tests.fake_model import FakeKV, FakeModel, peaked

V, C = 200, 16
CFG = SamplerConfig(max_denoising_steps=4, stop_token_ids=(1, 106, 50), empty_reply_retry=0)
PAD, FILLER = 0, filler_id(V)
SKY = "Why is the sky blue?"  # the README's streaming example: pad from its first block with thinking on


def sure(tokens: list[int]) -> torch.Tensor:
    return peaked(tokens, 40.0, V)


def blocks_then_blank(text_blocks: int, blank: list[int]) -> FakeModel:
    """A model whose first `text_blocks` blocks are text (ids 20..) and every later one `blank`."""
    model = FakeModel(V, C, lambda i, c: sure(blank))
    # the block being denoised: the prompt and each committed block are one prefill each
    model.script = lambda i, c: sure(
        [20 + r for r in range(C)] if len(model.prefilled) <= text_blocks else blank
    )
    return model


def test_a_pad_block_ends_the_reply_and_leaves_it() -> None:
    model = blocks_then_blank(2, [PAD, FILLER] * (C // 2))
    kv = FakeKV()
    out = generate(model, [5, 6], kv, CFG, seed=1, max_new_tokens=10 * C)
    assert out.finish_reason == "stop" and out.stop_token is None
    assert out.token_ids == [20 + r for r in range(C)] * 2  # the blank block is no part of the reply
    assert out.blocks == 3
    # every reply token is in the cache (the blank block never is): the next turn extends it as after a stop
    assert kv.length == 2 + 2 * C and out.cached_tokens == len(out.token_ids)


def test_off_the_blank_blocks_run_to_the_budget() -> None:
    model = blocks_then_blank(1, [PAD] * C)
    out = generate(model, [5], FakeKV(), CFG.replace(pad_block_stop=False), seed=1, max_new_tokens=4 * C)
    assert out.finish_reason == "length" and len(out.token_ids) == 4 * C
    assert out.token_ids[C:] == [PAD] * 3 * C


def test_text_after_a_pad_is_not_a_blank_block() -> None:
    # pad rows that are not sure and duplicate each other: the confidence cut keeps row 0 only, yet the block has
    # text after them, which the next block re-denoises
    def script(i: int, c: torch.Tensor) -> torch.Tensor:
        if i >= 4:
            return sure([20 + r for r in range(C - 1)] + [106])
        logits = sure([PAD, PAD, PAD] + [30 + r for r in range(C - 3)])
        logits[1:3, PAD] = 0.3  # p_max well below commit_conf_trim's 0.9
        return logits

    out = generate(FakeModel(V, C, script), [5], FakeKV(), CFG, seed=1, max_new_tokens=4 * C)
    assert out.token_ids == [PAD] + [20 + r for r in range(C - 1)]
    assert out.finish_reason == "stop" and out.stop_token == 106


def test_the_option_is_an_environment_override(tmp_path) -> None:
    assert load_sampler_config(tmp_path, {}).pad_block_stop
    assert not load_sampler_config(tmp_path, {"DIFFGEMMA_PAD_BLOCK_STOP": "0"}).pad_block_stop
    assert not SamplerConfig().reference().pad_block_stop  # the reference runs to max_new_tokens


@pytest.fixture(scope="module")
def demo() -> diffgemma.Engine:
    return diffgemma.load(bundled_model(), device="cpu", dtype="float32", threads=1)


def test_thinking_on_the_demo_model_stops_by_itself(demo) -> None:
    blocks: list[list[int]] = []
    out = demo.generate(SKY, think=True, max_new_tokens=512, on_block=blocks.append)
    assert out.finish_reason == "stop" and out.blocks <= 3
    blank = {PAD, filler_id(demo.config.vocab_size)}
    assert all(set(b) - blank for b in blocks if b)  # no blank block reached the reply
    off = demo.generate(SKY, think=True, max_new_tokens=160, pad_block_stop=False)
    assert off.finish_reason == "length" and len(off.token_ids) == 160 and set(off.token_ids) == {PAD}


def test_the_scheduler_stops_on_a_blank_block(demo) -> None:
    ids = demo.prompt_ids(SKY, think=True)
    turns = {}
    sched = Scheduler(demo.runner)
    for on in (True, False):
        turns[on] = demo.turn(ids, demo.new_cache(), demo.sampler.replace(pad_block_stop=on), 42, 160)
        sched.submit(Request(turns[on]))
    sched.run()
    assert turns[True].out.finish_reason == "stop" and turns[True].out.token_ids == []
    assert turns[False].out.finish_reason == "length" and len(turns[False].out.token_ids) == 160


def test_the_session_block_ops_stop_on_a_blank_block(demo) -> None:
    p = Pipeline(demo)
    call(p, O.Activate(0))
    call(p, O.Extend(demo.prompt_ids(SKY, think=True)))
    call(p, O.BeginTurn(seed=42))
    (prop,) = call(p, O.ProposeBlock())
    assert set(prop.tokens) == {PAD}
    (committed,) = call(p, O.CommitBlock(len(prop.tokens)))
    assert committed.done and committed.ids == []
    (replied,) = call(p, O.EndTurn())
    assert replied.finish_reason == "stop" and replied.token_ids == []
