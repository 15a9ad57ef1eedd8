"""Load a DiffusionGemma checkpoint or pack (single or sharded safetensors, memory-mapped) into our model.

Safetensors only: nothing from a checkpoint is ever unpickled. Every float weight must be finite (checked on the
device as it lands); float16 weights are converted to the model's dtype, with a line saying so. A pack's quantized
weights (`diffgemma quantize`) are recognised by their stored tensors (`quant.formats.detect`), checked before any
weight is read, and kept quantized (`QuantWeight`) where the device has a kernel for their format.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffgemma.config import FULL, SLIDING, ConfigError, ModelConfig
from diffgemma.model.model import DiffusionGemma
from diffgemma.quant import formats
from diffgemma.quant.weight import QuantWeight
from diffgemma.weights.overlay import Overlay, OverlayError
from diffgemma.weights.pack import PAD_PREFIX, TORCH_DTYPES, misaligned

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
IGNORED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")

LAYER_NAMES = {  # checkpoint suffix under layers.N. -> our Layer attribute
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm",
    "post_feedforward_layernorm_1.weight": "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2.weight": "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2.weight": "post_feedforward_layernorm_2",
    "mlp.gate_proj.weight": "mlp_gate",
    "mlp.up_proj.weight": "mlp_up",
    "mlp.down_proj.weight": "mlp_down",
    "router.proj.weight": "router_proj",
    "router.scale": "router_scale",
    "router.per_expert_scale": "per_expert_scale",
    "experts.gate_up_proj": "experts_gate_up",
    "experts.down_proj": "experts_down",
    "layer_scalar": "layer_scalar",
}
TOP_NAMES = {
    "embed_tokens.weight": "embed",
    "norm.weight": "norm",
    "self_conditioning.pre_norm.weight": "sc_pre_norm",
    "self_conditioning.gate_proj.weight": "sc_gate",
    "self_conditioning.up_proj.weight": "sc_up",
    "self_conditioning.down_proj.weight": "sc_down",
}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, misshapen or corrupt."""


class ConfigMismatch(CheckpointError, ConfigError):
    """config.json and the checkpoint's tensors disagree (either may be wrong): the message names the field."""


def checkpoint_names(model: DiffusionGemma) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """(checkpoint tensor name, owning module, attribute) for every weight the model needs."""
    for suffix, attr in TOP_NAMES.items():
        yield DECODER + suffix, model, attr
    if model.lm_head is not None:
        yield "lm_head.weight", model, "lm_head"
    for i, layer in enumerate(model.layers):
        for suffix, attr in LAYER_NAMES.items():
            if getattr(layer, attr) is not None:
                yield f"{DECODER}layers.{i}.{suffix}", layer, attr


def set_weight(module: torch.nn.Module, attr: str, w: torch.Tensor | QuantWeight) -> None:
    """A weight onto its module: a tensor as a frozen Parameter, a QuantWeight as a plain attribute (it is no
    tensor, and nn.Module refuses a non-Parameter where a Parameter is registered)."""
    if isinstance(w, QuantWeight):
        module._parameters.pop(attr, None)
        setattr(module, attr, w)
    else:
        setattr(module, attr, torch.nn.Parameter(w, requires_grad=False))


def shard_files(path: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"{f} is listed in {index.name} but missing")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def _open(f: Path):
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{f}: corrupt safetensors file ({e})") from None


# Weights a pack may hold quantized, by attribute, and their class (quant.profiles.CLASSES); every other weight
# must be a float type.
ATTR_CLASSES = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "attn",
    "mlp_gate": "dense",
    "mlp_up": "dense",
    "mlp_down": "dense",
    "experts_gate_up": "experts.gate_up",
    "experts_down": "experts.down",
    "sc_gate": "sc",
    "sc_up": "sc",
    "sc_down": "sc",
}
# Formats with a CUDA kernel, by class: the Triton expert kernels (int4, fp8) and fp8 GEMMs
# (`kernels.library.linear_fp8`). The others are dequantized to the model's dtype at load on CUDA.
CUDA_FORMATS = {
    "experts.gate_up": ("int4", "fp8"),
    "experts.down": ("int4", "fp8"),
    "attn": ("fp8",),
    "dense": ("fp8",),
    "sc": ("fp8",),
}


def runs_quantized(device: torch.device, attr: str, fmt: str) -> bool:
    """Whether a weight stays quantized on this device (CPU: always, through the reference's dequantize)."""
    return device.type != "cuda" or fmt in CUDA_FORMATS[ATTR_CLASSES[attr]]


def _infos(handles, files: dict[str, Path]) -> dict[str, formats.TensorInfo]:
    """Every stored tensor's dtype and shape, from the headers (no data read)."""
    out = {}
    for name, f in files.items():
        try:
            sl = handles[f].get_slice(name)
            dtype = TORCH_DTYPES.get(sl.get_dtype())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"tensor {name}: corrupt header in {f.name} ({e})") from None
        if dtype is None:
            raise CheckpointError(f"tensor {name} has dtype {sl.get_dtype()}, which no weight takes")
        out[name] = formats.TensorInfo(dtype, tuple(sl.get_shape()))
    return out


def _check_pack(path: Path, files: dict[str, Path]) -> None:
    """A pack's tensors all start at 64-byte-aligned file offsets (pack.ALIGN: the seed's GPU rule)."""
    for f in sorted(set(files.values())):
        try:
            bad = misaligned(f)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{f}: corrupt safetensors file ({e})") from None
        if bad is not None:
            raise CheckpointError(
                f"tensor {bad} in {f.name} does not start at a 64-byte-aligned file offset: {path} is not a "
                "valid pack (re-run diffgemma quantize)"
            )


def plan_weights(model: DiffusionGemma, infos: dict[str, formats.TensorInfo], path: Path) -> dict[str, str]:
    """Each model weight's format, derived from the stored tensors alone, with every shape, companion and dtype
    checked: raises CheckpointError naming the tensor before anything is read or allocated."""
    fmts = {}
    for name, owner, attr in checkpoint_names(model):
        param = getattr(owner, attr)
        data = infos.get(name)
        if data is None:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint at {path}")
        shape = tuple(param.shape)
        if not data.dtype.is_floating_point or data.dtype == torch.float8_e4m3fn:
            if attr not in ATTR_CLASSES:
                raise CheckpointError(f"tensor {name} is {data.dtype}, not a floating-point type")
        elif data.shape != shape:
            raise CheckpointError(f"tensor {name} has shape {data.shape}, the config expects {shape}")
        found = {s: infos[name + s] for s in ("", *formats.COMPANIONS) if name + s in infos}
        try:
            fmts[name] = formats.detect(name, found, shape)
        except formats.FormatError as e:
            raise CheckpointError(str(e)) from None
    return fmts


@contextmanager
def stored_tensors(
    path: Path, base: str | Path | None = None
) -> Iterator[tuple[dict[str, formats.TensorInfo], Callable[[str], torch.Tensor]]]:
    """The checkpoint's tensors under our names, as (infos from the headers, a reader), with the pack and
    compressed-tensors checks done: nothing is read until the reader is called. An overlay pack's raw tensors
    come from its base's shards (`base`, when given, instead of the recorded one), each shard checked first."""
    files = {n: f for n, f in shard_files(path).items() if not n.startswith(PAD_PREFIX)}
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if qc is not None and method not in ("diffgemma", "compressed-tensors"):
        raise CheckpointError(
            f"{path}: quantization method {method!r} is not supported (diffgemma packs and compressed-tensors "
            "FP8 checkpoints are)"
        )
    if method == "diffgemma":
        _check_pack(path, files)
        try:
            index = Overlay.read(path)
            if index is not None:  # the pack's own tensors win over the base's of the same name
                files = {**index.resolve(path, base), **files}
        except OverlayError as e:
            raise CheckpointError(str(e)) from None
    with ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in set(files.values())}

        def read_stored(name: str) -> torch.Tensor:
            try:
                return handles[files[name]].get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"tensor {name}: corrupt data in {files[name].name} ({e})") from None

        infos, read = _infos(handles, files), read_stored
        if method == "compressed-tensors":  # seen through our pack's names and layout
            from diffgemma.weights.community import CompressedTensors

            try:
                community = CompressedTensors(qc, infos, read_stored)
            except ValueError as e:
                raise CheckpointError(f"{path}: {e}") from None
            infos, read = community.infos, community.read
        yield infos, read


# -- config.json against the checkpoint, before the model is built ----------------------------------------------


@dataclass(frozen=True)
class Expected:
    """A weight the config implies: its checkpoint name, our attribute, its shape and the field behind each dim."""

    name: str
    attr: str
    shape: tuple[int, ...]
    fields: tuple[str, ...]


def expected_weights(cfg: ModelConfig, transformers_spelling: bool = False) -> Iterator[Expected]:
    """Every weight `DiffusionGemma(cfg)` has (the order of `checkpoint_names`), from the config alone: no model
    is built, so a config is checked against the headers before its modules exist."""
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hs, vs, ins = "hidden_size", "vocab_size", "intermediate_size"
    top = {
        "embed": ((v, h), (vs, hs)),
        "norm": ((h,), (hs,)),
        "sc_pre_norm": ((h,), (hs,)),
        "sc_gate": ((inter, h), (ins, hs)),
        "sc_up": ((inter, h), (ins, hs)),
        "sc_down": ((h, inter), (hs, ins)),
    }
    for suffix, attr in TOP_NAMES.items():
        yield Expected(DECODER + suffix, attr, *top[attr])
    if not cfg.tie_word_embeddings:
        yield Expected("lm_head.weight", "lm_head", (v, h), (vs, hs))
    e, mi = cfg.num_experts, cfg.moe_intermediate_size
    for i in range(cfg.num_layers):
        hd, kv, nh = cfg.head_dims[i], cfg.num_kv_heads[i], cfg.num_heads
        if transformers_spelling:
            hdf, kvf = f"head_dim of layer {i}", f"num_key_value_heads of layer {i}"
        elif cfg.is_sliding(i):
            hdf, kvf = "head_dim", "num_key_value_heads"
        else:
            hdf, kvf = "global_head_dim", "num_global_key_value_heads"
        q, k = (nh * hd, h), (kv * hd, h)
        qf, kf = (f"num_attention_heads x {hdf}", hs), (f"{kvf} x {hdf}", hs)
        shapes = {
            "q_proj": (q, qf),
            "k_proj": (k, kf),
            "v_proj": (k, kf),
            "o_proj": ((h, nh * hd), (hs, qf[0])),
            "q_norm": ((hd,), (hdf,)),
            "k_norm": ((hd,), (hdf,)),
            "mlp_gate": ((inter, h), (ins, hs)),
            "mlp_up": ((inter, h), (ins, hs)),
            "mlp_down": ((h, inter), (hs, ins)),
            "router_proj": ((e, h), ("num_experts", hs)),
            "router_scale": ((h,), (hs,)),
            "per_expert_scale": ((e,), ("num_experts",)),
            "experts_gate_up": ((e, 2 * mi, h), ("num_experts", "2 x moe_intermediate_size", hs)),
            "experts_down": ((e, h, mi), ("num_experts", hs, "moe_intermediate_size")),
            "layer_scalar": ((1,), ("a layer scalar's 1",)),
        }
        shapes.update({a: ((h,), (hs,)) for a in LAYER_NAMES.values() if "layernorm" in a})
        for suffix, attr in LAYER_NAMES.items():
            if attr == "v_proj" and not cfg.is_sliding(i):
                continue  # full layers take V from k_proj
            yield Expected(f"{DECODER}layers.{i}.{suffix}", attr, *shapes[attr])


def _stored_data_shape(want: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """The shape of a weight's data tensor in whichever format its dtype says: the nibble formats (uint8) store
    two values a byte along the input dimension, every other format the weight's own shape."""
    return (*want[:-1], want[-1] // 2) if dtype == torch.uint8 and want else want


def _shape_problem(e: Expected, stored: formats.TensorInfo) -> str | None:
    """Which config fields a stored tensor's shape contradicts, or None when its dims agree with them."""
    want = _stored_data_shape(e.shape, stored.dtype)
    if stored.shape == want:
        return None
    if len(stored.shape) != len(want):
        fields = ", ".join(e.fields)
    else:
        fields = ", ".join(f for f, a, b in zip(e.fields, stored.shape, want, strict=True) if a != b)
    return (
        f"config.json and the checkpoint disagree: tensor {e.name} has shape {stored.shape}, the config "
        f"expects {want} (from {fields})"
    )


LAYER_INDEX = re.compile(re.escape(DECODER) + r"layers\.(\d+)\.")


def _check_layers(cfg: ModelConfig, infos: dict[str, formats.TensorInfo], layer_types_given: bool) -> None:
    """num_hidden_layers against the layers the checkpoint holds, and each layer's type against its tensors
    (a sliding layer has a v_proj, a full one none): either mismatch would load silently into a wrong model."""
    held = {int(m.group(1)) for n in infos if (m := LAYER_INDEX.match(n))}
    if held != set(range(cfg.num_layers)):
        have = f"layers 0 to {max(held)}" if held == set(range(len(held))) and held else f"{len(held)} layers"
        raise ConfigMismatch(
            f"config.json: num_hidden_layers is {cfg.num_layers}, but the checkpoint holds {have} "
            f"({DECODER}layers.N)"
        )
    field = "layer_types" if layer_types_given else "layer_types (absent: every sixth layer full)"
    for i, t in enumerate(cfg.layer_types):
        has_v = f"{DECODER}layers.{i}.self_attn.v_proj.weight" in infos
        if has_v != (t == SLIDING):
            other = FULL if t == SLIDING else SLIDING
            raise ConfigMismatch(
                f"config.json: {field} makes layer {i} {t}, but the checkpoint's layer {i} is {other} "
                f"({'no' if t == SLIDING else 'a'} self_attn.v_proj)"
            )


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` (None: unknown). CPU: MemAvailable, under a cgroup's limit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's own limit (cgroup v2), which MemAvailable does not see
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free


def _nbytes(info: formats.TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n * info.dtype.itemsize


def check_checkpoint(
    cfg: ModelConfig,
    path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    raw_config: dict | None = None,
    base: str | Path | None = None,
) -> int:
    """Check config.json against the checkpoint's headers (layer count and types, every weight's shape and
    format) and the weights' memory against what `device` has free, before any model is built or weight read;
    returns the weights' bytes on the device. ConfigMismatch / ConfigError name the field in one line."""
    path, device = Path(path), torch.device(device)
    raw = raw_config if raw_config is not None else json.loads((path / "config.json").read_text())
    tc = raw.get("text_config", raw)
    with stored_tensors(path, base) as (infos, _):
        _check_layers(cfg, infos, tc.get("layer_types") is not None)
        total = 0
        for e in expected_weights(cfg, transformers_spelling="per_layer_config" in tc):
            data = infos.get(e.name)
            if data is None:
                raise CheckpointError(f"tensor {e.name} is missing from the checkpoint at {path}")
            problem = _shape_problem(e, data)
            if problem:
                raise ConfigMismatch(problem)
            if e.attr not in ATTR_CLASSES and (
                not data.dtype.is_floating_point or data.dtype == torch.float8_e4m3fn
            ):
                raise CheckpointError(f"tensor {e.name} is {data.dtype}, not a floating-point type")
            found = {s: infos[e.name + s] for s in ("", *formats.COMPANIONS) if e.name + s in infos}
            try:
                fmt = formats.detect(e.name, found, e.shape)
            except formats.FormatError as err:
                raise ConfigMismatch(f"{err} (the config's shape {e.shape}: {', '.join(e.fields)})") from None
            if fmt == "bf16" or not runs_quantized(device, e.attr, fmt):
                total += _nbytes(formats.TensorInfo(dtype, e.shape))
            else:
                total += sum(_nbytes(infos[e.name + s]) for s in formats.layout(fmt, e.shape))
    free = free_memory(device)
    if free is not None and total > free:
        raise ConfigError(
            f"config.json: the weights its sizes imply need {_size(total)} on {device} in "
            f"{str(dtype).removeprefix('torch.')} (as the checkpoint stores them), but only {_size(free)} is free"
        )
    return total


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**27 else f"{nbytes / 2**20:,.1f} MiB"


def load_weights(
    model: DiffusionGemma,
    path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    base: str | Path | None = None,
) -> None:
    """Fill every weight of `model` from the checkpoint or pack at `path`, on device: float weights cast to dtype,
    quantized ones kept in their format (`QuantWeight`) where the device runs it, else dequantized to dtype.
    `base`: an overlay pack's base checkpoint, instead of the one it records."""
    path = Path(path)
    device = torch.device(device)
    with stored_tensors(path, base) as (infos, read):
        fmts = plan_weights(model, infos, path)

        target = str(dtype).removeprefix("torch.")
        said: set[torch.dtype] = set()

        def land(name: str, t: torch.Tensor) -> torch.Tensor:
            """`t` on the device in the model's dtype, refused unless floating-point and finite."""
            if not t.dtype.is_floating_point:
                raise CheckpointError(f"tensor {name} is {t.dtype}, not a floating-point type")
            if t.dtype == torch.float16 != dtype and not said:
                said.add(t.dtype)
                print(
                    f"diffgemma: the checkpoint's weights are float16; converting them to {target}",
                    file=sys.stderr,
                )
            out = t.to(device=device, dtype=dtype)
            if not bool(torch.isfinite(out).all()):
                cast = f" once cast to {target}" if t.dtype != dtype and bool(torch.isfinite(t).all()) else ""
                raise CheckpointError(f"tensor {name} holds NaN or infinite values{cast}")
            return out

        dequantized: set[str] = set()

        def land_quant(name: str, fmt: str, attr: str, shape: tuple[int, ...]):
            parts = {s: read(name + s) for s in formats.layout(fmt, shape)}
            for s, t in parts.items():
                if t.dtype.is_floating_point and not bool(torch.isfinite(t.float()).all()):
                    raise CheckpointError(f"tensor {name}{s} holds NaN or infinite values")
            w = QuantWeight.from_pack(fmt, shape, parts).to_device(device)
            if not runs_quantized(device, attr, fmt):
                dequantized.add(f"{fmt} ({ATTR_CLASSES[attr]})")
                return land(name, w.dequantize(dtype))
            return w

        used = set()
        for name, owner, attr in checkpoint_names(model):
            fmt = fmts[name]
            if fmt == "bf16":
                set_weight(owner, attr, land(name, read(name)))
            else:
                set_weight(owner, attr, land_quant(name, fmt, attr, tuple(getattr(owner, attr).shape)))
            used.update(name + s for s in ("", *formats.COMPANIONS))
        if dequantized:
            print(
                f"diffgemma: no CUDA kernel for {', '.join(sorted(dequantized))}; dequantized to {target} at load",
                file=sys.stderr,
            )
        for i, layer in enumerate(model.layers):
            name = f"{ENCODER}layers.{i}.layer_scalar"
            if name in infos:
                t = read(name)
                if t.numel() != 1:
                    raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, expected (1,)")
                set_weight(layer, "encoder_layer_scalar", land(name, t.reshape(1)))
                used.add(name)
            else:  # the encoder shares the decoder's weights
                set_weight(layer, "encoder_layer_scalar", layer.layer_scalar.detach().clone())
        unknown = [
            n
            for n in infos
            if n not in used
            and not n.startswith(IGNORED_PREFIXES)
            and not n.startswith(ENCODER)
            and n != "lm_head.weight"
        ]
        if unknown:
            print(f"diffgemma: ignoring {len(unknown)} unknown tensors, e.g. {unknown[0]}", file=sys.stderr)
    for lt in model.inv_freq:
        model.inv_freq[lt] = model.inv_freq[lt].to(device)


def load_model(
    path: str | Path, device: torch.device | str, dtype: torch.dtype, base: str | Path | None = None
) -> DiffusionGemma:
    """Build the model from config.json without allocating (meta device), then fill it from the checkpoint
    (`base`: an overlay pack's base checkpoint, instead of the one it records: RuntimeConfig.overlay_base)."""
    cfg = ModelConfig.from_dir(path)
    check_checkpoint(cfg, path, device, dtype, base=base)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    load_weights(model, path, device, dtype, base)
    return model.eval()
