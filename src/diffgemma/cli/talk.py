"""`diffgemma ask`, `chat` and `prompt`: one reply, a conversation, a rendered chat template."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import typer

from diffgemma.cli.options import (
    CTX,
    DEVICE,
    DTYPE,
    MAX_TOKENS,
    MODEL,
    OPLOG,
    RAW,
    SEED,
    THINK,
    THREADS,
    TOOL_REPAIR,
    TOOL_VALIDATE,
    CliError,
    _stderr,
    one_line_errors,
)
from diffgemma.cli.replies import _check_log, _prompt_ids, load_engine, result_json, stream_reply, summary


def ask(
    prompt: str = typer.Option(..., "-p", "--prompt", help="The question; '-' reads stdin."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    model: str | None = MODEL,
    seed: int = SEED,
    ctx: int = CTX,
    max_tokens: int | None = MAX_TOKENS,
    raw: bool = RAW,
    think: bool = THINK,
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
    log: Path | None = OPLOG,
    tool_validate: bool = TOOL_VALIDATE,
    tool_repair: bool = TOOL_REPAIR,
) -> None:
    """Answer one prompt, streaming the reply as blocks commit."""
    with one_line_errors():
        text = sys.stdin.read() if prompt == "-" else prompt
        if not text.strip():
            raise CliError("empty prompt", 2)
        _check_log(log)
        # one reply: compiling would cost more than it saves (docs/performance.md, "torch.compile and warm-up")
        engine = load_engine(model, device, dtype, ctx, threads, compile=False)
        ids = _prompt_ids(engine, text, raw, think)
        from diffgemma.session.client import Session  # torch: after the errors that need none

        session = Session(engine, log=log, tool_validate=tool_validate, tool_repair=tool_repair)
        out, wall = stream_reply(
            engine, session.generate, ids, json_out, max_new_tokens=max_tokens, seed=seed
        )
        if json_out:
            print(json.dumps(result_json(out, wall, model=str(engine.path), seed=seed)))
        _stderr(summary(out, wall))


CHAT_HELP = "commands: /reset, /think on|off, /seed N, /quit"


def chat(
    json_out: bool = typer.Option(False, "--json", help="One JSON object per turn instead of streamed text."),
    model: str | None = MODEL,
    seed: int = SEED,
    ctx: int = CTX,
    max_tokens: int | None = MAX_TOKENS,
    think: bool = THINK,
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
    log: Path | None = OPLOG,
    tool_validate: bool = TOOL_VALIDATE,
    tool_repair: bool = TOOL_REPAIR,
) -> None:
    """Interactive chat with history; only each new turn is prefilled (the KV cache is reused)."""
    with one_line_errors():
        _check_log(log)
        engine = load_engine(model, device, dtype, ctx, threads)
        if engine.tokenizer is None:
            raise CliError(f"{engine.path} has no tokenizer.json")
        from diffgemma.session.client import Session  # torch: after the errors that need none

        conv = Session(engine, log=log, tool_validate=tool_validate, tool_repair=tool_repair)
        messages: list[dict[str, Any]] = []
        tty = sys.stdin.isatty()
        warm = None
        if tty:
            _stderr(CHAT_HELP)
            if engine.runner.fast:  # compile while the first message is typed (piped input would not wait)
                warm = threading.Thread(target=_warm_up, args=(engine,), name="diffgemma-warm-up")
                warm.start()
        while True:
            line = _read_line(tty)
            if line is None:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                cmd, _, arg = line.partition(" ")
                if cmd == "/quit":
                    break
                if cmd == "/reset":
                    messages, _ = [], conv.reset()
                    _stderr("history cleared")
                elif cmd == "/think" and arg in ("on", "off"):
                    think = arg == "on"
                    _stderr(f"thinking {arg}")
                elif cmd == "/think":
                    _stderr(f"/think takes on or off, got {arg.strip()!r}")
                elif cmd == "/seed":
                    try:
                        seed = int(arg)
                        _stderr(f"seed {seed}")
                    except ValueError:
                        _stderr(f"/seed takes an integer, got {arg.strip()!r}; the seed stays {seed}")
                else:
                    _stderr(f"unknown command {line!r}; {CHAT_HELP}")
                continue
            turn = [*messages, {"role": "user", "content": line}]
            ids = engine.prompt_ids(turn, think=think)
            if len(ids) >= engine.max_tokens:
                _stderr(
                    f"error: the conversation is {len(ids)} tokens; the context is {engine.max_tokens} (--ctx); "
                    "/reset to start over"
                )
                continue
            if warm is not None:
                warm.join()
                warm = None
            out, wall = stream_reply(
                engine, conv.generate, ids, json_out, max_new_tokens=max_tokens, seed=seed
            )
            if out.finish_reason == "cancelled":
                _stderr("cancelled")
            messages = [*turn, {"role": "assistant", "content": out.text}]
            if json_out:
                print(json.dumps(result_json(out, wall, turn=len(messages) // 2)), flush=True)
            _stderr(summary(out, wall))
        if warm is not None:  # quit before the first reply: let the warm-up end, not die inside a CUDA call
            if warm.is_alive():
                _stderr("finishing the warm-up before exiting")
            warm.join()


def _warm_up(engine) -> None:
    try:
        engine.warm_up()
    except Exception as e:  # noqa: BLE001 - the first reply then compiles what it needs itself
        _stderr(f"warm-up failed ({type(e).__name__}: {e}); the first reply compiles instead")


def _read_line(tty: bool) -> str | None:
    """The next line: None at the end of input (Ctrl-D) or on Ctrl-C with piped input; at a terminal's prompt
    Ctrl-C drops the line typed so far and asks again, as a shell does (a reply's Ctrl-C cancels the reply)."""
    try:
        return input(">>> ") if tty else (sys.stdin.readline() or None)
    except EOFError:
        if tty:
            print()  # end the prompt's line, so that the shell's prompt starts on a line of its own
        return None
    except KeyboardInterrupt:
        if not tty:
            return None
        print()
        _stderr("Ctrl-C at the prompt does not quit: /quit or Ctrl-D does")
        return ""


def prompt(model: str | None = MODEL) -> None:
    """Render a request read from stdin ({"messages", "tools", "enable_thinking", "add_generation_prompt"})
    with the model's chat template; print {"text", "ids"}."""
    from diffgemma.chat.tokenizer import ChatTokenizer
    from diffgemma.weights.download import resolve_model

    with one_line_errors():
        try:
            req = json.loads(sys.stdin.read())
        except json.JSONDecodeError as e:
            raise CliError(f"stdin is not valid JSON: {e}", 2) from None
        if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
            raise CliError('stdin must be a JSON object with a "messages" list', 2)
        path = resolve_model(model)
        tok = ChatTokenizer.from_dir(path)
        options = dict(
            tools=req.get("tools"),
            add_generation_prompt=bool(req.get("add_generation_prompt", True)),
            enable_thinking=bool(req.get("enable_thinking", False)),
        )
        text = tok.render(req["messages"], **options)
        print(json.dumps({"text": text, "ids": tok.encode_chat(req["messages"], **options)}))
