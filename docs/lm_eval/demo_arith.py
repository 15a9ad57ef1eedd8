"""The dataset of the `diffgemma_demo_arith` task, read from the JSON Lines file beside it (no hub download)."""

import json
from pathlib import Path

import datasets


def load(**_metadata) -> datasets.DatasetDict:
    """lm-eval's `custom_dataset` hook: the task's one split, `test`."""
    lines = Path(__file__).with_name("demo_arith.jsonl").read_text().splitlines()
    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_list([json.loads(x) for x in lines if x.strip()])}
    )
