"""Validation of OpenAI request bodies into plain dataclasses; every problem is a 400 (or 404 for the model).

Unknown fields are ignored, as the OpenAI API does. `temperature` and `top_p` are accepted but do not apply:
the entropy-bound sampler has no sampling temperature a client could set. The body must be plain JSON (no
NaN or Infinity), valid Unicode (no lone surrogates) and at most MAX_DEPTH levels deep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from diffgemma.server.errors import APIError, invalid

ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_SEED = 42
MAX_STOP = 16
MAX_DEPTH = 64  # nesting levels of a request body: deeper is refused before anything walks it
MAX_TOP_LOGPROBS = 20
THINKING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


@dataclass
class ToolChoice:
    mode: str = "auto"  # "auto", "none" or "required"
    name: str | None = None  # a named function (mode "required")


@dataclass
class GenParams:
    """What chat and raw completions share."""

    model: str
    max_tokens: int | None
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # None: not asked; k: each token's log probability and its top k alternatives


@dataclass
class ChatRequest(GenParams):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    json_mode: bool = False
    think: bool = False


@dataclass
class CompletionRequest(GenParams):
    prompt: str | list[int] = ""
    echo: bool = False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise invalid("request body is not valid UTF-8", code="invalid_json") from None
    except RecursionError:
        raise invalid(f"request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object", code="invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    """Refuse a body nested deeper than MAX_DEPTH or holding a string that is not valid Unicode (a lone
    surrogate, which JSON's \\u escapes can spell), naming where. Iterative: depth costs no stack."""
    todo: list[tuple[Any, str, int]] = [(body, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise invalid(f"request body is nested deeper than {MAX_DEPTH} levels (at {where})", param=where)
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key.encode(
                    "utf-8", "backslashreplace"
                ).decode()  # printable even when it is not Unicode
                path = f"{where}.{name}" if where else name
                _check_text(key, path)
                todo.append((item, path, depth + 1))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"U+{ord(text[exc.start]):04X}"
        raise invalid(f"{where} is not valid Unicode text (a lone surrogate {bad})", param=where) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _optional(body: dict[str, Any], key: str, check: Any, what: str) -> Any:
    value = body.get(key)
    if value is not None and not check(value):
        raise invalid(f"'{key}' must be {what}", param=key)
    return value


def resolve_model(requested: Any, model_id: str) -> tuple[str, bool | None]:
    """`ID`, `ID:think`, `ID:think=false` -> (echoed name, forced thinking or None). Unknown ids are a 404."""
    if requested is None:
        return model_id, None
    if not isinstance(requested, str):
        raise invalid("'model' must be a string", param="model")
    base, _, suffix = requested.partition(":")
    think = {"": None, "think": True, "think=true": True, "think=false": False}.get(suffix.lower(), "?")
    if base != model_id or think == "?":
        raise APIError(
            404,
            f"the model '{requested}' does not exist; this server serves '{model_id}' "
            f"(optionally '{model_id}:think' or '{model_id}:think=false')",
            param="model",
            code="model_not_found",
        )
    return requested, think


def _common(body: dict[str, Any], model_id: str) -> tuple[GenParams, bool | None]:
    model, think = resolve_model(body.get("model"), model_id)
    n = _optional(body, "n", _is_int, "an integer")
    if n is not None and n != 1:
        raise invalid("only n=1 is supported", param="n")
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        value = _optional(body, key, _is_int, "an integer")
        if value is not None:
            if value < 1:
                raise invalid(f"'{key}' must be at least 1, got {value}", param=key)
            max_tokens = value
    seed = _optional(body, "seed", _is_int, "an integer")
    for key in ("temperature", "top_p"):  # accepted, not applied (see module docstring)
        _optional(body, key, _is_number, "a number")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean") or False
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    include_usage = options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise invalid("'stream_options.include_usage' must be a boolean", param="stream_options")
    params = GenParams(
        model=model,
        max_tokens=max_tokens,
        seed=DEFAULT_SEED if seed is None else seed,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
    )
    return params, think


def _top_k(value: Any, key: str) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"'{key}' must be an integer from 0 to {MAX_TOP_LOGPROBS}", param=key)
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: `logprobs: true` asks for them, `top_logprobs` for that many alternatives a token."""
    asked = _optional(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    top = body.get("top_logprobs")
    if top is not None:
        top = _top_k(top, "top_logprobs")
        if not asked:
            raise invalid("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if asked else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions: `logprobs: k` asks for each token's log probability and its top k alternatives."""
    value = body.get("logprobs")
    return None if value is None else _top_k(value, "logprobs")


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' holds at most {MAX_STOP} sequences", param="stop")
    return stops


def _text_parts(content: list[Any], where: str) -> list[dict[str, str]]:
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid(f"{where}.content[{j}] must be an object", param=f"{where}.content")
        kind = part.get("type")
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}].text must be a string", param=f"{where}.content")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image_url", "input_image", "image", "input_audio", "audio", "file"):
            raise invalid(f"{where}.content[{j}]: '{kind}' input is not supported (text only)", param=where)
        else:
            raise invalid(f"{where}.content[{j}] has unknown type {kind!r}", param=f"{where}.content")
    return parts


def _content(message: dict[str, Any], where: str, required: bool) -> Any:
    content = message.get("content")
    if content is None:
        if required:
            raise invalid(f"{where}.content is required", param=f"{where}.content")
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return _text_parts(content, where)
    if isinstance(content, dict) and message.get("role") == "tool":
        return content  # a JSON object result renders as a mapping
    raise invalid(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")


def _arguments(args: Any, where: str) -> str | dict[str, Any]:
    """A call's arguments: a string that encodes a JSON object (OpenAI's wire form) or the object itself."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            value = json.loads(args, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            return args
    raise invalid(
        f"{where} must be a string that encodes a JSON object, got {json.dumps(args)[:80]}", param=where
    )


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"{w}.function.name must be a non-empty string", param=w)
        args = _arguments(fn.get("arguments", "{}"), f"{w}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"{w}.id must be a string", param=w)
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise invalid("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})", param=where)
        m: dict[str, Any] = {"role": role}
        if role == "assistant":
            if message.get("tool_calls"):
                m["tool_calls"] = _tool_calls(message["tool_calls"], where)
            m["content"] = _content(message, where, required=False)
            reasoning = message.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                m["reasoning_content"] = reasoning
        else:
            m["content"] = _content(message, where, required=True)
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]:
                raise invalid(
                    f"{where}: a tool message needs a 'tool_call_id'", param=f"{where}.tool_call_id"
                )
            m["tool_call_id"] = message["tool_call_id"]
            _check_answers_a_call(out, m["tool_call_id"], where)
        if isinstance(message.get("name"), str):
            m["name"] = message["name"]
        out.append(m)
    return out


def _check_answers_a_call(earlier: list[dict[str, Any]], call_id: str, where: str) -> None:
    """A tool message answers a call of the assistant message it follows (after that message's other
    results), as the OpenAI API requires; the template renders it inside that assistant's turn."""
    j = len(earlier) - 1
    while j >= 0 and earlier[j]["role"] == "tool":
        j -= 1
    calls = (earlier[j].get("tool_calls") or []) if j >= 0 and earlier[j]["role"] == "assistant" else []
    if not calls:
        raise invalid(
            f"{where}: a tool message must follow an assistant message with 'tool_calls'",
            param=f"{where}.tool_call_id",
        )
    if call_id not in {c["id"] for c in calls}:
        raise invalid(
            f"{where}.tool_call_id {call_id!r} matches no call of messages[{j}].tool_calls",
            param=f"{where}.tool_call_id",
        )


def parse_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise invalid(f"tools[{i}] must be a function tool", param=f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{i}].function.name must be a non-empty string", param=f"tools[{i}]")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid(f"tools[{i}].function.description must be a string", param=f"tools[{i}]")
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"tools[{i}].function.parameters")
    return tools or None


def _check_schema(schema: Any, where: str) -> None:
    """The parts of a JSON Schema the Gemma 4 template reads, checked for the shapes it reads them in."""
    if not isinstance(schema, dict):
        raise invalid(f"{where} must be an object (a JSON Schema)", param=where)
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise invalid(f"{where}.properties must be an object", param=f"{where}.properties")
        for name, sub in props.items():
            _check_schema(sub, f"{where}.properties.{name}")
    items = schema.get("items")
    if isinstance(items, list):
        for j, sub in enumerate(items):
            _check_schema(sub, f"{where}.items[{j}]")
    elif items is not None:
        _check_schema(items, f"{where}.items")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(t, str) for t in kinds):
        raise invalid(f"{where}.type must be a string or a list of strings", param=f"{where}.type")
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise invalid(f"{where}.required must be a list of strings", param=f"{where}.required")
    if schema.get("enum") is not None and not isinstance(schema["enum"], list):
        raise invalid(f"{where}.enum must be a list", param=f"{where}.enum")
    if schema.get("description") is not None and not isinstance(schema["description"], str):
        raise invalid(f"{where}.description must be a string", param=f"{where}.description")


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    if value is None or value == "auto":
        return ToolChoice("auto")
    if value == "none":
        return ToolChoice("none")
    names = {t["function"]["name"] for t in tools or []}
    if value == "required":
        if not names:
            raise invalid("tool_choice 'required' needs 'tools'", param="tool_choice")
        return ToolChoice("required")
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid(
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise invalid(
            f"tool_choice names the function {name!r}, which is not in 'tools'", param="tool_choice"
        )
    return ToolChoice("required", name)


def _thinking(body: dict[str, Any], forced: bool | None) -> bool:
    if forced is not None:  # the `:think` model suffix forces it
        return forced
    kwargs = _optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object") or {}
    enable = kwargs.get("enable_thinking")
    if enable is not None:
        if not isinstance(enable, bool):
            raise invalid(
                "chat_template_kwargs.enable_thinking must be a boolean", param="chat_template_kwargs"
            )
        return enable
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in THINKING_EFFORTS:
            raise invalid(
                f"'reasoning_effort' must be one of {', '.join(THINKING_EFFORTS)}", param="reasoning_effort"
            )
        return THINKING_EFFORTS[effort]
    return False


def _json_mode(value: Any) -> bool:
    if value is None:
        return False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'", param="response_format"
        )
    return kind != "text"


def parse_chat(body: dict[str, Any], model_id: str) -> ChatRequest:
    params, forced_think = _common(body, model_id)
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    params.logprobs = _chat_logprobs(body)
    return ChatRequest(
        **vars(params),
        messages=messages,
        tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        json_mode=_json_mode(body.get("response_format")),
        think=_thinking(body, forced_think),
    )


def parse_completion(body: dict[str, Any], model_id: str) -> CompletionRequest:
    params, _ = _common(body, model_id)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise invalid("'prompt' must be a non-empty string or a list of token ids", param="prompt")
    echo = _optional(body, "echo", lambda v: isinstance(v, bool), "a boolean") or False
    params.logprobs = _completion_logprobs(body)
    return CompletionRequest(**vars(params), prompt=prompt, echo=echo)
