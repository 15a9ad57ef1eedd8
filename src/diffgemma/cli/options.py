"""The options the commands share, and the errors a user can cause printed as one line."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer

from diffgemma.config import CHAT_CONTEXT

MODEL = typer.Option(None, "-m", "--model", help="Model directory or HF repo id (default: discover).")
SEED = typer.Option(42, "--seed", help="Canvas noise seed.")
CTX = typer.Option(
    None, "--ctx", help=f"Context in tokens, prompt + reply (default {CHAT_CONTEXT}, at most the model's)."
)
MAX_TOKENS = typer.Option(None, "--max-tokens", help="Reply budget (default: generation_config).")
RAW = typer.Option(False, "--raw", help="Send the text verbatim, no chat template.")
THINK = typer.Option(False, "--think/--no-think", help="Thinking on (reasoning in the thought channel).")
DEVICE = typer.Option(None, "--device", help="cpu, cuda, mps (default: best available).")
DTYPE = typer.Option(None, "--dtype", help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU).")
THREADS = typer.Option(
    None, "--threads", help="CPU threads (default: 1 for a small model such as the demo, else all cores)."
)
OPLOG = typer.Option(None, "--log", help="Append every op and event to this JSONL file (diffgemma replay).")
TOOL_VALIDATE = typer.Option(
    False,
    "--tool-validate",
    help="Retry a reply whose tool call does not parse, with the next seed (3 tries).",
)
TOOL_REPAIR = typer.Option(
    False,
    "--tool-repair",
    help="Repair an invalid tool call off the record: error feedback, regenerate, rewind.",
)
# click's exceptions, wherever this typer takes click from (recent ones vendor it)
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_NO_ARGS_IS_HELP = getattr(sys.modules[_USAGE_ERROR.__module__], "NoArgsIsHelpError", ())


class CliError(Exception):
    """A user-facing error: one line on stderr, exit status 1 (2 for bad input)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn the errors a user can cause into one line on stderr and a non-zero exit, never a traceback."""
    # ValueError covers ConfigError and the loader's CheckpointError (importing that module would import torch)
    try:
        yield
    except CliError as e:
        _die(str(e), e.code)
    except (ValueError, TypeError, OSError) as e:
        _die(str(e), 1)


def _die(message: str, code: int) -> None:
    print(f"diffgemma: error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _stderr(message: str) -> None:
    print(f"diffgemma: {message}", file=sys.stderr, flush=True)


def _usage(ctx: typer.Context, message: str) -> NoReturn:
    """A bad option value found after parsing: one line and exit 2, as the parsers' own errors."""
    raise _USAGE_ERROR(message, ctx)
