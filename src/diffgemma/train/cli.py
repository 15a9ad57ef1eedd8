"""What `diffgemma train` and `diffgemma eval` run, once the command line (`diffgemma.cli`) has parsed them."""

from __future__ import annotations

import json
from pathlib import Path

from diffgemma.train import data
from diffgemma.train.trainer import TrainConfig


def run_train(cfg: TrainConfig) -> dict:
    """Train, print the run's summary as JSON and return it."""
    from diffgemma.train.trainer import train

    summary = train(cfg)
    print(json.dumps(summary, indent=2))
    return summary


def run_eval(
    model: str | Path,
    n: int = 50,
    seed: int = 1234,
    device: str | None = None,
    dtype: str | None = None,
    tasks: tuple[str, ...] = data.TASKS,
    max_new_tokens: int = 160,
    json_out: str | Path | None = None,
) -> dict:
    """Evaluate `model` on n held-out prompts of each task, print the table (and write the JSON)."""
    from diffgemma.train.eval import evaluate, format_table, write_json

    result = evaluate(model, n, seed, device, dtype, tasks, max_new_tokens)
    print(format_table(result))
    if json_out:
        write_json(result, json_out)
        print(f"wrote {json_out}")
    return result
