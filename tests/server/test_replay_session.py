"""`serve --log-dir D` journals every op and event to D/ops.jsonl; a real openai-client session against it
(multi-turn, streaming, tools and their results, a client gone mid-stream) replays identically, and the same log
with one generated token changed fails on that event."""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from diffgemma.cli import app
from diffgemma.server import create_app
from tests.server.conftest import CTX, MODEL, ServerThread
from tests.server.test_tools_reasoning import WEATHER


def test_a_served_session_replays_identically_and_a_changed_token_is_named(engine, model_dir, tmp_path):
    log_dir = tmp_path / "logs"
    with ServerThread(create_app(engine, ctx=CTX, log_dir=log_dir)) as server:
        client = server.client()
        history = [{"role": "user", "content": "What is 17 + 25?"}]
        first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=24, seed=3)
        history += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
        history += [{"role": "user", "content": "And 2 + 2?"}]
        text = ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=24, seed=4, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
        tools_turn = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"},
        ]
        client.chat.completions.create(
            model=MODEL, messages=tools_turn, tools=[WEATHER], max_tokens=24, seed=5
        )
        real = engine.model.denoise

        def slow(*args, **kwargs):
            time.sleep(0.01)  # room for the disconnect to land mid-generation
            return real(*args, **kwargs)

        engine.model.denoise = slow
        try:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "A long story."}],
                max_tokens=600,
                stream=True,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            stream.close()
            deadline = time.monotonic() + 20
            while server.app.state.worker.depth:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            del engine.model.denoise
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=24, seed=4)
    log = log_dir / "ops.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    replies = [r["event"] for r in records if "event" in r and r["event"]["type"] == "Replied"]
    assert len(replies) == 5 and any(r["finish_reason"] == "cancelled" for r in replies)
    assert any(r.get("op", {}).get("type") == "Finalize" for r in records)

    runner = CliRunner()
    ok = runner.invoke(app, ["replay", str(log), "-m", str(model_dir)])
    assert ok.exit_code == 0 and ok.stdout.startswith("identical: 1 session(s)"), ok.output

    lines = log.read_text().splitlines()
    i = next(
        i
        for i, line in enumerate(lines)
        if '"Replied"' in line and '"token_ids":[' in line and '"token_ids":[]' not in line
    )
    rec = json.loads(lines[i])
    rec["event"]["token_ids"][-1] = (rec["event"]["token_ids"][-1] + 1) % 1000
    lines[i] = json.dumps(rec)
    log.write_text("\n".join(lines) + "\n")
    bad = runner.invoke(app, ["replay", str(log), "-m", str(model_dir)])
    assert bad.exit_code == 1, bad.output
    assert (
        bad.stdout.startswith(f"line {i + 1}: event") and "differs: token_ids first differs at" in bad.stdout
    )
