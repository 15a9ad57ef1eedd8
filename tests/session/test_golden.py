"""The golden gate on the bundled demo model (CPU, fp32) and the rewind byte-consistency gate: generate, rewind,
generate restores the KV bytes exactly and regenerates bit-identically, below and across the sliding-window ring's
wrap and after an in-block re-roll."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import diffgemma
from diffgemma.cli import app
from diffgemma.session import golden as G
from diffgemma.session import ops as O
from diffgemma.session.pipeline import Pipeline, call
from diffgemma.weights.download import bundled_model


@pytest.fixture(scope="module")
def demo():
    return diffgemma.load(bundled_model(), device="cpu", dtype="float32", threads=1)


def test_the_golden_paths_replay_byte_for_byte(demo):
    assert len(G.PATHS) >= 8
    same, line = G.check(demo)
    assert same, line


def test_golden_names_the_path_and_event_of_a_change(demo, tmp_path):
    lines = G.FIXTURE.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"Fingerprint"' in line)
    rec = json.loads(lines[i])
    rec["event"]["sha256"] = "0" * 64
    lines[i] = json.dumps(rec)
    changed = tmp_path / "golden.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    same, line = G.check(demo, changed)
    assert not same and line.startswith(
        f"line {i + 1} (short_prompt): event 1 of op KvFingerprint differs: sha256"
    )
    res = CliRunner().invoke(app, ["golden"])
    assert res.exit_code == 0 and res.stdout.startswith("identical: 9 session(s)")


def _gate(p, prompt: list[int], seed: int) -> None:
    before = call(p, O.KvFingerprint())[0].sha256
    mark = call(p, O.Mark())[0].kv
    first = call(p, O.Generate(prompt, seed=seed, max_new_tokens=80))[-1]
    after = call(p, O.KvFingerprint())[0].sha256
    call(p, O.Rewind(mark))
    assert call(p, O.KvFingerprint())[0].sha256 == before  # the bytes of the shorter cache, exactly
    again = call(p, O.Generate(prompt, seed=seed, max_new_tokens=80))[-1]
    assert again.token_ids == first.token_ids and again.steps == first.steps
    assert call(p, O.KvFingerprint())[0].sha256 == after


def test_rewind_restores_the_bytes_below_and_across_the_ring_wrap(demo):
    prompt = demo.prompt_ids("Count from 37 to 55.")
    p = Pipeline(demo)
    call(p, O.Activate(0))
    call(p, O.Extend(prompt))
    _gate(p, [], seed=1)  # below the wrap: a reply of two blocks
    wrap = Pipeline(demo)
    call(wrap, O.Activate(0))
    kv = wrap.active.kv
    call(wrap, O.SyntheticFill(kv.ring_size + demo.config.canvas_length + 37, seed=2))
    assert kv.length > kv.period  # the rings have wrapped
    _gate(wrap, prompt[1:], seed=3)


def test_rewind_restores_the_bytes_after_an_in_block_re_roll(demo):
    p = Pipeline(demo)
    call(p, O.Activate(0))
    call(p, O.Extend(demo.prompt_ids("Count from 10 to 30.")))
    before = call(p, O.KvFingerprint())[0].sha256
    mark = call(p, O.Mark())[0].kv
    call(p, O.BeginTurn(seed=4, max_new_tokens=100))
    call(p, O.ProposeBlock())
    call(p, O.DiscardBlock())
    prop = call(p, O.ProposeBlock())[0]
    call(p, O.CommitBlock(len(prop.tokens) if prop.stop_at is None else prop.stop_at))
    if not p.turn.done:
        call(p, O.ProposeBlock())  # prefills the committed block first
    reply = call(p, O.EndTurn())[0]
    assert reply.retries == 1
    call(p, O.Rewind(mark))
    assert call(p, O.KvFingerprint())[0].sha256 == before
