"""Quantized packs on CPU: each codec against its error bound, `diffgemma quantize` (profiles, `--set`, every
refusal before anything is written or read, aligned tensors, no partial output), and loading a pack: its logits
against the same model with the weights dequantized in torch, a misaligned or inconsistent pack refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffgemma.quant import formats, profiles
from diffgemma.quant.weight import QuantWeight
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights import loader, pack
from diffgemma.weights.header import read_header
from diffgemma.weights.loader import CheckpointError, load_model

QUANTIZABLE_TINY = {"moe_intermediate_size": 32}  # every input dimension a multiple of 32


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("src"), seed=3, **QUANTIZABLE_TINY)


def _weights(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w[..., 0, :32] = 0.3  # a constant group (affine formats: exact)
    w[..., 1, :32] = 0.0  # an all-zero group and nvfp4 block
    w[..., 2, :16] = 1e-7  # values far below the row's range
    return w


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("shape", [(40, 96), (3, 24, 64)])
def test_codec_round_trips_within_its_bound(fmt, shape):
    w = _weights(len(shape), *shape)
    parts = formats.encode(w, fmt)
    want = {s: (i.dtype, i.shape) for s, i in formats.layout(fmt, shape).items()}
    assert {
        s: (t.dtype if s or fmt != "bf16" else torch.bfloat16, tuple(t.shape)) for s, t in parts.items()
    } == (want if fmt != "bf16" else {"": (torch.bfloat16, shape)})
    info = {s: formats.TensorInfo(t.dtype, tuple(t.shape)) for s, t in parts.items()}
    assert formats.detect("w", info, shape) == fmt
    err = (formats.decode(fmt, parts) - w).abs()
    bound = formats.error_bound(fmt, w)
    assert bool((err <= bound).all()), float((err - bound).max())
    if fmt in ("int4", "q5", "q6"):
        assert float(err[..., 0, :32].max()) < 1e-3 * 0.3  # a constant group: one level, fp16-rounded scale
    assert float(err[..., 1, :32].max()) == 0.0
    q = QuantWeight.quantize(w, fmt) if fmt != "bf16" else None
    if q is not None:
        assert torch.equal(q.dequantize(), formats.decode(fmt, parts))
        if len(shape) == 3:  # one expert of a stack is that expert's weight
            assert torch.equal(q[1].dequantize(), formats.decode(fmt, parts)[1])


def test_codecs_refuse_shapes_their_rules_forbid():
    for fmt in ("int4", "q5", "q6"):
        with pytest.raises(formats.FormatError, match="multiple of 32"):
            formats.encode(torch.zeros(4, 48), fmt)
    with pytest.raises(formats.FormatError, match="multiple of 16"):
        formats.encode(torch.zeros(4, 24), "nvfp4")
    with pytest.raises(formats.FormatError, match="matrix"):
        formats.encode(torch.zeros(32), "q8")


def test_quantized_weights_concatenate_along_rows():
    a, b = _weights(1, 16, 64), _weights(2, 8, 64)
    for fmt in ("q8", "int4", "q5", "q6", "fp8", "nvfp4"):
        both = QuantWeight.cat([QuantWeight.quantize(a, fmt), QuantWeight.quantize(b, fmt)])
        want = torch.cat(
            [QuantWeight.quantize(a, fmt).dequantize(), QuantWeight.quantize(b, fmt).dequantize()]
        )
        assert both.shape == (24, 64) and torch.equal(both.dequantize(), want), fmt


def test_profiles_and_overrides_resolve():
    assert profiles.resolve("int4") == ("int4", profiles.PROFILES["int4"], {})
    assert profiles.PROFILES["int4"]["sc"] == "q8" and profiles.PROFILES["int4"]["attn"] == "bf16"
    base, fmts, given = profiles.resolve("nvfp4x")
    assert base == "int4" and given == {"experts": "nvfp4"}
    assert fmts == {**profiles.PROFILES["int4"], "experts.gate_up": "nvfp4", "experts.down": "nvfp4"}
    _, fmts, _ = profiles.resolve(
        "int4", ["attn=fp8", "dense=fp8", "experts.gate_up=fp8", "experts.down=fp8"]
    )
    assert fmts["attn"] == fmts["dense"] == fmts["experts.down"] == "fp8"
    assert profiles.tensor_class("model.decoder.layers.3.self_attn.q_norm.weight", 1) == "norms"
    assert profiles.tensor_class("model.decoder.layers.3.router.proj.weight", 2) == "router"
    assert profiles.tensor_class("model.decoder.embed_tokens.weight", 2) == "embed"
    assert profiles.tensor_class("model.decoder.self_conditioning.up_proj.weight", 2) == "sc"
    assert profiles.tensor_class("model.encoder.vision_tower.encoder.layers.0.mlp.fc1.weight", 2) == "vision"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffgemma.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "embed=q8"], "embed is locked"),
        (["--set", "router=fp8"], "router is locked"),
        (["--set", "norms=q8"], "norms is locked"),
        (["--set", "mlp=q8"], "unknown class 'mlp'"),
        (["--set", "attn=q3"], "unknown format 'q3'"),
        (["--set", "attn"], "expected CLASS=FORMAT"),
        (["--profile", "q4"], "unknown profile 'q4'"),
        (["--set", "experts.down=fp8"], "must share one format"),
        (["--profile", "fp8", "--set", "experts.gate_up=int4"], "must share one format"),
        (["--set", "experts=int4", "--profile", "int4", "--set", "attn=nvfp4"], None),  # legal: see below
    ],
)
def test_quantize_refusals_exit_2_with_one_line_and_no_output(tmp_path, args, message):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)  # moe_intermediate_size 24: int4 experts break
    out = tmp_path / "pack"
    proc = run_cli("quantize", "-m", str(src), "-o", str(out), *args)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("diffgemma: error:")]
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert message is None or message in lines[0]
    if message is None:  # the dimension rule: experts.down's input dimension is 24
        assert "experts.down_proj" in lines[0] and "multiple of 32" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_refusals_come_before_any_weight_is_read(tmp_path, monkeypatch):
    src = write_tiny_checkpoint(tmp_path / "src", seed=1)

    def no_reads(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(pack, "safe_open", no_reads)
    with pytest.raises(profiles.QuantSpecError, match=r"layers\.0\.experts\.down_proj .*multiple of 32"):
        pack.quantize(src, tmp_path / "out", "int4")
    with pytest.raises(profiles.QuantSpecError, match="already exists"):
        pack.quantize(src, src, "int4")
    assert not (tmp_path / "out").exists()


def test_quantize_writes_an_aligned_pack(source, tmp_path):
    out = pack.quantize(source, tmp_path / "pack", "int4", ["attn=nvfp4"], quiet=True)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "diffgemma" and qc["profile"] == "int4"
    assert qc["formats"]["experts.gate_up"] == "int4" and qc["formats"]["attn"] == "nvfp4"
    assert qc["overrides"] == {"attn": "nvfp4"}
    for name in ("generation_config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    f = out / "model.safetensors"
    assert pack.misaligned(f) is None
    header, start = read_header(f)
    assert start % 64 == 0 and any(n.startswith(pack.PAD_PREFIX) for n in header)
    src = load_file(str(source / "model.safetensors"))
    got = load_file(str(f))
    layer = "model.decoder.layers.1."
    assert got[layer + "experts.gate_up_proj"].dtype == torch.uint8
    assert got[layer + "self_attn.q_proj.weight_scale"].dtype == torch.float8_e4m3fn
    assert got["model.decoder.self_conditioning.gate_proj.weight"].dtype == torch.int8
    for name in (
        layer + "router.proj.weight",
        "model.decoder.embed_tokens.weight",
        layer + "mlp.up_proj.weight",
    ):
        assert torch.equal(got[name].view(torch.uint8), src[name].view(torch.uint8))  # byte-verbatim
    assert all(bool((got[n] == 0).all()) for n in header if n.startswith(pack.PAD_PREFIX))


def test_zero_overrides_is_exactly_the_base_profile(source, tmp_path):
    a = pack.quantize(source, tmp_path / "a", "q6", quiet=True)
    b = pack.quantize(source, tmp_path / "b", "q6", ["experts=q6", "sc=q8"], quiet=True)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    qa = json.loads((a / "config.json").read_text())["quantization_config"]
    assert qa["formats"] == profiles.PROFILES["q6"] and qa["overrides"] == {}


def test_a_failure_midway_leaves_no_partial_output(source, tmp_path, monkeypatch):
    calls = []

    def interrupted(w, fmt):
        calls.append(fmt)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(w, fmt)

    real = formats.encode
    monkeypatch.setattr(formats, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack.quantize(source, tmp_path / "pack", "int4", quiet=True)
    assert list(tmp_path.iterdir()) == []


def _dequantized_copy(model):
    """The model with every QuantWeight replaced by its fp32 dequantization (a plain parameter)."""
    for module in model.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, QuantWeight):
                loader.set_weight(module, attr, value.dequantize())
    return model


@pytest.mark.parametrize(
    "profile, sets",
    [
        ("int4", []),
        ("q5", ["attn=q8"]),
        ("q6", ["dense=int4"]),
        ("q8", ["attn=q6"]),
        ("fp8", ["attn=fp8", "dense=fp8", "sc=fp8"]),
        ("nvfp4", ["dense=nvfp4", "attn=q5"]),
    ],
)
def test_pack_logits_match_the_dequantized_model(source, tmp_path, profile, sets):
    out = pack.quantize(source, tmp_path / "pack", profile, sets, quiet=True)
    model = load_model(out, "cpu", torch.float32)
    fmts = {w.fmt for m in model.modules() for w in vars(m).values() if isinstance(w, QuantWeight)}
    _, resolved, _ = profiles.resolve(profile, sets)
    assert fmts == {f for c, f in resolved.items() if c != "vision"} - {"bf16"}
    reference = _dequantized_copy(load_model(out, "cpu", torch.float32))
    bf16 = load_model(source, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (1, 12), generator=g)
    canvas = torch.randint(3, 1000, (1, 16), generator=g)
    logits = {}
    for name, m in (("pack", model), ("ref", reference), ("bf16", bf16)):
        cache = m.new_cache(64)
        m.prefill(prompt, cache)
        logits[name] = m.denoise(canvas, cache, sc_seed=True)
    assert float((logits["pack"] - logits["ref"]).abs().max()) <= 1e-4
    assert float((logits["pack"] - logits["bf16"]).abs().max()) > 1e-4  # the formats did round something


def _rewrite_pack(path, fn):
    """Rewrite a pack's safetensors with plain save_file (tensors back to back: offsets not aligned)."""
    f = path / "model.safetensors"
    tensors = {n: t for n, t in load_file(str(f)).items() if not n.startswith(pack.PAD_PREFIX)}
    fn(tensors)
    save_file(tensors, str(f))


def test_a_misaligned_pack_is_refused_before_any_weight_is_allocated(source, tmp_path, monkeypatch):
    out = pack.quantize(source, tmp_path / "pack", "int4", quiet=True)
    _rewrite_pack(out, lambda t: None)
    bad = pack.misaligned(out / "model.safetensors")
    assert bad is not None
    monkeypatch.setattr(loader, "plan_weights", lambda *a: pytest.fail("the weights were planned"))
    monkeypatch.setattr(loader, "set_weight", lambda *a: pytest.fail("a weight was set"))
    with pytest.raises(CheckpointError, match=rf"tensor {bad.replace('.', '[.]')} .*64-byte-aligned"):
        load_model(out, "cpu", torch.float32)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t, n: t.pop(n + "_scale"), r"gate_up_proj is uint8 without .*gate_up_proj_scale"),
        (lambda t, n: t.update({n + "_scale": t[n + "_scale"][:, :1]}), r"gate_up_proj_scale has shape"),
        (
            lambda t, n: t.update({n + "_scale": t[n + "_scale"].float()}),
            r"gate_up_proj_scale is torch\.float32",
        ),
        (lambda t, n: t.update({n + "_extra": t[n + "_scale"]}), None),  # unknown: ignored with a line
        (
            lambda t, n: t.update(
                {"model.decoder.embed_tokens.weight": torch.zeros(1024, 64, dtype=torch.int8)}
            ),
            r"embed_tokens\.weight is torch\.int8, not a floating-point type",
        ),
        (
            lambda t, n: t.update(
                {n + "_scale": t[n + "_scale"].index_fill(0, torch.tensor([2]), float("nan"))}
            ),
            r"gate_up_proj_scale holds NaN",
        ),
    ],
)
def test_an_inconsistent_pack_is_refused_naming_the_tensor(source, tmp_path, edit, message):
    out = pack.quantize(source, tmp_path / "pack", "int4", quiet=True)
    name = "model.decoder.layers.2.experts.gate_up_proj"
    tensors = {n: t.clone() for n, t in load_file(str(out / "model.safetensors")).items()}  # not mmapped
    edit(tensors, name)
    entries = [
        pack.Entry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items() if not n.startswith("__pad__")
    ]
    pack.write_aligned(out / "model.safetensors", entries, lambda e: tensors[e.name])
    if message is None:
        load_model(out, "cpu", torch.float32)
        return
    with pytest.raises(CheckpointError, match=message):
        load_model(out, "cpu", torch.float32)


def test_a_pack_runs_from_the_command_line(source, tmp_path):
    out = tmp_path / "pack"
    proc = run_cli("quantize", "-m", str(source), "-o", str(out), "--profile", "fp8", "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    proc = run_cli("ask", "-m", str(out), "-p", "hi", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.decoder.layers.0.experts.down_proj").dtype == torch.float8_e4m3fn


def test_training_refuses_a_pack_as_its_starting_point(source, tmp_path):
    from diffgemma.train.trainer import TrainConfig, train

    out = pack.quantize(source, tmp_path / "pack", "int4", quiet=True)
    with pytest.raises(ValueError, match="is a quantized pack: fine-tune from a bf16 checkpoint"):
        train(TrainConfig(out=str(tmp_path / "run"), steps=1, init=str(out), device="cpu", canvas_length=16))


def test_a_sharded_source_makes_a_sharded_pack_that_loads_the_same(source, tmp_path, monkeypatch):
    sharded = write_tiny_checkpoint(tmp_path / "src", seed=3, shards=2, **QUANTIZABLE_TINY)
    one = pack.quantize(source, tmp_path / "one", "int4", quiet=True)
    monkeypatch.setattr(pack, "SHARD_BYTES", 200_000)
    many = pack.quantize(sharded, tmp_path / "many", "int4", quiet=True)
    files = sorted(p.name for p in many.glob("*.safetensors"))
    assert len(files) > 2 and (many / "model.safetensors.index.json").exists()
    assert all(pack.misaligned(many / f) is None for f in files)
    a, b = load_model(one, "cpu", torch.float32), load_model(many, "cpu", torch.float32)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb)
    qa = a.layers[0].experts_gate_up
    assert all(torch.equal(t, b.layers[0].experts_gate_up.parts[s]) for s, t in qa.parts.items())
