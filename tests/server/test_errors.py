"""Auth, unknown fields, the full queue; the malformed-request corpus is in test_malformed.py."""

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
JSON = {"Content-Type": "application/json"}  # bodies sent as bytes name their type (else 415)


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": OK_MSG, "max_tokens": 4, **fields}).encode()


@pytest.fixture(scope="module")
def small_server(engine):
    with ServerThread(create_app(engine, ctx=CTX, max_body_bytes=64_000)) as srv:
        yield srv


def test_unknown_fields_are_ignored(small_server) -> None:
    body = chat(
        frequency_penalty=0.5, logit_bias={"1": 2}, user="u", metadata={"a": "b"}, top_p=0.3, temperature=0
    )
    r = httpx.post(small_server.base + CHAT, content=body, headers=JSON, timeout=30)
    assert r.status_code == 200


def test_api_key(engine) -> None:
    with ServerThread(create_app(engine, ctx=CTX, api_key="s3cret")) as srv:
        r = httpx.post(srv.base + CHAT, content=chat(), headers=JSON)
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
            results.append(httpx.post(srv.base + CHAT, content=chat(), headers=JSON, timeout=30).status_code)

        first = threading.Thread(target=post)
        first.start()
        while srv.app.state.worker.depth < 1:  # the first job is running (and blocked)
            time.sleep(0.01)
        second = threading.Thread(target=post)
        second.start()
        while srv.app.state.worker.depth < 2:  # the second one fills the queue
            time.sleep(0.01)
        third = httpx.post(srv.base + CHAT, content=chat(), headers=JSON, timeout=30)
        assert third.status_code == 503 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["code"] == "server_overloaded"
        gate.set()
        first.join()
        second.join()
        assert results == [200, 200]
