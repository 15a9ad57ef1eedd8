"""POST /v1/chat/completions: the body, its messages, tools and tool choice, and the request it becomes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, PlainValidator, field_validator, model_validator

from diffgemma.server.schema.body import _no_constant
from diffgemma.server.schema.errors import _fail, _join, _report_here
from diffgemma.server.schema.shared import (
    MAX_TOP_LOGPROBS,
    GenParams,
    NonEmptyStr,
    SamplerFields,
    _GenBody,
    _Shape,
)

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = get_args(Role)


THINKING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "file")
ROLE_FIELDS = {
    "assistant": {"tool_calls", "reasoning_content"},
    "tool": {"tool_call_id"},
}  # only they read them


@dataclass
class ToolChoice:
    mode: str = "auto"  # "auto", "none" or "required"
    name: str | None = None  # a named function (mode "required")


@dataclass
class ChatRequest(GenParams):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    json_mode: bool = False
    think: bool = False


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
    only a tool message may send: `ChatMessage` checks the role)."""
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


class TextPart(_Shape):
    type: Literal["text", "input_text"]
    text: str


class CallFunction(_Shape):
    name: NonEmptyStr
    arguments: Annotated[
        str | dict[str, Any], PlainValidator(_arguments, json_schema_input_type=str | dict[str, Any])
    ] = Field("{}", description="a JSON object, or a string that encodes one")


class ToolCallIn(_Shape):
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
ToolCalls = Annotated[list[Annotated[ToolCallIn, _report_here("a function call")]], _report_here("a list")]


class ChatMessage(_Shape):
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
    def _role_rules(self) -> ChatMessage:
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


class ResponseFormat(_Shape):
    """`json_object` and `json_schema` ask for a JSON object (a schema is not checked beyond that)."""

    type: Literal["text", "json_object", "json_schema"]


class ChatTemplateKwargs(_Shape):
    enable_thinking: bool | None = None


TOOL_CHOICES = "'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"


class ChatCompletionBody(SamplerFields, _GenBody):
    """The body of POST /v1/chat/completions."""

    messages: Annotated[list[Annotated[ChatMessage, _report_here("a message")]], Field(min_length=1)]
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
    def _results_answer_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
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
