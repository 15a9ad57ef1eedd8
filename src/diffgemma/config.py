"""Model and sampler configuration, read from a checkpoint directory, plus `DIFFGEMMA_*` overrides."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from diffgemma.config_fields import (
    FULL,
    MIN_BYTES_PER_WEIGHT,
    SLIDING,
    ConfigError,
    Fields,
    RopeConfig,
    gib,
    head_field,
    is_int,
    layer_weights,
    machine_memory,
)

# The config format's documented default when `canvas_length` is absent (transformers' DiffusionGemmaConfig).
FORMAT_DEFAULT_CANVAS_LENGTH = 256
# Contexts (prompt + reply tokens) when none is asked for, each capped at the model's positions: `load`'s,
# `ask`/`chat`'s and `serve`'s.
LOAD_CONTEXT = 8192
CHAT_CONTEXT = 32768
SERVE_CONTEXT = 131072


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    num_kv_heads: tuple[int, ...]  # per layer
    sliding_window: int
    rope: dict[str, RopeConfig]  # by layer type
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    max_position_embeddings: int | None = None  # positions the model was trained for (None: not stated)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sliding(i)]

    @property
    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_sliding(i)]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(_read_json(Path(path) / "config.json"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Accepts the real checkpoint's spelling (`global_head_dim`, `num_global_key_value_heads`) and
        transformers' (`per_layer_config`), nested under `text_config` or flat. Every field is checked (present,
        typed, in range, consistent) and the weights the sizes imply are bounded by this machine's memory before
        any per-layer table is built: a ConfigError names the field in one line."""
        tc = data.get("text_config", data)
        if not isinstance(tc, dict):
            raise ConfigError("config.json: text_config must be an object")
        f = Fields(tc, "text_config." if tc is not data else "")

        vocab, hidden, inter = (
            f.integer("vocab_size"),
            f.integer("hidden_size"),
            f.integer("intermediate_size"),
        )
        n_layers, n_heads = f.integer("num_hidden_layers"), f.integer("num_attention_heads")
        head_dim, kv_heads = f.integer("head_dim"), f.integer("num_key_value_heads")
        window = f.integer("sliding_window")
        n_exp, top_k, moe_i = (
            f.integer("num_experts"),
            f.integer("top_k_experts"),
            f.integer("moe_intermediate_size"),
        )
        if top_k > n_exp:  # the router would pick experts that do not exist (topk clamps silently)
            raise f.error("top_k_experts", f"({top_k}) must not exceed num_experts ({n_exp})")
        if tc.get("use_bidirectional_attention") == "all":
            raise ConfigError("config.json: use_bidirectional_attention='all' is not supported")
        activation = tc.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise f.error("hidden_activation", f"{activation!r} is not supported (only 'gelu_pytorch_tanh')")

        layer_types = tc.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list):
                raise f.error("layer_types", f"must be a list of {SLIDING!r}/{FULL!r}")
            bad = next((i for i, t in enumerate(layer_types) if t not in (SLIDING, FULL)), None)
            if bad is not None:
                raise f.error(f"layer_types[{bad}]", f"is {layer_types[bad]!r}, not {SLIDING!r} or {FULL!r}")
            if len(layer_types) != n_layers:
                raise f.error(
                    "layer_types", f"lists {len(layer_types)} layers; num_hidden_layers is {n_layers}"
                )
            n_full = layer_types.count(FULL)
        else:  # transformers' default pattern: every sixth layer is full
            n_full = n_layers // 6

        # Full layers' head dim and kv heads, by spelling (the type-level values: per-index overrides come later)
        per_layer = f.per_layer_config(n_layers)
        if per_layer is not None:
            g_head_dim = per_layer.get(FULL, {}).get("head_dim", head_dim)
            g_kv = per_layer.get(FULL, {}).get("num_key_value_heads", kv_heads)
            s_head_dim = per_layer.get(SLIDING, {}).get("head_dim", head_dim)
            s_kv = per_layer.get(SLIDING, {}).get("num_key_value_heads", kv_heads)
        else:
            g_head_dim = f.integer("global_head_dim", default=512)
            g_kv = f.integer("num_global_key_value_heads", default=kv_heads)
            if tc.get("attention_k_eq_v", True) is False:
                g_kv = kv_heads
            s_head_dim, s_kv = head_dim, kv_heads
        # the top level wins over text_config, as transformers reads it
        top = "tie_word_embeddings" in data and tc is not data
        tied = data["tie_word_embeddings"] if top else tc.get("tie_word_embeddings", True)
        if not isinstance(tied, bool):
            where = "tie_word_embeddings" if top else f"{f.prefix}tie_word_embeddings"
            raise ConfigError(f"config.json: {where} must be true or false, got {tied!r}")

        # Bound the model before its per-layer tables (or, later, its modules) are built: a config of 10^9 layers
        # would otherwise spend minutes and gigabytes on them before failing for memory.
        count = (2 - tied) * vocab * hidden + 3 * inter * hidden + 2 * hidden
        count += (n_layers - n_full) * layer_weights(
            hidden, inter, n_heads, s_head_dim, s_kv, True, n_exp, moe_i
        )
        count += n_full * layer_weights(hidden, inter, n_heads, g_head_dim, g_kv, False, n_exp, moe_i)
        ram = machine_memory()
        if ram is not None and count * MIN_BYTES_PER_WEIGHT > ram:
            raise ConfigError(
                f"config.json: the sizes imply {count:.3g} weights (num_hidden_layers={n_layers}, "
                f"hidden_size={hidden}, num_experts={n_exp}, moe_intermediate_size={moe_i}, vocab_size={vocab}): "
                f"{gib(count * MIN_BYTES_PER_WEIGHT)} even at 4 bits a weight, more than this machine's "
                f"{gib(ram)} of RAM"
            )

        if layer_types is None:
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
        head_dims = [s_head_dim if t == SLIDING else g_head_dim for t in layer_types]
        kv = [s_kv if t == SLIDING else g_kv for t in layer_types]
        for key, overrides in (per_layer or {}).items():
            if key not in (SLIDING, FULL):
                head_dims[int(key)] = overrides.get("head_dim", head_dims[int(key)])
                kv[int(key)] = overrides.get("num_key_value_heads", kv[int(key)])
        for i in range(n_layers):
            field = head_field(per_layer, layer_types[i], i)
            if n_heads % kv[i]:
                raise f.error(
                    "num_attention_heads",
                    f"({n_heads}) is not a multiple of layer {i}'s {kv[i]} kv heads ({field('num_key_value_heads')})",
                )
            if head_dims[i] % 2:
                raise ConfigError(
                    f"config.json: {f.prefix}{field('head_dim')} must be even (RoPE rotates pairs), got {head_dims[i]} "
                    f"(layer {i})"
                )

        rope = f.rope(set(layer_types), head_dims, layer_types)

        pad = f.token_id("pad_token_id", 0, vocab)
        bos = f.token_id("bos_token_id", 2, vocab)
        eos = tc.get("eos_token_id", data.get("eos_token_id", 1))
        eos_list = eos if isinstance(eos, list) else [eos]
        if not eos_list or not all(is_int(e) and 0 <= e < vocab for e in eos_list):
            raise f.error(
                "eos_token_id", f"must be a token id or a list of them in [0, {vocab}), got {eos!r}"
            )
        canvas = data.get("canvas_length", tc.get("canvas_length", FORMAT_DEFAULT_CANVAS_LENGTH))
        if not is_int(canvas) or canvas <= 0:
            raise ConfigError(f"config.json: canvas_length must be a positive integer, got {canvas!r}")
        max_pos = tc.get("max_position_embeddings")
        if max_pos is not None and (not is_int(max_pos) or max_pos <= 0):
            raise ConfigError(
                f"config.json: max_position_embeddings must be a positive integer, got {max_pos!r}"
            )
        if max_pos is not None and canvas > max_pos:
            raise ConfigError(
                f"config.json: canvas_length ({canvas}) exceeds max_position_embeddings ({max_pos})"
            )
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=n_layers,
            num_heads=n_heads,
            layer_types=tuple(layer_types),
            head_dims=tuple(head_dims),
            num_kv_heads=tuple(kv),
            sliding_window=window,
            rope=rope,
            num_experts=n_exp,
            top_k_experts=top_k,
            moe_intermediate_size=moe_i,
            canvas_length=canvas,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            final_logit_softcapping=f.number("final_logit_softcapping", 30.0, falsy_default=True),
            tie_word_embeddings=tied,
            pad_token_id=pad,
            bos_token_id=bos,
            eos_token_ids=tuple(eos_list),
            max_position_embeddings=max_pos,
        )

    def context(self, requested: int | None, default: int) -> int:
        """Tokens of context (prompt + reply) to allocate: `requested`, which may not exceed the model's positions,
        or `default` capped at them."""
        limit = self.max_position_embeddings
        if requested is None:
            return default if limit is None else min(default, limit)
        if requested <= 0:
            raise ConfigError(f"the context must be a positive number of tokens, got {requested}")
        if limit is not None and requested > limit:
            raise ConfigError(
                f"a context of {requested} tokens is beyond this model's {limit} positions "
                f"(max_position_embeddings in config.json)"
            )
        return requested


@dataclass(frozen=True)
class SamplerConfig:
    """The entropy-bound sampler and block loop. Defaults are the seed's; each OURS divergence of the
    seed's §9 is a named option, and `reference()` switches every one of them off."""

    entropy_bound: float = 0.1  # nats
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = (1, 106, 50)
    pad_token_id: int = 0
    # §9 divergences, seed defaults.
    denoiser_argmax: bool = True  # 1: commit the row argmax, not a tempered categorical draw
    first_step_sc_seed: bool = True  # 2: step 1 runs the SC MLP on the canvas's own embedding
    plateau_steps: int = 8  # 3: stop when the accept mask is unchanged this many steps (0 = off) ...
    plateau_mean_entropy: float = 0.05  # ... and mean entropy is below this
    pad_gate: bool = True  # 4: an argmax canvas of nothing but pad and filler ids never early-stops
    canvas_shrink: bool = (
        False  # 5: MLX shrinks the last canvas to max(remaining, 64); the seed keeps it fixed
    )
    sc_sparse: bool = True  # 6: SC soft-embed keeps only tokens with p >= e^-10 * row max
    prefill_f32_max_tokens: int = 256  # 7: prompts up to this long prefill with fp32 activations (0 = off)
    entropy_stop: float = 0.05  # 9: after min_steps, stop when mean entropy < this (0 = off)
    entropy_stop_min_steps: int = 12
    empty_reply_retry: int = 3  # 10: re-roll a first block that opens on a stop/pad token, canvas halving
    commit_conf_trim: float = 0.9  # 11: cut a block at the first low-confidence duplicated row (0 = off)
    # Ours, beyond the seed's list: a committed block of nothing but pad and filler ends the reply ("stop"), its
    # blanks dropped. The block has nothing left to say, yet without it the turn commits such blocks until the
    # budget or the context ends (the demo model with thinking on streamed blanks to 8,164 tokens); the reference
    # runs to max_new_tokens.
    pad_block_stop: bool = True

    def reference(self) -> SamplerConfig:
        """The same config with every divergence from the transformers reference switched off."""
        return dataclasses.replace(
            self,
            denoiser_argmax=False,
            first_step_sc_seed=False,
            plateau_steps=0,
            pad_gate=False,
            canvas_shrink=False,
            sc_sparse=False,
            prefill_f32_max_tokens=0,
            entropy_stop=0.0,
            empty_reply_retry=0,
            commit_conf_trim=0.0,
            pad_block_stop=False,
        )

    def replace(self, **changes: Any) -> SamplerConfig:
        return dataclasses.replace(self, **changes).validated()

    def validated(self) -> SamplerConfig:
        checks = [
            (self.entropy_bound > 0, "entropy_bound must be > 0"),
            (self.max_denoising_steps > 0, "max_denoising_steps must be > 0"),
            (0 <= self.t_min < self.t_max, "need 0 <= t_min < t_max"),
            (self.stability_threshold >= 0, "stability_threshold must be >= 0"),
            (self.confidence_threshold > 0, "confidence_threshold must be > 0"),
            (self.max_new_tokens > 0, "max_new_tokens must be > 0"),
            (self.plateau_steps >= 0, "plateau_steps must be >= 0"),
            (self.entropy_stop >= 0, "entropy_stop must be >= 0"),
            (self.empty_reply_retry >= 0, "empty_reply_retry must be >= 0"),
            (0 <= self.commit_conf_trim < 1, "commit_conf_trim must be in [0, 1)"),
            (self.prefill_f32_max_tokens >= 0, "prefill_f32_max_tokens must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"sampler config: {message}")
        return self

    @classmethod
    def from_dir(cls, path: str | Path) -> SamplerConfig:
        p = Path(path) / "generation_config.json"
        return cls.from_dict(_read_json(p) if p.exists() else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplerConfig:
        """Reads generation_config.json; a field that is absent or null takes the seed default."""
        values: dict[str, Any] = {}
        sampler = data.get("sampler_config")
        if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
            values["entropy_bound"] = float(sampler["entropy_bound"])
        for key in ("max_denoising_steps", "stability_threshold", "max_new_tokens"):
            if data.get(key) is not None:
                values[key] = int(data[key])
        for key in ("t_min", "t_max", "confidence_threshold"):
            if data.get(key) is not None:
                values[key] = float(data[key])
        eos = data.get("eos_token_id")
        if eos is not None:
            values["stop_token_ids"] = tuple(eos) if isinstance(eos, list) else (int(eos),)
        if data.get("pad_token_id") is not None:
            values["pad_token_id"] = int(data["pad_token_id"])
        return cls(**values).validated()


@dataclass(frozen=True)
class RuntimeConfig:
    """How the model runs (`runner.ModelRunner`): where, in what precision and with which kernels."""

    device: str | None = None  # "cpu", "cuda", "cuda:1", "mps" (None: the best available)
    dtype: str | None = (
        None  # "float32", "bfloat16", "float16", "float64" (None: bfloat16 on a GPU, float32 on CPU)
    )
    kernels: str = "auto"  # "reference" (torch ops), "fast" (Triton and library kernels), "auto": fast on CUDA in 16 bits
    compile: bool = (
        True  # torch.compile the fast kernels' regions (docs/performance.md, "torch.compile and warm-up")
    )
    graphs: bool = True  # CUDA graphs for the denoise steps, commits and short prefills (CUDA only)
    prefill_chunk: int = 8192  # tokens a fast prefill pass (docs/performance.md, "Prefill chunk size")
    # the seed's top-k sparse full-layer attention (`torch_ref.attention_topk`; on the fast kernels
    # kernels/triton_topk.py): off until its speed and effect are measured (docs/performance.md, "Top-k attention")
    attention_topk: bool = False
    # the SC soft embedding as the seed's survivor gather (kernels/triton_sc_embed.py, CUDA): off while rows that
    # overflow its cap cost more than the GEMM (docs/performance.md, "The SC soft embedding as a survivor gather")
    sc_gather: bool = False
    threads: int | None = None  # CPU threads (None: one for a small model, else torch's default)
    # ranks that share each layer's experts (`runner.parallel`; launched by torchrun, one process a GPU); 1: none
    expert_parallel: int = 1
    # an overlay pack's base checkpoint, instead of the one its overlay.json records (docs/quantization.md)
    overlay_base: str | None = None
    # batch invariance on the fast kernels: every row of a pass computed in an order that does not depend on the
    # other rows (fixed-tile GEMMs, one expert tile set at any pair count), so a request batched with others
    # gets its solo tokens and logits bit for bit; off by default for its cost, on for `serve --log-dir` (replay)
    # (docs/performance.md, "Batch-invariant mode")
    batch_invariant: bool = False

    def replace(self, **changes: Any) -> RuntimeConfig:
        return dataclasses.replace(self, **changes).validated()

    def validated(self) -> RuntimeConfig:
        checks = [
            (self.dtype in (None, *DTYPES), f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (self.kernels in KERNELS, f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}"),
            (self.prefill_chunk > 0, f"prefill_chunk must be > 0, got {self.prefill_chunk}"),
            (self.threads is None or self.threads >= 1, f"threads must be at least 1, got {self.threads}"),
            (self.expert_parallel >= 1, f"expert_parallel must be at least 1, got {self.expert_parallel}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"runtime config: {message}")
        return self


DTYPES = ("float32", "bfloat16", "float16", "float64", "fp32", "bf16", "fp16")
KERNELS = ("auto", "reference", "fast")


# ---------------------------------------------------------------------------------------------
# Environment overrides: the one place `DIFFGEMMA_*` variables are read. Every field of SamplerConfig and
# RuntimeConfig has one (`DIFFGEMMA_ENTROPY_BOUND`, `DIFFGEMMA_DEVICE`, ...); any other name is an error.

ENV_PREFIX = "DIFFGEMMA_"
_FIELDS = {
    **{f.name: ("sampler", f) for f in fields(SamplerConfig)},
    **{f.name: ("runtime", f) for f in fields(RuntimeConfig)},
}
# Not a config field: serve's API key (`--api-key`'s fallback, so the key need not be in the process list).
API_KEY_ENV = ENV_PREFIX + "API_KEY"


def env_api_key(environ: dict[str, str] | None = None) -> str | None:
    """`DIFFGEMMA_API_KEY`: None where unset; an empty value raises (a server meant to have a key would have none)."""
    raw = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if raw is not None and not raw.strip():
        raise ConfigError(f"{API_KEY_ENV} is set but empty")
    return raw.strip() if raw is not None else None


def _parse_env_value(name: str, raw: str, typ: Any) -> Any:
    typ = str(typ).replace(" | None", "")
    try:
        if typ == "bool":
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ == "int":
            return int(raw)
        if typ == "float":
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
        if typ == "tuple[int, ...]":
            return tuple(int(x) for x in raw.split(",") if x.strip())
        if typ == "str":
            return raw
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {typ}") from None
    raise ConfigError(f"{name}: unsupported option type {typ}")


def env_overrides(kind: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The overrides of one config ("sampler" or "runtime") from `DIFFGEMMA_<FIELD>` variables. An unknown
    `DIFFGEMMA_*` name or a bad value raises, whichever config is asked for."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name == API_KEY_ENV:  # serve reads it (env_api_key)
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in _FIELDS:
            known = ", ".join(sorted([API_KEY_ENV, *(ENV_PREFIX + k.upper() for k in _FIELDS)]))
            raise ConfigError(f"unknown environment variable {name}; known: {known}")
        owner, f = _FIELDS[key]
        value = _parse_env_value(name, raw, f.type)
        if owner == kind:
            out[key] = value
    return out


def load_sampler_config(path: str | Path, environ: dict[str, str] | None = None) -> SamplerConfig:
    base = SamplerConfig.from_dir(path)
    return dataclasses.replace(base, **env_overrides("sampler", environ)).validated()


def load_runtime_config(environ: dict[str, str] | None = None, **given: Any) -> RuntimeConfig:
    """RuntimeConfig from the environment's overrides, under the fields `given` (those not None win)."""
    values = {**env_overrides("runtime", environ), **{k: v for k, v in given.items() if v is not None}}
    return RuntimeConfig(**values).validated()
