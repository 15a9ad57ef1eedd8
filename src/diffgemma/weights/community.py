"""Community FP8 checkpoints in the compressed-tensors layout, seen through our pack's names and fp8 format.

What such a checkpoint holds (llm-compressor's FP8_DYNAMIC recipe, `oneshot` or `model_free_ptq`; the layout
vLLM loads); sources are the compressed-tensors, llm-compressor, vLLM and transformers repositories:

- config.json `quantization_config`: quant_method "compressed-tensors", format "float-quantized",
  quantization_status "compressed", an `ignore` list of module names / `re:` regexes left in bf16 (lm_head,
  embeddings, routers, norms, vision tower), and `config_groups` of schemes {targets ["Linear"], weights {num_bits
  8, type "float", strategy "channel" (FP8_DYNAMIC) or "tensor", symmetric, dynamic false}, input_activations
  {num_bits 8, type "float", strategy "token", dynamic true} or null, output_activations null}. A group may also be
  written as a preset name with its targets (`"FP8_DYNAMIC": ["Linear"]`).
- Each quantized Linear `X` stores `X.weight` as float8_e4m3fn [out, in] and `X.weight_scale` in the model's
  float dtype (bf16 for a bf16 model): [out, 1] for the channel strategy, one element ([1]; (1, 1) or [] from other
  writers) for the tensor strategy, with w = fp8 * scale. Symmetric schemes store no zero point; dynamic
  activations store nothing (no `input_scale`: that is the static FP8 scheme, refused here).
- Gemma 4 / DiffusionGemma MoE experts, fused 3-D parameters in transformers ([E, 2I, H] gate rows then up rows,
  [E, H, I]), are not Linears: llm-compressor unfuses them into per-expert Linears before quantizing (its
  Gemma 4 / DiffusionGemma calibration modules and model_free_ptq's fused-expert split), so a checkpoint holds
  `experts.{e}.gate_proj.weight` [I, H], `experts.{e}.up_proj.weight` [I, H], `experts.{e}.down_proj.weight`
  [H, I], each with its `weight_scale`; vLLM's gemma4 loader maps exactly these names (and explodes bf16 fused
  3-D tensors into them). Experts left unquantized come either fused (bf16, as the base checkpoint) or split.
- A fused 3-D fp8 form is being added to llm-compressor (repacking compressed experts into `gate_up_proj` /
  `down_proj`): taken here as `experts.gate_up_proj` (or `experts.gate_up_proj.weight`) float8 [E, 2I, H] with
  `experts.gate_up_proj_scale` (or `.weight_scale`) of [E, 2I, 1] / [E, 2I] (channel), or [E, 2] / [E, 1] / [E]
  / one element (tensor: one scale an expert's projection, an expert, or the whole tensor); likewise down_proj.

`CompressedTensors.infos` presents every tensor under our names: unquantized ones as they are, quantized ones as
our fp8 format (data under the weight's name, `<name>_scale` float32 [..., N, 1]), per-expert experts stacked
into `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]. Everything is checked from the headers
alone; `read` builds a tensor only when the loader asks for it. Activations are not part of the checkpoint: our
fp8 kernels quantize them per row on the fly (dense) or keep them in the model's dtype (experts).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

import torch

from diffgemma.quant.formats import TensorInfo
from diffgemma.weights.loader import DECODER, IGNORED_PREFIXES, LAYER_NAMES, TOP_NAMES

FP8 = torch.float8_e4m3fn
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STRATEGIES = ("channel", "tensor")
# The 2-D Linears of ours that may be quantized, as the loader takes them (the experts are handled on their own);
# every other weight our model reads (embeddings, norms, router, lm_head) must stay a float type.
QUANT_LAYER = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {
    f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
}
QUANT_TOP = {f"self_conditioning.{p}_proj.weight" for p in ("gate", "up", "down")}
FUSED = ("experts.gate_up_proj", "experts.down_proj")
PER_EXPERT = re.compile(
    r"^(?P<layer>.*\.layers\.\d+)\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)
LAYER = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?P<suffix>.+)$")
# Companions of a scheme this loader does not take, by what they mean.
STATIC = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point")
OTHER = {
    ".weight_zero_point": "an asymmetric weight zero point",
    ".weight_g_idx": "an activation-order group index",
    ".weight_packed": "packed int4/fp4 weights",
    ".weight_shape": "packed weights",
    ".weight_global_scale": "an fp4 global scale",
}
# fp8 KV-cache scales (kv_cache_scheme; older writers used the k/v projections' output_scale): not needed, our KV
# cache stays in the model's dtype
KV_SCALES = (
    ".k_scale",
    ".v_scale",
    ".q_scale",
    ".prob_scale",
    ".k_proj.output_scale",
    ".v_proj.output_scale",
)


def _args_problem(args: object, what: str) -> str | None:
    return None if isinstance(args, dict) else f"{what} are {args!r}, not a quantization-args mapping"


def _flat(qc: dict) -> dict:
    if "config_groups" not in qc and isinstance(qc.get("quantization_config"), dict):
        return {**qc, **qc["quantization_config"]}  # transformers' nesting of the compressed-tensors config
    return qc


def check_config(qc: dict) -> set[str]:
    """The weight strategies a compressed-tensors `quantization_config` uses; ValueError naming what is not
    supported (not float-quantized FP8 weights with channel or tensor scales and dynamic or no activations)."""
    qc = _flat(qc)
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise ValueError(
            f"compressed-tensors quantization_status {status!r} is not supported: only compressed checkpoints "
            "(weights stored as float8) load"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("the compressed-tensors quantization_config has no config_groups")
    strategies = set()
    for gname, g in groups.items():
        if isinstance(g, list):  # a preset name with its targets
            if gname != "FP8_DYNAMIC":
                raise ValueError(
                    f"compressed-tensors preset scheme {gname!r} is not supported (FP8_DYNAMIC is: FP8 weights "
                    "per channel, dynamic activations)"
                )
            strategies.add("channel")
            continue
        if not isinstance(g, dict):
            raise ValueError(f"compressed-tensors config group {gname!r} is {g!r}, not a scheme")
        fmt = g.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise ValueError(
                f"compressed-tensors format {fmt!r} (config group {gname}) is not supported: only "
                "float-quantized FP8 checkpoints load"
            )
        w = g.get("weights")
        problem = _args_problem(w, f"config group {gname}'s weights")
        if problem:
            raise ValueError(f"compressed-tensors {problem}")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(
                f"compressed-tensors config group {gname} has {w.get('num_bits')}-bit {w.get('type')} weights: "
                "only 8-bit float (FP8 E4M3) weights are supported"
            )
        strategy = w.get("strategy")
        if strategy not in STRATEGIES:
            raise ValueError(
                f"compressed-tensors weight strategy {strategy!r} (config group {gname}) is not supported: only "
                "channel and tensor scales are (not group, block or tensor_group ones)"
            )
        if w.get("symmetric") is False or w.get("dynamic") not in (None, False) or w.get("actorder"):
            raise ValueError(
                f"compressed-tensors config group {gname} has asymmetric, dynamic or activation-ordered weights: "
                "only symmetric static FP8 weights are supported"
            )
        strategies.add(strategy)
        a = g.get("input_activations")
        if a is not None:
            problem = _args_problem(a, f"config group {gname}'s input activations")
            if problem:
                raise ValueError(f"compressed-tensors {problem}")
            if a.get("dynamic") is not True:
                raise ValueError(
                    f"compressed-tensors config group {gname} has static input activations (dynamic: "
                    f"{a.get('dynamic')}, an input_scale per layer): only dynamic activations are supported "
                    "(FP8_DYNAMIC)"
                )
        if g.get("output_activations") is not None:
            raise ValueError(
                f"compressed-tensors config group {gname} quantizes output activations: not supported"
            )
    sparsity = qc.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format") not in (None, "dense")):
        raise ValueError("compressed-tensors sparsity_config is not supported (only dense weights are)")
    transform = qc.get("transform_config")
    if transform and (not isinstance(transform, dict) or transform.get("config_groups")):
        raise ValueError("compressed-tensors transform_config (rotations) is not supported")
    return strategies


def _scale_kind(shape: tuple[int, ...], lead: tuple[int, ...], n: int) -> tuple[str, int] | None:
    """How a scale of `shape` covers a weight [*lead, n, k]: ("channel", n) one a row, ("tensor", p) one for
    each of p equal blocks of rows (p = 1: the whole matrix), or None for no known layout."""
    numel = 1
    for d in shape:
        numel *= d
    if shape in ((*lead, n, 1), (*lead, n)):
        return "channel", n
    if numel == 1 and len(shape) <= len(lead) + 2:  # one scale for every expert and row
        return "tensor", 1
    if lead:
        for tail in ((), (1,), (1, 1)):
            if (
                len(shape) == len(lead) + len(tail)
                and shape[: len(lead)] == lead
                and shape[len(lead) :] == tail
            ):
                return "tensor", 1  # one an expert
        if len(shape) in (len(lead) + 1, len(lead) + 2) and shape[: len(lead)] == lead:
            p = shape[len(lead)]
            if (len(shape) == len(lead) + 1 or shape[-1] == 1) and 0 < p < n and n % p == 0:
                return "tensor", p  # one an expert's projection (gate, up)
    return None


def _rows(scale: torch.Tensor, lead: tuple[int, ...], n: int) -> torch.Tensor:
    """A stored scale (any layout `_scale_kind` knows) as our fp8 format's float32 [*lead, n, 1]."""
    s = scale.to(torch.float32)
    s = s.reshape(1).expand(*lead, 1) if s.numel() == 1 else s.reshape(*lead, -1)
    return s.repeat_interleave(n // s.shape[-1], dim=-1).unsqueeze(-1).contiguous()


class CompressedTensors:
    """A compressed-tensors FP8 checkpoint (its config and stored tensors' headers) as our pack's tensors.

    `infos`: every tensor the loader sees, by our name, dtype and shape (from the headers: nothing read);
    `read(name)`: one of them, built from the stored tensors. ValueError naming the problem when the config or a
    tensor is not one this loader takes."""

    def __init__(
        self,
        qc: dict,
        infos: dict[str, TensorInfo],
        read_stored: Callable[[str], torch.Tensor],
    ) -> None:
        self._read_stored = read_stored
        self._strategies = check_config(qc)
        self._kv_cache = _flat(qc).get("kv_cache_scheme") is not None
        self.infos: dict[str, TensorInfo] = {}
        self._sources: dict[str, Callable[[], torch.Tensor]] = {}
        self._build(infos)

    def read(self, name: str) -> torch.Tensor:
        source = self._sources.get(name)
        if source is None:
            raise KeyError(name)
        return source()

    # -- planning (headers only) ----------------------------------------------------------------------------

    def _put(self, name: str, info: TensorInfo, source: Callable[[], torch.Tensor]) -> None:
        if name in self.infos:
            raise ValueError(f"tensor {name} is stored twice (fused and per-expert, or under two spellings)")
        self.infos[name] = info
        self._sources[name] = source

    def _pass(self, name: str, info: TensorInfo) -> None:
        self._put(name, info, partial(self._read_stored, name))

    def _scale_of(self, data: str, stored: dict[str, TensorInfo]) -> str | None:
        """The stored scale of the stored fp8 tensor `data`."""
        names = [data + "_scale"] if data.endswith(".weight") else [data + "_scale", data + ".weight_scale"]
        found = [n for n in names if n in stored]
        if len(found) > 1:
            raise ValueError(f"tensor {data} has two scales, {found[0]} and {found[1]}")
        return found[0] if found else None

    def _check_scale(self, data: str, info: TensorInfo, scale: str, sinfo: TensorInfo) -> tuple[str, int]:
        """The kind of `scale` for the fp8 weight `data`, checked against its shape and the config."""
        if sinfo.dtype not in SCALE_DTYPES:
            raise ValueError(
                f"tensor {scale} is {sinfo.dtype}; a weight scale is bfloat16, float16 or float32"
            )
        *lead, n, _ = info.shape
        kind = _scale_kind(sinfo.shape, tuple(lead), n)
        if kind is None:
            want = f"[{', '.join(map(str, (*lead, n)))}, 1] (channel) or one element (tensor)"
            raise ValueError(
                f"tensor {scale} has shape {list(sinfo.shape)}; an fp8 weight {list(info.shape)} needs {want}"
            )
        if kind[0] not in self._strategies and n > 1:
            raise ValueError(
                f"tensor {scale} has {kind[0]} scales ({list(sinfo.shape)}) but the config's weight strategy is "
                f"{', '.join(sorted(self._strategies))}"
            )
        return kind

    def _quantized(self, ours: str, data: str, info: TensorInfo, scale: str, sinfo: TensorInfo) -> None:
        """A stored fp8 weight (2-D or fused 3-D) and its scale as our fp8 `ours` + `ours_scale`."""
        self._check_scale(data, info, scale, sinfo)
        *lead, n, _ = info.shape
        self._put(ours, info, partial(self._read_stored, data))
        self._put(
            ours + "_scale",
            TensorInfo(torch.float32, (*lead, n, 1)),
            partial(self._read_scale, scale, tuple(lead), n),
        )

    def _read_scale(self, scale: str, lead: tuple[int, ...], n: int) -> torch.Tensor:
        return _rows(self._read_stored(scale), lead, n)

    def _build(self, stored: dict[str, TensorInfo]) -> None:
        experts: dict[str, dict[tuple[str, int], str]] = {}  # layer prefix -> (proj, e) -> stored weight name
        consumed: set[str] = set()
        for name, info in stored.items():
            if name.startswith(IGNORED_PREFIXES):  # the vision tower: skipped by the loader, in any format
                self._pass(name, info)
                continue
            if name.endswith(KV_SCALES) and self._kv_cache:
                consumed.add(name)  # fp8 KV-cache scales: our KV cache stays in the model's dtype
                continue
            for end in STATIC:
                if name.endswith(end):
                    raise ValueError(
                        f"tensor {name} is a static activation scale: only dynamic activations are supported "
                        "(FP8_DYNAMIC)"
                    )
            for end, what in OTHER.items():
                if name.endswith(end):
                    raise ValueError(
                        f"tensor {name} is {what}: only FP8 weights with a weight_scale are supported"
                    )
            if info.dtype == torch.float8_e5m2:
                raise ValueError(f"tensor {name} is float8_e5m2: only float8_e4m3fn weights are supported")
            m = PER_EXPERT.match(name)
            if m and m["layer"].startswith(DECODER):
                experts.setdefault(m["layer"], {})[(m["proj"], int(m["e"]))] = name
                consumed.add(name)
                consumed.add(name + "_scale")
                continue
            if info.dtype != FP8:
                continue  # plain tensors (and scales) are placed below
            consumed.add(name)
            scale = self._scale_of(name, stored)
            if scale is None:
                raise ValueError(f"tensor {name} is float8_e4m3fn without a weight_scale")
            consumed.add(scale)
            self._place_fp8(name, info, scale, stored[scale])
        for layer, found in experts.items():
            self._stack_experts(layer, found, stored)
        for name, info in stored.items():
            if name in consumed or name.startswith(IGNORED_PREFIXES):
                continue
            if name.endswith(".weight_scale"):  # not consumed: its weight is not float8, or absent
                data = name.removesuffix("_scale")
                if data not in stored and data.removesuffix(".weight") not in stored:
                    raise ValueError(f"tensor {name} is a weight scale without its weight {data}")
                dtype = stored.get(data, stored.get(data.removesuffix(".weight"))).dtype
                raise ValueError(
                    f"tensor {name} scales a {dtype} weight: the checkpoint is not compressed (only float8 "
                    "weights carry a weight_scale)"
                )
            self._pass(name, info)  # a plain tensor; refused if it clashes with a stacked one

    def _place_fp8(self, name: str, info: TensorInfo, scale: str, sinfo: TensorInfo) -> None:
        """A stored fp8 tensor other than a per-expert one: a 2-D Linear of ours or a fused expert stack."""
        m = LAYER.match(name) if name.startswith(DECODER) else None
        suffix = m["suffix"] if m else None
        if suffix is not None and suffix.removesuffix(".weight") in FUSED:
            ours = f"{m['layer']}.{suffix.removesuffix('.weight')}"
            if len(info.shape) != 3:
                raise ValueError(f"tensor {name} has shape {list(info.shape)}; fused experts are [E, N, K]")
            self._quantized(ours, name, info, scale, sinfo)
            return
        top = name.removeprefix(DECODER) if name.startswith(DECODER) else None
        if (suffix in QUANT_LAYER) or (m is None and top in QUANT_TOP):
            if len(info.shape) != 2:
                raise ValueError(f"tensor {name} has shape {list(info.shape)}; a Linear weight is [out, in]")
            self._quantized(name, name, info, scale, sinfo)
            return
        if name == "lm_head.weight" or (suffix or top) in LAYER_NAMES or (suffix or top) in TOP_NAMES:
            raise ValueError(
                f"tensor {name} is quantized (float8_e4m3fn), but diffgemma takes it only unquantized: embeddings, "
                "lm_head, the router and norms must stay bf16 (list them in the quantization ignore list)"
            )
        # not a tensor our model reads: left as it is (the loader ignores it, with a line)
        self._pass(name, info)
        self._pass(scale, sinfo)

    def _stack_experts(
        self, layer: str, found: dict[tuple[str, int], str], stored: dict[str, TensorInfo]
    ) -> None:
        """One layer's per-expert Linears as our stacked experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
        n_exp = max(e for _, e in found) + 1
        for proj in ("gate", "up", "down"):
            for e in range(n_exp):
                if (proj, e) not in found:
                    raise ValueError(
                        f"tensor {layer}.experts.{e}.{proj}_proj.weight is missing ({layer} stores experts one by "
                        f"one, {n_exp} of them)"
                    )
        infos = {k: stored[n] for k, n in found.items()}
        dtypes = {i.dtype for i in infos.values()}
        if len(dtypes) > 1:
            raise ValueError(f"{layer}'s experts mix dtypes ({', '.join(sorted(map(str, dtypes)))})")
        dtype = dtypes.pop()
        gate, down = infos[("gate", 0)].shape, infos[("down", 0)].shape
        if len(gate) != 2 or down != (gate[1], gate[0]):
            raise ValueError(
                f"tensor {found[('down', 0)]} has shape {list(down)}; with gate_proj {list(gate)} it needs "
                f"{[*reversed(gate)]}"
            )
        for (proj, e), info in infos.items():
            want = down if proj == "down" else gate
            if info.shape != want:
                raise ValueError(
                    f"tensor {found[(proj, e)]} has shape {list(info.shape)}, expected {list(want)}"
                )
        i, h = gate
        for proj in ("gate_up", "down"):
            parts = ("gate", "up") if proj == "gate_up" else ("down",)
            names = [[found[(p, e)] for p in parts] for e in range(n_exp)]
            ours = f"{layer}.experts.{proj}_proj"
            shape = (n_exp, 2 * i, h) if proj == "gate_up" else (n_exp, h, i)
            if dtype != FP8:
                for row in names:
                    for n in row:
                        if n + "_scale" in stored:
                            raise ValueError(f"tensor {n}_scale scales {n}, which is {dtype}: not compressed")
                self._put(ours, TensorInfo(dtype, shape), partial(self._read_stack, names))
                continue
            scales = []
            for row in names:
                for n in row:
                    scale = self._scale_of(n, stored)
                    if scale is None:
                        raise ValueError(f"tensor {n} is float8_e4m3fn without a weight_scale")
                    self._check_scale(n, stored[n], scale, stored[scale])
                scales.append([n + "_scale" for n in row])
            self._put(ours, TensorInfo(FP8, shape), partial(self._read_stack, names))
            self._put(
                ours + "_scale",
                TensorInfo(torch.float32, (*shape[:2], 1)),
                partial(self._read_scale_stack, scales, [[stored[n].shape[0] for n in row] for row in names]),
            )

    # -- reading -----------------------------------------------------------------------------------------------

    def _read_stack(self, names: list[list[str]]) -> torch.Tensor:
        """Expert e's tensors concatenated along rows (gate then up), experts stacked."""
        return torch.stack([torch.cat([self._read_stored(n) for n in row]) for row in names])

    def _read_scale_stack(self, scales: list[list[str]], rows: list[list[int]]) -> torch.Tensor:
        return torch.stack(
            [
                torch.cat([_rows(self._read_stored(s), (), n) for s, n in zip(row, ns, strict=True)])
                for row, ns in zip(scales, rows, strict=True)
            ]
        )
