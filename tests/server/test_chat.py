"""Chat and completions on the real tiny model through the official `openai` client."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import CTX, MODEL

USER = [{"role": "user", "content": "What is the capital of France?"}]


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(server.base + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base + "/health").json()["status"] == "ok"
    assert client.models.retrieve(MODEL + ":think").id == MODEL + ":think"


def test_chat_non_streaming(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, seed=7)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12
    assert (
        r.usage.prompt_tokens > 0
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    )
    again = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, seed=7)
    assert again.choices[0].message.content == choice.message.content  # fixed seed, same reply


def test_chat_streaming_usage_in_last_chunk(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    finishes = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=20)
    assert text == plain.choices[0].message.content  # default seed: streaming and not agree


def test_second_turn_reuses_kv(server, client) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=16
    )
    history = [
        {"role": "user", "content": "Tell me about Paris."},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And London?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens  # the whole first turn, reply included
    assert cached < second.usage.prompt_tokens
    server.check_registry()


def test_raw_completion(client) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, seed=1)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 10
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, seed=1, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[2, 300, 301], max_tokens=4)
    assert ids.usage.prompt_tokens == 3


def test_eight_concurrent_clients(server, client) -> None:
    def ask(i: int) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question number {i}?"}], max_tokens=8, seed=i
        )
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(ask, range(8)))
    assert len(reasons) == 8 and all(r in ("stop", "length") for r in reasons)
    server.check_registry()
    registry = server.app.state.registry
    assert len(registry) <= registry.max_conversations


def test_cancel_mid_stream_then_correct_request(server, client, engine, monkeypatch) -> None:
    real_denoise = engine.model.denoise

    def slow(*args, **kwargs):
        time.sleep(0.01)  # room for the disconnect to land mid-generation
        return real_denoise(*args, **kwargs)

    prompt = [{"role": "user", "content": "Write a very long story."}]
    reference = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40, seed=5)
    monkeypatch.setattr(engine.model, "denoise", slow)
    before = metric(server, "diffgemma_generations_total", reason="cancelled")
    generated = metric(server, "diffgemma_generated_tokens_total")
    stream = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=900, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while metric(server, "diffgemma_generations_total", reason="cancelled") == before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert metric(server, "diffgemma_generated_tokens_total") - generated < 900
    server.check_registry()
    monkeypatch.setattr(engine.model, "denoise", real_denoise)
    after = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40, seed=5)
    assert after.choices[0].message.content == reference.choices[0].message.content
    assert after.usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_parse(server, client) -> None:
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    text = httpx.get(server.base + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "diffgemma_requests",
        "diffgemma_queue_depth",
        "diffgemma_prompt_tokens",
        "diffgemma_cached_prompt_tokens",
        "diffgemma_generated_tokens",
        "diffgemma_denoise_steps",
        "diffgemma_request_duration_seconds",
        "diffgemma_time_to_first_token_seconds",
    ):
        assert name in families, name
    assert families["diffgemma_request_duration_seconds"].type == "histogram"
    assert metric(server, "diffgemma_requests_total", route="/v1/chat/completions", status="200") >= 1
    assert metric(server, "diffgemma_denoise_steps_total") > 0


def test_request_log(server, client) -> None:
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, user="log-me")
    log_dir = server.app.state.request_log_path
    lines = [json.loads(line) for line in log_dir.read_text().splitlines()]
    last = [x for x in lines if x["request"].get("user") == "log-me"][-1]
    assert last["status"] == 200 and last["usage"]["completion_tokens"] > 0 and last["route"] == "chat"
    httpx.post(
        server.base + "/v1/chat/completions",
        content=b"{oops",
        headers={"Content-Type": "application/json"},
    )
    error = json.loads(log_dir.read_text().splitlines()[-1])
    assert error["status"] == 400 and "JSON" in error["error"]


def test_prompt_fills_the_context(client) -> None:
    import openai
    import pytest

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * CTX}])
    assert err.value.body["code"] == "context_length_exceeded"
