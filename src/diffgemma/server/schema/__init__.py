"""OpenAI request bodies: pydantic models that declare their shape (and /openapi.json), validated into the plain
dataclasses the routes and jobs use; every problem is a 400 naming the field (or a 404 for the model).

Unknown fields are ignored, as the OpenAI API does, and a top-level `null` is the field left out. `temperature`
and `top_p` are accepted but do not apply: the entropy-bound sampler has no sampling temperature a client could
set; its own settings (`SamplerFields`) may be set per request instead. The body must be plain JSON (no NaN or
Infinity), valid Unicode (no lone surrogates) and at most MAX_DEPTH levels deep: `parse_body` checks that before
any model sees it.

The modules: body.py (the raw body), errors.py (where an error is), shared.py (what both routes' bodies share,
the sampler's fields among it), chat.py and completions.py (each route's body and request), parse.py (bodies into
requests; the routes only call `parse_chat` and `parse_completion`).
"""

from diffgemma.server.schema.body import MAX_DEPTH, parse_body
from diffgemma.server.schema.chat import (
    ROLES,
    ChatCompletionBody,
    ChatMessage,
    ChatRequest,
    Role,
    Tool,
    ToolCallIn,
    ToolChoice,
)
from diffgemma.server.schema.completions import COMPLETION_MAX_TOKENS, CompletionBody, CompletionRequest
from diffgemma.server.schema.parse import (
    CANVAS_INTERVAL_MS,
    openapi_schemas,
    parse_chat,
    parse_completion,
    request_body,
)
from diffgemma.server.schema.shared import (
    DEFAULT_SEED,
    MAX_STEPS,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    REFUSED_FIELDS,
    GenParams,
    SamplerFields,
    request_sampler,
    resolve_model,
)

__all__ = [
    "CANVAS_INTERVAL_MS",
    "COMPLETION_MAX_TOKENS",
    "ChatCompletionBody",
    "ChatMessage",
    "ChatRequest",
    "CompletionBody",
    "CompletionRequest",
    "DEFAULT_SEED",
    "GenParams",
    "MAX_DEPTH",
    "MAX_STEPS",
    "MAX_STOP",
    "MAX_TOP_LOGPROBS",
    "REFUSED_FIELDS",
    "ROLES",
    "Role",
    "SamplerFields",
    "Tool",
    "ToolCallIn",
    "ToolChoice",
    "openapi_schemas",
    "parse_body",
    "parse_chat",
    "parse_completion",
    "request_body",
    "request_sampler",
    "resolve_model",
]
