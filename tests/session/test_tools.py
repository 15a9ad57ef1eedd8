"""The tool stages on the real KV path with scripted replies (`drive` stands in for the block loop): a malformed
tool call is retried (--tool-validate) or repaired as an evaporating draft (--tool-repair) whose final KV equals a
session's that never saw the bad exchange."""

from __future__ import annotations

import pytest
import torch

import diffgemma
import diffgemma.session.pipeline as pipeline_module
from diffgemma.session import ops as O
from diffgemma.session.client import Session
from diffgemma.session.oplog import replay
from diffgemma.session.pipeline import Pipeline, call

BAD = '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'  # the string never closes
GOOD = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


@pytest.fixture(scope="module")
def eng(tiny_a):
    return diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=4, max_tokens=512)


class Script:
    """Replies by call, each committed in blocks of 4 and ended by its stop token (None: "length"); records each
    call's stop ids."""

    def __init__(self, tok, *replies: tuple[str, int | None]) -> None:
        self.tok, self.replies, self.stops = tok, list(replies), []

    def __call__(self, turn, on_step=None, cancel=None, on_commit=None):
        self.stops.append(set(turn.cfg.stop_token_ids))
        text, stop = self.replies.pop(0)
        ids = self.tok.encode(text)[: turn.max_new]
        out = turn.out
        for start in range(0, len(ids), 4):
            if out.token_ids:
                turn.model.prefill(torch.tensor([out.token_ids[-4:]]), turn.kv)
                out.cached_tokens = len(out.token_ids)
            chunk = ids[start : start + 4]
            out.token_ids += chunk
            out.blocks += 1
            out.steps += 1
            turn.done = start + 4 >= len(ids)
            if on_commit is not None:
                on_commit(turn, chunk)
        out.finish_reason, out.stop_token = ("stop", stop) if stop is not None else ("length", None)
        turn.done = True
        return out


def test_repair_evaporates_the_bad_exchange(eng, monkeypatch, tmp_path):
    tok = eng.tokenizer
    opener = tok.token_to_id("<|tool_response>")
    tail = '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
    script = Script(tok, (BAD, opener), ("I could not reach the weather tool." + tail, 106))
    monkeypatch.setattr(pipeline_module, "drive", script)
    log = tmp_path / "r.jsonl"
    s = Session(eng, log=log, tool_repair=True)
    prompt = eng.prompt_ids("Weather in Paris?", tools=[])
    out = s.generate(prompt, seed=1, max_new_tokens=64)
    clean = tok.encode("I could not reach the weather tool.")
    assert out.token_ids == clean and out.text == "I could not reach the weather tool."
    assert out.prompt_tokens == len(prompt)
    assert (out.finish_reason, out.stop_token) == ("stop", opener)
    assert opener in script.stops[0] and opener not in script.stops[1]  # regenerated to a natural end
    assert s.log == prompt  # rewound: neither the bad call nor the feedback stays cached
    call(s.pipeline, O.Extend(clean))
    repaired = call(s.pipeline, O.KvFingerprint())[0]
    never = Pipeline(eng)
    for op in (O.Activate(0), O.Extend(prompt), O.Extend(clean)):
        call(never, op)
    assert call(never, O.KvFingerprint())[0].sha256 == repaired.sha256  # the same bytes (another epoch)
    ops = [line for line in log.read_text().splitlines() if '"op"' in line]
    assert sum('"Rewind"' in line for line in ops) == 1 and sum('"Generate"' in line for line in ops) == 2
    monkeypatch.setattr(
        pipeline_module,
        "drive",
        Script(tok, (BAD, opener), ("I could not reach the weather tool." + tail, 106)),
    )
    assert replay(log, eng)[0]  # the log holds the ops the stage ran: it replays without the stage


def test_repair_leaves_a_valid_reply_alone(eng, monkeypatch):
    tok = eng.tokenizer
    monkeypatch.setattr(pipeline_module, "drive", Script(tok, (GOOD, tok.token_to_id("<|tool_response>"))))
    s = Session(eng, tool_repair=True)
    out = s.generate("Weather in Paris?", seed=1, max_new_tokens=64)
    assert [c.name for c in out.tool_calls] == ["get_weather"] and out.tool_calls[0].arguments == {
        "city": "Paris"
    }


def test_validate_retries_with_the_next_seed_from_the_prompts_end(eng, monkeypatch):
    tok = eng.tokenizer
    opener = tok.token_to_id("<|tool_response>")
    seeds: list[int] = []
    script = Script(tok, (BAD, opener), (BAD, opener), (GOOD, opener))
    real = type(eng).turn

    def spy(self, ids, kv, cfg=None, seed=42, *args, **kwargs):
        seeds.append(seed)
        return real(self, ids, kv, cfg, seed, *args, **kwargs)

    monkeypatch.setattr(pipeline_module, "drive", script)
    monkeypatch.setattr(type(eng), "turn", spy)
    s = Session(eng, tool_validate=True)
    prompt = eng.prompt_ids("Weather in Paris?")
    out = s.generate(prompt, seed=7, max_new_tokens=64)
    assert seeds == [7, 8, 9] and out.tool_calls[0].arguments == {"city": "Paris"}
    assert s.log[: len(prompt)] == prompt and len(s.log) < len(prompt) + len(out.token_ids) + 1
    never = Session(eng, tool_validate=True)
    monkeypatch.setattr(pipeline_module, "drive", Script(tok, (BAD, opener), (BAD, opener), (BAD, opener)))
    last = never.generate(prompt, seed=1, max_new_tokens=64)
    assert last.tool_calls == [] and len(seeds) == 6  # three tries, then the last reply stands
