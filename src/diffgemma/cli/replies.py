"""A reply on the terminal: the model loaded, the blocks shown as they commit, the summary and JSON lines."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from diffgemma.cli.options import CliError, _stderr
from diffgemma.config import CHAT_CONTEXT


def load_engine(
    model: str | None,
    device: str | None,
    dtype: str | None,
    ctx: int | None,
    threads: int | None = None,
    compile: bool = True,
):
    """Resolve and load a model, saying on stderr which one, with a spinner while weights load on a TTY.
    The engine's `max_tokens` is the context: --ctx, else CHAT_CONTEXT capped at the model's positions."""
    import diffgemma
    from diffgemma.config import ModelConfig, load_runtime_config
    from diffgemma.weights.download import resolve_model

    if ctx is not None and ctx <= 0:
        raise CliError(f"--ctx must be positive, got {ctx}", 2)
    runtime = load_runtime_config(device=device, dtype=dtype, threads=threads).replace(compile=compile)
    if runtime.device:  # a device this torch cannot run on is said before the model line, as the only line
        from diffgemma.runner.devices import check_device  # torch: not for the errors found before this

        check_device(runtime.device)
    path = resolve_model(model)
    _stderr(f"model {path}")
    ctx = ModelConfig.from_dir(path).context(ctx, CHAT_CONTEXT)
    if sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(f"loading {path.name}…"):
            return diffgemma.load(path, max_tokens=ctx, runtime=runtime)
    return diffgemma.load(path, max_tokens=ctx, runtime=runtime)


class Display:
    """Shows a reply as its blocks commit. Not a TTY: content to stdout, reasoning to stderr, nothing else.
    A TTY: one live view of the committed text (reasoning dimmed) followed by the canvas being denoised."""

    def __init__(self, engine, quiet: bool = False):
        from diffgemma.chat.parser import Content, Reasoning, StreamParser

        self.tok = engine.tokenizer
        self.parser = StreamParser(self.tok) if self.tok is not None else None
        self.Content, self.Reasoning = Content, Reasoning
        self.quiet = quiet
        self.text = ""
        self.reasoning = ""
        self.live = None
        if not quiet and sys.stdout.isatty() and self.tok is not None:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(), auto_refresh=False, vertical_overflow="visible")
            self.live.start()

    def _view(self, preview: str = ""):
        from rich.text import Text

        view = Text()
        if self.reasoning:
            view.append(self.reasoning.rstrip() + "\n", style="dim italic")
        view.append(self.text)
        if preview:
            width = max(10, self.live.console.width - len(self.text.rsplit("\n", 1)[-1]) - 1)
            view.append(preview.replace("\n", " ")[:width], style="dim")
        return view

    def on_step(self, info) -> None:
        if self.live is not None:
            self.live.update(
                self._view(self.tok.decode(info.argmax.tolist(), skip_special=True)), refresh=True
            )

    def on_block(self, ids: list[int]) -> None:
        if self.parser is None:
            return
        for event in self.parser.feed(ids):
            if isinstance(event, self.Content):
                self.text += event.text
                if not self.quiet and self.live is None:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, self.Reasoning):
                self.reasoning += event.text
                if not self.quiet and self.live is None:
                    sys.stderr.write(event.text)
                    sys.stderr.flush()
        if self.live is not None:
            self.live.update(self._view(), refresh=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.update(self._view(), refresh=True)
            self.live.stop()
            self.live = None

    def close(self, out) -> None:
        self.stop()
        if self.parser is not None:
            self.parser.finish(out.finish_reason)
        if self.quiet:
            return
        if self.tok is None:
            print(json.dumps(out.token_ids))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()


@contextmanager
def ctrl_c_cancels(cancel) -> Iterator[None]:
    """While a reply generates, Ctrl-C cancels it (between denoise steps) instead of killing the process."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda *_: cancel.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_reply(engine, generate: Callable[..., Any], ids: list[int], quiet: bool, **kwargs: Any):
    """Run `generate` with the display and Ctrl-C cancellation wired in; returns (output, wall seconds)."""
    from diffgemma.engine.generate import CancelToken

    display = Display(engine, quiet=quiet)
    cancel = CancelToken()
    t0 = time.perf_counter()
    try:
        with ctrl_c_cancels(cancel):
            out = generate(ids, on_step=display.on_step, on_block=display.on_block, cancel=cancel, **kwargs)
    finally:
        display.stop()
    wall = time.perf_counter() - t0
    display.close(out)
    return out, wall


def summary(out, wall: float) -> str:
    n = len(out.token_ids)
    line = (
        f"{n} tokens, {out.blocks} blocks, {out.steps} steps, {n / wall if wall > 0 else 0:.1f} tok/s "
        f"(prompt {out.prompt_tokens + out.reused_tokens} tokens, {out.reused_tokens} reused; "
        f"prefill {out.prefill_seconds:.2f}s, denoise {out.denoise_seconds:.2f}s) [{out.finish_reason}]"
    )
    return line


def result_json(out, wall: float, **extra: Any) -> dict[str, Any]:
    calls = [{"name": c.name, "arguments": c.arguments} for c in out.tool_calls]
    return {
        "text": out.text,
        "reasoning": out.reasoning,
        "tool_calls": calls,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens + out.reused_tokens,
        "reused_tokens": out.reused_tokens,
        "prefilled_tokens": out.prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "token_ids": out.token_ids,
        "blocks": out.blocks,
        "steps": out.steps,
        "prefill_seconds": round(out.prefill_seconds, 4),
        "denoise_seconds": round(out.denoise_seconds, 4),
        "tok_s": round(len(out.token_ids) / wall, 2) if wall > 0 else 0.0,
        **extra,
    }


def _prompt_ids(engine, text: str, raw: bool, think: bool) -> list[int]:
    if engine.tokenizer is None:
        raise CliError(f"{engine.path} has no tokenizer.json")
    ids = engine.prompt_ids(text, raw=raw, think=think)
    if len(ids) >= engine.max_tokens:
        raise CliError(f"the prompt is {len(ids)} tokens; the context is {engine.max_tokens} (--ctx)", 2)
    return ids


def _check_log(log: Path | None) -> None:
    """CliError, before the model loads, for a --log path that cannot be appended to as a file."""
    if log is None:
        return
    if log.is_dir():
        raise CliError(f"--log {log} is a directory: name a file", 2)
    if not log.parent.is_dir():
        raise CliError(f"--log {log}: no directory {log.parent}", 2)
