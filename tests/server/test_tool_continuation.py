"""Tool-turn continuation with thinking on: the tool-mode prompt opens the thought channel, the next round prompts
as the raw log (reasoning intact) plus the results and a reopened thought, a pure extension of the cache; the round
that ends the turn finalizes thought-free. Thinking off, and --no-tool-continuation, keep the canonical render."""

from __future__ import annotations

from diffgemma.server import create_app
from tests.server.conftest import CTX, MODEL, ServerThread
from tests.server.test_tools_reasoning import WEATHER

CALL = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


def _history(first) -> list[dict]:
    msg = first.choices[0].message
    calls = [c.model_dump(include={"id", "type", "function"}) for c in msg.tool_calls]
    return [
        *QUESTION,
        {"role": "assistant", "content": msg.content or "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Snow, -3 C"},
    ]


def test_the_next_round_continues_the_raw_log_with_its_reasoning(server, client, script, engine) -> None:
    tok = engine.tokenizer
    s = script("I should look it up.\n<channel|>" + CALL, "It snows.\n<channel|>It is snowing in Oslo.")
    first = client.chat.completions.create(
        model=MODEL + ":think", messages=QUESTION, tools=[WEATHER], max_tokens=64
    )
    assert first.choices[0].message.reasoning_content == "I should look it up."  # the thought was seeded open
    assert tok.decode(s.prompts[0]).endswith("<|turn>model\n<|channel>thought\n")
    server.check_registry()
    cached = list(server.app.state.registry.conversations[0].log)
    assert tok.decode(cached).endswith("I should look it up.\n<channel|>" + CALL + "<|tool_response>")  # raw
    history = _history(first)
    second = client.chat.completions.create(
        model=MODEL + ":think", messages=history, tools=[WEATHER], max_tokens=64
    )
    assert second.choices[0].message.content == "It is snowing in Oslo."
    assert second.choices[0].message.reasoning_content == "It snows."
    assert second.usage.prompt_tokens_details.cached_tokens == len(cached)  # a pure extension of the raw log
    suffix = tok.decode(s.prompts[1])  # what the round prefilled: the result and a reopened thought
    assert suffix == 'response:get_weather{value:<|"|>Snow, -3 C<|"|>}<tool_response|><|channel>thought\n'
    server.check_registry()
    final = server.app.state.registry.conversations[0].log
    canonical = tok.encode_chat(
        [*history, {"role": "assistant", "content": "It is snowing in Oslo."}],
        tools=[WEATHER], add_generation_prompt=False, enable_thinking=True,
    )  # fmt: skip
    assert final == canonical and "I should look it up" not in tok.decode(final)  # the turn ends thought-free


def test_thinking_off_and_the_switch_keep_the_canonical_render(engine, script, tmp_path) -> None:
    tok = engine.tokenizer
    for kwargs, model in (({}, MODEL), ({"tool_continuation": False}, MODEL + ":think")):
        with ServerThread(create_app(engine, ctx=CTX, **kwargs)) as srv:
            client = srv.client()
            s = script(CALL, "Snowing.")
            first = client.chat.completions.create(
                model=model, messages=QUESTION, tools=[WEATHER], max_tokens=64
            )
            history = _history(first)
            client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=64)
            think = model.endswith(":think")
            assert s.prompts[0] == tok.encode_chat(QUESTION, tools=[WEATHER], enable_thinking=think)
            full = tok.encode_chat(history, tools=[WEATHER], enable_thinking=think)
            assert s.prompts[1] == full[len(full) - len(s.prompts[1]) :] and not tok.decode(
                s.prompts[1]
            ).endswith("<|channel>thought\n")
