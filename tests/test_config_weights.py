"""Config spellings, sampler defaults and overrides, and checkpoint loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import diffgemma
from diffgemma.config import (
    ConfigError,
    ModelConfig,
    SamplerConfig,
    env_overrides,
    load_runtime_config,
    load_sampler_config,
)
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights.loader import CheckpointError, load_model


def test_both_config_spellings_give_the_same_model_config(tmp_path):
    real = ModelConfig.from_dir(write_tiny_checkpoint(tmp_path / "r", tokenizer=False))
    hf = ModelConfig.from_dir(
        write_tiny_checkpoint(tmp_path / "t", tokenizer=False, config_style="transformers")
    )
    assert real == hf
    assert real.head_dims == (16, 32, 16, 16, 32) and real.num_kv_heads == (2, 1, 2, 2, 1)
    assert real.canvas_length == 16  # read from the config, not assumed


def test_canvas_length_comes_from_the_config(tmp_path):
    cfg = ModelConfig.from_dir(write_tiny_checkpoint(tmp_path, tokenizer=False, canvas_length=40))
    assert cfg.canvas_length == 40


def test_sampler_defaults_when_fields_absent_or_null():
    cfg = SamplerConfig.from_dict({"t_min": None, "max_denoising_steps": None, "eos_token_id": [1, 106, 50]})
    assert (cfg.entropy_bound, cfg.max_denoising_steps, cfg.t_min, cfg.t_max) == (0.1, 48, 0.4, 0.8)
    assert (cfg.stability_threshold, cfg.confidence_threshold, cfg.max_new_tokens) == (1, 0.005, 256)
    assert cfg.stop_token_ids == (1, 106, 50)
    nested = SamplerConfig.from_dict(
        {"sampler_config": {"entropy_bound": 0.3, "_cls_name": "EntropyBoundSamplerConfig"}}
    )
    assert nested.entropy_bound == 0.3


def test_reference_switches_every_divergence_off():
    ref = SamplerConfig().reference()
    assert not ref.denoiser_argmax and not ref.first_step_sc_seed and not ref.pad_gate and not ref.sc_sparse
    assert ref.plateau_steps == ref.entropy_stop == ref.empty_reply_retry == ref.commit_conf_trim == 0
    assert ref.prefill_f32_max_tokens == 0 and not ref.canvas_shrink and not ref.pad_block_stop
    assert SamplerConfig().pad_block_stop  # on by default, as every other divergence


def test_env_overrides_parse_and_reject(tmp_path):
    env = {
        "DIFFGEMMA_ENTROPY_BOUND": "0.2",
        "DIFFGEMMA_PAD_GATE": "off",
        "OTHER": "x",
        "DIFFGEMMA_GRAPHS": "0",
    }
    assert env_overrides("sampler", env) == {"entropy_bound": 0.2, "pad_gate": False}
    assert env_overrides("runtime", env) == {"graphs": False}
    runtime = load_runtime_config({"DIFFGEMMA_DEVICE": "cpu", "DIFFGEMMA_THREADS": "2"}, dtype="float64")
    assert (runtime.device, runtime.threads, runtime.dtype, runtime.kernels) == ("cpu", 2, "float64", "auto")
    with pytest.raises(ConfigError, match="DIFFGEMMA_MAX_DENOISING_STEPS"):
        env_overrides("sampler", {"DIFFGEMMA_MAX_DENOISING_STEPS": "many"})
    for name in (
        "DIFFGEMMA_ENTROPY_BOUNDS",
        "DIFFGEMMA_MODEL",
        "DIFFGEMMA_HOME",
    ):  # every name is read or refused
        with pytest.raises(ConfigError, match=f"unknown environment variable {name}"):
            env_overrides("runtime", {name: "x"})
    with pytest.raises(ConfigError, match="kernels must be one of"):
        load_runtime_config({"DIFFGEMMA_KERNELS": "triton"})
    with pytest.raises(ConfigError, match="t_min"):
        load_sampler_config(write_tiny_checkpoint(tmp_path, tokenizer=False), {"DIFFGEMMA_T_MIN": "0.9"})


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    one = load_model(write_tiny_checkpoint(tmp_path / "one", seed=4, tokenizer=False), "cpu", torch.float32)
    many = load_model(
        write_tiny_checkpoint(tmp_path / "many", seed=4, shards=3, tokenizer=False), "cpu", torch.float32
    )
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    for a, b in zip(one.state_dict().values(), many.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _rewrite(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_is_named(tmp_path):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    _rewrite(p, lambda t: t.pop("model.decoder.layers.2.router.per_expert_scale"))
    with pytest.raises(
        CheckpointError, match=r"model\.decoder\.layers\.2\.router\.per_expert_scale is missing"
    ):
        load_model(p, "cpu", torch.float32)


def test_wrong_shape_is_named(tmp_path):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    _rewrite(p, lambda t: t.update({"model.decoder.norm.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"model\.decoder\.norm\.weight has shape \(3,\)"):
        load_model(p, "cpu", torch.float32)


def test_corrupt_file_is_a_clear_error(tmp_path):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(p, "cpu", torch.float32)
    (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(p, "cpu", torch.float32)


def test_vision_tensors_are_ignored_and_bad_config_is_named(tmp_path):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    _rewrite(p, lambda t: t.update({"model.encoder.vision_tower.patch.weight": torch.ones(2, 2)}))
    load_model(p, "cpu", torch.float32)
    cfg = json.loads((p / "config.json").read_text())
    del cfg["text_config"]["num_experts"]
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_experts"):
        load_model(p, "cpu", torch.float32)
    with pytest.raises(FileNotFoundError):
        diffgemma.load(tmp_path / "nope")


def test_load_applies_sampler_overrides_and_defaults(tiny_a):
    eng = diffgemma.load(tiny_a, device="cpu", dtype="float32", entropy_bound=0.5)
    assert eng.sampler.entropy_bound == 0.5 and eng.model.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        diffgemma.load(tiny_a, device="cpu", dtype="int8")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: t.long(), r"model\.decoder\.norm\.weight is torch\.int64, not a floating-point type"),
        (lambda t: t > 0, r"model\.decoder\.norm\.weight is torch\.bool, not a floating-point type"),
        (
            lambda t: t.index_fill(0, torch.tensor([3]), float("nan")),
            r"norm\.weight holds NaN or infinite values",
        ),
        (
            lambda t: t.index_fill(0, torch.tensor([0]), float("inf")),
            r"norm\.weight holds NaN or infinite values",
        ),
    ],
)
def test_non_float_and_non_finite_weights_are_refused(tmp_path, make, message):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    _rewrite(p, lambda t: t.update({"model.decoder.norm.weight": make(t["model.decoder.norm.weight"])}))
    with pytest.raises(CheckpointError, match=message):
        load_model(p, "cpu", torch.float32)


def test_nan_embeddings_and_overflow_on_the_cast_are_refused(tmp_path):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    name = "model.decoder.embed_tokens.weight"
    _rewrite(p, lambda t: t[name].__setitem__((5, 7), float("nan")))
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight holds NaN"):
        load_model(p, "cpu", torch.float32)
    q = write_tiny_checkpoint(tmp_path / "big", tokenizer=False)
    _rewrite(q, lambda t: t["model.decoder.norm.weight"].__setitem__(0, 1e30))  # finite in fp32, not in fp16
    with pytest.raises(CheckpointError, match="once cast to float16"):
        load_model(q, "cpu", torch.float16)


def test_float16_checkpoints_are_converted_with_a_line_saying_so(tmp_path, capsys):
    p = write_tiny_checkpoint(tmp_path, tokenizer=False)
    ref = load_model(p, "cpu", torch.float32)
    _rewrite(p, lambda t: t.update({k: v.half() for k, v in t.items()}))
    model = load_model(p, "cpu", torch.float32)
    err = capsys.readouterr().err
    assert err.count("float16; converting them to float32") == 1
    assert model.embed.dtype == torch.float32
    assert torch.equal(model.embed, ref.embed.half().float())
