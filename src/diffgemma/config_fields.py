"""The checks of config.json's fields before anything is built from them: presence, type, range and consistency,
each refused in one line naming the field (`ConfigError`), and the memory the sizes imply against the machine's."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    """A checkpoint's config or an override is invalid."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" or "proportional"
    theta: float
    partial_rotary_factor: float = 1.0


# The narrowest storage of any weight format (int4 / nvfp4: a nibble a weight, before its scales). A config whose
# weights exceed the machine's memory even at this cannot load anywhere on it, whatever the checkpoint holds.
MIN_BYTES_PER_WEIGHT = 0.5


def machine_memory() -> int | None:
    """This machine's physical RAM in bytes (None: unknown): the coarse bound a config's size is held to."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:,.1f} MiB"


def check_int(name: str, value: Any, minimum: int | None = None, optional: bool = False) -> None:
    """TypeError unless `value` is an int (None too when `optional`), ValueError when it is below `minimum`."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def layer_weights(
    h: int, inter: int, heads: int, hd: int, kv: int, sliding: bool, experts: int, moe_i: int
) -> int:
    """Weights of one layer (model.Layer's parameters): attention, seven norms, dense MLP, router and experts."""
    attn = 2 * heads * hd * h + (2 if sliding else 1) * kv * hd * h + 2 * hd
    return attn + 7 * h + 3 * inter * h + experts * (h + 1) + h + 3 * experts * moe_i * h + 2


def head_field(per_layer: dict[str, Any] | None, layer_type: str, i: int):
    """The config field that sets layer i's `head_dim` / `num_key_value_heads`, for error messages."""

    def name(key: str) -> str:
        if per_layer is not None:
            for k in (str(i), layer_type):
                if key in per_layer.get(k, {}):
                    return f"per_layer_config.{k}.{key}"
            return key
        if layer_type == FULL:
            return {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}[key]
        return key

    return name


class Fields:
    """Typed reads of a text_config, each refusing a missing, mistyped or out-of-range value in one line."""

    def __init__(self, tc: dict[str, Any], prefix: str):
        self.tc, self.prefix = tc, prefix

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"config.json: {self.prefix}{key} {problem}")

    def integer(
        self, key: str, default: int | None = None, minimum: int = 1, falsy_default: bool = False
    ) -> int:
        value = self.tc.get(key)
        if value is None or (falsy_default and value == 0):
            if default is None:
                raise self.error(key, "is required")
            return default
        if not is_int(value):
            raise self.error(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be at least {minimum}, got {value}")
        return value

    def number(self, key: str, default: float, falsy_default: bool = False) -> float:
        value = self.tc.get(key)
        if value is None or (falsy_default and value == 0):
            return default
        if not is_number(value):
            raise self.error(key, f"must be a finite number, got {value!r}")
        if value <= 0:
            raise self.error(key, f"must be positive, got {value}")
        return float(value)

    def token_id(self, key: str, default: int, vocab: int) -> int:
        value = self.tc.get(key)
        if value is None:
            return default
        if not is_int(value) or not 0 <= value < vocab:
            raise self.error(key, f"must be a token id in [0, {vocab}) (vocab_size), got {value!r}")
        return value

    def per_layer_config(self, n_layers: int) -> dict[str, dict[str, int]] | None:
        """transformers' per_layer_config: {layer type or index: {head_dim, num_key_value_heads}}, checked."""
        per_layer = self.tc.get("per_layer_config")
        if per_layer is None:
            return None
        if not isinstance(per_layer, dict):
            raise self.error("per_layer_config", "must be an object")
        for key, overrides in per_layer.items():
            if key not in (SLIDING, FULL) and not (key.isdigit() and int(key) < n_layers):
                raise self.error(
                    f"per_layer_config.{key}",
                    f"is neither a layer type nor a layer index below num_hidden_layers ({n_layers})",
                )
            if not isinstance(overrides, dict):
                raise self.error(f"per_layer_config.{key}", "must be an object")
            for name in ("head_dim", "num_key_value_heads"):
                value = overrides.get(name)
                if value is not None and (not is_int(value) or value < 1):
                    raise self.error(
                        f"per_layer_config.{key}.{name}", f"must be a positive integer, got {value!r}"
                    )
        return per_layer

    def rope(self, used: set[str], head_dims: list[int], layer_types: list[str]) -> dict[str, RopeConfig]:
        """RoPE by layer type from rope_parameters (transformers' defaults when absent), each entry checked."""
        params = self.tc.get("rope_parameters")
        if params is None:
            params = {
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
            }
        elif not isinstance(params, dict):
            raise self.error("rope_parameters", "must be an object keyed by layer type")
        rope = {}
        for lt in sorted(used):
            where = f"rope_parameters.{lt}"
            p = params.get(lt)
            if p is None:
                raise self.error(where, "is missing")
            if not isinstance(p, dict):
                raise self.error(where, "must be an object")
            rtype = p.get("rope_type", "default")
            if rtype not in ("default", "proportional"):
                raise self.error(
                    f"{where}.rope_type", f"{rtype!r} is not supported ('default', 'proportional')"
                )
            theta = p.get("rope_theta")
            if theta is None:
                raise self.error(f"{where}.rope_theta", "is required")
            if not is_number(theta) or theta <= 1:
                raise self.error(f"{where}.rope_theta", f"must be a finite number above 1, got {theta!r}")
            factor = p.get("partial_rotary_factor", 1.0)
            if not is_number(factor) or not 0 < factor <= 1:
                raise self.error(f"{where}.partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
            if rtype == "default" and factor != 1:  # its frequencies would not cover the head (rope_cos_sin)
                raise self.error(
                    f"{where}.partial_rotary_factor", f"must be 1 with rope_type 'default', got {factor}"
                )
            rope[lt] = RopeConfig(rtype, float(theta), float(factor))
        return rope
