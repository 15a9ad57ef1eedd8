"""The Python API with text: strings and message lists through the chat template; parsed replies; KV reuse."""

from __future__ import annotations

import pytest

import diffgemma
from diffgemma.engine.generate import GenerateOutput

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def eng(tiny_a):
    return diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=3)


def test_string_and_messages_render_through_the_template(eng):
    tok = eng.tokenizer
    ids = eng.prompt_ids("What is 17 + 25?")
    assert tok.decode(ids).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    think = eng.prompt_ids([{"role": "user", "content": "hi"}], think=True)
    assert tok.decode(think).startswith("<bos><|turn>system\n<|think|>")
    with_tools = tok.decode(eng.prompt_ids([{"role": "user", "content": "hi"}], tools=TOOLS))
    assert "<|tool>declaration:get_weather{" in with_tools
    assert eng.prompt_ids("<|turn>raw", raw=True) == tok.encode("<|turn>raw")
    out = eng.generate("What is 17 + 25?", max_new_tokens=8, seed=1)
    assert out.prompt_tokens == len(ids) and isinstance(out.text, str) and len(out.token_ids) == 8


def test_replies_are_parsed_into_text_reasoning_and_tool_calls(eng):
    tok = eng.tokenizer
    reply = tok.encode(
        '<|channel>thought\nlet me see<channel|>The answer<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    )
    out = eng.parse(GenerateOutput(token_ids=reply))
    assert out.reasoning == "let me see" and out.text == "The answer"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_a_session_reuses_the_common_prefix_and_rewinds(eng):
    s = diffgemma.Session(eng, ctx=512)
    kv = s.pipeline.active.kv
    msgs = [{"role": "user", "content": "first question"}]
    ids1 = eng.prompt_ids(msgs)
    out1 = s.generate(ids1, max_new_tokens=40, seed=2)
    assert out1.reused_tokens == 0 and kv.length == len(s.log) == len(ids1) + out1.cached_tokens
    msgs += [{"role": "assistant", "content": out1.text}, {"role": "user", "content": "second"}]
    ids2 = eng.prompt_ids(msgs)
    out2 = s.generate(ids2, max_new_tokens=8, seed=2)
    assert len(ids1) - 4 <= out2.reused_tokens < len(ids1)  # the history drops the empty thought channel
    assert s.log[: len(ids2)] == ids2 and kv.length == len(s.log)
    # A different conversation in the same cache: only the shared <bos><|turn>user prefix survives.
    out3 = s.generate(eng.prompt_ids("something else entirely"), max_new_tokens=8, seed=2)
    assert out3.reused_tokens <= 4
    with pytest.raises(ValueError, match="does not fit"):
        s.generate(list(range(3, 600)))
    assert kv.length == len(s.log) and s.pipeline.active.kv is kv


def test_one_shot_calls_reuse_the_engines_cache_and_match_a_fresh_engine(tiny_a, eng):
    """One-shot calls are ops on a conversation of the engine's own, emptied and reused (the denoise graphs are
    tied to a cache): a call after another gives what a fresh engine gives, and a reply stops at the context."""
    fresh = diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=3)
    want = fresh.generate("a first question", max_new_tokens=12, seed=5).token_ids
    eng.generate("something else entirely, to leave K/V behind", max_new_tokens=30, seed=9)
    kv = eng._oneshot.pipeline.active.kv
    assert eng.generate("a first question", max_new_tokens=12, seed=5).token_ids == want
    assert eng._oneshot.pipeline.active.kv is kv
    out = eng.generate("a long one", max_new_tokens=kv.max_tokens + 10, seed=1)
    assert eng._oneshot.pipeline.active.kv is kv and out.prompt_tokens + len(out.token_ids) < kv.max_tokens
