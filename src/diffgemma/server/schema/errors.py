"""Where in the body an error is, in the corpus's style (`messages[1].tool_calls[0].function.arguments`)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, WrapValidator
from pydantic_core import ErrorDetails, PydanticCustomError

from diffgemma.server.errors import APIError, invalid

PLACED = "invalid_request"  # our own error type: the message is ours and `at` says where, below its location
MODEL_NOT_FOUND = "model_not_found"


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
