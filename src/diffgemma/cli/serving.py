"""`diffgemma serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from pathlib import Path

import typer

from diffgemma.cli.options import (
    DEVICE,
    DTYPE,
    MODEL,
    THREADS,
    TOOL_REPAIR,
    TOOL_VALIDATE,
    CliError,
    _stderr,
    one_line_errors,
)
from diffgemma.config import SERVE_CONTEXT


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
        if not 0 <= port <= 65535:
            raise CliError(f"--port must be 0 to 65535, got {port}", 2)
        if device:
            from diffgemma.runner.devices import check_device

            check_device(device)
        if data_parallel == 1:  # a taken port or bad host said now, not after the model has loaded
            _check_listen(host, port)
        path = resolve_model(model)
        _stderr(f"model {path}")
        from diffgemma.server import serve as run_server  # torch and the web stack: after the cheap checks

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
