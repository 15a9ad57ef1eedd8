"""What chat and raw completions share: their common fields, the sampler's fields, the model they name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from diffgemma.config import ConfigError, SamplerConfig
from diffgemma.server.errors import APIError, invalid
from diffgemma.server.schema.errors import MODEL_NOT_FOUND, _fail, _report_here

DEFAULT_SEED = 42
MAX_STOP = 16


MAX_TOP_LOGPROBS = 20


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


NonEmptyStr = Annotated[str, Field(min_length=1)]


class _Shape(BaseModel):
    """Strict JSON types (no "10" for an integer, no 1 for a boolean); unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Shape):
    include_usage: bool | None = None
    # diffgemma's extension (chat only): `canvas` events with each denoise step's canvas, at most one every
    # canvas_interval_ms (default CANVAS_INTERVAL_MS)
    canvas: bool | None = None
    canvas_interval_ms: Annotated[int, Field(ge=0, le=60_000)] | None = None


Stop = Annotated[
    NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)],
    _report_here(f"a non-empty string or a list of at most {MAX_STOP} of them", detail=False),
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
