"""Community FP8 checkpoints (compressed-tensors, llm-compressor's FP8_DYNAMIC layout) on CPU: per-expert and fused
experts, channel and tensor scales; every quantized weight equals its dequantized reference exactly, the logits
equal a plain model holding those dequantized weights, the layout is planned from the headers alone, and what
the loader does not take is refused in one line naming it before anything is read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import diffgemma
from diffgemma.quant import formats
from diffgemma.quant.weight import QuantWeight
from diffgemma.testing.compressed import write_tiny_compressed_fp8
from diffgemma.weights import loader
from diffgemma.weights.community import CompressedTensors
from diffgemma.weights.loader import CheckpointError, checkpoint_names, load_model

LAYOUTS = [(e, s) for e in ("per_expert", "fused") for s in ("channel", "tensor")]
TOL = 1e-4


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{e}-{s}" for e, s in LAYOUTS])
def community(request, tmp_path_factory):
    experts, strategy = request.param
    path, reference = write_tiny_compressed_fp8(
        tmp_path_factory.mktemp(f"ct_{experts}_{strategy}"), seed=5, experts=experts, strategy=strategy
    )
    return path, reference


def _dense_twin(path, reference, out):
    """The same checkpoint without quantization: every quantized weight replaced by its reference (fp32), the
    rest as stored; built without diffgemma's compressed-tensors code."""
    out.mkdir()
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    stored = load_file(str(path / "model.safetensors"))
    plain = {
        n: t
        for n, t in stored.items()
        if t.dtype != torch.float8_e4m3fn and not n.endswith("_scale") and ".experts." not in n
    }
    plain.update({n: t for n, t in stored.items() if n.endswith(".router.per_expert_scale")})
    plain.update(reference)
    save_file(plain, str(out / "model.safetensors"))
    return out


def _logits(model):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (1, 12), generator=g)
    canvas = torch.randint(3, 1000, (1, 16), generator=g)
    cache = model.new_cache(64)
    model.prefill(prompt, cache)
    first = model.denoise(canvas, cache)
    return torch.cat([first, model.denoise(canvas, cache, sc_logits=first / 0.7)])


@torch.no_grad()
def test_community_checkpoint_loads_with_its_weights_exact(community, tmp_path):
    path, reference = community
    model = load_model(path, "cpu", torch.float32)
    quantized = set()
    for name, owner, attr in checkpoint_names(model):
        w = getattr(owner, attr)
        if name in reference:
            assert isinstance(w, QuantWeight) and w.fmt == "fp8", name
            assert w.parts["_scale"].dtype == torch.float32 and w.parts["_scale"].shape[-1] == 1
            assert torch.equal(w.dequantize(), reference[name]), name
            quantized.add(name)
        else:
            assert not isinstance(w, QuantWeight), name
    assert quantized == set(reference)
    assert any(".experts.gate_up_proj" in n for n in quantized) and any(
        "self_conditioning" in n for n in quantized
    )

    twin = load_model(_dense_twin(path, reference, tmp_path / "dense"), "cpu", torch.float32)
    ours, want = _logits(model), _logits(twin)
    assert float((ours - want).abs().max()) <= TOL


def test_the_engine_loads_a_community_checkpoint(community):
    path, reference = community
    engine = diffgemma.load(path, device="cpu", dtype="float32")
    layer = engine.model.layers[0]
    assert isinstance(layer.experts_gate_up, QuantWeight) and isinstance(layer.q_proj, QuantWeight)
    assert torch.equal(layer.experts_down.dequantize(), reference["model.decoder.layers.0.experts.down_proj"])


def _headers(path):
    return {
        n: formats.TensorInfo(t.dtype, tuple(t.shape))
        for n, t in load_file(str(path / "model.safetensors")).items()
    }


def test_the_layout_is_planned_from_the_headers_alone(community):
    path, reference = community
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    stored = _headers(path)
    reads = []
    ct = CompressedTensors(qc, stored, lambda n: reads.append(n) or pytest.fail(f"{n} was read"))
    assert reads == []
    assert not any(".experts.0." in n for n in ct.infos)  # no stored-only per-expert names left
    for name, ref in reference.items():
        assert ct.infos[name] == formats.TensorInfo(torch.float8_e4m3fn, tuple(ref.shape)), name
        assert ct.infos[name + "_scale"] == formats.TensorInfo(torch.float32, (*ref.shape[:-1], 1)), name
    embed = "model.decoder.embed_tokens.weight"
    assert ct.infos[embed] == stored[embed]  # plain tensors pass through as stored (bf16)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_scales_of_any_float_dtype_and_module_style_fused_names(tmp_path, scale_dtype):
    path, reference = write_tiny_compressed_fp8(
        tmp_path / "ct", seed=6, experts="fused", strategy="channel", scale_dtype=scale_dtype
    )
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    for name in list(tensors):  # experts.gate_up_proj -> experts.gate_up_proj.weight (+ .weight_scale)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + ".weight"] = tensors.pop(name)
            tensors[name + ".weight_scale"] = tensors.pop(name + "_scale")
    save_file(tensors, str(f))
    model = load_model(path, "cpu", torch.float32)
    for name, owner, attr in checkpoint_names(model):
        if name in reference:
            assert torch.equal(getattr(owner, attr).dequantize(), reference[name]), name


def test_ignored_weights_stay_plain(tmp_path):
    path, reference = write_tiny_compressed_fp8(tmp_path / "ct", seed=7, quantize_self_conditioning=False)
    assert not any("self_conditioning" in n for n in reference)
    model = load_model(path, "cpu", torch.float32)
    stored = load_file(str(path / "model.safetensors"))
    assert not isinstance(model.sc_gate, QuantWeight)
    assert torch.equal(model.sc_gate, stored["model.decoder.self_conditioning.gate_proj.weight"].float())


@pytest.fixture(scope="module")
def refusable(tmp_path_factory):
    return write_tiny_compressed_fp8(tmp_path_factory.mktemp("refuse"), seed=8)[0]


Q = "model.decoder.layers.0.self_attn.q_proj.weight"
EMBED = "model.decoder.embed_tokens.weight"
ROUTER = "model.decoder.layers.2.router.proj.weight"
EXPERT = "model.decoder.layers.3.experts.3.up_proj.weight"


def _group(qc):
    return qc["config_groups"]["group_0"]


def _fp8(t, name, scale_shape=None):
    data = (t[name].float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    t[name] = data
    t[name + "_scale"] = torch.full(scale_shape or (data.shape[0], 1), 0.01, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "edit_config, edit_tensors, message",
    [
        (
            lambda qc: _group(qc)["weights"].update(strategy="group", group_size=128),
            None,
            r"strategy 'group'",
        ),
        (
            lambda qc: _group(qc)["weights"].update(strategy="block", block_structure=[128, 128]),
            None,
            r"strategy 'block'",
        ),
        (
            lambda qc: qc.update(format="pack-quantized") or _group(qc).pop("format"),
            None,
            r"'pack-quantized'",
        ),
        (lambda qc: _group(qc)["weights"].update(type="int"), None, r"8-bit int weights"),
        (
            lambda qc: _group(qc)["input_activations"].update(dynamic=False, strategy="tensor"),
            lambda t: t.update({Q.replace("weight", "input_scale"): torch.ones(1, dtype=torch.bfloat16)}),
            r"static input activations .*input_scale",
        ),
        (
            None,
            lambda t: t.update({Q.replace("weight", "input_scale"): torch.ones(1, dtype=torch.bfloat16)}),
            r"q_proj\.input_scale is a static activation scale",
        ),
        (None, lambda t: _fp8(t, EMBED), r"embed_tokens\.weight is quantized .*only unquantized"),
        (None, lambda t: _fp8(t, ROUTER), r"router\.proj\.weight is quantized"),
        (
            None,
            lambda t: t.update({Q + "_scale": t[Q + "_scale"].expand(-1, 2).contiguous()}),
            r"q_proj\.weight_scale has shape \[64, 2\]",
        ),
        (
            None,
            lambda t: t.update({Q + "_scale": t[Q + "_scale"][:1, :1].clone()}),
            r"tensor scales .*channel",
        ),
        (None, lambda t: t.pop(Q + "_scale"), r"q_proj\.weight is float8_e4m3fn without a weight_scale"),
        (None, lambda t: t.pop(EXPERT), r"experts\.3\.up_proj\.weight is missing"),
        (
            None,
            lambda t: t.update({Q.replace("weight", "weight_zero_point"): torch.zeros(64, 1)}),
            r"asymmetric weight zero point",
        ),
        (
            None,
            lambda t: t.update({Q: t[Q].float().to(torch.bfloat16)}),
            r"q_proj\.weight_scale scales a torch\.bfloat16 weight",
        ),
        (lambda qc: qc.update(quantization_status="frozen"), None, r"quantization_status 'frozen'"),
    ],
)
def test_unsupported_checkpoints_are_refused_in_one_line_before_any_read(
    refusable, tmp_path, monkeypatch, edit_config, edit_tensors, message
):
    path = tmp_path / "ct"
    path.mkdir()
    config = json.loads((refusable / "config.json").read_text())
    if edit_config:
        edit_config(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))
    tensors = {n: t.clone() for n, t in load_file(str(refusable / "model.safetensors")).items()}
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    monkeypatch.setattr(loader, "plan_weights", lambda *a: pytest.fail("the weights were planned"))
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(path, "cpu", torch.float32)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def _unquantize_experts(t):
    """Layer 3's per-expert Linears as bf16 (what an ignored expert list gives): scales dropped."""
    for name in [n for n in t if ".layers.3.experts." in n and n.endswith(".weight")]:
        t[name] = (t[name].float() * t.pop(name + "_scale").float()).to(torch.bfloat16)


def _add_vision(t):
    t["model.encoder.vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(8, 16).to(
        torch.float8_e4m3fn
    )
    t["model.encoder.vision_tower.encoder.layers.0.mlp.fc1.weight_scale"] = torch.ones(
        8, 1, dtype=torch.bfloat16
    )


@pytest.mark.parametrize(
    "edit_config, edit_tensors",
    [
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), None),
        (
            lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}),
            lambda t: t.update({Q.replace("q_proj.weight", "k_scale"): torch.ones(1, dtype=torch.bfloat16)}),
        ),
        (lambda qc: qc.update(config_groups={"FP8_DYNAMIC": ["Linear"]}), None),  # a preset, unexpanded
        (lambda qc: _group(qc).update(input_activations=None), None),  # weight-only FP8
        (lambda qc: {"quant_method": "compressed-tensors", "quantization_config": qc}, None),  # nested
        (None, _add_vision),  # a quantized vision tower: skipped by the loader as ever
        (None, _unquantize_experts),  # experts kept bf16 but split per expert
    ],
)
def test_accepted_variants_load(refusable, tmp_path, edit_config, edit_tensors):
    path = tmp_path / "ct"
    path.mkdir()
    config = json.loads((refusable / "config.json").read_text())
    if edit_config:  # edits the quantization_config in place, or returns one to replace it
        config["quantization_config"] = (
            edit_config(config["quantization_config"]) or config["quantization_config"]
        )
    (path / "config.json").write_text(json.dumps(config))
    tensors = {n: t.clone() for n, t in load_file(str(refusable / "model.safetensors")).items()}
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    model = load_model(path, "cpu", torch.float32)
    stored = load_file(str(refusable / "model.safetensors"))
    want = stored[Q].float() * stored[Q + "_scale"].float()
    assert torch.equal(model.layers[0].q_proj.dequantize(), want)
    experts = model.layers[3].experts_gate_up
    assert isinstance(experts, QuantWeight) == (edit_tensors is not _unquantize_experts)
