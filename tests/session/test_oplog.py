"""The op log and replay: ask/chat --log through the pipeline, replay identical (exit 0) or naming the first
differing event (exit 1), another model's log refused in one line."""

from __future__ import annotations

import json
import os
import stat

import pytest
from typer.testing import CliRunner

import diffgemma
from diffgemma.cli import app
from diffgemma.session import ops as O
from diffgemma.session.client import Session
from diffgemma.session.oplog import OpLog, read_log, replay
from diffgemma.session.pipeline import Pipeline


@pytest.fixture(scope="module")
def eng(tiny_a):
    return diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=4, max_tokens=512)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_session_logs_every_op_and_event_and_replays_identically(eng, tmp_path):
    log = tmp_path / "s.jsonl"
    s = Session(eng, log=log)
    first = s.generate("What is 2 + 2?", seed=3, max_new_tokens=40)
    second = s.generate(
        [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": first.text},
         {"role": "user", "content": "And 3 + 3?"}],
        seed=4, max_new_tokens=40,
    )  # fmt: skip
    assert second.reused_tokens > 0
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600  # token ids of prompts: owner only
    recs = records(log)
    assert list(recs[0]) == ["header"] and recs[0]["header"]["model_id"] != "unknown"
    ops = [r["op"]["type"] for r in recs if "op" in r]
    assert ops == ["Activate", "AlignTo", "Generate", "AlignTo", "Generate"]
    replied = [r["event"] for r in recs if "event" in r and r["event"]["type"] == "Replied"]
    assert replied[0]["token_ids"] == first.token_ids and replied[1]["token_ids"] == second.token_ids
    events = sum(1 for r in recs if "event" in r)
    assert replay(log, eng) == (True, f"identical: 1 session(s), 5 ops, {events} events")


def test_a_changed_token_is_named_and_exits_1(eng, tiny_a, tmp_path):
    log = tmp_path / "s.jsonl"
    Session(eng, log=log).generate("Count to five.", seed=1, max_new_tokens=30)
    runner = CliRunner()
    ok = runner.invoke(app, ["replay", str(log), "-m", str(tiny_a)])
    assert ok.exit_code == 0 and ok.stdout.startswith("identical:"), ok.output
    lines = log.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"Replied"' in line)
    rec = json.loads(lines[i])
    rec["event"]["token_ids"][0] = (rec["event"]["token_ids"][0] + 1) % 1000
    lines[i] = json.dumps(rec)
    log.write_text("\n".join(lines) + "\n")
    bad = runner.invoke(app, ["replay", str(log), "-m", str(tiny_a)])
    assert bad.exit_code == 1
    assert (
        f"line {i + 1}: event" in bad.stdout
        and "of op Generate differs: token_ids first differs at [0]" in bad.stdout
    )


def test_another_models_log_is_refused_in_one_line(eng, tiny_b, tmp_path):
    log = tmp_path / "s.jsonl"
    Session(eng, log=log).generate("hi", seed=1, max_new_tokens=8)
    res = CliRunner().invoke(app, ["replay", str(log), "-m", str(tiny_b)])
    assert res.exit_code == 1
    (line,) = res.stderr.strip().splitlines()
    assert "was recorded on model" in line and "replay it with -m pointing at that model" in line


def test_per_block_ops_and_a_cancel_replay_where_they_struck(eng, tmp_path):
    from diffgemma.engine.generate import CancelToken

    log = tmp_path / "p.jsonl"
    p = OpLog(Pipeline(eng), log)
    sink: list[O.Event] = []
    ids = eng.prompt_ids("Tell me a long story about a fox.")
    for op in (O.Activate(0), O.Extend(ids), O.BeginTurn(seed=9, max_new_tokens=64), O.ProposeBlock()):
        p.run(op, sink.append)
    p.run(O.CommitBlock(5), sink.append)
    p.run(O.EndTurn(), sink.append)
    token, seen = CancelToken(), []

    def on_step(info):
        seen.append(1)
        if len(seen) == 2:
            token.cancel()

    p.run(O.Generate([], seed=2, max_new_tokens=64), sink.append, on_step=on_step, cancel=token)
    p.run(O.KvFingerprint(), sink.append)
    p.close()
    assert sink[-2].finish_reason == "cancelled" and sink[-2].cancel_after == 2
    same, line = replay(log, eng)
    assert same, line


def test_bad_logs_are_refused_naming_the_line(tmp_path):
    log = tmp_path / "bad.jsonl"
    log.write_text('{"op": {"type": "Ping"}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: op before any header"):
        read_log(log)
    log.write_text('{"header": {}}\n{"op": {"type": "Explode"}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: unknown message type 'Explode'"):
        read_log(log)
    res = CliRunner().invoke(app, ["replay", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 2 and "no such log" in res.stderr
