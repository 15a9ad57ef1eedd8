"""`diffgemma score`: a question schema answered by scored reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from diffgemma.cli.options import DEVICE, DTYPE, MODEL, THREADS, CliError, one_line_errors
from diffgemma.cli.replies import load_engine


def score(
    schema: Path = typer.Option(..., "--schema", help="A question schema (JSON: questions, options...)."),
    state: Path = typer.Option(..., "--state", help="The state to answer about (JSON)."),
    model: str | None = MODEL,
    seed: int = typer.Option(42, "--seed", help="The holes' noise seed (42, as the server and ask)."),
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
) -> None:
    """Answer a question schema about a state by scored reads (no generated text); print the answers as JSON."""
    from diffgemma.chat.questions import SchemaError

    with one_line_errors():
        docs = []
        for name, path in (("--schema", schema), ("--state", state)):
            try:
                docs.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise CliError(f"{name} {path}: {e}", 2) from None
        if not isinstance(docs[0], dict):
            raise CliError(
                f"--schema {schema}: a question schema is a JSON object, not {_json_kind(docs[0])}", 2
            )
        engine = load_engine(model, device, dtype, None, threads, compile=False)
        if engine.tokenizer is None:
            raise CliError(f"{engine.path} has no tokenizer.json")
        try:
            print(json.dumps(engine.score(docs[0], docs[1], seed=seed)))
        except SchemaError as e:
            raise CliError(f"the question schema: {e}", 2) from None


def _json_kind(value: Any) -> str:
    """How JSON names a parsed value's type: "an array", "a string"..."""
    kinds = (
        (dict, "an object"),
        (list, "an array"),
        (str, "a string"),
        (bool, "a boolean"),
        (type(None), "null"),
    )
    return next((name for cls, name in kinds if isinstance(value, cls)), "a number")
