"""Conversation routing: extend, fork on divergence, LRU bound, KV copies byte-exact."""

from __future__ import annotations

from diffgemma.engine.generate import drive
from diffgemma.session import ops as O
from diffgemma.session import registry as R
from diffgemma.session.conversation import common_prefix
from diffgemma.session.pipeline import Pipeline, call, collector
from diffgemma.session.registry import copy_prefix
from tests.server.conftest import CTX, routed_generate


def _ids(engine, text: str) -> list[int]:
    return engine.prompt_ids([{"role": "user", "content": text}])


def test_extend_fork_and_evict(engine) -> None:
    p = Pipeline(engine, CTX, max_conversations=2)
    reg = p.registry
    shared = "A long shared system prompt that several clients send before their own question. " * 2
    a = _ids(engine, shared + "First?")
    out, conv_a = routed_generate(p, a, seed=1)
    assert out.reused_tokens == 0

    # A follow-up that extends A's log continues A.
    cached = len(conv_a.log)
    follow = conv_a.log + engine.tokenizer.encode("<|turn>user\nMore<turn|>\n")
    out, conv = routed_generate(p, follow, seed=1)
    assert conv is conv_a and out.reused_tokens == cached >= len(a)

    # A request that shares only the system prompt forks: A stays cached for its own client.
    a_log = list(conv_a.log)
    b = _ids(engine, shared + "Second?")
    out, conv_b = routed_generate(p, b, seed=2)
    assert conv_b is not conv_a and conv_a.log == a_log
    assert out.reused_tokens > 16
    reg.check()

    # A third unrelated conversation evicts the least recently used one (A), never more than the bound.
    out, conv_c = routed_generate(p, _ids(engine, "Unrelated."), seed=3)
    assert len(reg) == 2 and conv_c is conv_a and out.reused_tokens == 0
    reg.check()


def test_copy_prefix_is_byte_exact(engine) -> None:
    ids = _ids(engine, "Copy me " * 20)
    _, src = routed_generate(Pipeline(engine, CTX, max_conversations=2), ids, seed=4, max_new_tokens=16)
    dst = engine.new_cache(CTX)
    n = len(ids) - 5
    copy_prefix(src.kv, dst, n)
    src.kv.truncate(n)
    assert dst.length == n and dst.fingerprint() == src.kv.fingerprint()


def test_memory_plan_bounds_context_and_conversations(engine, monkeypatch) -> None:
    from diffgemma.server import run

    assert run.kv_bytes(engine, CTX) == engine.new_cache(CTX).nbytes()
    monkeypatch.setattr(run, "free_memory", lambda device: 10 * run.kv_bytes(engine, CTX))
    assert run.plan_memory(engine, CTX, 4) == (CTX, 4)
    monkeypatch.setattr(run, "free_memory", lambda device: int(1.5 * run.kv_bytes(engine, CTX)))
    assert run.plan_memory(engine, CTX, 4) == (CTX, 1)
    monkeypatch.setattr(run, "free_memory", lambda device: run.kv_bytes(engine, CTX) // 4)
    ctx, n = run.plan_memory(engine, CTX, 4)
    assert ctx < CTX and n == 1 and run.kv_bytes(engine, ctx) <= run.kv_bytes(engine, CTX) // 4


def test_a_full_pool_salvages_a_long_prefix_in_place_and_re_prefills_the_rest(engine, caplog) -> None:
    import logging

    from diffgemma.session import registry as R

    p = Pipeline(engine, CTX, max_conversations=1)
    reg = p.registry
    prefix = engine.tokenizer.encode("word " * (R.SALVAGE_MIN_PREFIX + 20))
    a = prefix + engine.tokenizer.encode(" first question")
    _, conv = routed_generate(p, a, seed=1)
    assert reg.decision == "new"
    with caplog.at_level(logging.INFO, logger="diffgemma.server"):
        again = reg.route(prefix + engine.tokenizer.encode(" second"))
    assert again is conv and reg.decision == "salvage" and len(conv.log) > len(prefix)  # the caller cuts
    assert "route: salvage (shared prefix" in caplog.text
    assert (
        reg.route(prefix[:5] + engine.tokenizer.encode("unrelated")) is conv and reg.decision == "re-prefill"
    )
    assert conv.log == []  # five shared tokens are not worth keeping: prefilled anew

    p2 = Pipeline(engine, CTX, max_conversations=2)
    two = p2.registry
    _, x = routed_generate(p2, a, seed=1)
    _, y = routed_generate(p2, engine.tokenizer.encode("other " * 40), seed=1)
    z = two.route(prefix + engine.tokenizer.encode(" second"))  # every slot taken, a long shared prefix
    assert z is x and two.decision == "salvage"
    w = two.route(a[:40] + engine.tokenizer.encode(" elsewhere"))  # a short prefix: a copy into the LRU slot
    assert w is y and two.decision == "fork"


def _served_turn(p, ids: list[int], seed: int, max_new: int = 12) -> tuple[list[int], str]:
    """One request as the server runs it (Route, AlignTo, Generate, Finalize): the reply's tokens and its route."""
    (routed,) = call(p, O.Route(ids))
    (aligned,) = call(p, O.AlignTo(ids))
    reply = call(p, O.Generate(ids[aligned.reused :], seed, max_new))[-1]
    call(p, O.Finalize(ids + reply.token_ids))
    return reply.token_ids, routed.route


def _solo(engine, ids: list[int], seed: int, max_new: int = 12) -> list[int]:
    """The reply to `ids` on a pipeline of its own (nothing cached)."""
    return _served_turn(Pipeline(engine, CTX, max_conversations=1), ids, seed, max_new)[0]


def test_a_fork_of_the_only_idle_conversation_cuts_it_instead_of_evicting_its_own_source(engine) -> None:
    """Issue 57 item 10: four slots, three held by running turns, and a request whose best route is a fork of the
    fourth (the least recently used, the only idle one). The fork's copy must not go into the slot it copies from
    (evicted first, it had no prefix left: 'cannot truncate to N: cache holds 0 positions'); the request gets the
    reply of its solo run, and so do the three held turns."""
    system = "You are a terse assistant for the harbour office; answer in one short line. "
    prompts = [_ids(engine, system + q) for q in ("Tides?", "Ferries?", "Cranes?", "Berths?")]
    p = Pipeline(engine, CTX, max_conversations=4)
    for i, ids in enumerate(prompts):  # A, B, C, D cached; A the least recently used
        _served_turn(p, ids, seed=i)
    conv_a = p.registry.conversations[0]
    assert len(p.registry) == 4 and common_prefix(conv_a.log, prompts[0]) == len(prompts[0])

    # Three long requests, one continuing each of B, C, D, hold their conversations (begun, not yet driven).
    held = []
    for conv in p.registry.conversations[1:]:
        follow = list(conv.log) + engine.tokenizer.encode("<|turn>user\nAnd tomorrow?<turn|>\n<|turn>model\n")
        call(p, O.Route(follow))
        assert p.active is conv and p.registry.decision == "continue"
        events: list[O.Event] = []
        request = p.begin_generate(O.Generate(follow[len(conv.log) :], 7, 24), collector(events, None))
        assert request is not None
        held.append((follow, request, events))
    assert p.registry.idle() == [conv_a]

    x = _ids(engine, system + "Pilots?")  # shares the system prompt with A (a fork of it), diverges after
    shared = common_prefix(conv_a.log, x)
    assert R.MIN_FORK_TOKENS <= shared < R.SALVAGE_MIN_PREFIX and shared < len(x)
    got, route = _served_turn(p, x, seed=9)
    assert (
        route == "salvage" and p.active is conv_a
    )  # the fork's source is the only slot that can go: cut in place
    assert conv_a.log[: len(x)] == x
    p.registry.check()
    assert got == _solo(engine, x, seed=9)

    for follow, request, events in held:  # the held turns end as their solo runs do
        drive(request.turn, request.on_step, request.cancel, request.on_commit)
        p.end_generate(request)
        assert events[-1].token_ids == _solo(engine, follow, seed=7, max_new=24)
    p.registry.check()
