"""A census campaign: every arm over every battery and seed in one process. Writes to its output directory
`campaign.json` (what was run), `records.jsonl` (one line a reply, appended as each ends), then `summary.json` and
`summary.txt`, computed from records.jsonl as read back, by the code `--analyze` runs (`census.analyze`)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffgemma.census import analyze
from diffgemma.census.arms import Arm
from diffgemma.census.batteries import Battery, Item
from diffgemma.census.checks import Grade, Reply, grade
from diffgemma.census.metrics import trace_counts
from diffgemma.census.trace import TraceRecorder
from diffgemma.config import ConfigError
from diffgemma.engine.engine import ContextOverflow

RECORDS, CAMPAIGN, SUMMARY, TABLE = "records.jsonl", "campaign.json", "summary.json", "summary.txt"


@dataclass
class Campaign:
    arms: list[Arm]
    batteries: list[Battery]
    seeds: list[int]
    model: Path  # the model of arms that name none
    out: Path


def _say(message: str) -> None:
    print(f"census: {message}", file=sys.stderr, flush=True)


def check_out(out: Path) -> None:
    """The output directory may exist, but not hold a campaign already (its records would be mixed)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is not a directory")
    if (out / RECORDS).exists():
        raise ConfigError(f"--out {out} holds a campaign already ({RECORDS}): pass a new directory")


def arm_model(plan: Campaign, arm: Arm, say: Callable[[str], None]) -> Path:
    """The directory the arm runs: its model, or the pack of it its `quantize` names (written on first use)."""
    model = arm.model or plan.model
    if arm.quantize is None:
        return model
    pack = plan.out / "packs" / arm.name
    if not pack.exists():
        from diffgemma.weights.pack import quantize

        say(f"arm {arm.name}: writing its {arm.quantize} pack of {model} to {pack}")
        quantize(model, pack, arm.quantize, quiet=True)
    return pack


def run(plan: Campaign, say: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run the campaign; returns its summary (also written to the output directory)."""
    import diffgemma
    from diffgemma.config import CHAT_CONTEXT, ModelConfig, load_runtime_config

    check_out(plan.out)
    plan.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "version": diffgemma.__version__,
        "model": str(plan.model),
        "arms": [a.describe() for a in plan.arms],
        "batteries": [{"name": b.name, "path": str(b.path), "items": len(b.items)} for b in plan.batteries],
        "seeds": plan.seeds,
    }
    (plan.out / CAMPAIGN).write_text(json.dumps(meta, indent=2) + "\n")
    total = len(plan.arms) * len(plan.seeds) * sum(len(b.items) for b in plan.batteries)
    done, t_start, cpu_start = 0, time.perf_counter(), time.process_time()
    engine, loaded = None, None
    with open(plan.out / RECORDS, "w", encoding="utf-8") as records:
        for arm in plan.arms:
            path = arm_model(plan, arm, say)
            key = (str(path), sorted(arm.runtime.items()))
            if key != loaded:  # arms that differ in sampler settings only share one loaded model
                engine = None  # the last arm's model is freed before the next one loads
                runtime = load_runtime_config({**os.environ, **arm.env})
                ctx = ModelConfig.from_dir(path).context(None, CHAT_CONTEXT)  # `chat`'s: room for longctx
                engine, loaded = diffgemma.load(path, max_tokens=ctx, runtime=runtime), key
                say(f"arm {arm.name}: loaded {path} ({engine.model.device}, {engine.model.dtype})")
            sampler = engine.sampler.replace(**arm.sampler)
            for battery in plan.batteries:
                for seed in plan.seeds:
                    t0, passed = time.perf_counter(), 0
                    for item in battery.items:
                        rec = reply_record(engine, sampler, item, seed)
                        rec = {"arm": arm.name, "battery": battery.name, **rec}
                        records.write(json.dumps(rec) + "\n")
                        records.flush()
                        passed += rec["passed"]
                        done += 1
                    say(
                        f"[{done}/{total}] arm {arm.name} · {battery.name} seed {seed}: "
                        f"{passed}/{len(battery.items)} pass ({time.perf_counter() - t0:.1f} s)"
                    )
    say(
        f"{total} replies in {time.perf_counter() - t_start:.1f} s wall, "
        f"{time.process_time() - cpu_start:.1f} s CPU (this process)"
    )
    summary = analyze.report(plan.out, write_to=plan.out)
    return summary


def reply_record(engine: Any, sampler: Any, item: Item, seed: int) -> dict[str, Any]:
    """Generate (or, for a question schema, score) one item's reply and grade it: the record's fields."""
    t0, c0 = time.perf_counter(), time.process_time()
    recorder = TraceRecorder()
    if item.schema is not None:
        got = engine.score(item.schema, item.state, seed=seed)["answers"]
        reply = Reply(labels={qid: a["label"] for qid, a in got.items()}, finish_reason="scored")
        g = grade(item.checks, reply)
    else:
        ids = engine.prompt_ids(item.prompt, think=item.think, tools=item.tools)
        try:
            out = engine.generate(
                ids, max_new_tokens=item.max_tokens, seed=seed, on_step=recorder.on_step,
                on_block=recorder.on_block, sampler=sampler,
            )  # fmt: skip
        except ContextOverflow as e:  # the model's size, not the campaign's failure: an outcome of its own
            reply, g = Reply(finish_reason="none"), Grade(False, "over_context", str(e))
        else:
            calls = [(c.name, c.arguments) for c in out.tool_calls]
            reply = Reply(out.text, out.reasoning, calls, out.finish_reason)
            g = grade(item.checks, reply)
    tok = engine.tokenizer
    pad = tok.pad_id if tok is not None and tok.pad_id is not None else 0
    return {
        "id": item.id,
        "seed": seed,
        "passed": g.passed,
        "outcome": g.outcome,
        "detail": g.detail,
        **g.extra,
        "text": reply.text,
        "finish_reason": reply.finish_reason,
        **trace_counts(recorder.trace, pad),
        "seconds": round(time.perf_counter() - t0, 4),
        "cpu_seconds": round(time.process_time() - c0, 4),
    }
