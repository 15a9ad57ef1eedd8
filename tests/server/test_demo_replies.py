"""Through HTTP on the bundled demo model: replies with thinking on stop by themselves (`pad_block_stop`), logprobs
list exactly the tokens of the returned text, and a completion without `max_tokens` takes 16."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

import diffgemma
from diffgemma.server import create_app
from diffgemma.server.schema import COMPLETION_MAX_TOKENS
from diffgemma.weights.download import bundled_model
from tests.server.conftest import ServerThread

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
SKY = "Why is the sky blue?"  # the README's streaming example
COUNT = "Count from 37 to 55."  # the demo's multi-block task: 90 tokens to its stop token


@pytest.fixture(scope="module")
def demo() -> diffgemma.Engine:
    return diffgemma.load(bundled_model(), device="cpu", dtype="float32", threads=1)


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory) -> Iterator[ServerThread]:
    with ServerThread(create_app(demo, log_dir=tmp_path_factory.mktemp("log"))) as srv:
        yield srv


def post(server: ServerThread, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.base + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: ServerThread, path: str, **body: Any) -> list[dict[str, Any]]:
    """The data chunks of a streamed reply."""
    with httpx.stream("POST", server.base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_readmes_thinking_stream_stops_by_itself(server, demo) -> None:
    chunks = stream(
        server,
        CHAT,
        model=server.app.state.model_id + ":think",
        messages=[{"role": "user", "content": SKY}],
        stream_options={"include_usage": True},
    )
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop"
    # it streamed blanks to the end of the 8,192-token context: now a few blocks at most
    assert chunks[-1]["usage"]["completion_tokens"] <= 3 * demo.config.canvas_length


def test_pad_block_stop_off_per_request_runs_to_max_tokens(server) -> None:
    body = dict(messages=[{"role": "user", "content": SKY}], max_tokens=96, reasoning_effort="high")
    on = post(server, CHAT, **body)
    off = post(server, CHAT, **body, pad_block_stop=False)
    assert on["choices"][0]["finish_reason"] == "stop"
    assert off["choices"][0]["finish_reason"] == "length" and off["usage"]["completion_tokens"] == 96


def _text_tokens(server: ServerThread, prompt: Any, **body: Any) -> tuple[str, list[str], dict]:
    r = post(server, COMP, prompt=prompt, logprobs=1, **body)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    return choice["text"], lp["tokens"], r["usage"]


@pytest.mark.parametrize("prompt", [COUNT, SKY, "The capital of France is"])
def test_completion_logprobs_are_the_tokens_of_the_text(server, prompt) -> None:
    text, tokens, usage = _text_tokens(server, prompt, max_tokens=64)
    assert "".join(tokens) == text and "<pad>" not in tokens
    assert len(tokens) <= usage["completion_tokens"]  # usage counts every generated token, pad included


def test_completion_logprobs_of_token_ids_and_a_stop_string(server, demo) -> None:
    ids = demo.prompt_ids(COUNT)  # the chat template's ids: the demo counts
    text, tokens, _ = _text_tokens(server, ids, max_tokens=128)
    assert text.startswith("37, 38, 39") and "".join(tokens) == text
    cut, cut_tokens, _ = _text_tokens(server, ids, max_tokens=128, stop=["40"])
    assert cut == "37, 38, 39, " and "".join(cut_tokens) == cut
    # streamed: the final chunk's logprobs are the same
    chunks = stream(server, COMP, prompt=ids, max_tokens=128, stop=["40"], logprobs=1)
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["logprobs"]["tokens"] == cut_tokens


def test_chat_logprobs_are_the_tokens_of_the_reply(server) -> None:
    def reply(content: str, **body: Any) -> tuple[dict, str]:
        r = post(server, CHAT, messages=[{"role": "user", "content": content}], logprobs=True, **body)
        choice = r["choices"][0]
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        assert "<pad>" not in tokens and len(tokens) <= r["usage"]["completion_tokens"]
        return choice["message"], "".join(tokens)

    message, joined = reply(COUNT)
    assert joined == message["content"] and message["content"].startswith("37, 38")
    message, joined = reply(COUNT, stop=["40"])
    assert joined == message["content"] == "37, 38, 39, "
    # with thinking on the reply's reasoning is listed too, with the channel's grammar token (README)
    message, joined = reply("What is 17 + 25?", reasoning_effort="high")
    assert joined.endswith(message["content"]) and (message["reasoning_content"] or "") in joined


def test_a_completion_without_max_tokens_takes_16(server, demo) -> None:
    assert COMPLETION_MAX_TOKENS == 16
    ids = demo.prompt_ids(COUNT)
    r = post(server, COMP, prompt=ids)
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 16
    # chat keeps its default: to a stop token (90 tokens here) or the end of the context
    chat = post(server, CHAT, messages=[{"role": "user", "content": COUNT}])
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["completion_tokens"] > 16
