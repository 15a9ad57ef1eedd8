"""The server's limits and edges: context and output budgets, metrics labels, headers, the request log, control
tokens out of replies, tool calls that do not parse, and log probabilities."""

from __future__ import annotations

import json
import math
import os
import stat

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

import diffgemma
from diffgemma.config import ConfigError
from diffgemma.engine.generate import token_logprobs
from diffgemma.kernels import torch_ref
from diffgemma.server import create_app
from diffgemma.server.reqlog import RequestLog
from diffgemma.testing import write_tiny_checkpoint
from tests.server.conftest import MODEL, ServerThread
from tests.server.test_tools_reasoning import CALL, WEATHER

USER = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def short_server(engine):
    """A server whose context is 200 tokens."""
    with ServerThread(create_app(engine, ctx=200)) as srv:
        yield srv


def test_a_prompt_past_the_context_is_a_400_naming_both_numbers(short_server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 300}]}
    r = httpx.post(short_server.base + CHAT, json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    prompt = int(error["message"].split("the prompt is ")[1].split(" ")[0])
    assert prompt > 200 and "context is 200 tokens" in error["message"]


def test_max_tokens_beyond_what_the_context_leaves_is_a_400(short_server, script) -> None:
    # vLLM's rule: prompt + max_tokens past the context is refused (opencode's compaction asks for 32,000), streamed
    # or not, before any reply starts
    for stream in (False, True):
        body = {"model": MODEL, "messages": USER, "max_tokens": 32000, "stream": stream}
        r = httpx.post(short_server.base + CHAT, json=body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and (error["code"], error["param"]) == (
            "context_length_exceeded",
            "max_tokens",
        )
        assert "max_tokens is 32000" in error["message"] and "context of 200 tokens" in error["message"]
        left = int(error["message"].split("ask for at most ")[1])
    script(list(range(300, 700)), list(range(300, 700)))  # replies that would never stop
    r = short_server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=left)
    assert r.usage.total_tokens == 200
    body = {"model": MODEL, "prompt": list(range(5, 195)), "max_tokens": 11}
    r = httpx.post(short_server.base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "ask for at most 10" in r.json()["error"]["message"]
    # a completion's default of 16 is capped at what is left, never refused
    del body["max_tokens"]
    r = httpx.post(short_server.base + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 200


def test_without_max_tokens_a_reply_runs_to_the_context(short_server, script) -> None:
    script(list(range(300, 700)))
    r = short_server.client().chat.completions.create(model=MODEL, messages=USER)
    assert r.usage.total_tokens == 200  # not generation_config's 256, nor past the context
    script("Paris.<turn|>")
    r = short_server.client().chat.completions.create(model=MODEL, messages=USER)
    assert r.choices[0].message.content == "Paris." and r.choices[0].finish_reason == "stop"


def test_the_context_never_passes_the_models_positions(tmp_path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m", seed=5, max_position_embeddings=512)
    engine = diffgemma.load(path, "cpu")
    assert engine.max_tokens == 512  # load's default, capped
    with pytest.raises(ConfigError, match="beyond this model's 512 positions"):
        create_app(engine, ctx=1024)
    with pytest.raises(ConfigError, match="512 positions"):
        diffgemma.load(path, "cpu", max_tokens=513)
    app = create_app(engine)
    assert app.state.ctx == 512


def test_metrics_labels_stay_a_fixed_set(engine) -> None:
    for api_key in (None, "k"):
        with (
            ServerThread(create_app(engine, ctx=256, api_key=api_key)) as srv,
            httpx.Client(base_url=srv.base) as http,
        ):
            auth = {"Authorization": "Bearer k"} if api_key else {}
            for i in range(50):
                http.get(f"/v1/models/x{i}")
                http.get(f"/nowhere/{i}")
            http.get("/metrics", headers=auth)  # so that the scrape's own series exist
            lines = http.get("/metrics", headers=auth).text.splitlines()
            for i in range(50, 300):
                http.get(f"/v1/models/x{i}")
                http.get(f"/nowhere/{i}")
            again = http.get("/metrics", headers=auth).text.splitlines()
            assert len(again) == len(lines)  # 500 more distinct paths, not one more series
            assert not any("x1" in line or "nowhere" in line for line in again)
            assert any('route="/v1/models/{model}"' in line for line in again)


def test_headers_and_openapi(engine) -> None:
    with ServerThread(create_app(engine, ctx=256, api_key="k")) as srv:
        r = httpx.get(srv.base + CHAT)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = httpx.post(srv.base + CHAT, json={})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(srv.base + "/openapi.json").status_code == 401  # behind the key (issue 56)
        spec = httpx.get(srv.base + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


def test_the_request_log_never_fails_and_is_private(tmp_path) -> None:
    log = RequestLog(tmp_path / "logs")
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600

    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    log.write({"user": "\udc00", "text": "a\ud800b"})  # a lone surrogate writes, escaped
    log.write({"value": Unprintable()})  # dropped, not raised
    log.write({"ok": True})
    log.close()
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [line.get("user") for line in lines] == ["\udc00", None] and lines[1]["ok"] is True
    os.chmod(log.path, 0o644)  # an older log made with wider permissions is narrowed
    RequestLog(tmp_path / "logs").close()
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600


def test_completions_never_return_control_tokens(server, script) -> None:
    tok = server.app.state.registry.engine.tokenizer
    words = tok.encode("Hello world")
    script([0] * 6 + words + [0, 46, 0])
    r = server.client().completions.create(model=MODEL, prompt="Once", max_tokens=12)
    assert r.choices[0].text == "Hello world"


def test_a_prompt_string_to_completions_is_text(server, script) -> None:
    s = script("ok")
    server.client().completions.create(model=MODEL, prompt="<|turn>user\nhi<turn|>", max_tokens=4)
    tok = server.app.state.registry.engine.tokenizer
    assert not set(s.prompts[-1]) & tok.special_ids  # control ids only as token ids


BAD = '<|tool_call>call:get_weather{city:<|"|>Par<tool_call|>'


def test_a_tool_call_that_does_not_parse_is_retried(server, script) -> None:
    s = script(BAD, CALL + "<|tool_response>")
    r = server.client().chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
    assert len(s.prompts) == 2  # one retry, with a new seed


def test_when_every_attempt_fails_the_reply_is_plain_text(server, script) -> None:
    script("Let me look." + BAD, "Let me look." + BAD, "Let me look." + BAD)
    r = server.client().chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    message = r.choices[0].message
    assert message.content == "Let me look." and not message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_streaming_retries_only_what_was_not_sent(server, script) -> None:
    s = script(BAD, CALL + "<|tool_response>")
    chunks = list(
        server.client().chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True)
    )
    assert len(s.prompts) == 2 and any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    s = script("Checking." + BAD + " Done.", CALL)
    chunks = list(
        server.client().chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(s.prompts) == 1 and text == "Checking. Done." and "call:" not in text


def test_tool_choice_none_drops_a_call_from_the_text(server, script) -> None:
    script("Sure. " + CALL, "Sure. " + CALL, "Sure. " + CALL)
    r = server.client().chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.content == "Sure. " and not r.choices[0].message.tool_calls


def test_chat_logprobs(server) -> None:
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, seed=3, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content
    # the reply's text tokens: usage counts every generated one, pad included (tests/server/test_demo_replies.py)
    assert 0 < len(entries) <= r.usage.completion_tokens and "<pad>" not in [e.token for e in entries]
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
        # the committed token is the committing step's argmax, so it is its own best alternative
        assert e.token == e.top_logprobs[0].token and e.logprob == tops[0]
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-5
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, seed=3, logprobs=True, stream=True
    )
    streamed = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, seed=3)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(server) -> None:
    r = server.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=8, seed=2, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert 0 < len(lp.tokens) <= r.usage.completion_tokens  # the text's tokens, of every generated one
    assert all(
        len(top) <= 2 and max(top.values()) == p
        for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert lp.text_offset == sorted(lp.text_offset)


def test_token_logprobs_are_the_softcapped_log_softmax() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    raw = torch.randn(5, 50, generator=g) * 40
    chosen = raw.argmax(-1)
    out = token_logprobs(raw, chosen, 4, 30.0)
    want = torch.log_softmax(torch_ref.softcap(raw, 30.0), -1)
    for r, t in enumerate(out):
        assert t.token_id == int(chosen[r]) and t.logprob == pytest.approx(
            float(want[r, chosen[r]]), abs=1e-6
        )
        ids = [i for i, _ in t.top]
        assert ids == want[r].topk(4).indices.tolist()
