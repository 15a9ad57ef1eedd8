"""A conversation's answers do not depend on what the server's cache held (CPU, fp32: token for token)."""

from __future__ import annotations

from diffgemma.engine.generate import prefill
from diffgemma.server import create_app
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Pipeline, call
from tests.server.conftest import CTX, MODEL, ServerThread, routed_generate

TURNS = [
    "hello there",
    "what is two plus two?",
    "tell me a story about a fox",
    "why?",
    "and then what happened next",
    "ok thanks",
    "bye",
]


def test_cached_turns_equal_a_fresh_servers(engine) -> None:
    """Seven turns against one server (each turn reuses the cache the last one left) and each turn also sent
    whole to a new server: the same reply every time."""
    messages: list[dict] = []
    with ServerThread(create_app(engine, ctx=CTX)) as cached:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            r = cached.client().chat.completions.create(
                model=MODEL, messages=messages, max_tokens=40, seed=11
            )
            with ServerThread(create_app(engine, ctx=CTX)) as fresh:
                f = fresh.client().chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=40, seed=11
                )
            assert r.choices[0].message.content == f.choices[0].message.content, turn
            assert f.usage.prompt_tokens_details.cached_tokens == 0
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # the later turns did reuse the cache
        cached.check_registry()


def test_an_identical_request_reuses_its_own_conversation(engine) -> None:
    p = Pipeline(engine, CTX, max_conversations=2)
    reg = p.registry
    a = engine.prompt_ids([{"role": "user", "content": "First conversation, asked twice."}])
    b = engine.prompt_ids([{"role": "user", "content": "Another one."}])
    out_a, conv_a = routed_generate(p, a, seed=1)
    _, conv_b = routed_generate(p, b, seed=1)
    again, conv = routed_generate(p, a, seed=1)
    assert conv is conv_a and len(reg) == 2  # not a copy that evicts conversation B
    assert again.token_ids == out_a.token_ids and again.reused_tokens == len(a)
    assert conv_b in reg.conversations and conv_b.log[: len(b)] == b
    reg.check()


def test_a_cache_holds_the_bytes_of_one_prefill_of_its_tokens(engine) -> None:
    """However a conversation's tokens reached the cache (prompts, committed blocks, finalized turns, rewinds),
    its K/V are bit for bit those of one prefill of the same tokens into an empty cache."""
    p = Pipeline(engine, CTX, max_conversations=1)
    messages: list[dict] = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        out, conv = routed_generate(p, engine.tokenizer.encode_chat(messages), seed=11, max_new_tokens=40)
        messages.append({"role": "assistant", "content": engine.parse(out).text})
        call(p, O.Finalize(engine.tokenizer.encode_chat(messages, add_generation_prompt=False)))
        fresh = engine.new_cache(CTX)
        prefill(engine.runner, conv.log, fresh, engine.sampler)
        assert conv.kv.fingerprint() == fresh.fingerprint(), turn


def test_prefill_in_any_pieces_gives_the_same_bytes(engine) -> None:
    import torch

    ids = torch.randint(3, 1000, (1, 150), generator=torch.Generator().manual_seed(0))
    whole = engine.new_cache(CTX)
    engine.runner.prefill(ids, whole)
    for cuts in ([1, 2, 3], [17, 40, 41, 100], [16, 32, 149]):
        kv = engine.new_cache(CTX)
        for a, b in zip([0, *cuts], [*cuts, 150], strict=True):
            engine.runner.prefill(ids[:, a:b], kv)
        assert kv.fingerprint() == whole.fingerprint(), cuts
    engine.runner.rewind(kv, 70)  # and a rewind leaves what a prefill of the shorter prefix leaves
    short = engine.new_cache(CTX)
    engine.runner.prefill(ids[:, :70], short)
    assert kv.fingerprint() == short.fingerprint()
