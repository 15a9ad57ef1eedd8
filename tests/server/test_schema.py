"""The request models: /openapi.json describes both bodies, and no value anywhere in a body gets past them as
anything but our 400 (or the model's 404)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

from diffgemma.config import SamplerConfig
from diffgemma.server.errors import APIError
from diffgemma.server.schema import ChatRequest, parse_chat, parse_completion
from tests.server.conftest import MODEL

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": {"ok": True}},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "stop": ["\n\n"],
    "stream_options": {"include_usage": True},
    "response_format": {"type": "json_object"},
    "chat_template_kwargs": {"enable_thinking": True},
    "logprobs": True,
    "top_logprobs": 2,
    "max_denoising_steps": 8,
}
COMPLETION_BODY: dict[str, Any] = {"model": MODEL, "prompt": [[5, 6, 7]], "echo": True, "logprobs": 3}
ODD = [None, 0, -1, 2.5, True, "", "x", [], [1], ["x"], {}, {"a": 1}, [{}], {"type": 5}, [{"type": "text"}]]
SAMPLER = SamplerConfig()


def test_openapi_describes_both_request_bodies(server) -> None:
    spec = httpx.get(server.base + "/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def body(path: str) -> dict[str, Any]:
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.removeprefix("#/components/schemas/")]

    chat, completion = body("/v1/chat/completions"), body("/v1/completions")
    assert {"messages", "tools", "tool_choice", "entropy_bound", "max_denoising_steps"} <= set(
        chat["properties"]
    )
    assert {"prompt", "echo", "logprobs", "commit_conf_trim"} <= set(completion["properties"])
    assert "messages" in chat["required"] and "prompt" in completion["required"]
    assert not {"stop_token_ids", "pad_token_id", "max_new_tokens"} & set(chat["properties"])
    refs = list(_refs(spec))
    assert "#/components/schemas/ChatMessage" in refs
    assert all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs)  # every $ref resolves


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_the_valid_bodies_parse_as_before() -> None:
    req = parse_chat(copy.deepcopy(CHAT_BODY), MODEL, SAMPLER)
    assert isinstance(req, ChatRequest) and req.think and req.json_mode and req.include_usage
    assert (req.tool_choice.mode, req.tool_choice.name, req.logprobs, req.stop) == (
        "required",
        "f",
        2,
        ["\n\n"],
    )
    assert req.messages[1] == {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert req.messages[2]["tool_calls"] == [CALL] and req.messages[3]["content"] == {"ok": True}
    assert req.tools == CHAT_BODY["tools"] and req.sampler == SAMPLER.replace(max_denoising_steps=8)
    comp = parse_completion(copy.deepcopy(COMPLETION_BODY), MODEL, SAMPLER)
    assert (comp.prompt, comp.echo, comp.logprobs, comp.seed, comp.sampler) == ([5, 6, 7], True, 3, 42, None)


def _mutations(body: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every place in `body` (and one new key in each object) with each odd value put there."""
    if isinstance(body, dict):
        for key in [*body, "extra"]:
            for value in ODD:
                yield (*path, key), value
            if key in body:
                yield from _mutations(body[key], (*path, key))
    elif isinstance(body, list):
        for i, item in enumerate(body):
            for value in ODD:
                yield (*path, i), value
            yield from _mutations(item, (*path, i))


def _put(body: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(body)
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(("parse", "body"), [(parse_chat, CHAT_BODY), (parse_completion, COMPLETION_BODY)])
def test_no_odd_value_escapes_as_anything_but_our_error(parse, body) -> None:
    outcomes = {"ok": 0, "400": 0}
    for path, value in _mutations(body):
        try:
            parse(_put(body, path, value), MODEL, SAMPLER)
            outcomes["ok"] += 1
        except APIError as exc:
            assert exc.status == 400 or (exc.status == 404 and path == ("model",)), (path, value, exc.message)
            assert exc.param and exc.message, (path, value)
            if exc.status == 400 and path[0] != "extra":  # where the odd value is, or a field it bears on
                assert exc.param.split(".")[0].split("[")[0] in (path[0], "tool_choice", "top_logprobs")
            outcomes["400"] += 1
    assert outcomes["ok"] > 20 and outcomes["400"] > 100, outcomes  # both kinds of value were tried
