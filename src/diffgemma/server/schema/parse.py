"""Bodies into the requests the routes and jobs use, and the bodies' JSON Schemas for /openapi.json."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from diffgemma.config import SamplerConfig
from diffgemma.server.errors import invalid
from diffgemma.server.schema.chat import ChatCompletionBody, ChatRequest, _thinking, _tool_choice
from diffgemma.server.schema.completions import CompletionBody, CompletionRequest
from diffgemma.server.schema.errors import _validate
from diffgemma.server.schema.shared import GenParams, request_sampler, resolve_model

REF = "#/components/schemas/{model}"


def _common(
    body: ChatCompletionBody | CompletionBody, model_id: str, sampler: SamplerConfig
) -> tuple[GenParams, bool | None]:
    model, think = resolve_model(body.model, model_id)
    stop = [] if body.stop is None else body.stop
    params = GenParams(
        model=model,
        max_tokens=body.max_completion_tokens or body.max_tokens,  # the newer name wins when both are given
        seed=body.seed,
        stop=[stop] if isinstance(stop, str) else stop,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        sampler=request_sampler(body, sampler),
        canvas_ms=_canvas_ms(body),
    )
    return params, think


CANVAS_INTERVAL_MS = 100  # canvas events at most ten a second unless the client asks otherwise


def _canvas_ms(body: ChatCompletionBody | CompletionBody) -> int | None:
    opts = body.stream_options
    if opts is None or not opts.canvas:
        if opts is not None and opts.canvas_interval_ms is not None:
            raise invalid(
                "'stream_options.canvas_interval_ms' needs 'stream_options.canvas': true",
                param="stream_options.canvas_interval_ms",
            )
        return None
    if not body.stream:
        raise invalid("'stream_options.canvas' needs 'stream': true", param="stream_options.canvas")
    if not isinstance(body, ChatCompletionBody):
        raise invalid("'stream_options.canvas' is for chat completions", param="stream_options.canvas")
    return CANVAS_INTERVAL_MS if opts.canvas_interval_ms is None else opts.canvas_interval_ms


def parse_chat(body: dict[str, Any], model_id: str, sampler: SamplerConfig) -> ChatRequest:
    """A chat body (from `parse_body`) as a request; `sampler` is the engine's, which the request may change."""
    chat = _validate(ChatCompletionBody, body, model_id)
    params, forced_think = _common(chat, model_id, sampler)
    params.logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
    return ChatRequest(
        **vars(params),
        messages=[m.for_template() for m in chat.messages],
        tools=body.get("tools")
        or None,  # as sent (validated): the template reads keys the models do not declare
        tool_choice=_tool_choice(chat.tool_choice),
        json_mode=chat.response_format is not None and chat.response_format.type != "text",
        think=_thinking(chat, forced_think),
    )


def parse_completion(body: dict[str, Any], model_id: str, sampler: SamplerConfig) -> CompletionRequest:
    """A raw completion body (from `parse_body`) as a request; `sampler` as for `parse_chat`."""
    comp = _validate(CompletionBody, body, model_id)
    params, _ = _common(comp, model_id, sampler)
    params.logprobs = comp.logprobs
    return CompletionRequest(**vars(params), prompt=comp.prompt, echo=comp.echo)


def openapi_schemas() -> dict[str, Any]:
    """JSON Schemas of both request bodies and the parts they use, for the OpenAPI document's components."""
    _, schemas = models_json_schema(
        [(ChatCompletionBody, "validation"), (CompletionBody, "validation")], ref_template=REF
    )
    return schemas["$defs"]


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model` (validated by hand after `parse_body`)."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
