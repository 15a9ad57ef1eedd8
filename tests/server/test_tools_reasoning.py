"""Tool calls, reasoning, stop strings and JSON mode, with scripted replies on the real KV path."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.chat.test_template_oracle import oracle
from tests.server.conftest import MODEL

ORACLE = Path(__file__).resolve().parents[2].parent / "shared" / "oracle" / "gemma4_chat_template.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


def _message_dict(message) -> dict:
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


@pytest.mark.skipif(not ORACLE.is_file(), reason=f"oracle template not found at {ORACLE}")
def test_tool_call_round_trip(server, client, script, renders) -> None:
    s = script(CALL, "It is sunny in Paris.")
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER], max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    history = [
        *question,
        _message_dict(choice.message),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=64)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"

    # The second prompt is exactly what the template renders (the oracle takes arguments as objects).
    prompt = [r for r in renders if r["add_generation_prompt"]][-1]["text"]
    as_objects = json.loads(json.dumps(history))
    as_objects[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected = oracle(as_objects, tools=[WEATHER])
    assert prompt == expected
    assert prompt.endswith("<tool_response|>") and "response:get_weather{value:" in prompt

    # The tool-calling turn was finalized prefix-stable: only the tool result was prefilled.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == len(
        server.app.state.registry.engine.tokenizer.encode(expected.split("response:get_weather")[0])
    )
    assert s.prompts[1] == server.app.state.registry.engine.tokenizer.encode(expected)[cached:]
    server.check_registry()


def test_tool_call_streaming(client, script) -> None:
    script('<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>')
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Rome?"}], tools=[WEATHER], stream=True
        )
    )
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == {"city": "Rome"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_tool_choice_named_forces_the_call(client, script) -> None:
    s = script('city:<|"|>Oslo<|"|>}<tool_call|>')
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert s.engine.tokenizer.decode(s.prompts[-1]).endswith("<|tool_call>call:get_weather{")


def test_tool_choice_none_hides_tools(client, script, renders) -> None:
    script("Just text.")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.content == "Just text." and r.choices[0].message.tool_calls is None
    assert "<|tool>" not in [r for r in renders if r["add_generation_prompt"]][0]["text"]


@pytest.mark.parametrize(
    "extra",
    [
        {"model": MODEL + ":think"},
        {"model": MODEL, "reasoning_effort": "high"},
        {"model": MODEL, "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
    ],
)
def test_reasoning_split(client, script, renders, extra) -> None:
    script("<|channel>thought\nParis is in France.\n<channel|>The capital is Paris.")
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Capital?"}], **extra)
    message = r.choices[0].message
    assert message.reasoning_content == "Paris is in France."
    assert message.content == "The capital is Paris."
    prompt = [r for r in renders if r["add_generation_prompt"]][0]  # (a finalize may render before it)
    assert prompt["enable_thinking"] is True and prompt["text"].endswith("<|turn>model\n")


def test_reasoning_streaming_and_forced_off(client, script, renders) -> None:
    script("<|channel>thought\nHmm, let me see.<channel|>Done.")
    chunks = list(
        client.chat.completions.create(
            model=MODEL + ":think",
            messages=[{"role": "user", "content": "Go"}],
            stream=True,
        )
    )
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == "Hmm, let me see." and content == "Done."

    script("Plain.")
    client.chat.completions.create(
        model=MODEL + ":think=false", messages=[{"role": "user", "content": "Go"}], reasoning_effort="high"
    )
    # the model suffix wins (the prompt's render: the previous turn's finalize may render after it)
    assert [r for r in renders if r["add_generation_prompt"]][-1]["enable_thinking"] is False


def test_stop_strings_cut_and_cancel(client, script) -> None:
    script("Hello world. STOP here and never more " * 3, block=2)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop=["STOP"]
    )
    assert r.choices[0].message.content == "Hello world. "
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 20  # generation stopped early

    script("one two three", block=1)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop=["two"], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "one "


def test_json_object_retries_with_a_new_seed(server, client, script) -> None:
    s = script("not json at all", '```json\n{"answer": 42}\n```')
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
    )
    assert json.loads(r.choices[0].message.content) == {"answer": 42}
    assert len(s.prompts) == 2

    script("nope", "still nope", "{broken")
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON"}],
            response_format={"type": "json_object"},
        )
    assert err.value.body["code"] == "invalid_model_output" and "3 attempts" in err.value.body["message"]
    server.check_registry()
