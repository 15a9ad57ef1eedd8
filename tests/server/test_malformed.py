"""A corpus of malformed requests over both completion routes: no 5xx, every 4xx an OpenAI-shaped error naming
the field, and the next normal answers unchanged."""

from __future__ import annotations

import json
from typing import Any

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

from diffgemma.server import create_app
from tests.server.conftest import CTX, MODEL, ServerThread

OK_MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MAX_BODY = 64_000


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": OK_MSG, "max_tokens": 4, **fields}).encode()


def comp(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}).encode()


def raw_chat(fragment: str) -> bytes:
    """A chat body with `fragment` spliced in verbatim (JSON that json.dumps would never write)."""
    head = json.dumps({"model": MODEL, "messages": OK_MSG})[:-1]
    return (head + ", " + fragment + "}").encode()


def tool(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
ASKED = [*OK_MSG, {"role": "assistant", "tool_calls": [CALL]}]
DEEP = 30_000  # nesting levels: deep enough for Python's own recursion limit, inside the body limit

# (name, method, path, body, status, error param or None)
CASES: list[tuple[str, str, str, bytes | None, int, str | None]] = [
    # the body itself
    ("bad json", "POST", CHAT, b'{"model": ', 400, None),
    ("not utf-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400, None),
    ("body is a string", "POST", COMP, b'"hello"', 400, None),
    ("arrays nested 30k deep", "POST", CHAT, b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, None),
    (
        "objects nested 10k deep",
        "POST",
        COMP,
        b'{"prompt": ' + b'{"a":' * 10_000 + b"1" + b"}" * 10_000 + b"}",
        400,
        None,
    ),
    (
        "nested 100 deep in an unknown field",
        "POST",
        CHAT,
        raw_chat('"x": ' + "[" * 100 + "]" * 100),
        400,
        None,
    ),
    ("NaN", "POST", CHAT, raw_chat('"temperature": NaN'), 400, None),
    ("Infinity", "POST", CHAT, raw_chat('"max_tokens": Infinity'), 400, None),
    ("-Infinity", "POST", COMP, b'{"prompt": "hi", "seed": -Infinity}', 400, None),
    (
        "lone surrogate in content",
        "POST",
        CHAT,
        raw_chat('"x": 1').replace(b'"hi"', b'"a\\ud800b"'),
        400,
        "messages[0].content",
    ),
    ("lone surrogate in the user field", "POST", CHAT, raw_chat('"user": "\\udc00"'), 400, "user"),
    (
        "lone surrogate in a key",
        "POST",
        CHAT,
        raw_chat('"metadata": {"\\ud83d": 1}'),
        400,
        "metadata.\\ud83d",
    ),
    ("lone surrogate in a prompt", "POST", COMP, b'{"prompt": "x\\udfff"}', 400, "prompt"),
    ("oversized body", "POST", CHAT, chat(padding="x" * 70_000), 413, None),
    # messages
    ("missing messages", "POST", CHAT, json.dumps({"model": MODEL}).encode(), 400, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages=5), 400, "messages"),
    ("messages empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("message not an object", "POST", CHAT, chat(messages=["hi"]), 400, "messages[0]"),
    ("missing role", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0]"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "narrator", "content": "x"}]), 400, "messages[0]"),
    ("user content missing", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (
        "content is a number",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 3}]),
        400,
        "messages[0].content",
    ),
    (
        "content part not an object",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": ["x"]}]),
        400,
        "messages[0].content",
    ),
    (
        "content part of unknown type",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "blob"}]}]),
        400,
        "messages[0].content",
    ),
    (
        "content part text not a string",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
        400,
        "messages[0].content",
    ),
    (
        "image part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages[0]",
    ),
    (
        "tool message without tool_call_id",
        "POST",
        CHAT,
        chat(messages=[*ASKED, {"role": "tool", "content": "42"}]),
        400,
        "messages[2].tool_call_id",
    ),
    (
        "tool_call_id matching no call",
        "POST",
        CHAT,
        chat(messages=[*ASKED, {"role": "tool", "tool_call_id": "zz", "content": "42"}]),
        400,
        "messages[2].tool_call_id",
    ),
    (
        "tool message after a user message",
        "POST",
        CHAT,
        chat(messages=[*OK_MSG, {"role": "tool", "tool_call_id": "c1", "content": "42"}]),
        400,
        "messages[1].tool_call_id",
    ),
    (
        "tool_calls not a list",
        "POST",
        CHAT,
        chat(messages=[*OK_MSG, {"role": "assistant", "tool_calls": {"a": 1}}]),
        400,
        "messages[1].tool_calls",
    ),
    (
        "tool call without a name",
        "POST",
        CHAT,
        chat(
            messages=[
                *OK_MSG,
                {"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]},
            ]
        ),
        400,
        "messages[1].tool_calls[0]",
    ),
    (
        "tool call id not a string",
        "POST",
        CHAT,
        chat(messages=[*OK_MSG, {"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}]),
        400,
        "messages[1].tool_calls[0]",
    ),
    (
        "arguments not JSON",
        "POST",
        CHAT,
        chat(
            messages=[
                *OK_MSG,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{bad"}}],
                },
            ]
        ),
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "arguments a JSON array",
        "POST",
        CHAT,
        chat(
            messages=[
                *OK_MSG,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1, 2]"}}],
                },
            ]
        ),
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "arguments a number",
        "POST",
        CHAT,
        chat(
            messages=[
                *OK_MSG,
                {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": 5}}]},
            ]
        ),
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "arguments with NaN",
        "POST",
        CHAT,
        chat(
            messages=[
                *OK_MSG,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": '{"a": NaN}'}}],
                },
            ]
        ),
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "prompt longer than the context",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "a b " * CTX}]),
        400,
        "messages",
    ),
    # tools
    ("tools not a list", "POST", CHAT, chat(tools={"a": 1}), 400, "tools"),
    ("tool not a function", "POST", CHAT, chat(tools=[{"type": "code_interpreter"}]), 400, "tools[0]"),
    (
        "tool name empty",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": ""}}]),
        400,
        "tools[0]",
    ),
    (
        "tool description a number",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]),
        400,
        "tools[0]",
    ),
    ("parameters a list", "POST", CHAT, chat(tools=tool([1])), 400, "tools[0].function.parameters"),
    (
        "properties a list",
        "POST",
        CHAT,
        chat(tools=tool({"type": "object", "properties": [1, 2]})),
        400,
        "tools[0].function.parameters.properties",
    ),
    (
        "properties holding a number",
        "POST",
        CHAT,
        chat(tools=tool({"type": "object", "properties": {"a": 3}})),
        400,
        "tools[0].function.parameters.properties.a",
    ),
    (
        "nested properties a string",
        "POST",
        CHAT,
        chat(tools=tool({"properties": {"a": {"type": "object", "properties": "x"}}})),
        400,
        "tools[0].function.parameters.properties.a.properties",
    ),
    (
        "items a number",
        "POST",
        CHAT,
        chat(tools=tool({"properties": {"a": {"type": "array", "items": 5}}})),
        400,
        "tools[0].function.parameters.properties.a.items",
    ),
    (
        "required not strings",
        "POST",
        CHAT,
        chat(tools=tool({"properties": {}, "required": [1]})),
        400,
        "tools[0].function.parameters.required",
    ),
    (
        "type a number",
        "POST",
        CHAT,
        chat(tools=tool({"properties": {"a": {"type": 7}}})),
        400,
        "tools[0].function.parameters.properties.a.type",
    ),
    (
        "enum not a list",
        "POST",
        CHAT,
        chat(tools=tool({"properties": {"a": {"type": "string", "enum": "x"}}})),
        400,
        "tools[0].function.parameters.properties.a.enum",
    ),
    (
        "tool_choice names a missing tool",
        "POST",
        CHAT,
        chat(tools=tool({}), tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice a number", "POST", CHAT, chat(tools=tool({}), tool_choice=5), 400, "tool_choice"),
    # parameters
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("zero max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    ("n > 1", "POST", CHAT, chat(n=2), 400, "n"),
    ("stream not a boolean", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    (
        "stream_options not an object",
        "POST",
        CHAT,
        chat(stream=True, stream_options=3),
        400,
        "stream_options",
    ),
    (
        "include_usage not a boolean",
        "POST",
        CHAT,
        chat(stream=True, stream_options={"include_usage": 1}),
        400,
        "stream_options",
    ),
    ("temperature not a number", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("seed not an integer", "POST", CHAT, chat(seed=1.5), 400, "seed"),
    ("stop of the wrong type", "POST", CHAT, chat(stop=[1, 2]), 400, "stop"),
    ("stop an empty string", "POST", CHAT, chat(stop=""), 400, "stop"),
    ("too many stops", "POST", CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("bad reasoning_effort", "POST", CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    (
        "chat_template_kwargs not an object",
        "POST",
        CHAT,
        chat(chat_template_kwargs=[]),
        400,
        "chat_template_kwargs",
    ),
    (
        "enable_thinking not a boolean",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": "y"}),
        400,
        "chat_template_kwargs",
    ),
    ("logprobs not a boolean", "POST", CHAT, chat(logprobs="yes"), 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs above 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("model not a string", "POST", CHAT, chat(model=5), 400, "model"),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("unknown model suffix", "POST", CHAT, chat(model=MODEL + ":fast"), 404, "model"),
    # completions
    ("completion without prompt", "POST", COMP, json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    ("completion prompt empty", "POST", COMP, comp(prompt=""), 400, "prompt"),
    ("completion prompt of floats", "POST", COMP, comp(prompt=[1.5, 2.0]), 400, "prompt"),
    ("completion negative token id", "POST", COMP, comp(prompt=[5, -1]), 400, "prompt"),
    ("completion token id out of range", "POST", COMP, comp(prompt=[5, 10**9]), 400, "prompt"),
    ("completion batch of two", "POST", COMP, comp(prompt=["a", "b"]), 400, "prompt"),
    ("completion prompt longer than the context", "POST", COMP, comp(prompt=[5] * CTX), 400, "prompt"),
    ("completion logprobs above 20", "POST", COMP, comp(logprobs=50), 400, "logprobs"),
    ("completion logprobs a boolean", "POST", COMP, comp(logprobs=True), 400, "logprobs"),
    ("completion echo not a boolean", "POST", COMP, comp(echo="no"), 400, "echo"),
    ("completion max_tokens 0", "POST", COMP, comp(max_tokens=0), 400, "max_tokens"),
    ("completion n = 3", "POST", COMP, comp(n=3), 400, "n"),
    ("completion stop a number", "POST", COMP, comp(stop=3), 400, "stop"),
    ("completion unknown model", "POST", COMP, comp(model="davinci"), 404, "model"),
    ("completion seed a string", "POST", COMP, comp(seed="1"), 400, "seed"),
    # sampler fields
    ("entropy_bound a string", "POST", CHAT, chat(entropy_bound="low"), 400, "entropy_bound"),
    ("entropy_bound zero", "POST", CHAT, chat(entropy_bound=0), 400, "entropy_bound"),
    ("max_denoising_steps a float", "POST", CHAT, chat(max_denoising_steps=1.5), 400, "max_denoising_steps"),
    ("max_denoising_steps zero", "POST", COMP, comp(max_denoising_steps=0), 400, "max_denoising_steps"),
    (
        "max_denoising_steps past the cap",
        "POST",
        COMP,
        comp(max_denoising_steps=10**9),
        400,
        "max_denoising_steps",
    ),
    ("t_min above t_max", "POST", CHAT, chat(t_min=0.9, t_max=0.5), 400, "t_min"),
    ("t_max below the server's t_min", "POST", COMP, comp(t_max=0.1), 400, "t_max"),
    ("t_min negative", "POST", COMP, comp(t_min=-0.1), 400, "t_min"),
    ("commit_conf_trim 1.5", "POST", CHAT, chat(commit_conf_trim=1.5), 400, "commit_conf_trim"),
    ("plateau_steps negative", "POST", COMP, comp(plateau_steps=-1), 400, "plateau_steps"),
    ("pad_gate a string", "POST", CHAT, chat(pad_gate="yes"), 400, "pad_gate"),
    ("denoiser_argmax a number", "POST", COMP, comp(denoiser_argmax=1), 400, "denoiser_argmax"),
    (
        "stability_threshold a boolean",
        "POST",
        COMP,
        comp(stability_threshold=True),
        400,
        "stability_threshold",
    ),
    ("confidence_threshold zero", "POST", COMP, comp(confidence_threshold=0), 400, "confidence_threshold"),
    ("entropy_stop negative", "POST", CHAT, chat(entropy_stop=-0.5), 400, "entropy_stop"),
    ("empty_reply_retry past the cap", "POST", CHAT, chat(empty_reply_retry=100), 400, "empty_reply_retry"),
    (
        "prefill_f32_max_tokens negative",
        "POST",
        COMP,
        comp(prefill_f32_max_tokens=-1),
        400,
        "prefill_f32_max_tokens",
    ),
    ("sc_sparse a list", "POST", COMP, comp(sc_sparse=[True]), 400, "sc_sparse"),
    ("stop_token_ids", "POST", CHAT, chat(stop_token_ids=[1]), 400, "stop_token_ids"),
    ("pad_token_id", "POST", COMP, comp(pad_token_id=0), 400, "pad_token_id"),
    ("max_new_tokens", "POST", COMP, comp(max_new_tokens=5), 400, "max_new_tokens"),
    # routes
    ("unknown route", "POST", "/v1/embeddings", b"{}", 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("wrong method on completions", "GET", COMP, None, 405, None),
    ("posting to the model list", "POST", "/v1/models", b"{}", 405, None),
    ("unknown model card", "GET", "/v1/models/other", None, 404, "model"),
]


@pytest.fixture(scope="module")
def small_server(engine):
    with ServerThread(create_app(engine, ctx=CTX, max_body_bytes=MAX_BODY)) as srv:
        yield srv


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)
    assert sum(c[2] == COMP for c in CASES) >= 15 and all(len(c[3] or b"") <= MAX_BODY for c in CASES[:14])


def answers(http: httpx.Client) -> tuple[Any, Any]:
    json_type = {"content-type": "application/json"}
    a = http.post(CHAT, content=chat(max_tokens=12, seed=9), headers=json_type).json()
    b = http.post(COMP, content=comp(max_tokens=12, seed=9), headers=json_type).json()
    return a["choices"][0]["message"]["content"], b["choices"][0]["text"]


def test_malformed_requests(small_server) -> None:
    failures = []
    with httpx.Client(base_url=small_server.base, timeout=30) as http:
        before = answers(http)
        for name, method, path, body, status, param in CASES:
            r = http.request(method, path, content=body, headers={"content-type": "application/json"})
            error = (
                r.json().get("error")
                if r.headers.get("content-type", "").startswith("application/json")
                else None
            )
            ok = (
                r.status_code == status
                and isinstance(error, dict)
                and set(error) == {"message", "type", "param", "code"}
                and isinstance(error["message"], str)
                and error["message"]
                and (param is None or error["param"] == param)
            )
            if not ok:
                failures.append((name, r.status_code, r.text[:300]))
        assert not failures, failures
        assert http.get("/health").status_code == 200
        assert answers(http) == before  # and it still answers, the same
    small_server.check_registry()
