"""The `diffgemma` command line (typer): ask, chat, prompt, serve, score, replay, golden, download, quantize, bench,
train, eval.

Longer than 600 lines on purpose: each command's typer signature is its `--help`, and the twelve of them are kept
in one file as the command line's one reference; the work each command does lives in its own module."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer

from diffgemma.config import CHAT_CONTEXT, SERVE_CONTEXT

app = typer.Typer(add_completion=False, no_args_is_help=True, help="DiffusionGemma inference engine.")

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
    from diffgemma.config import ConfigError
    from diffgemma.weights.loader import CheckpointError

    try:
        yield
    except CliError as e:
        _die(str(e), e.code)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError, TypeError, OSError) as e:
        _die(str(e), 1)


def _die(message: str, code: int) -> None:
    print(f"diffgemma: error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _stderr(message: str) -> None:
    print(f"diffgemma: {message}", file=sys.stderr, flush=True)


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
    from diffgemma.runner.devices import check_device
    from diffgemma.weights.download import resolve_model

    if ctx is not None and ctx <= 0:
        raise CliError(f"--ctx must be positive, got {ctx}", 2)
    runtime = load_runtime_config(device=device, dtype=dtype, threads=threads).replace(compile=compile)
    if runtime.device:  # a device this torch cannot run on is said before the model line, as the only line
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


@app.command()
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
    from diffgemma.session.client import Session

    with one_line_errors():
        text = sys.stdin.read() if prompt == "-" else prompt
        if not text.strip():
            raise CliError("empty prompt", 2)
        _check_log(log)
        # one reply: compiling would cost more than it saves (docs/performance.md, "torch.compile and warm-up")
        engine = load_engine(model, device, dtype, ctx, threads, compile=False)
        ids = _prompt_ids(engine, text, raw, think)
        session = Session(engine, log=log, tool_validate=tool_validate, tool_repair=tool_repair)
        out, wall = stream_reply(
            engine, session.generate, ids, json_out, max_new_tokens=max_tokens, seed=seed
        )
        if json_out:
            print(json.dumps(result_json(out, wall, model=str(engine.path), seed=seed)))
        _stderr(summary(out, wall))


def _check_log(log: Path | None) -> None:
    """CliError, before the model loads, for a --log path that cannot be appended to as a file."""
    if log is None:
        return
    if log.is_dir():
        raise CliError(f"--log {log} is a directory: name a file", 2)
    if not log.parent.is_dir():
        raise CliError(f"--log {log}: no directory {log.parent}", 2)


CHAT_HELP = "commands: /reset, /think on|off, /seed N, /quit"


@app.command()
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
    from diffgemma.session.client import Session

    with one_line_errors():
        _check_log(log)
        engine = load_engine(model, device, dtype, ctx, threads)
        if engine.tokenizer is None:
            raise CliError(f"{engine.path} has no tokenizer.json")
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


@app.command()
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


@app.command()
def serve(
    model: str | None = MODEL,
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback unless told otherwise)."),
    port: int = typer.Option(8080, "--port"),
    ctx: int | None = typer.Option(
        None, "--ctx", help=f"Context per conversation (default {SERVE_CONTEXT}, at most the model's)."
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        help="Require 'Authorization: Bearer KEY' (or --api-key-file, or DIFFGEMMA_API_KEY).",
    ),
    api_key_file: Path | None = typer.Option(
        None,
        "--api-key-file",
        help="Read the API key from this file's first line (kept off the command line).",
    ),
    allowed_host: list[str] | None = typer.Option(
        None, "--allowed-host", help="A further Host name clients may use (repeatable; '*': any)."
    ),
    allow_origin: list[str] | None = typer.Option(
        None,
        "--allow-origin",
        help="A web origin allowed cross-origin requests, with CORS (repeatable; '*': any).",
    ),
    shutdown_grace: float = typer.Option(
        10.0,
        "--shutdown-grace",
        help="Seconds replies in flight run on after SIGTERM before they are cancelled.",
    ),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting beyond this get 503."),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Write the JSONL request log and op log (ops.jsonl: diffgemma replay) here."
    ),
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
    tool_validate: bool = TOOL_VALIDATE,
    tool_repair: bool = TOOL_REPAIR,
    tool_continuation: bool = typer.Option(
        True,
        "--tool-continuation/--no-tool-continuation",
        help="With thinking on, a tool round's next round continues its raw log, reasoning included.",
    ),
    data_parallel: int = typer.Option(
        1,
        "--data-parallel",
        help="Replicas, one a process (under torchrun --nproc-per-node N), behind one address; ports PORT+1..PORT+N.",
    ),
    expert_parallel: int = typer.Option(
        1,
        "--expert-parallel",
        help="Processes sharing each layer's experts (under torchrun --nproc-per-node N); the first one serves.",
    ),
) -> None:
    """OpenAI-compatible HTTP server."""
    from diffgemma.weights.download import resolve_model

    with one_line_errors():
        from diffgemma.runner.devices import check_device
        from diffgemma.server import serve as run_server

        if not 0 <= port <= 65535:
            raise CliError(f"--port must be 0 to 65535, got {port}", 2)
        if device:
            check_device(device)
        if data_parallel == 1:  # a taken port or bad host said now, not after the model has loaded
            _check_listen(host, port)
        path = resolve_model(model)
        _stderr(f"model {path}")
        run_server(
            path,
            host=host,
            port=port,
            ctx=ctx,
            api_key=api_key,
            max_queue=max_queue,
            log_dir=log_dir,
            device=device,
            dtype=dtype,
            threads=threads,
            tool_validate=tool_validate,
            tool_repair=tool_repair,
            tool_continuation=tool_continuation,
            data_parallel=data_parallel,
            expert_parallel=expert_parallel,
            api_key_file=api_key_file,
            allowed_hosts=allowed_host or (),
            allow_origins=allow_origin or (),
            shutdown_grace=shutdown_grace,
        )


def _check_listen(host: str, port: int) -> None:
    """CliError unless a server can listen on host:port (bound and closed at once, with uvicorn's SO_REUSEADDR)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:  # gaierror for a bad host, EADDRINUSE, EACCES below 1024
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@app.command()
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


@app.command()
def replay(
    log: Path = typer.Argument(
        ..., help="An op log (ask/chat --log FILE, serve --log-dir DIR: DIR/ops.jsonl)."
    ),
    model: str | None = typer.Option(None, "-m", "--model", help="Model (default: the one the log names)."),
    device: str | None = typer.Option(None, "--device", help="Default: the log's."),
    dtype: str | None = typer.Option(None, "--dtype", help="Default: the log's."),
    threads: int | None = THREADS,
) -> None:
    """Re-execute a logged session and compare every event: exit 0 when identical, 1 at the first difference."""
    import diffgemma
    from diffgemma.config import load_runtime_config
    from diffgemma.session.oplog import read_log
    from diffgemma.session.oplog import replay as replay_log
    from diffgemma.weights.download import resolve_model

    with one_line_errors():
        if not log.is_file():
            raise CliError(f"{log}: no such log", 2)
        sessions = read_log(log)
        first = sessions[0].header
        path = resolve_model(model or first.get("model"))
        runtime = load_runtime_config(
            device=device or first.get("device"), dtype=dtype or first.get("dtype"), threads=threads
        )
        engine = diffgemma.load(path, max_tokens=first.get("ctx"), runtime=runtime)
        same, line = replay_log(log, engine)
        print(line)
        if not same:
            raise typer.Exit(1)


@app.command()
def golden(
    bless: bool = typer.Option(False, "--bless", help="Record the paths anew (after a deliberate change)."),
    model: str | None = typer.Option(None, "-m", "--model", help="Default: the bundled demo model."),
) -> None:
    """The refactor gate: replay the golden session paths on the demo model (CPU, fp32) and diff every event."""
    import diffgemma
    from diffgemma.session import golden as G
    from diffgemma.weights.download import bundled_model, resolve_model

    with one_line_errors():
        path = resolve_model(model) if model else bundled_model()
        if path is None:
            raise CliError("this build has no bundled demo model: pass -m", 2)
        engine = diffgemma.load(path, device="cpu", dtype="float32", threads=1)
        if bless:
            print(f"recorded {len(G.PATHS)} paths into {G.bless(engine)}")
            return
        same, line = G.check(engine)
        print(line)
        if not same:
            raise typer.Exit(1)


@app.command()
def download(
    repo: str = typer.Option("google/diffusiongemma-26B-A4B-it", "--repo", help="Hub repo, ORG/NAME."),
    revision: str | None = typer.Option(None, "--revision", help="Branch, tag or commit (default: main)."),
    out: Path | None = typer.Option(None, "-o", "--out", help="Target directory (default: the HF cache)."),
) -> None:
    """Download a checkpoint or pack (safetensors, configs, tokenizer) from the Hugging Face Hub; an interrupted
    run resumes, and the directory is printed only once every file matches the hub's size and sha256."""
    import shlex

    from diffgemma.weights.download import DEFAULT_REPO, VerifyError
    from diffgemma.weights.download import download as fetch

    flags = {"--repo": None if repo == DEFAULT_REPO else repo, "--revision": revision, "-o": out}
    again = "diffgemma download" + "".join(f" {k} {shlex.quote(str(v))}" for k, v in flags.items() if v)
    with one_line_errors():
        try:
            path = fetch(repo, revision, out)
        except VerifyError as e:
            raise CliError(f"{e}: run `{again}` to fetch it again") from None
        except KeyboardInterrupt:
            raise CliError(f"interrupted: run `{again}` to resume", 130) from None
        except Exception as e:  # hub errors come in many classes, some of several lines: one line here
            why = f"{type(e).__name__}: {' '.join(str(e).split())}"
            status = getattr(getattr(e, "response", None), "status_code", None) or 500
            final = isinstance(e, FileNotFoundError) or (400 <= status < 500 and status not in (408, 429))
            resume = "" if final else f"; run `{again}` to resume"  # no retry helps a 404 or a missing token
            raise CliError(f"download of {repo} failed: {why}{resume}") from None
        print(path)


@app.command()
def quantize(
    model: str | None = MODEL,
    out: Path = typer.Option(..., "-o", "--out", help="The pack's directory (must not exist)."),
    profile: str = typer.Option(
        "int4", "--profile", help="int4 (the default), q5, q6, q8, fp8, nvfp4, nvfp4x (int4, experts nvfp4)."
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="CLASS=FORMAT on top of the profile: experts, experts.gate_up, experts.down, attn, "
        "dense, sc, vision = bf16, q8, int4, q5, q6, fp8, nvfp4.",
        show_default=False,
    ),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="No progress line."),
) -> None:
    """Write a quantized pack of a checkpoint: one tensor at a time, into a directory renamed into place at the end."""
    from diffgemma.quant.profiles import QuantSpecError
    from diffgemma.weights.download import resolve_model
    from diffgemma.weights.pack import quantize as write_pack

    with one_line_errors():
        try:
            path = write_pack(resolve_model(model), out, profile, overrides, quiet=quiet)
        except QuantSpecError as e:
            raise CliError(str(e), code=2) from None
        except KeyboardInterrupt:
            raise CliError(f"interrupted; no {out} was written", code=130) from None
        print(path)


def _usage(ctx: typer.Context, message: str) -> NoReturn:
    """A bad option value found after parsing: one line and exit 2, as the parsers' own errors."""
    raise _USAGE_ERROR(message, ctx)


@app.command()
def bench(
    ctx: typer.Context,
    model: str | None = typer.Option(
        None, "-m", "--model", help="Checkpoint directory (default: random weights)."
    ),
    tiny: bool = typer.Option(False, "--tiny", help="Random weights at a tiny shape (a CPU smoke test)."),
    real: bool = typer.Option(
        False, "--real", help="Random weights at the real 26B-A4B shape on CPU too (a GPU's default)."
    ),
    device: str | None = typer.Option(
        None, "--device", help="cuda or cpu (default: cuda when there is one; on CPU the demo model bare)."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: bfloat16 on a GPU, float32 on CPU)."
    ),
    contexts: str | None = typer.Option(
        None,
        "--contexts",
        help="Comma-separated context lengths (default 1024,8192,32768,131072; --tiny 256,1024).",
    ),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: 1 for a small model)."),
    reps: int = typer.Option(10, "--reps", help="Timed repetitions (median), at least 10."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed calls first."),
    prefill_chunk: int = typer.Option(8192, "--prefill-chunk", help="Tokens a fast prefill pass."),
    gen_steps: int = typer.Option(
        48, "--gen-steps", help="Fixed denoise steps of the generation (0 = skip)."
    ),
    gen_prompt: int = typer.Option(1024, "--gen-prompt", help="Prompt tokens of the generation."),
    gen_reps: int = typer.Option(10, "--gen-reps", help="Timed generations (median), at least 10."),
    fixed_steps: int = typer.Option(
        16, "--fixed-steps", help="Steps a block of the tok/s generation, early stops off (0 = skip)."
    ),
    quant: str | None = typer.Option(
        None, "--quant", help="Quantize the weights on the device first: a profile (int4, fp8, ...)."
    ),
    quant_set: list[str] = typer.Option(
        [], "--set", help="CLASS=FORMAT on top of --quant, as diffgemma quantize.", show_default=False
    ),
    init: str = typer.Option(
        "hf", "--init", help="Random weights: transformers' init (hf) or the wide test one."
    ),
    kernels: str = typer.Option("auto", "--kernels", help="auto, fast or reference."),
    compile: bool = typer.Option(
        True, "--compile/--no-compile", help="torch.compile the fast kernels' regions."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the results as JSON here."),
    concurrency: str | None = typer.Option(
        None, "--concurrency", help="Also N requests at once through the scheduler, e.g. 1,2,4,8,16."
    ),
    schema: bool = typer.Option(
        False, "--schema", help="Also a 3-question schema scored: a first request and a repeat."
    ),
    topk_error: bool = typer.Option(
        False, "--topk-error", help="Also top-k sparse against dense attention at each context (errors)."
    ),
    expert_parallel: int = typer.Option(
        1,
        "--expert-parallel",
        help="Ranks sharing each layer's experts (run under torchrun --nproc-per-node N).",
    ),
    data_parallel: int = typer.Option(
        1,
        "--data-parallel",
        help="Ranks each running a replica, tok/s summed (under torchrun --nproc-per-node N).",
    ),
) -> None:
    """Measure prefill and denoise speed, a fixed-step generation and peak memory (`bench/compare_hf.py` runs
    transformers on the same weights beside it)."""
    from diffgemma.bench import BenchOptions, run

    opts = BenchOptions(
        model=model,
        tiny=tiny,
        real=real,
        device=device,
        dtype=dtype,
        contexts=contexts,
        threads=threads,
        reps=reps,
        warmup=warmup,
        prefill_chunk=prefill_chunk,
        gen_steps=gen_steps,
        gen_prompt=gen_prompt,
        gen_reps=gen_reps,
        fixed_steps=fixed_steps,
        quant=quant,
        quant_set=tuple(quant_set),
        init=init,
        kernels=kernels,
        compile=compile,
        out=str(out) if out else None,
        concurrency=concurrency,
        schema=schema,
        topk_error=topk_error,
        expert_parallel=expert_parallel,
        data_parallel=data_parallel,
    )
    try:
        opts.check()
    except ValueError as e:
        _usage(ctx, str(e))
    with one_line_errors():
        run(opts)


@app.command()
def train(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Checkpoint directory to write (and resume from)."),
    steps: int = typer.Option(3000, "--steps"),
    batch: int = typer.Option(128, "--batch"),
    lr: float = typer.Option(1.5e-3, "--lr"),
    warmup: int = typer.Option(150, "--warmup"),
    weight_decay: float = typer.Option(0.05, "--weight-decay"),
    resume: bool = typer.Option(False, "--resume", help="Continue from OUT/train_state."),
    init: str = typer.Option(
        "", "--init", help="Fine-tune from this checkpoint directory (weights + tokenizer)."
    ),
    mix: str = typer.Option("", "--mix", help='Task weights over the default mix, e.g. "arith=0.3,long=0".'),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:1 ..."),
    seed: int = typer.Option(0, "--seed"),
    preset: str = typer.Option("demo", "--preset", help="Model shape: demo or tiny."),
    canvas_length: int = typer.Option(32, "--canvas-length"),
    max_denoising_steps: int = typer.Option(16, "--max-denoising-steps"),
    vocab_size: int = typer.Option(4096, "--vocab-size", help="The tokenizer's size cap."),
    sc_prob: float = typer.Option(0.5, "--sc-prob"),
    pad_weight: float = typer.Option(0.25, "--pad-weight"),
    curriculum_steps: int = typer.Option(
        0,
        "--curriculum-steps",
        help="Cap retrieval lists at 2 + step // 400 lines before this step (0 = off).",
    ),
    lookup_weight: float = typer.Option(
        0.0,
        "--lookup-weight",
        help="Weight of the two-hop lookup attention loss: retrieval answers, schema choices (0 = off).",
    ),
    time_limit: float = typer.Option(0.0, "--time-limit", help="Stop cleanly after this many seconds."),
    log_every: int = typer.Option(25, "--log-every"),
    ckpt_every: int = typer.Option(500, "--ckpt-every"),
    max_shard_mb: float = typer.Option(
        0.0, "--max-shard-mb", help="Shard model.safetensors above this size."
    ),
    eval_n: int = typer.Option(0, "--eval-n", help="After training, evaluate N held-out prompts per task."),
) -> None:
    """Train a DiffusionGemma-architecture model on the demo corpus."""
    from diffgemma.train.batches import task_weights
    from diffgemma.train.cli import run_eval, run_train
    from diffgemma.train.trainer import PRESETS, TrainConfig

    if preset not in PRESETS:
        _usage(ctx, f"--preset must be one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    if lookup_weight < 0:
        _usage(ctx, f"--lookup-weight must be >= 0, got {lookup_weight}")
    if curriculum_steps < 0:
        _usage(ctx, f"--curriculum-steps must be >= 0, got {curriculum_steps}")
    try:
        task_weights(mix)
    except ValueError as e:
        _usage(ctx, str(e))
    cfg = TrainConfig(
        out=str(out),
        steps=steps,
        batch=batch,
        lr=lr,
        warmup=warmup,
        weight_decay=weight_decay,
        seed=seed,
        device=device,
        preset=preset,
        canvas_length=canvas_length,
        max_denoising_steps=max_denoising_steps,
        vocab_size=vocab_size,
        sc_prob=sc_prob,
        pad_weight=pad_weight,
        time_limit=time_limit,
        log_every=log_every,
        ckpt_every=ckpt_every,
        max_shard_mb=max_shard_mb,
        resume=resume,
        init=init,
        mix=mix,
        curriculum_steps=curriculum_steps,
        lookup_weight=lookup_weight,
    )
    with one_line_errors():
        run_train(cfg)
        if eval_n > 0:
            run_eval(out, eval_n, device=None if device == "auto" else device, json_out=out / "eval.json")


@app.command("eval")
def eval_(
    ctx: typer.Context,
    model: Path = typer.Option(..., "-m", "--model", help="Checkpoint directory."),
    n: int = typer.Option(50, "--n", help="Held-out prompts per task."),
    seed: int = typer.Option(1234, "--seed"),
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    tasks: str | None = typer.Option(None, "--tasks", help="Comma-separated tasks (default: all of them)."),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens"),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON to this file."),
) -> None:
    """Held-out accuracy of a model on the demo tasks."""
    from diffgemma.train import data
    from diffgemma.train.cli import run_eval

    chosen = tuple(t for t in (tasks or ",".join(data.TASKS)).split(",") if t)
    unknown = [t for t in chosen if t not in data.TASKS]
    if unknown:
        _usage(ctx, f"unknown tasks {unknown}; choose from {', '.join(data.TASKS)}")
    with one_line_errors():
        run_eval(model, n, seed, device, dtype, chosen, max_new_tokens, json_out)


def main() -> None:
    # Not click's standalone mode: it prints a usage error as a boxed block, and every other error here is one line.
    try:
        code = app(standalone_mode=False)
    except _NO_ARGS_IS_HELP as e:  # a bare `diffgemma`: the help (a vendored click has printed it already)
        if e.format_message():
            e.show()
        raise SystemExit(2) from None
    except _USAGE_ERROR as e:
        where = "diffgemma" if e.ctx is None or e.ctx.parent is None else f"diffgemma {e.ctx.info_name}"
        print(f"diffgemma: error: {e.format_message()} (see `{where} --help`)", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C outside a reply (e.g. while loading): quit quietly
        print("diffgemma: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
