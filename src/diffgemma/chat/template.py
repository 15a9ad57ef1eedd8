"""Our own renderer of the Gemma 4 chat format, in plain Python.

It produces the same bytes as the Gemma 4 chat template (tests prove it against that template), so a
checkpoint without a `chat_template.jinja` still gets the exact prompt format. One deliberate difference:
tool-call arguments given as a JSON string (the OpenAI wire shape) are parsed and rendered as the template
renders an argument object; the template itself would paste the string verbatim inside `{...}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from diffgemma.chat.toolcall import QUOTE, format_value, sorted_items

ROLES = ("system", "developer", "user", "assistant", "tool")
_STANDARD_KEYS = ("description", "type", "properties", "required", "nullable")


def _q(text: Any) -> str:
    return QUOTE + str(text) + QUOTE


def _upper_type(spec: Mapping[str, Any], key: str = "type") -> str:
    return str(spec.get(key, "")).upper()


def _quoted_list(items: Sequence[Any]) -> str:
    return "[" + ",".join(_q(item) for item in items) + "]"


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _format_items(items: Mapping[str, Any]) -> str:
    parts = []
    for key, value in sorted_items(items):
        if value is None:
            continue
        if key == "properties":
            inner = _format_parameters(value) if isinstance(value, Mapping) else ""
            parts.append("properties:{" + inner + "}")
        elif key == "required":
            parts.append("required:" + _quoted_list(value))
        elif key == "type":
            if isinstance(value, str):
                parts.append("type:" + format_value(value.upper(), escape_keys=True))
            else:
                parts.append("type:" + format_value([str(v).upper() for v in value], escape_keys=True))
        else:
            parts.append(f"{key}:{format_value(value, escape_keys=True)}")
    return "items:{" + ",".join(parts) + "}"


def _format_property(value: Mapping[str, Any]) -> str:
    fields = []
    p_type = _upper_type(value)
    if value.get("description"):
        fields.append("description:" + _q(value["description"]))
    if p_type == "STRING" and value.get("enum"):
        fields.append("enum:" + format_value(value["enum"], escape_keys=True))
    elif p_type == "ARRAY" and isinstance(value.get("items"), Mapping) and value.get("items"):
        fields.append(_format_items(value["items"]))
    if value.get("nullable"):
        fields.append("nullable:true")
    if p_type == "OBJECT":
        if isinstance(value.get("properties"), Mapping):
            fields.append("properties:{" + _format_parameters(value["properties"]) + "}")
        else:
            # Without `properties`, the template lists the schema's non-standard keys as the properties.
            fields.append("properties:{" + _format_parameters(value, filter_keys=True) + "}")
        if value.get("required"):
            fields.append("required:" + _quoted_list(value["required"]))
    fields.append("type:" + _q(p_type))
    return "{" + ",".join(fields) + "}"


def _format_parameters(properties: Mapping[str, Any], filter_keys: bool = False) -> str:
    return ",".join(
        f"{key}:{_format_property(value)}"
        for key, value in sorted_items(properties)
        if not filter_keys or key not in _STANDARD_KEYS
    )


def _format_declaration(tool: Mapping[str, Any]) -> str:
    fn = tool["function"]
    out = "declaration:" + str(fn["name"]) + "{description:" + _q(fn.get("description", ""))
    params = fn.get("parameters")
    if params:
        out += ",parameters:{"
        if params.get("properties"):
            out += "properties:{" + _format_parameters(params["properties"]) + "},"
        if params.get("required"):
            out += "required:" + _quoted_list(params["required"]) + ","
        # The template only closes `parameters:{` when a type is given; mirror that byte for byte.
        if params.get("type"):
            out += "type:" + _q(_upper_type(params)) + "}"
    if "response" in fn:
        response = fn["response"]
        out += ",response:{"
        if response.get("description"):
            out += "description:" + _q(response["description"]) + ","
        if _upper_type(response) == "OBJECT":
            out += "type:" + _q("OBJECT") + "}"
    return (out + "}").strip()


def strip_thinking(text: str) -> str:
    """Drop every `<|channel>...<channel|>` span (reasoning never re-enters the prompt)."""
    out = []
    for part in text.split("<channel|>"):
        out.append(part.split("<|channel>")[0] if "<|channel>" in part else part)
    return "".join(out).strip()


def _tool_response(name: str, response: Any) -> str:
    if isinstance(response, Mapping):
        body = ",".join(f"{k}:{format_value(v)}" for k, v in sorted_items(response))
        return f"<|tool_response>response:{name}{{{body}}}<tool_response|>"
    return f"<|tool_response>response:{name}{{value:{format_value(response)}}}<tool_response|>"


def _arguments(arguments: Any) -> Any:
    """OpenAI sends arguments as a JSON string; render a JSON object string as the object it encodes."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _tool_call(call: Mapping[str, Any]) -> str:
    fn = call["function"]
    args = _arguments(fn.get("arguments"))
    if isinstance(args, Mapping):
        body = ",".join(f"{k}:{format_value(v)}" for k, v in sorted_items(args))
    elif isinstance(args, str):
        body = args
    else:
        body = ""
    return "<|tool_call>call:" + fn["name"] + "{" + body + "}<tool_call|>"


def _tool_result_name(follow: Mapping[str, Any], calls: Sequence[Mapping[str, Any]]) -> str:
    name = follow.get("name")
    for call in calls:
        if call.get("id") == follow.get("tool_call_id"):
            name = call["function"]["name"]
    return "unknown" if name is None else str(name)


def _tool_result_body(content: Any) -> Any:
    if _is_sequence(content):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content


class _State:
    """What the previous piece of output was; decides how a turn is closed and the generation prompt."""

    def __init__(self) -> None:
        self.prev: str | None = None


def _content(message: Mapping[str, Any], role: str, state: _State) -> str:
    content = message.get("content")
    clean = strip_thinking if role == "model" else str.strip
    if isinstance(content, str):
        return clean(content)
    if not _is_sequence(content):
        return ""
    out = []
    for item in content:
        kind = item.get("type")
        if kind == "text":
            out.append(clean(item["text"]))
        elif kind in ("image", "audio", "video"):
            out.append(f"<|{kind}|>")
            state.prev = kind
    return "".join(out)


def _system_turn(
    messages: Sequence[Mapping[str, Any]], tools: Any, enable_thinking: bool, state: _State
) -> str:
    out = "<|turn>system\n"
    if enable_thinking:
        out += "<|think|>\n"
        state.prev = "think"
    if messages and messages[0]["role"] in ("system", "developer"):
        content = messages[0].get("content")
        if isinstance(content, str):
            out += content.strip()
        elif _is_sequence(content):
            out += "".join(item["text"].strip() + " " for item in content)
    if tools:
        out += "".join("<|tool>" + _format_declaration(tool) + "<tool|>" for tool in tools)
        state.prev = "tool"
    return out + "<turn|>\n"


def check_roles(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError naming the first message whose role Gemma 4 does not know."""
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})")


def render_gemma4(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    bos_token: str = "<bos>",
) -> str:
    """Render OpenAI-style messages (and tool schemas) as a Gemma 4 prompt."""
    check_roles(messages)
    state = _State()
    out = [bos_token]
    loop = list(messages)
    has_system = bool(messages) and messages[0]["role"] in ("system", "developer")
    if enable_thinking or tools or has_system:
        out.append(_system_turn(messages, tools, enable_thinking, state))
        if has_system:
            loop = loop[1:]

    last_user = max((i for i, m in enumerate(loop) if m["role"] == "user"), default=-1)
    prev_role: str | None = None  # role of the previous non-tool message
    for i, message in enumerate(loop):
        if message["role"] == "tool":
            continue  # rendered inside the assistant turn whose call it answers
        state.prev = None
        role = "model" if message["role"] == "assistant" else message["role"]
        if not (role == "model" and prev_role == "assistant"):
            out.append(f"<|turn>{role}\n")
        prev_role = message["role"]

        calls = message.get("tool_calls") or []
        thinking = message.get("reasoning") or message.get("reasoning_content")
        if thinking and i > last_user and calls:
            out.append(f"<|channel>thought\n{thinking}\n<channel|>")
        if calls:
            out.extend(_tool_call(call) for call in calls)
            state.prev = "tool_call"

        answered = False
        if message.get("tool_responses"):
            for resp in message["tool_responses"]:
                out.append(_tool_response(str(resp.get("name", "unknown")), resp["response"]))
                answered = True
                state.prev = "tool_response"
        elif calls:
            for follow in loop[i + 1 :]:
                if follow["role"] != "tool":
                    break
                name = _tool_result_name(follow, calls)
                out.append(_tool_response(name, _tool_result_body(follow.get("content"))))
                answered = True
                state.prev = "tool_response"

        content = _content(message, role, state)
        out.append(content)
        if state.prev == "tool_call" and not answered:
            out.append("<|tool_response>")
        elif not (answered and not content.strip()):
            out.append("<turn|>\n")

    if add_generation_prompt and state.prev not in ("tool_response", "tool_call"):
        out.append("<|turn>model\n")
        if not enable_thinking:
            out.append("<|channel>thought\n<channel|>")
    return "".join(out)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages with JSON-string tool-call arguments decoded to objects (for any Gemma 4 template)."""
    out = []
    for message in messages:
        m = dict(message)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if "arguments" in fn:
                    fn["arguments"] = _arguments(fn["arguments"])
                call["function"] = fn
                calls.append(call)
            m["tool_calls"] = calls
        out.append(m)
    return out
