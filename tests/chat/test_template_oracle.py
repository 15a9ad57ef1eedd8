"""Our Gemma 4 renderer against Google's Gemma 4 chat template (the oracle), byte for byte."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffgemma.chat.template import render_gemma4
from diffgemma.chat.tokenizer import ChatTokenizer
from diffgemma.testing.tokenizer import build_tokenizer, write_tokenizer_files

ORACLE = Path(__file__).resolve().parents[2] / ".." / "shared" / "oracle" / "gemma4_chat_template.jinja"
needs_oracle = pytest.mark.skipif(not ORACLE.is_file(), reason=f"oracle template not found at {ORACLE}")


def _oracle_env() -> jinja2.Environment:
    """The environment transformers builds for chat templates (utils/chat_template_utils.py)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


@functools.cache
def _oracle_template() -> jinja2.Template:
    return _oracle_env().from_string(ORACLE.read_text())


def oracle(messages, tools=None, add_generation_prompt=True, enable_thinking=False) -> str:
    template = _oracle_template()
    return template.render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
        bos_token="<bos>",
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "integer", "description": "Forecast days"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "Limit": {"type": "number", "description": "Max results", "nullable": True},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["api", "guide"]}},
                "filters": {
                    "type": "object",
                    "description": "Nested filters",
                    "properties": {
                        "since": {"type": "string", "description": "ISO date"},
                        "authors": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
                                "required": ["name"],
                            },
                        },
                    },
                    "required": ["since"],
                },
                "meta": {"type": "object", "description": "Free-form", "extra": {"type": "string"}},
                "kinds": {"type": "array", "items": {"type": ["string", "null"], "description": "kind"}},
            },
            "required": ["query", "exact"],
        },
        "response": {"description": "The matches", "type": "object"},
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "now", "description": "Current time."}}

CALL_WEATHER = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
}
CALL_SEARCH = {
    "id": "call_2",
    "type": "function",
    "function": {
        "name": "search_docs",
        "arguments": {
            "query": "tool calls",
            "exact": False,
            "Limit": 2.5,
            "tags": ["api", "guide"],
            "filters": {"since": "2024-01-01", "authors": [{"name": "Ada", "id": 7}], "missing": None},
        },
    },
}

CASES: dict[str, dict[str, Any]] = {
    "user_only": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "user_only_no_prompt": {
        "messages": [{"role": "user", "content": "  Hi there  \n"}],
        "add_generation_prompt": False,
    },
    "system_multiturn": {
        "messages": [
            {"role": "system", "content": "  You are terse.\n"},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Count to 3."},
        ]
    },
    "developer_role": {
        "messages": [
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
        ]
    },
    "thinking_on": {
        "messages": [{"role": "system", "content": "Be careful."}, {"role": "user", "content": "2+2?"}],
        "enable_thinking": True,
    },
    "thinking_on_no_system": {"messages": [{"role": "user", "content": "2+2?"}], "enable_thinking": True},
    "thinking_on_no_prompt": {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "enable_thinking": True,
        "add_generation_prompt": False,
    },
    "content_parts": {
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": " Part one. "}, {"type": "text", "text": "Two"}],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "Look: "}, {"type": "text", "text": " here "}],
            },
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "<|channel>thought\nhm<channel|>Seen."}],
            },
            {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
        ]
    },
    "earlier_thought_stripped": {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<|channel>thought\nlet me think\n<channel|>A1"},
            {"role": "user", "content": "Q2"},
            {
                "role": "assistant",
                "content": "<|channel>thought\nagain<channel|>A2 <|channel>x<channel|> tail ",
                "reasoning_content": "should not appear (no tool calls)",
            },
            {"role": "user", "content": "Q3"},
        ],
        "enable_thinking": True,
    },
    "tools_declared": {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, SEARCH, NO_PARAMS],
    },
    "tools_with_system": {
        "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"}],
        "tools": [WEATHER],
        "enable_thinking": True,
    },
    "one_call_pending": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL_WEATHER]},
        ],
        "tools": [WEATHER],
    },
    "one_call_string_result": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [CALL_WEATHER]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
        "tools": [WEATHER],
    },
    "call_result_then_answer": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL_WEATHER]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny"}'},
            {"role": "assistant", "content": "It is sunny and 21 C."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": [WEATHER],
    },
    "several_calls_with_reasoning": {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Weather and docs?"},
            {
                "role": "assistant",
                "reasoning_content": "I need two tools.",
                "tool_calls": [CALL_WEATHER, CALL_SEARCH],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Rain"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "3 hits"}]},
        ],
        "tools": [WEATHER, SEARCH],
        "enable_thinking": True,
    },
    "tool_result_named": {
        "messages": [
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c9", "type": "function", "function": {"name": "now", "arguments": {}}}
                ],
            },
            {"role": "tool", "tool_call_id": "other", "name": "clock", "content": "12:00"},
            {"role": "assistant", "content": "Noon."},
        ],
        "tools": [NO_PARAMS],
        "add_generation_prompt": False,
    },
    "old_reasoning_before_last_user": {
        "messages": [
            {"role": "user", "content": "First"},
            {"role": "assistant", "reasoning_content": "old thoughts", "tool_calls": [CALL_WEATHER]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Again"},
        ],
    },
    "call_with_content": {
        "messages": [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [CALL_SEARCH]},
            {"role": "tool", "tool_call_id": "call_2", "content": "done"},
        ],
    },
    "unicode_and_whitespace": {
        "messages": [
            {"role": "system", "content": "\n\tÜnïcödé — 日本語 🙂  "},
            {"role": "user", "content": "  café?  "},
            {"role": "assistant", "content": "  Oui ☕  "},
        ],
        "add_generation_prompt": False,
    },
    "legacy_tool_responses_mapping": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [CALL_WEATHER],
                "tool_responses": [
                    {"name": "get_weather", "response": {"temp": 21, "Sky": "sunny", "ok": True, "x": None}}
                ],
            },
            {"role": "assistant", "content": "Sunny."},
        ],
    },
    "only_system": {"messages": [{"role": "system", "content": "Alone."}]},
}


@needs_oracle
@pytest.mark.parametrize("name", sorted(CASES))
def test_renderer_matches_oracle(name: str) -> None:
    case = CASES[name]
    kwargs = {k: v for k, v in case.items() if k != "messages"}
    expected = oracle(case["messages"], **kwargs)
    got = render_gemma4(case["messages"], **kwargs)
    assert got == expected


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 15


@needs_oracle
def test_string_arguments_render_like_objects() -> None:
    """OpenAI sends arguments as a JSON string; we render it as the oracle renders the object."""
    as_string = {**CALL_SEARCH, "function": {**CALL_SEARCH["function"]}}
    as_string["function"]["arguments"] = json.dumps(CALL_SEARCH["function"]["arguments"])
    msgs = [{"role": "user", "content": "Go"}]
    got = render_gemma4([*msgs, {"role": "assistant", "tool_calls": [as_string]}])
    assert got == oracle([*msgs, {"role": "assistant", "tool_calls": [CALL_SEARCH]}])
    assert "call:search_docs{exact:false,filters:{authors:[{id:7," in got


@needs_oracle
def test_json_object_tool_result_renders_as_mapping() -> None:
    """The oracle crashes on a dict `content`; we render it as it renders a mapping `tool_responses` entry."""
    result = {"temp": 21, "Sky": "sunny", "tags": ["a", "b"]}
    head = [{"role": "user", "content": "Weather?"}]
    ours = render_gemma4(
        [
            *head,
            {"role": "assistant", "tool_calls": [CALL_WEATHER]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
        ]
    )
    legacy = [
        *head,
        {
            "role": "assistant",
            "tool_calls": [CALL_WEATHER],
            "tool_responses": [{"name": "get_weather", "response": result}],
        },
    ]
    assert ours == oracle(legacy)
    assert '<|tool_response>response:get_weather{Sky:<|"|>sunny<|"|>,tags:[' in ours


@needs_oracle
def test_generation_prompt_facts() -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    off = render_gemma4(msgs)
    assert (
        off
        == "<bos><|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    on = render_gemma4(msgs, enable_thinking=True)
    assert on.startswith("<bos><|turn>system\n<|think|>\n<turn|>\n") and on.endswith("<|turn>model\n")


def test_unknown_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="narrator"):
        render_gemma4([{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}])


@needs_oracle
def test_chat_tokenizer_uses_checkpoint_template(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, build_tokenizer())
    msgs = CASES["several_calls_with_reasoning"]
    plain = ChatTokenizer.from_dir(tmp_path)
    assert plain.chat_template is None
    marked = ORACLE.read_text().replace("{{- bos_token -}}", "{{- bos_token -}}[from-checkpoint]", 1)
    (tmp_path / "chat_template.jinja").write_text(marked)
    with_template = ChatTokenizer.from_dir(tmp_path)
    kwargs = {"tools": msgs["tools"], "enable_thinking": True}
    rendered = with_template.render(msgs["messages"], **kwargs)
    assert rendered.startswith("<bos>[from-checkpoint]<|turn>system\n")
    assert rendered.replace("[from-checkpoint]", "", 1) == plain.render(msgs["messages"], **kwargs)


TEXTS = st.sampled_from(
    ["", "  hi  ", "Hello\nworld", " <|channel>thought\nx<channel|>ok ", "Ünï 🙂", "a<channel|>b"]
)
CALLS = st.lists(st.sampled_from([CALL_WEATHER, CALL_SEARCH]), min_size=1, max_size=2)


@st.composite
def messages_st(draw) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        role = draw(st.sampled_from(["system", "developer"]))
        msgs.append(
            {"role": role, "content": draw(TEXTS | st.builds(lambda t: [{"type": "text", "text": t}], TEXTS))}
        )
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["user", "assistant", "call", "parts"]))
        if kind == "user":
            msgs.append({"role": "user", "content": draw(TEXTS)})
        elif kind == "parts":
            role = draw(st.sampled_from(["user", "assistant"]))
            parts = [{"type": "text", "text": t} for t in draw(st.lists(TEXTS, max_size=3))]
            msgs.append({"role": role, "content": parts})
        elif kind == "assistant":
            msgs.append({"role": "assistant", "content": draw(TEXTS), "reasoning_content": draw(TEXTS)})
        else:
            calls = draw(CALLS)
            msgs.append(
                {
                    "role": "assistant",
                    "content": draw(st.none() | TEXTS),
                    "reasoning_content": draw(TEXTS),
                    "tool_calls": calls,
                }
            )
            for call in calls[: draw(st.integers(0, len(calls)))]:
                body = draw(TEXTS | st.builds(lambda t: [{"type": "text", "text": t}], TEXTS))
                msgs.append({"role": "tool", "tool_call_id": call["id"], "name": "n", "content": body})
    return msgs


@needs_oracle
@settings(max_examples=300, deadline=None)
@given(
    messages=messages_st(),
    tools=st.none() | st.lists(st.sampled_from([WEATHER, SEARCH, NO_PARAMS]), max_size=3),
    add_generation_prompt=st.booleans(),
    enable_thinking=st.booleans(),
)
def test_random_conversations_match_oracle(messages, tools, add_generation_prompt, enable_thinking) -> None:
    kwargs = {
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "enable_thinking": enable_thinking,
    }
    assert render_gemma4(messages, **kwargs) == oracle(messages, **kwargs)


@needs_oracle
def test_json_string_tool_result_renders_as_the_template_renders_it() -> None:
    """The standard OpenAI form of a tool result (content a JSON string) renders as the official template does:
    as a string value."""
    content = json.dumps({"conditions": "sunny", "temperature": 21})
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [CALL_WEATHER]},
        {"role": "tool", "tool_call_id": "call_1", "content": content},
    ]
    got = render_gemma4(msgs)
    assert got == oracle(msgs)
    assert f'<|tool_response>response:get_weather{{value:<|"|>{content}<|"|>}}<tool_response|>' in got
