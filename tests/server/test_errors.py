"""Malformed requests get OpenAI-style errors and leave the server healthy; auth, body limit, full queue."""

from __future__ import annotations

import json
import threading
import time
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


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": OK_MSG, "max_tokens": 4, **fields}).encode()


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (name, method, path, body, status, error param or None)
CASES: list[tuple[str, str, str, bytes | None, int, str | None]] = [
    ("bad json", "POST", CHAT, b'{"model": ', 400, None),
    ("not utf-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400, None),
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
        chat(messages=[*OK_MSG, {"role": "tool", "content": "42"}]),
        400,
        "messages[1].tool_call_id",
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
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("zero max_completion_tokens", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    ("n > 1", "POST", CHAT, chat(n=2), 400, "n"),
    ("stream not a boolean", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    ("temperature not a number", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("seed not an integer", "POST", CHAT, chat(seed=1.5), 400, "seed"),
    ("stop of the wrong type", "POST", CHAT, chat(stop=[1, 2]), 400, "stop"),
    ("tools not a list", "POST", CHAT, chat(tools={"a": 1}), 400, "tools"),
    (
        "tool_choice names a missing tool",
        "POST",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        "tool_choice",
    ),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("bad reasoning_effort", "POST", CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    (
        "prompt longer than the context",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "a b " * CTX}]),
        400,
        "messages",
    ),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("unknown model suffix", "POST", CHAT, chat(model=MODEL + ":fast"), 404, "model"),
    ("oversized body", "POST", CHAT, chat(padding="x" * 70_000), 413, None),
    (
        "completion without prompt",
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL}).encode(),
        400,
        "prompt",
    ),
    (
        "completion token id out of range",
        "POST",
        "/v1/completions",
        json.dumps({"prompt": [5, 10**9]}).encode(),
        400,
        "prompt",
    ),
    ("unknown route", "POST", "/v1/embeddings", b"{}", 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("unknown model card", "GET", "/v1/models/other", None, 404, "model"),
]


@pytest.fixture(scope="module")
def small_server(engine):
    with ServerThread(create_app(engine, ctx=CTX, max_body_bytes=64_000)) as srv:
        yield srv


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 15


def test_malformed_requests(small_server) -> None:
    failures = []
    with httpx.Client(base_url=small_server.base, timeout=30) as http:
        for name, method, path, body, status, param in CASES:
            r = http.request(method, path, content=body)
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
        ok = http.post(CHAT, content=chat())  # and it still answers
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    small_server.app.state.registry.check()


def test_unknown_fields_are_ignored(small_server) -> None:
    body = chat(
        frequency_penalty=0.5, logit_bias={"1": 2}, user="u", metadata={"a": "b"}, top_p=0.3, temperature=0
    )
    r = httpx.post(small_server.base + CHAT, content=body, timeout=30)
    assert r.status_code == 200


def test_api_key(engine) -> None:
    with ServerThread(create_app(engine, ctx=CTX, api_key="s3cret")) as srv:
        r = httpx.post(srv.base + CHAT, content=chat())
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        bad = httpx.get(srv.base + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        assert httpx.get(srv.base + "/health").status_code == 200
        models = srv.client(api_key="s3cret").models.list()
        assert models.data[0].id == MODEL


def test_full_queue_is_a_503_with_retry_after(engine, monkeypatch) -> None:
    gate = threading.Event()
    real = engine.model.denoise

    def blocked(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "denoise", blocked)
    with ServerThread(create_app(engine, ctx=CTX, max_queue=1)) as srv:
        results: list[int] = []

        def post() -> None:
            results.append(httpx.post(srv.base + CHAT, content=chat(), timeout=30).status_code)

        first = threading.Thread(target=post)
        first.start()
        while srv.app.state.worker.depth < 1:  # the first job is running (and blocked)
            time.sleep(0.01)
        second = threading.Thread(target=post)
        second.start()
        while srv.app.state.worker.depth < 2:  # the second one fills the queue
            time.sleep(0.01)
        third = httpx.post(srv.base + CHAT, content=chat(), timeout=30)
        assert third.status_code == 503 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["code"] == "server_overloaded"
        gate.set()
        first.join()
        second.join()
        assert results == [200, 200]
