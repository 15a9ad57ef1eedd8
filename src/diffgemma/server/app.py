"""The OpenAI-compatible HTTP API: routes, auth, the Host and Origin checks, body limit, errors, metrics and the
request log."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import jinja2.exceptions
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffgemma.chat import questions as Q
from diffgemma.engine.engine import EngineCore
from diffgemma.engine.generate import CancelToken
from diffgemma.server import responses as R
from diffgemma.server.errors import APIError, invalid
from diffgemma.server.events import CanvasEvent, Delta, Done, JobFailed
from diffgemma.server.guard import _GuardMiddleware, served_names
from diffgemma.server.jobs import ChatJob, CompletionJob, QuestionJob
from diffgemma.server.metrics import Metrics
from diffgemma.server.reqlog import RequestLog
from diffgemma.server.schema import (
    ChatCompletionBody,
    ChatRequest,
    CompletionBody,
    CompletionRequest,
    openapi_schemas,
    parse_body,
    parse_chat,
    parse_completion,
    request_body,
    resolve_model,
)
from diffgemma.server.toolturns import THOUGHT_OPEN, ToolRounds, continuation_ids
from diffgemma.server.worker import Channel, QueueFull, Worker
from diffgemma.session import scoring
from diffgemma.session.client import stages
from diffgemma.session.pipeline import Pipeline

log = logging.getLogger("diffgemma.server")

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_CONVERSATIONS = 4
DEFAULT_MAX_BODY = 8 << 20
DRAIN_LIMIT = 64 << 20  # read (and drop) an oversized body up to this, so the client sees the 413
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
POLL_SECONDS = 0.25  # how often a non-streaming request checks that its client is still there


def route_label(path: str) -> str:
    """The metrics label of a request path: its route's template, so that labels stay a fixed set."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def model_id_of(engine: EngineCore) -> str:
    return Path(engine.path).resolve().name if engine.path is not None else "diffgemma"


class _MetricsMiddleware:
    """Counts every response by route and status (plain ASGI, so streaming and disconnects pass through)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_label(scope.get("path", ""))
        status = {"code": 500}
        started = time.perf_counter()

        async def wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            self.metrics.requests.inc(route=route, status=str(status["code"]))
            self.metrics.latency.observe(time.perf_counter() - started, route=route)


def json_media_type(value: str | None) -> bool:
    """`application/json` or a `+json` type, charset or other parameters allowed."""
    media = (value or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


PAGE_DIR = Path(__file__).resolve().parents[1] / "assets" / "page"
PAGE_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
}
# The page loads nothing but itself (the server runs offline) and talks to this server only.
PAGE_POLICY = "default-src 'self'; style-src 'self'; script-src 'self'; img-src 'self' data:"


def _page_file(name: str) -> Response:
    body = (PAGE_DIR / name).read_bytes()
    headers = {"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"}
    return Response(body, media_type=PAGE_TYPES[name], headers=headers)


def create_app(
    engine: EngineCore,
    *,
    model_id: str | None = None,
    ctx: int | None = None,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    log_dir: str | Path | None = None,
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    tool_validate: bool = False,
    tool_repair: bool = False,
    tool_continuation: bool = True,
    host: str | None = None,
    allowed_hosts: Iterable[str] = (),
    allow_origins: Iterable[str] = (),
) -> FastAPI:
    """An app serving `engine` with a context of `ctx` tokens a conversation (default: the engine's; at most the
    model's positions). Its worker thread starts and stops with the app's lifespan. Requests must name a Host among
    loopback's names, `host` (the bind address) and `allowed_hosts` (any Host where `host` is a wildcard and none is
    listed), and come from no browser page but the server's own or those of `allow_origins` (`*`: any), which get
    CORS headers."""
    model_id = model_id or model_id_of(engine)
    ctx = engine.config.context(ctx or engine.max_tokens, engine.max_tokens)
    # every op and event to log_dir/ops.jsonl (`diffgemma replay`), the tool stages around it
    ops_log = Path(log_dir) / "ops.jsonl" if log_dir else None
    base = Pipeline(engine, ctx, max_conversations)
    try:
        pipeline = stages(base, ops_log, tool_validate, tool_repair)
    except OSError as exc:  # a read-only directory: serve without that journal, not refuse to start
        log.warning("op log %s cannot be opened (%s); serving without it", ops_log, exc.strerror or exc)
        ops_log = None
        pipeline = stages(base, None, tool_validate, tool_repair)
    registry = pipeline.registry
    tool_rounds = ToolRounds(keep=2 * max_conversations) if tool_continuation else None
    worker: Worker
    metrics = Metrics(queue_depth=lambda: worker.depth, conversations=lambda: len(registry))
    worker = Worker(pipeline, max_queue, on_forward=lambda n: metrics.batch_size.observe(n))
    request_log = None
    if log_dir:
        try:
            request_log = RequestLog(log_dir)
        except OSError as exc:
            log.warning(
                "request log in %s cannot be opened (%s); serving without it", log_dir, exc.strerror or exc
            )
    tok = engine.tokenizer
    max_pos = engine.config.max_position_embeddings
    # every request's cancel token, so that a shutdown past its grace ends the replies still running cleanly
    # (each turn stops at its next step, its reply finishing "cancelled"); weak, as a token lives as its request
    in_flight: weakref.WeakSet[CancelToken] = weakref.WeakSet()

    def new_cancel() -> CancelToken:
        token = CancelToken()
        in_flight.add(token)
        return token

    def cancel_in_flight() -> int:
        """Cancel every request still running; how many there were."""
        running = [t for t in list(in_flight) if not t.cancelled]
        for token in running:
            token.cancel()
        return len(running)

    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)
            if request_log is not None:
                request_log.close()
            if ops_log is not None:
                pipeline.close()

    # /openapi.json is a route of ours below, behind the key
    app = FastAPI(title="diffgemma", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the request bodies' schemas that the completion routes refer to."""
        if app.openapi_schema is None:
            spec = default_openapi()  # caches it in app.openapi_schema
            spec.setdefault("components", {}).setdefault("schemas", {}).update(openapi_schemas())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    origins = frozenset(o.strip().lower().rstrip("/") for o in allow_origins)
    if origins:  # innermost of the three: the guard has refused the other origins before it
        app.add_middleware(
            CORSMiddleware, allow_origins=sorted(origins), allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(
        _GuardMiddleware, names=served_names(host, allowed_hosts), origins=origins, metrics=metrics
    )
    app.add_middleware(_MetricsMiddleware, metrics=metrics)  # outermost: refusals are counted too
    app.state.registry, app.state.worker, app.state.metrics = registry, worker, metrics
    app.state.pipeline = pipeline
    app.state.cancel_in_flight = cancel_in_flight
    app.state.op_log_path = ops_log
    app.state.model_id, app.state.ctx = model_id, ctx
    app.state.request_log_path = request_log.path if request_log is not None else None

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        # not a 401: a client without the key must not fill the disk (they are counted in /metrics instead)
        if request_log is not None and exc.status != 401:
            request_log.write({"route": request.url.path, "status": exc.status, "error": exc.message})
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            metrics.unauthorized.inc(route=route_label(request.url.path))
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer KEY')",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(request: Request) -> dict[str, Any]:
        kind = request.headers.get("content-type")
        if not json_media_type(kind):  # a form or text/plain is what a cross-site page can send unasked
            raise APIError(
                415,
                "the body must be JSON, sent as 'Content-Type: application/json'; got "
                + (repr(kind) if kind is not None else "no Content-Type"),
                code="unsupported_media_type",
            )
        length = request.headers.get("content-length", "")
        too_big = APIError(
            413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large"
        )
        if length.isdigit() and int(length) > DRAIN_LIMIT:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_LIMIT:
                raise too_big
            if size <= max_body_bytes:
                chunks.append(chunk)
        if size > max_body_bytes:
            raise too_big
        return parse_body(b"".join(chunks))

    def submit(job: ChatJob | CompletionJob) -> None:
        try:
            worker.submit(job)
        except QueueFull:
            raise APIError(
                503,
                "the server is busy: too many queued requests, retry shortly",
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            ) from None

    def budget(n: int, req: ChatRequest | CompletionRequest, param: str) -> int:
        """The reply's token budget after a prompt of n tokens: `max_tokens` capped at what the context leaves,
        or all of it (the reply then ends at a stop token or the context's end). A prompt that leaves no room
        is a 400 naming both numbers."""
        if n + 1 > ctx:
            raise invalid(
                f"the prompt is {n} tokens; this server's context is {ctx} tokens"
                + (f" (the model's positions end at {max_pos})" if max_pos == ctx else ""),
                param=param,
                code="context_length_exceeded",
            )
        return min(req.max_tokens or ctx, ctx - n)

    def chat_prompt(req: ChatRequest) -> tuple[list[int], list[int], list[dict[str, Any]] | None, int, bool]:
        if tok is None:
            raise invalid("this model has no tokenizer; use /v1/completions with token ids")
        tools = None if req.tool_choice.mode == "none" else req.tools
        try:
            ids = tok.encode_chat(
                req.messages, tools=tools, add_generation_prompt=True, enable_thinking=req.think
            )
        except (ValueError, TypeError, KeyError, jinja2.exceptions.TemplateError) as exc:
            raise invalid(f"the messages cannot be rendered: {exc}", param="messages") from None
        forced: list[int] = []
        if req.tool_choice.mode == "required":
            # Forcing the reply to open a tool call is the grammar-level way to require one; the name is text.
            name = req.tool_choice.name
            forced = tok.encode("<|tool_call>") + tok.encode_text("call:" + (name + "{" if name else ""))
        thought_open = tool_rounds is not None and bool(tools) and req.think and not forced
        if thought_open:  # tool-turn continuation (server.toolturns): the thought channel seeded open
            round_ = tool_rounds.match(req.messages, tools)
            cont = continuation_ids(tok, round_, req.messages, tools) if round_ is not None else None
            ids = cont if cont is not None else ids + tok.encode(THOUGHT_OPEN)
        return ids, forced, tools, budget(len(ids) + len(forced), req, "messages"), thought_open

    def question_job(
        req: ChatRequest, obj: dict[str, Any], state: Any, channel: Channel, cancel
    ) -> QuestionJob:
        try:
            schema, template, ids = scoring.prepare(tok, engine.config.canvas_length, obj, state, req.seed)
        except Q.SchemaError as exc:
            raise invalid(f"the question schema: {exc}", param="messages") from None
        budget(len(ids) + len(template.ids), req, "messages")
        pad = tok.pad_id if tok.pad_id is not None else 0
        return QuestionJob(schema, template, ids, engine.config.vocab_size, pad, metrics, channel, cancel)

    def completion_prompt(req: CompletionRequest) -> tuple[list[int], int]:
        if isinstance(req.prompt, str):
            if tok is None:
                raise invalid("this model has no tokenizer: send the prompt as token ids", param="prompt")
            ids = tok.encode_text(req.prompt)  # client text: control tokens only as token ids
        else:
            vocab = engine.config.vocab_size
            if any(t >= vocab for t in req.prompt):
                raise invalid(f"token ids must be below the vocabulary size {vocab}", param="prompt")
            ids = list(req.prompt)
        return ids, budget(len(ids), req, "prompt")

    async def wait_all(request: Request, channel: Channel, cancel: CancelToken) -> tuple[list[Delta], Done]:
        """Collect a job's events; cancel it if the client disconnects while waiting."""
        deltas: list[Delta] = []
        while True:
            try:
                event = await channel.get(timeout=POLL_SECONDS)
            except TimeoutError:
                if await request.is_disconnected():
                    cancel.cancel()
                continue
            except asyncio.CancelledError:  # the server shutting down past its grace: stop the turn too
                cancel.cancel()
                raise
            if isinstance(event, JobFailed):
                raise event.error
            if isinstance(event, Done):
                return deltas, event
            deltas.append(event)

    def record(
        kind: str,
        rid: str,
        req: Any,
        status: int,
        started: float,
        done: Done | None,
        error: str | None,
        body: dict[str, Any],
    ) -> None:
        if request_log is None:
            return
        request_log.write(
            {
                "id": rid,
                "route": kind,
                "status": status,
                "model": req.model,
                "stream": req.stream,
                "think": getattr(req, "think", None),
                "seconds": round(time.perf_counter() - started, 4),
                "finish_reason": done.finish_reason if done else None,
                "usage": done.usage() if done else None,
                "steps": done.steps if done else None,
                "error": error,
                "request": body,
            }
        )

    async def sse(
        kind: str,
        rid: str,
        req: Any,
        body: dict[str, Any],
        started: float,
        channel: Channel,
        cancel: CancelToken,
    ) -> AsyncIterator[str]:
        chunk = R.ChunkWriter(kind, rid, req.model, req.include_usage, tok)
        done, error = None, None
        try:
            if kind == "chat":
                yield chunk.role()
            while True:
                event = await channel.get()
                if isinstance(event, Delta):
                    yield chunk.delta(event)
                elif isinstance(event, CanvasEvent):  # asked for (`stream_options.canvas`): a named event
                    yield R.sse(event.body(), event="canvas")
                elif isinstance(event, Done):
                    done = event
                    yield chunk.finish(event)
                    break
                elif isinstance(event, JobFailed):
                    error = event.error.message
                    yield R.sse(event.error.body())
                    break
            yield R.sse_done()
        finally:
            if done is None and error is None:
                cancel.cancel()  # the client went away: stop between denoise steps
                error = "client disconnected"
            record(kind, rid, req, 200, started, done, error, body)

    # The bodies are read by hand (parse_body, then the models), so the routes declare them for the document.
    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionBody))
    async def chat_completions(request: Request) -> Any:
        started = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        req = parse_chat(body, model_id, engine.sampler)
        channel, cancel = Channel(), new_cancel()
        schema = Q.recognize(req.messages) if tok is not None else None
        if schema is not None:  # a question schema: scored forwards, no generated text
            submit(await run_in_threadpool(question_job, req, *schema, channel, cancel))
        else:
            ids, forced, tools, max_new, thought_open = await run_in_threadpool(chat_prompt, req)
            rounds = tool_rounds if thought_open else None
            submit(ChatJob(req, ids, forced, max_new, tok, tools, metrics, channel, cancel, rounds))
        rid = R.new_id("chatcmpl")
        if req.stream:
            return StreamingResponse(
                sse("chat", rid, req, body, started, channel, cancel), media_type="text/event-stream"
            )
        deltas, done = await wait_all(request, channel, cancel)
        record("chat", rid, req, 200, started, done, None, body)
        return R.chat_completion(rid, req.model, deltas, done, tok)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionBody))
    async def completions(request: Request) -> Any:
        started = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        req = parse_completion(body, model_id, engine.sampler)
        ids, max_new = await run_in_threadpool(completion_prompt, req)
        channel, cancel = Channel(), new_cancel()
        submit(CompletionJob(req, ids, max_new, tok, metrics, channel, cancel))
        rid = R.new_id("cmpl")
        if req.stream:
            return StreamingResponse(
                sse("completion", rid, req, body, started, channel, cancel), media_type="text/event-stream"
            )
        deltas, done = await wait_all(request, channel, cancel)
        record("completion", rid, req, 200, started, done, None, body)
        prefix = req.prompt if req.echo and isinstance(req.prompt, str) else ""
        return R.text_completion(rid, req.model, prefix, deltas, done, tok)

    def model_card() -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "diffgemma",
            "context_length": ctx,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> Any:
        check_auth(request)
        resolve_model(name, model_id)
        return {**model_card(), "id": name}

    @app.get("/", include_in_schema=False)
    async def page() -> Any:
        """The chat page: static, so it discloses nothing; its requests carry the key it asks for."""
        return _page_file("index.html")

    @app.get("/page/{name}", include_in_schema=False)
    async def page_asset(name: str) -> Any:
        if name not in PAGE_TYPES or name == "index.html":
            raise StarletteHTTPException(404)
        return _page_file(name)

    @app.get("/health")
    async def health() -> Any:
        return {
            "status": "ok",
            "model": model_id,
            "queue_depth": worker.depth,
            "conversations": len(registry),
        }

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_document(request: Request) -> Any:
        check_auth(request)  # the routes and their fields are the key holder's to read
        return JSONResponse(await run_in_threadpool(app.openapi))

    @app.get("/metrics")
    async def prometheus(request: Request) -> Any:
        check_auth(request)
        text = await run_in_threadpool(metrics.render)  # off the event loop
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
