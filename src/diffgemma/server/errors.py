"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # Whatever text the message quotes, the body is valid UTF-8 JSON (a lone surrogate as its \\u escape).
        text = json.dumps(self.body(), ensure_ascii=False).encode("utf-8", "backslashreplace")
        return Response(text, status_code=self.status, headers=self.headers, media_type="application/json")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request that does not follow the API."""
    return APIError(400, message, param=param, code=code)
