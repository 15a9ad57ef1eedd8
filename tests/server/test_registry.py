"""Conversation routing: extend, fork on divergence, LRU bound, KV copies byte-exact."""

from __future__ import annotations

from diffgemma.session.registry import Registry, copy_prefix
from tests.server.conftest import CTX


def _ids(engine, text: str) -> list[int]:
    return engine.prompt_ids([{"role": "user", "content": text}])


def test_extend_fork_and_evict(engine) -> None:
    reg = Registry(engine, CTX, max_conversations=2)
    shared = "A long shared system prompt that several clients send before their own question. " * 2
    a = _ids(engine, shared + "First?")
    out, conv_a = reg.generate(a, max_new_tokens=8, seed=1)
    assert out.reused_tokens == 0

    # A follow-up that extends A's log continues A.
    cached = len(conv_a.log)
    follow = conv_a.log + engine.tokenizer.encode("<|turn>user\nMore<turn|>\n")
    out, conv = reg.generate(follow, max_new_tokens=8, seed=1)
    assert conv is conv_a and out.reused_tokens == cached >= len(a)

    # A request that shares only the system prompt forks: A stays cached for its own client.
    a_log = list(conv_a.log)
    b = _ids(engine, shared + "Second?")
    out, conv_b = reg.generate(b, max_new_tokens=8, seed=2)
    assert conv_b is not conv_a and conv_a.log == a_log
    assert out.reused_tokens > 16
    reg.check()

    # A third unrelated conversation evicts the least recently used one (A), never more than the bound.
    out, conv_c = reg.generate(_ids(engine, "Unrelated."), max_new_tokens=8, seed=3)
    assert len(reg) == 2 and conv_c is conv_a and out.reused_tokens == 0
    reg.check()


def test_copy_prefix_is_byte_exact(engine) -> None:
    reg = Registry(engine, CTX, max_conversations=2)
    ids = _ids(engine, "Copy me " * 20)
    _, src = reg.generate(ids, max_new_tokens=16, seed=4)
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

    reg = Registry(engine, CTX, max_conversations=1)
    prefix = engine.tokenizer.encode("word " * (R.SALVAGE_MIN_PREFIX + 20))
    a = prefix + engine.tokenizer.encode(" first question")
    conv = reg.route(a)
    assert reg.decision == "new"
    conv.generate(a, max_new_tokens=8, seed=1)
    with caplog.at_level(logging.INFO, logger="diffgemma.server"):
        again = reg.route(prefix + engine.tokenizer.encode(" second"))
    assert again is conv and reg.decision == "salvage" and len(conv.log) > len(prefix)  # the caller cuts
    assert "route: salvage (shared prefix" in caplog.text
    assert (
        reg.route(prefix[:5] + engine.tokenizer.encode("unrelated")) is conv and reg.decision == "re-prefill"
    )
    assert conv.log == []  # five shared tokens are not worth keeping: prefilled anew

    two = Registry(engine, CTX, max_conversations=2)
    x = two.route(a)
    x.generate(a, max_new_tokens=8, seed=1)
    y = two.route(engine.tokenizer.encode("other " * 40))
    y.generate(engine.tokenizer.encode("other " * 40), max_new_tokens=8, seed=1)
    z = two.route(prefix + engine.tokenizer.encode(" second"))  # every slot taken, a long shared prefix
    assert z is x and two.decision == "salvage"
    w = two.route(a[:40] + engine.tokenizer.encode(" elsewhere"))  # a short prefix: a copy into the LRU slot
    assert w is y and two.decision == "fork"
