"""The golden gate on the bundled demo model (CPU, fp32) and the rewind byte-consistency gate: generate, rewind,
generate restores the KV bytes exactly and regenerates bit-identically, below and across the sliding-window ring's
wrap and after an in-block re-roll."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import diffgemma
from diffgemma.cli import app
from diffgemma.session import golden as G
from diffgemma.session import oplog
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


def _fixture_with(tmp_path, edit) -> tuple:
    """The golden fixture with `edit(records)` applied, written to tmp_path; (path, records)."""
    records = [json.loads(line) for line in G.FIXTURE.read_text().splitlines()]
    edit(records)
    path = tmp_path / "golden.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


def _first(records, kind: str) -> int:
    return next(i for i, r in enumerate(records) if r.get("event", {}).get("type") == kind)


def test_golden_names_the_path_and_event_of_a_change(demo, tmp_path):
    def changed_reply(records):
        i = _first(records, "Replied")
        records[i]["event"]["token_ids"][0] += 1

    path, records = _fixture_with(tmp_path, changed_reply)
    same, line = G.check(demo, path)
    i = _first(records, "Replied")
    assert (
        not same
        and line.startswith(f"line {i + 1} (short_prompt): event ")
        and "token_ids first differs" in line
    )
    res = CliRunner().invoke(app, ["golden"])
    assert res.exit_code == 0 and res.stdout.startswith("identical: 9 session(s)")


def test_a_kv_fingerprint_is_compared_on_the_platform_that_recorded_it(demo, tmp_path):
    def zeroed(platform: str):
        def edit(records):
            for r in records:
                if "header" in r:
                    r["header"]["platform"] = platform
            records[_first(records, "Fingerprint")]["event"]["sha256"] = "0" * 64

        return edit

    here = oplog.platform_of(demo)
    path, records = _fixture_with(tmp_path, zeroed(here))
    same, line = G.check(demo, path)
    i = _first(records, "Fingerprint")
    assert not same and line.startswith(
        f"line {i + 1} (short_prompt): event 1 of op KvFingerprint differs: sha256"
    )
    # recorded elsewhere: the KV bytes may round differently there, the tokens are still compared
    path, _ = _fixture_with(tmp_path, zeroed("torch 0.0, another machine"))
    same, line = G.check(demo, path)
    assert same and line.endswith(
        f"KV fingerprints not compared (recorded on torch 0.0, another machine, this is {here})"
    )
    assert torch.__version__ in here and torch.backends.cpu.get_cpu_capability() in here


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
