"""The token pipeline's ops on a tiny model (CPU, fp32): each op, the epoch rule, the per-block protocol."""

from __future__ import annotations

import pytest

import diffgemma
from diffgemma.engine.generate import CancelToken
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Pipeline, sampler_fields


@pytest.fixture(scope="module")
def eng(tiny_a):
    return diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=4, max_tokens=512)


def run(p: Pipeline, op: O.Op, **kw) -> list[O.Event]:
    events: list[O.Event] = []
    p.run(op, events.append, **kw)
    return events


def one(p: Pipeline, op: O.Op, **kw) -> O.Event:
    events = run(p, op, **kw)
    assert len(events) == 1, events
    return events[0]


PROMPT: list[int] = []


@pytest.fixture(scope="module", autouse=True)
def prompt(eng):
    PROMPT[:] = eng.prompt_ids("What is 17 + 25? Say it in a few words.")


def test_every_op_and_event_round_trips_through_json():
    samples = [
        O.Route([1, 2]), O.Activate(3), O.Extend([4]), O.AlignTo([5]), O.Finalize([6]), O.Rewind((1, 7)),
        O.Splice(1, 2, [8]), O.SyntheticFill(9, 1), O.KvFingerprint(), O.Mark(), O.BeginTurn(1, 2, None, 3),
        O.ProposeBlock(), O.CommitBlock(4), O.DiscardBlock(), O.EndTurn(), O.Generate([1], 2, 3, {"a": 1}, 0),
        O.Read([1, 2], [1], [[5, 6]], 2), O.Ping(), O.Cancel(), O.Shutdown(),
    ]  # fmt: skip
    assert {type(s).__name__ for s in samples} == set(O.OPS)
    for s in samples:
        assert O.from_json(s.to_json(), O.OPS) == s
    ev = O.Replied([1], "stop", 106, 3, 1, 0, 0, (0, 5), [[1, -0.5, [[1, -0.5]]]], None)
    assert O.from_json(ev.to_json(), O.EVENTS) == ev
    with pytest.raises(ValueError, match="unknown message type 'Nope'"):
        O.from_json({"type": "Nope"}, O.OPS)
    with pytest.raises(ValueError, match="bad Extend"):
        O.from_json({"type": "Extend", "idz": []}, O.OPS)


def test_generate_is_the_engines_generate_token_for_token(eng):
    want = eng.generate(PROMPT, seed=7, max_new_tokens=40)
    p = Pipeline(eng)
    assert isinstance(one(p, O.Activate(0)), O.Activated)
    events = run(p, O.Generate(PROMPT, seed=7, max_new_tokens=40))
    *blocks, done = events
    assert isinstance(done, O.Replied) and done.token_ids == want.token_ids
    assert (done.finish_reason, done.stop_token, done.steps) == (
        want.finish_reason,
        want.stop_token,
        want.steps,
    )
    assert [t for b in blocks for t in b.ids] == want.token_ids and blocks[-1].done
    assert done.kv == (0, len(PROMPT) + want.cached_tokens)


def test_the_per_block_ops_give_generates_results(eng):
    p, q = Pipeline(eng), Pipeline(eng)
    for pipe in (p, q):
        one(pipe, O.Activate(0))
    want = run(p, O.Generate(PROMPT, seed=3, max_new_tokens=60))[-1]
    one(q, O.Extend(PROMPT))
    assert isinstance(one(q, O.BeginTurn(seed=3, max_new_tokens=60)), O.TurnBegun)
    from diffgemma.engine.generate import default_commit

    while True:
        prop = one(q, O.ProposeBlock())
        assert isinstance(prop, O.Proposed)
        kept = default_commit(q.turn, q.turn.proposal)
        if kept is None:
            assert isinstance(one(q, O.DiscardBlock()), O.Discarded)
            continue
        if one(q, O.CommitBlock(kept)).done:
            break
    got = one(q, O.EndTurn())
    assert got == want
    assert one(q, O.KvFingerprint()) == one(p, O.KvFingerprint())


def test_a_policy_sees_a_block_before_it_enters_the_cache(eng):
    p = Pipeline(eng)
    one(p, O.Activate(0))
    one(p, O.Extend(PROMPT))
    before = one(p, O.KvFingerprint())
    one(p, O.BeginTurn(seed=5, max_new_tokens=200))
    prop = one(p, O.ProposeBlock())
    assert one(p, O.KvFingerprint()) == before  # proposing reads the cache only
    assert one(p, O.DiscardBlock()) == O.Discarded(0, 1)
    again = one(p, O.ProposeBlock())
    # the next retry's seed; the tiny canvas (16) is below MIN_CANVAS, so it is not halved
    assert (again.block, again.retry) == (0, 1) and again.tokens != prop.tokens
    committed = one(p, O.CommitBlock(3))
    assert committed.ids == again.tokens[:3]
    if not committed.done:
        one(p, O.ProposeBlock())  # the commit is prefilled before the next proposal
        assert p.active.log[len(PROMPT) :] == again.tokens[:3]
    reply = one(p, O.EndTurn())
    assert reply.token_ids[:3] == again.tokens[:3] and reply.retries == 1
    assert isinstance(one(p, O.CommitBlock(1)), O.Failed)  # no turn is open


def test_epochs_refuse_a_stale_rewind(eng):
    p = Pipeline(eng)
    one(p, O.Activate(0))
    one(p, O.Extend(PROMPT))
    mark = one(p, O.Mark())
    assert mark == O.Marked((0, len(PROMPT)))
    one(p, O.Extend([400, 401, 402]))
    late = one(p, O.Mark()).kv
    assert one(p, O.Rewind(mark.kv)) == O.Rewound((1, len(PROMPT)))  # the cut starts epoch 1
    failed = one(p, O.Rewind(late))  # what (0, len + 3) named was cut away
    assert isinstance(failed, O.Failed) and "stale KV position" in failed.message
    one(p, O.Extend([400, 401, 402]))
    assert isinstance(one(p, O.Rewind(late)), O.Failed)  # same position, other lineage: still refused
    assert one(p, O.Rewind((0, 4))) == O.Rewound((2, 4))  # below every cut since epoch 0: still valid


def test_align_finalize_splice_fill_and_fingerprints(eng):
    p, q = Pipeline(eng), Pipeline(eng)
    one(p, O.Activate(0))
    one(q, O.Activate(0))
    one(p, O.Extend(PROMPT + [500, 501]))
    assert one(p, O.AlignTo(PROMPT + [600])) == O.Aligned((1, len(PROMPT)), len(PROMPT))
    one(p, O.Extend([600]))
    one(q, O.Extend(PROMPT + [600]))
    assert one(p, O.KvFingerprint()).sha256 == one(q, O.KvFingerprint()).sha256
    assert one(p, O.Splice(4, 6, [700, 701, 702])).kv == (2, len(PROMPT) + 2)
    assert p.active.log == PROMPT[:4] + [700, 701, 702] + PROMPT[6:] + [600]
    fresh = Pipeline(eng)
    one(fresh, O.Activate(0))
    one(fresh, O.Extend(p.active.log))
    assert one(fresh, O.KvFingerprint()).sha256 == one(p, O.KvFingerprint()).sha256
    assert one(p, O.Finalize(PROMPT)).kv == (3, len(PROMPT))
    assert one(p, O.Finalize([1] * 600)).skipped  # does not fit: left as it was
    one(p, O.SyntheticFill(20, seed=3))
    one(q, O.SyntheticFill(20, seed=3))
    assert p.active.log[-20:] == q.active.log[-20:] and len(set(p.active.log[-20:])) > 1
    assert isinstance(one(p, O.Splice(5, 2, [])), O.Failed)


def test_routing_activates_the_longest_prefix_and_new_ids_in_order(eng):
    p = Pipeline(eng, max_conversations=2)
    assert one(p, O.Route(PROMPT)) == O.Activated(0, (0, 0), 0, "new")
    run(p, O.Generate(PROMPT, max_new_tokens=8))
    routed = one(p, O.Route(PROMPT + [900]))
    assert routed.conv == 0 and routed.shared == len(PROMPT) and routed.route == "continue"
    assert one(p, O.Activate(1)).conv == 1
    failed = one(p, O.Activate(5))
    assert isinstance(failed, O.Failed) and "next id, 2" in failed.message
    assert isinstance(one(p, O.Ping()), O.Pong) and isinstance(one(p, O.Shutdown()), O.Stopped)


def test_a_cancel_records_where_it_struck_and_context_errors_are_events(eng):
    p = Pipeline(eng)
    one(p, O.Activate(0))
    token = CancelToken()
    steps = []

    def on_step(info):
        steps.append(info.step)
        if len(steps) == 3:
            token.cancel()

    done = run(p, O.Generate(PROMPT, seed=1, max_new_tokens=200), on_step=on_step, cancel=token)[-1]
    assert done.finish_reason == "cancelled" and done.cancel_after == 3
    too_long = one(p, O.Generate([5] * 600))
    assert isinstance(too_long, O.Failed) and "does not fit" in too_long.message
    assert p.sampler(sampler_fields(eng.sampler)) == eng.sampler
