"""POST /v1/completions: the body (text or token ids) and the request it becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from diffgemma.server.schema.errors import _report_here
from diffgemma.server.schema.shared import MAX_TOP_LOGPROBS, GenParams, NonEmptyStr, SamplerFields, _GenBody

COMPLETION_MAX_TOKENS = 16  # /v1/completions without `max_tokens` (`jobs.CompletionJob`)


@dataclass
class CompletionRequest(GenParams):
    prompt: str | list[int] = ""
    echo: bool = False


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _batch_of_one(prompt: Any) -> Any:
    ok = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list)
    return prompt[0] if ok else prompt


Prompt = Annotated[
    NonEmptyStr | TokenIds,
    BeforeValidator(_batch_of_one),
    _report_here("a non-empty string or a list of token ids", detail=False),
]


class CompletionBody(SamplerFields, _GenBody):
    """The body of POST /v1/completions."""

    prompt: Prompt = Field(description="text, or token ids; a batch of one of either")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives a token")
