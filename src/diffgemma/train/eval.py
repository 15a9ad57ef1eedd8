"""Evaluate a checkpoint on held-out prompts of each synthetic task, through the engine users run.

Per task: exact-match accuracy of the reply (the text before the stop token), a task-specific check
(arithmetic: the result appears; tool calls: the call parses in the tool-call grammar with the expected name and
arguments), the share of replies that ended on their expected stop token and on `<turn|>`, and the mean number
of denoising steps per block. Retrieval also reports its exact match on the prompts whose asked line lies beyond
the sliding window (only the full-attention layers can reach it). Question schemas are answered by scored reads
(`Engine.score`), as the API answers them: the share of label slots right, and of schemas wholly right.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from diffgemma.chat.toolcall import parse_call
from diffgemma.train import data

TURN_END_ID = 106
TOOL_RESPONSE_ID = 50


def check(ex: data.Example, text: str) -> tuple[bool, bool]:
    """(exact match, task check) for a decoded reply."""
    exact = text == ex.answer
    if ex.task == "arith":
        return exact, str(ex.meta["result"]) in text
    if ex.task == "tool_call":
        body = text.removeprefix("<|tool_call>").removesuffix("<tool_call|>")
        try:
            name, args = parse_call(body)
        except ValueError:
            return exact, False
        return exact, name == ex.meta["name"] and args == ex.meta["arguments"]
    return exact, exact


def key_distance(ex: data.Example, tok: Tokenizer, prompt_len: int) -> int:
    """Tokens from the asked line of a retrieval prompt (prompt_len tokens) to the end of the prompt."""
    cut = ex.prompt.index(f"- {ex.meta['key']}:")
    return prompt_len - len(tok.encode(ex.prompt[:cut], add_special_tokens=False).ids)


def evaluate(
    model_dir: str | Path,
    n_per_task: int = 50,
    seed: int = 1234,
    device: str | None = None,
    dtype: str | None = None,
    tasks: tuple[str, ...] = data.TASKS,
    max_new_tokens: int = 160,
    engine=None,
) -> dict[str, Any]:
    import diffgemma

    model_dir = Path(model_dir)
    eng = engine or diffgemma.load(model_dir, device=device, dtype=dtype)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    examples = data.heldout_set(n_per_task, seed, tasks)
    per_task: dict[str, dict[str, Any]] = {}
    samples: list[dict[str, Any]] = []
    t0 = time.time()
    for i, ex in enumerate(examples):
        if ex.task == "schema":  # answered by scored reads, as the question-schema API answers it
            r = per_task.setdefault("schema", {"n": 0, "slots": 0, "slots_ok": 0, "exact": 0, "s": 0.0})
            t1 = time.time()
            got = eng.score(ex.meta["schema"], ex.meta["state"], seed=seed + i)["answers"]
            r["s"] += time.time() - t1
            ok = [got[qid]["label"] == label for qid, label in ex.meta["labels"].items()]
            r["n"] += 1
            r["slots"] += len(ok)
            r["slots_ok"] += sum(ok)
            r["exact"] += all(ok)
            if len(samples) < 400:
                labels = {qid: a["label"] for qid, a in got.items()}
                samples.append(
                    {"task": "schema", "expected": ex.meta["labels"], "got": labels, "exact": all(ok)}
                )
            continue
        ids = tok.encode(ex.prompt, add_special_tokens=False).ids
        t1 = time.time()
        out = eng.generate(ids, max_new_tokens=max_new_tokens, seed=seed + i)
        dt = time.time() - t1
        text = tok.decode(out.token_ids, skip_special_tokens=False)
        exact, ok = check(ex, text)
        want_stop = TOOL_RESPONSE_ID if ex.stop == data.TOOL_RESPONSE else TURN_END_ID
        r = per_task.setdefault(
            ex.task,
            {"n": 0, "exact": 0, "check": 0, "stop_ok": 0, "turn_end": 0, "steps": 0, "blocks": 0, "s": 0.0},
        )
        r["n"] += 1
        r["exact"] += exact
        r["check"] += ok
        r["stop_ok"] += out.stop_token == want_stop
        r["turn_end"] += out.stop_token == TURN_END_ID
        r["steps"] += sum(out.block_steps)
        r["blocks"] += len(out.block_steps)
        r["s"] += dt
        if ex.task == "retrieval" and key_distance(ex, tok, len(ids)) > eng.model.cfg.sliding_window:
            r["far_n"] = r.get("far_n", 0) + 1
            r["far_exact"] = r.get("far_exact", 0) + exact
        if len(samples) < 400:
            samples.append(
                {"task": ex.task, "expected": ex.answer, "got": text, "exact": exact, "stop": out.stop_token}
            )
    rows = {}
    schema = per_task.pop("schema", None)
    if schema is not None:
        rows["schema"] = {
            "n": schema["n"],
            "slots": schema["slots"],
            "slot_accuracy": schema["slots_ok"] / max(1, schema["slots"]),
            "exact_match": schema["exact"] / schema["n"],
            "mean_seconds": schema["s"] / schema["n"],
        }
    for task, r in per_task.items():
        rows[task] = {
            "n": r["n"],
            "exact_match": r["exact"] / r["n"],
            "task_check": r["check"] / r["n"],
            "ended_on_expected_stop": r["stop_ok"] / r["n"],
            "ended_on_turn_end": r["turn_end"] / r["n"],
            "mean_steps_per_block": r["steps"] / max(1, r["blocks"]),
            "mean_blocks": r["blocks"] / r["n"],
            "mean_seconds": r["s"] / r["n"],
        }
        if "far_n" in r:
            rows[task]["beyond_window"] = {"n": r["far_n"], "exact_match": r["far_exact"] / r["far_n"]}
    tot = {
        k: sum(r[k] for r in per_task.values())
        for k in ("n", "exact", "stop_ok", "turn_end", "steps", "blocks")
    }
    overall = {
        "n": tot["n"],
        "exact_match": tot["exact"] / max(1, tot["n"]),
        "ended_on_expected_stop": tot["stop_ok"] / max(1, tot["n"]),
        "ended_on_turn_end": tot["turn_end"] / max(1, tot["n"]),
        "mean_steps_per_block": tot["steps"] / max(1, tot["blocks"]),
    }
    return {
        "model": str(model_dir),
        "device": str(eng.model.device),
        "dtype": str(eng.model.dtype),
        "n_per_task": n_per_task,
        "seed": seed,
        "seconds": time.time() - t0,
        "tasks": rows,
        "overall": overall,
        "samples": samples,
    }


def format_table(result: dict[str, Any]) -> str:
    head = f"{'task':<12} {'n':>4} {'exact':>7} {'check':>7} {'stop ok':>8} {'<turn|>':>8} {'steps/blk':>9} {'s/reply':>8}"
    lines = [head, "-" * len(head)]
    for task, r in result["tasks"].items():
        if task == "schema":
            lines.append(
                f"{task:<12} {r['n']:>4} {r['exact_match']:>7.1%} {r['slot_accuracy']:>7.1%} "
                f"{'':>8} {'':>8} {'':>9} {r['mean_seconds']:>8.3f}  ({r['slots']} label slots, scored)"
            )
            continue
        lines.append(
            f"{task:<12} {r['n']:>4} {r['exact_match']:>7.1%} {r['task_check']:>7.1%} "
            f"{r['ended_on_expected_stop']:>8.1%} {r['ended_on_turn_end']:>8.1%} "
            f"{r['mean_steps_per_block']:>9.2f} {r['mean_seconds']:>8.3f}"
        )
        if "beyond_window" in r:
            far = r["beyond_window"]
            lines.append(f"{'  beyond win':<12} {far['n']:>4} {far['exact_match']:>7.1%}")
    o = result["overall"]
    lines.append("-" * len(head))
    lines.append(
        f"{'overall':<12} {o['n']:>4} {o['exact_match']:>7.1%} {'':>7} {o['ended_on_expected_stop']:>8.1%} "
        f"{o['ended_on_turn_end']:>8.1%} {o['mean_steps_per_block']:>9.2f}"
    )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
