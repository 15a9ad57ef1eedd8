"""`serve`: load a model, size the KV budget to the machine, and run the app under uvicorn (blocking)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from diffgemma.config import API_KEY_ENV, SERVE_CONTEXT, ModelConfig, env_api_key, load_runtime_config
from diffgemma.engine.engine import EngineCore
from diffgemma.model.kv_cache import cache_bytes, kv_layout, ring_slots
from diffgemma.runner.parallel import join, leave, release
from diffgemma.server.app import DEFAULT_MAX_CONVERSATIONS, DEFAULT_MAX_QUEUE, create_app
from diffgemma.server.balance import replica_port, start_in_thread
from diffgemma.session.registry import SERVE_REWIND_SLACK

log = logging.getLogger("diffgemma.server")

MEMORY_SHARE = 0.8  # of the memory free after loading, what the conversations' KV caches may take
DEFAULT_SHUTDOWN_GRACE = 10.0  # seconds in-flight replies may run on after SIGTERM before they are cancelled
CANCEL_MARGIN = 5.0  # after the grace, how long cancelled replies get to end before uvicorn kills their tasks


def resolve_api_key(
    api_key: str | None, api_key_file: str | Path | None, environ: dict[str, str] | None = None
) -> str | None:
    """The key: `api_key`, else the first line of `api_key_file`, else DIFFGEMMA_API_KEY; None for none. The file
    and the variable keep it out of the process list, where any local user reads a command line."""
    if api_key is not None and api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        path = Path(api_key_file)
        lines = path.read_text(encoding="utf-8").strip().splitlines()
        if not lines or not lines[0].strip():
            raise ValueError(f"--api-key-file {path} is empty")
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            log.warning("--api-key-file %s is readable by other users (chmod 600 it)", path)
        return lines[0].strip()
    if api_key is not None:
        if not api_key.strip():
            raise ValueError("--api-key is empty")
        return api_key
    key = env_api_key(environ)
    if key is not None:
        log.info("API key from %s", API_KEY_ENV)
    return key


def serve_ring(engine: EngineCore, ctx: int) -> int:
    """A served conversation's sliding-layer ring slots (room to rewind `SERVE_REWIND_SLACK` tokens)."""
    return ring_slots(engine.config, ctx, SERVE_REWIND_SLACK)


def kv_bytes(engine: EngineCore, ctx: int) -> int:
    """Bytes of one conversation's preallocated KV cache at context `ctx`."""
    return cache_bytes(engine.config, ctx, engine.model.dtype, serve_ring(engine, ctx))


def free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan_memory(engine: EngineCore, ctx: int, max_conversations: int) -> tuple[int, int]:
    """Bound the context and the number of cached conversations by the memory left after the weights."""
    free = free_memory(engine.model.device)
    if free is None:
        return ctx, max_conversations
    budget = int(free * MEMORY_SHARE)
    if kv_bytes(engine, ctx) > budget:
        per_token = max(1, kv_bytes(engine, 2) - kv_bytes(engine, 1))
        fitted = max(engine.config.canvas_length * 2, budget // per_token)
        log.warning("--ctx %d does not fit in memory (%.1f GiB free); using %d", ctx, free / 2**30, fitted)
        ctx = min(ctx, fitted)
    conversations = max(1, min(max_conversations, budget // max(1, kv_bytes(engine, ctx))))
    if conversations < max_conversations:
        log.warning("memory holds the KV of %d conversations, not %d", conversations, max_conversations)
    return ctx, conversations


def graceful_server(app: Any, grace: float, **options: Any) -> Any:
    """A uvicorn server of `app` whose shutdown (SIGTERM, SIGINT) stops accepting at once, lets the replies in flight
    run `grace` seconds, then cancels those left through their tokens (`app.state.cancel_in_flight`): each ends at
    its next denoise step with finish_reason "cancelled". uvicorn's own timeout, CANCEL_MARGIN later, kills any
    task still there."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(grace, self.past_grace)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        def past_grace(self) -> None:
            n = app.state.cancel_in_flight()
            if n:
                log.warning(
                    "shutdown: %d replies still running after the %g s grace; cancelling them", n, grace
                )

    config = uvicorn.Config(app, timeout_graceful_shutdown=grace + CANCEL_MARGIN, **options)
    return Server(config)


def _after_shutdown(signum: int, frame: object) -> None:
    """SIGTERM once uvicorn has shut down (or in the instant before it takes the signal): nothing left to do."""


def serve(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8080,
    ctx: int | None = None,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    log_dir: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
    threads: int | None = None,
    tool_validate: bool = False,
    tool_repair: bool = False,
    tool_continuation: bool = True,
    data_parallel: int = 1,
    expert_parallel: int = 1,
    api_key_file: str | Path | None = None,
    allowed_hosts: Iterable[str] = (),
    allow_origins: Iterable[str] = (),
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
) -> None:
    """Serve the model at `model_path` with the OpenAI API until interrupted. The context is `ctx`, at most the
    model's positions (default SERVE_CONTEXT capped at them), lowered to what memory holds. Under torchrun, a
    process a GPU: `data_parallel` N, each process a replica on loopback port port + 1 + rank, and the first one
    also the front at host:port (`balance.py`); `expert_parallel` N (or DIFFGEMMA_EXPERT_PARALLEL), the first
    process the server and the others its experts' shares (`runner.parallel`). The key is `resolve_api_key`'s;
    `allowed_hosts` and `allow_origins` are `create_app`'s. On SIGTERM the server stops accepting, lets the
    replies in flight run `shutdown_grace` seconds more, cancels those left and returns."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if shutdown_grace < 0:
        raise ValueError(f"--shutdown-grace must be >= 0 seconds, got {shutdown_grace}")
    api_key = resolve_api_key(api_key, api_key_file)
    public_host = host  # the name clients reach (a data parallel replica listens on loopback)
    # a session logged for replay (`--log-dir`) runs batch invariant: its requests' bits then do not depend on
    # what else the server was running
    runtime = load_runtime_config(
        expert_parallel=expert_parallel if expert_parallel > 1 else None,
        batch_invariant=True if log_dir else None,
    )
    if data_parallel > 1 and runtime.expert_parallel > 1:
        raise ValueError("serve runs --data-parallel or --expert-parallel, not both above 1 (not built)")
    front, rank = None, 0
    parallel = max(data_parallel, runtime.expert_parallel)
    if parallel > 1:
        rank, world = join(
            parallel, "serve --data-parallel" if data_parallel > 1 else "serve --expert-parallel"
        )
    if data_parallel > 1:
        front = (host, port, [replica_port(port, r) for r in range(world)]) if rank == 0 else None
        host, port = "127.0.0.1", replica_port(port, rank)
    ctx = ModelConfig.from_dir(model_path).context(ctx, SERVE_CONTEXT)
    engine = EngineCore.load(
        model_path, device=device, dtype=dtype, max_tokens=ctx, threads=threads, runtime=runtime
    )
    if runtime.expert_parallel > 1 and rank > 0:
        log.info(
            "expert parallel: rank %d serves experts %s of every layer to rank 0",
            rank,
            engine.model.expert_shard,
        )
        engine.runner.follow()
        leave()
        return
    if engine.runner.fast:
        log.info("warming up: compiling kernels and capturing CUDA graphs before the first request")
        log.info("warm-up done in %.1f s", engine.warm_up())
    ctx, conversations = plan_memory(engine, ctx, max_conversations)
    engine.max_tokens = ctx
    app = create_app(
        engine,
        ctx=ctx,
        api_key=api_key,
        max_queue=max_queue,
        log_dir=log_dir,
        max_conversations=conversations,
        tool_validate=tool_validate,
        tool_repair=tool_repair,
        tool_continuation=tool_continuation,
        host=public_host,
        allowed_hosts=allowed_hosts,
        allow_origins=allow_origins,
    )
    log.info(
        "KV caches: %d conversations of %d tokens (%.2f GiB each), one running turn each, their canvases in shared "
        "forwards",
        conversations, ctx, kv_bytes(engine, ctx) / 2**30,
    )  # fmt: skip
    log.info(
        "KV cache layout: %s", kv_layout(engine.config, ctx, engine.model.dtype, serve_ring(engine, ctx))
    )
    if data_parallel > 1:
        torch.distributed.barrier()  # every replica loaded before the front takes connections
    if front is not None:
        start_in_thread(*front)
        log.info(
            "data parallel: the front at http://%s:%d/v1 over %d replicas", front[0], front[1], len(front[2])
        )
    if runtime.expert_parallel > 1:
        log.info(
            "expert parallel: %d processes, experts %s of every layer here",
            parallel,
            engine.model.expert_shard,
        )
    log.info("serving %s at http://%s:%d/v1 (context %d)", app.state.model_id, host, port, ctx)
    # uvicorn shuts down on SIGTERM and then raises it again under the handler it found; a handler that returns,
    # so that serve returns and the process exits 0 (the default one would kill it, status 143)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _after_shutdown) if main else None
    try:
        server = graceful_server(app, shutdown_grace, host=host, port=port, log_level="info")
        server.run()
        if not server.started:  # as uvicorn.run: the port taken, say (uvicorn has logged why)
            raise SystemExit(3)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        release()  # the expert parallel followers return (nothing without a group)
    if runtime.expert_parallel > 1:
        leave()
