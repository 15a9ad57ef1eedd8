"""OpenAI request bodies: pydantic models that declare their shape (and /openapi.json), validated into the plain
dataclasses the routes and jobs use; every problem is a 400 naming the field (or a 404 for the model).

Unknown fields are ignored, as the OpenAI API does, and a top-level `null` is the field left out. `temperature`
and `top_p` are accepted but do not apply: the entropy-bound sampler has no sampling temperature a client could
set; its own settings (`SamplerFields`) may be set per request instead. The body must be plain JSON (no NaN or
Infinity), valid Unicode (no lone surrogates) and at most MAX_DEPTH levels deep: `parse_body` checks that before
any model sees it.

Longer than 600 lines on purpose: every field the server accepts, its limit and its error live here, so that what
the API takes is read in one file (the routes only call `parse_chat` and `parse_completion`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.json_schema import models_json_schema
from pydantic_core import ErrorDetails, PydanticCustomError

from diffgemma.config import ConfigError, SamplerConfig
from diffgemma.server.errors import APIError, invalid

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = get_args(Role)
DEFAULT_SEED = 42
MAX_STOP = 16
MAX_DEPTH = 64  # nesting levels of a request body: deeper is refused before anything walks it
MAX_TOP_LOGPROBS = 20
COMPLETION_MAX_TOKENS = 16  # /v1/completions without `max_tokens` (`jobs.CompletionJob`)
THINKING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file")
ROLE_FIELDS = {
    "assistant": {"tool_calls", "reasoning_content"},
    "tool": {"tool_call_id"},
}  # only they read them
# A client's sampler may cost more than the server's, but not without bound: a block's noise for every step is
# drawn up front, and each retry of an empty first block denoises a whole canvas again. Step counts above a
# block's steps mean "never"; bounded, they also fit the tensors the stop rules compare them with.
MAX_STEPS = 512
MAX_EMPTY_REPLY_RETRY = 8
# SamplerConfig fields that the server owns: its stop tokens and pad id are the model's, `max_tokens` is the length.
REFUSED_FIELDS = {
    "stop_token_ids": "the model's own stop tokens end a reply; use 'stop' for stop strings",
    "pad_token_id": "the pad token is the model's own",
    "max_new_tokens": "use 'max_tokens' (or 'max_completion_tokens')",
    # the cache is shared: a prefix prefilled at one request's precision would be reused by the next requests
    "prefill_f32_max_tokens": "the prefill's precision is the server's (cached prefixes are shared by requests)",
}
PLACED = "invalid_request"  # our own error type: the message is ours and `at` says where, below its location
MODEL_NOT_FOUND = "model_not_found"
REF = "#/components/schemas/{model}"


# ---------------------------------------------------------------------------------------------
# What the routes and jobs use.


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
    sampler: SamplerConfig | None = None  # None: the engine's own (the request set no sampler field)
    canvas_ms: int | None = None  # streamed canvas events at most this often (ms); None: not asked


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


# ---------------------------------------------------------------------------------------------
# The raw body.


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


# ---------------------------------------------------------------------------------------------
# Errors: where in the body, in the corpus's style (`messages[1].tool_calls[0].function.arguments`).


def _path(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as a `param`: keys joined by dots, list indices in brackets."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _join(base: str, at: str) -> str:
    """`base` extended by the path `at` ("messages" + "[2].tool_call_id", "tools[0]" + "function")."""
    if not at or not base:
        return base + at
    return base + at if at.startswith("[") else f"{base}.{at}"


def _fail(message: str, at: str = "") -> PydanticCustomError:
    """A request error at the value being validated, or at `at`, a path below it ("properties.a", "[2].id")."""
    return PydanticCustomError(PLACED, "{message}", {"message": message, "at": at})


def _where(error: ErrorDetails) -> str:
    """The error's `param`: its location, and for one of ours the path below it that it names."""
    ctx = error.get("ctx") or {}
    return _join(_path(error["loc"]), ctx.get("at", "") if error["type"] == PLACED else "")


def _detail(error: ErrorDetails) -> str:
    if error["type"] == PLACED:
        return error["ctx"]["message"]
    return error["msg"]


def _report_here(what: str, detail: bool = True) -> WrapValidator:
    """Report a type or shape error anywhere inside this value at the value itself ("must be `what`", with
    pydantic's own words unless `detail` is False, as for a union), as the API always has for a value it reads
    as a whole; an error of our own keeps the place it names."""

    def check(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            if error["type"] == PLACED:
                raise _fail(error["ctx"]["message"], _where(error)) from None
            inside = _path(error["loc"])
            why = f" ({inside + ': ' if inside else ''}{error['msg']})" if detail else ""
            raise _fail(f"must be {what}{why}") from None

    return WrapValidator(check)


def _api_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found (fields are declared in the order the API checks them), as our 400."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == MODEL_NOT_FOUND:
        return APIError(404, error["ctx"]["message"], param="model", code=MODEL_NOT_FOUND)
    param = _where(error)
    return invalid(f"'{param}': {_detail(error)}", param=param)


M = TypeVar("M", bound=BaseModel)


def _validate(model: type[M], body: dict[str, Any], model_id: str) -> M:
    try:
        return model.model_validate(body, context={"model_id": model_id})
    except ValidationError as exc:
        raise _api_error(exc) from None


# ---------------------------------------------------------------------------------------------
# Checks of free-form values, kept by hand: JSON-in-a-string, JSON Schemas, content parts.


def _arguments(args: Any) -> str | dict[str, Any]:
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
    raise _fail(f"must be a string that encodes a JSON object, got {json.dumps(args)[:80]}")


def _json_schema(schema: Any) -> dict[str, Any] | None:
    if schema is not None:
        _check_schema(schema, "")
    return schema


def _check_schema(schema: Any, where: str) -> None:
    """The parts of a JSON Schema the Gemma 4 template reads, checked for the shapes it reads them in."""
    if not isinstance(schema, dict):
        raise _fail("must be an object (a JSON Schema)", where)
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise _fail("must be an object", _join(where, "properties"))
        for name, sub in props.items():
            _check_schema(sub, _join(where, f"properties.{name}"))
    items = schema.get("items")
    if isinstance(items, list):
        for j, sub in enumerate(items):
            _check_schema(sub, _join(where, f"items[{j}]"))
    elif items is not None:
        _check_schema(items, _join(where, "items"))
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(t, str) for t in kinds):
        raise _fail("must be a string or a list of strings", _join(where, "type"))
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise _fail("must be a list of strings", _join(where, "required"))
    if schema.get("enum") is not None and not isinstance(schema["enum"], list):
        raise _fail("must be a list", _join(where, "enum"))
    if schema.get("description") is not None and not isinstance(schema["description"], str):
        raise _fail("must be a string", _join(where, "description"))


def _content(content: Any) -> str | list[dict[str, str]] | dict[str, Any] | None:
    """A message's content: text, text parts (as `{"type": "text", "text"}`), or a tool result's object (which
    only a tool message may send: `Message` checks the role)."""
    if content is None or isinstance(content, str | dict):
        return content
    if not isinstance(content, list):
        raise _fail("must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _fail(f"part {j} must be an object")
        kind = part.get("type")
        if kind not in ("text", "input_text"):
            raise _fail(f"part {j} has unknown type {kind!r}")
        if not isinstance(part.get("text"), str):
            raise _fail(f"part {j}: 'text' must be a string")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _string_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# A field the template reads only when it is a string: anything else is ignored, as it always was.
LenientStr = Annotated[str | None, BeforeValidator(_string_or_none)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


# ---------------------------------------------------------------------------------------------
# The request shape.


class _Shape(BaseModel):
    """Strict JSON types (no "10" for an integer, no 1 for a boolean); unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Shape):
    type: Literal["text", "input_text"]
    text: str


class CallFunction(_Shape):
    name: NonEmptyStr
    arguments: Annotated[
        str | dict[str, Any], PlainValidator(_arguments, json_schema_input_type=str | dict[str, Any])
    ] = Field("{}", description="a JSON object, or a string that encodes one")


class ToolCall(_Shape):
    """A call of an earlier assistant turn, sent back (its `type` is not read)."""

    id: str | None = None
    function: CallFunction

    def for_template(self) -> dict[str, Any]:
        fn = self.function
        return {"id": self.id, "type": "function", "function": {"name": fn.name, "arguments": fn.arguments}}


Content = Annotated[
    str | list[dict[str, str]] | dict[str, Any] | None,
    PlainValidator(_content, json_schema_input_type=str | list[TextPart] | dict[str, Any] | None),
]
ToolCalls = Annotated[list[Annotated[ToolCall, _report_here("a function call")]], _report_here("a list")]


class Message(_Shape):
    """One chat message (text only). What its role does not read is ignored, such as a user message's
    `tool_calls`; content may be left out only by an assistant, and be an object only in a tool result."""

    role: Role
    content: Content = None
    name: LenientStr = None
    tool_calls: ToolCalls | None = None
    tool_call_id: LenientStr = Field(None, description="the call a tool message answers")
    reasoning_content: LenientStr = None

    @model_validator(mode="before")
    @classmethod
    def _read_by_role(cls, data: Any) -> Any:
        """Refuse media (reported at the message) and drop the fields its role does not read."""
        if not isinstance(data, dict):
            return data
        content = data.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise _fail(f"content[{j}]: '{kind}' input is not supported (text only)")
        role = data.get("role")
        reads = ROLE_FIELDS.get(role, set()) if isinstance(role, str) else set()
        unread = (ROLE_FIELDS["assistant"] | ROLE_FIELDS["tool"]) - reads
        if not data.get("tool_calls"):
            unread.add("tool_calls")  # an empty list is no calls
        return {k: v for k, v in data.items() if k not in unread}

    @model_validator(mode="after")
    def _role_rules(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise _fail(f"a {self.role} message needs content", "content")
        if isinstance(self.content, dict) and self.role != "tool":
            raise _fail("must be a string or a list of content parts", "content")
        if self.role == "tool" and not self.tool_call_id:
            raise _fail("a tool message needs a 'tool_call_id'", "tool_call_id")
        return self

    def for_template(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.reasoning_content:
            m["reasoning_content"] = self.reasoning_content
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            m["name"] = self.name
        return m


class FunctionDef(_Shape):
    name: NonEmptyStr
    description: str | None = None
    parameters: Annotated[
        dict[str, Any] | None, PlainValidator(_json_schema, json_schema_input_type=dict[str, Any] | None)
    ] = Field(None, description="a JSON Schema of the arguments")


class Tool(_Shape):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Shape):
    name: str


class NamedToolChoice(_Shape):
    """`{"type": "function", "function": {"name": ...}}` (its `type` is not read)."""

    function: NamedFunction


class StreamOptions(_Shape):
    include_usage: bool | None = None
    # diffgemma's extension (chat only): `canvas` events with each denoise step's canvas, at most one every
    # canvas_interval_ms (default CANVAS_INTERVAL_MS)
    canvas: bool | None = None
    canvas_interval_ms: Annotated[int, Field(ge=0, le=60_000)] | None = None


class ResponseFormat(_Shape):
    """`json_object` and `json_schema` ask for a JSON object (a schema is not checked beyond that)."""

    type: Literal["text", "json_object", "json_schema"]


class ChatTemplateKwargs(_Shape):
    enable_thinking: bool | None = None


TOOL_CHOICES = "'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
Stop = Annotated[
    NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)],
    _report_here(f"a non-empty string or a list of at most {MAX_STOP} of them", detail=False),
]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _batch_of_one(prompt: Any) -> Any:
    ok = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list)
    return prompt[0] if ok else prompt


Prompt = Annotated[
    NonEmptyStr | TokenIds,
    BeforeValidator(_batch_of_one),
    _report_here("a non-empty string or a list of token ids", detail=False),
]


class SamplerFields(_Shape):
    """The entropy-bound sampler's settings for this request (diffgemma.SamplerConfig); a field left out keeps
    the server's value, and the config's own rules (`validated()`) apply to the result."""

    entropy_bound: float | None = Field(
        None,
        description="nats: a step keeps its lowest-entropy rows while their summed entropy is within this",
    )
    max_denoising_steps: int | None = Field(None, le=MAX_STEPS, description="steps a block may take at most")
    t_min: float | None = Field(None, description="the temperature schedule's low end (the last steps)")
    t_max: float | None = Field(None, description="the temperature schedule's high end (the first step)")
    stability_threshold: int | None = Field(
        None, le=MAX_STEPS, description="steps the argmax must hold unchanged before a block stops"
    )
    confidence_threshold: float | None = Field(
        None, description="a stable block stops once its mean entropy is below this"
    )
    denoiser_argmax: bool | None = Field(None, description="renoise from the argmax, not a tempered draw")
    first_step_sc_seed: bool | None = Field(None, description="step 1 self-conditions on the canvas itself")
    plateau_steps: int | None = Field(
        None, le=MAX_STEPS, description="stop once the accepted rows are unchanged this many steps (0: off)"
    )
    plateau_mean_entropy: float | None = Field(None, description="... and mean entropy is below this")
    pad_gate: bool | None = Field(None, description="a canvas of only pad and filler ids never stops early")
    canvas_shrink: bool | None = Field(
        None, description="shrink the last canvas to what is left (64 at least)"
    )
    sc_sparse: bool | None = Field(None, description="self-conditioning keeps only the likely tokens")
    entropy_stop: float | None = Field(
        None, description="stop a block when mean entropy is below this (0: off)"
    )
    entropy_stop_min_steps: int | None = Field(None, le=MAX_STEPS, description="... after this many steps")
    empty_reply_retry: int | None = Field(
        None, le=MAX_EMPTY_REPLY_RETRY, description="re-rolls of a first block that opens on a stop token"
    )
    commit_conf_trim: float | None = Field(
        None, description="cut a block at its first unsure duplicated row, below this confidence (0: off)"
    )
    pad_block_stop: bool | None = Field(
        None, description="a committed block of only pad and filler ids ends the reply (finish_reason stop)"
    )

    def sampler_changes(self) -> dict[str, Any]:
        """The sampler fields this request set."""
        return {k: getattr(self, k) for k in SamplerFields.model_fields if getattr(self, k) is not None}


class _GenBody(_Shape):
    """What chat and raw completions share."""

    model: str | None = Field(
        None, description="the served model's id, optionally with ':think' or ':think=false'"
    )
    n: int = Field(1, description="must be 1")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over 'max_tokens'")
    seed: int = DEFAULT_SEED
    temperature: float | None = Field(None, description="accepted, not applied")
    top_p: float | None = Field(None, description="accepted, not applied")
    stream: bool = False
    stream_options: Annotated[StreamOptions, _report_here("an object")] | None = None
    stop: Stop | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_owned_fields(cls, data: Any) -> Any:
        """A top-level null is the field left out; the sampler fields the server owns are refused."""
        if not isinstance(data, dict):
            return data
        for key, why in REFUSED_FIELDS.items():
            if data.get(key) is not None:
                raise _fail(f"is not accepted here: {why}", key)
        return {k: v for k, v in data.items() if v is not None}

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        try:
            resolve_model(model, info.context["model_id"])
        except APIError as exc:
            raise PydanticCustomError(MODEL_NOT_FOUND, "{message}", {"message": exc.message}) from None
        return model

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise _fail("only n=1 is supported")
        return n


class ChatCompletionBody(SamplerFields, _GenBody):
    """The body of POST /v1/chat/completions."""

    messages: Annotated[list[Annotated[Message, _report_here("a message")]], Field(min_length=1)]
    tools: list[Annotated[Tool, _report_here("a function tool")]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs 'logprobs': true")
    tool_choice: Annotated[
        Literal["auto", "none", "required"] | NamedToolChoice, _report_here(TOOL_CHOICES, detail=False)
    ] = "auto"
    response_format: Annotated[ResponseFormat, _report_here("an object with a known 'type'")] | None = None
    chat_template_kwargs: Annotated[ChatTemplateKwargs, _report_here("an object")] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages: list[Message]) -> list[Message]:
        """A tool message answers a call of the assistant message it follows (after that message's other
        results), as the OpenAI API requires; the template renders it inside that assistant's turn."""
        for i, message in enumerate(messages):
            if message.role != "tool":
                continue
            j = i - 1
            while j >= 0 and messages[j].role == "tool":
                j -= 1
            calls = (messages[j].tool_calls or []) if j >= 0 and messages[j].role == "assistant" else []
            at = f"[{i}].tool_call_id"
            if not calls:
                raise _fail("a tool message must follow an assistant message with 'tool_calls'", at)
            if message.tool_call_id not in {c.id for c in calls}:
                raise _fail(f"{message.tool_call_id!r} matches no call of messages[{j}].tool_calls", at)
        return messages

    @model_validator(mode="after")
    def _choices_fit(self) -> ChatCompletionBody:
        if self.top_logprobs is not None and not self.logprobs:
            raise _fail("needs 'logprobs': true", "top_logprobs")
        names = {t.function.name for t in self.tools or []}
        choice = self.tool_choice
        if choice == "required" and not names:
            raise _fail("'required' needs 'tools'", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _fail(
                f"names the function {choice.function.name!r}, which is not in 'tools'", "tool_choice"
            )
        return self


class CompletionBody(SamplerFields, _GenBody):
    """The body of POST /v1/completions."""

    prompt: Prompt = Field(description="text, or token ids; a batch of one of either")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives a token")


# ---------------------------------------------------------------------------------------------
# Bodies into requests.


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


def request_sampler(body: SamplerFields, base: SamplerConfig) -> SamplerConfig | None:
    """`base` with the request's sampler fields, or None when it set none; a result the config's rules refuse
    is a 400 naming the field its rule names."""
    changes = body.sampler_changes()
    if not changes:
        return None
    try:
        return base.replace(**changes)
    except ConfigError as exc:
        # A rule's message names its fields ("need 0 <= t_min < t_max"): blame the first one the request set.
        param = next((k for k in changes if re.search(rf"\b{k}\b", str(exc))), next(iter(changes)))
        raise invalid(f"'{param}': {exc}", param=param) from None


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


def _thinking(body: ChatCompletionBody, forced: bool | None) -> bool:
    if forced is not None:  # the `:think` model suffix wins
        return forced
    kwargs = body.chat_template_kwargs
    if kwargs is not None and kwargs.enable_thinking is not None:
        return kwargs.enable_thinking
    return THINKING_EFFORTS[body.reasoning_effort] if body.reasoning_effort else False


def _tool_choice(choice: str | NamedToolChoice) -> ToolChoice:
    if isinstance(choice, NamedToolChoice):
        return ToolChoice("required", choice.function.name)
    return ToolChoice(choice)


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


# ---------------------------------------------------------------------------------------------
# /openapi.json


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
