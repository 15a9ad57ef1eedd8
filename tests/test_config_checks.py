"""config.json checks (issue #56 item 4): every corrupt config is refused through the CLI in one line naming the
field, before any model is built or weight allocated; good checkpoints, both spellings and packs still load."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from diffgemma import config as config_module
from diffgemma.bench import REAL_CONFIG
from diffgemma.config import FULL, SLIDING, ConfigError, ModelConfig
from diffgemma.model.model import DiffusionGemma
from diffgemma.testing import write_tiny_checkpoint
from diffgemma.weights import pack
from diffgemma.weights.loader import (
    CheckpointError,
    ConfigMismatch,
    check_checkpoint,
    checkpoint_names,
    expected_weights,
    load_model,
)

DEMO = Path(config_module.__file__).parent / "assets" / "demo"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("src"), seed=1, generation={"max_denoising_steps": 2}
    )


@pytest.fixture(scope="module")
def source_hf(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf"), seed=1, config_style="transformers")


def variant(src: Path, dst: Path, edit) -> Path:
    """A checkpoint dir whose files link to `src`'s, with config.json edited by `edit(config)`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def text(**changes: Any):
    """An edit of text_config: each key set (or deleted, for the value DELETE)."""

    def edit(cfg: dict) -> None:
        for key, value in changes.items():
            if value is DELETE:
                cfg["text_config"].pop(key)
            else:
                cfg["text_config"][key] = value

    return edit


DELETE = object()


def ask(model: Path, prelude: str = "", isolated: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """`diffgemma ask` on `model` and its wall time: in a subprocess (after `prelude`, Python run first) when
    `isolated` or given a prelude, else the same `main` in this process (a subprocess a case cost the file ~6 min on
    2 cores); an exception that escapes `main` is reported as its traceback, which `refused` rejects."""
    argv = ["ask", "-m", str(model), "-p", "hi", "--max-tokens", "4", "--device", "cpu"]
    start = time.monotonic()
    if isolated or prelude:
        code = f"import sys\n{prelude}\nfrom diffgemma.cli import main\nsys.argv = ['diffgemma', *sys.argv[1:]]\nmain()"
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        return proc, time.monotonic() - start
    from diffgemma.cli import main

    err, out = io.StringIO(), io.StringIO()
    code = 0
    saved = sys.argv
    sys.argv = ["diffgemma", *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:
        err.write(traceback.format_exc())
        code = 1
    finally:
        sys.argv = saved
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue()), time.monotonic() - start


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The one error line of a refused run, asserted: non-zero exit, no traceback, every needle in the line."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("diffgemma: error:")]
    assert len(errors) == 1, proc.stderr
    assert all(line.startswith("diffgemma:") for line in proc.stderr.splitlines()), proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


REQUIRED = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
]


@pytest.mark.parametrize("field", [*REQUIRED, "rope_theta"])
def test_each_missing_required_field_is_one_line_naming_it(source, tmp_path, field):
    if field == "rope_theta":  # the case: a 49-line KeyError traceback before
        edit = lambda c: c["text_config"]["rope_parameters"]["full_attention"].pop("rope_theta")  # noqa: E731
        name = "text_config.rope_parameters.full_attention.rope_theta is required"
    else:
        edit, name = text(**{field: DELETE}), f"text_config.{field} is required"
    # the case through a real process, the rest through the same main in this one
    refused(ask(variant(source, tmp_path / "m", edit), isolated=field == "rope_theta")[0], name)


@pytest.mark.parametrize(
    "edit, needles",
    [
        (text(hidden_size="64"), ["text_config.hidden_size must be an integer, got '64'"]),
        (text(num_experts=8.0), ["text_config.num_experts must be an integer, got 8.0"]),
        (text(num_hidden_layers=True), ["text_config.num_hidden_layers must be an integer"]),
        (text(layer_types="sliding_attention"), ["text_config.layer_types must be a list"]),
        (
            lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_theta="1e4"),
            ["rope_parameters.sliding_attention.rope_theta must be a finite number"],
        ),
        (
            lambda c: c.update(tie_word_embeddings="yes"),
            ["config.json: tie_word_embeddings must be true or false"],
        ),
        (text(rope_parameters=[1, 2]), ["text_config.rope_parameters must be an object"]),
    ],
    ids=["str-int", "float-int", "bool-int", "str-list", "str-theta", "str-bool", "list-object"],
)
def test_a_wrong_type_is_one_line_naming_the_field(source, tmp_path, edit, needles):
    refused(ask(variant(source, tmp_path / "m", edit))[0], *needles)


@pytest.mark.parametrize(
    "edit, needles",
    [
        (text(hidden_size=0), ["text_config.hidden_size must be at least 1, got 0"]),
        (text(num_experts=-8), ["text_config.num_experts must be at least 1, got -8"]),
        (text(sliding_window=0), ["text_config.sliding_window must be at least 1"]),
        (text(num_attention_heads=3), ["num_attention_heads (3) is not a multiple", "num_key_value_heads"]),
        (text(num_global_key_value_heads=3), ["not a multiple of layer 1's 3", "num_global_key_value_heads"]),
        (text(head_dim=15), ["text_config.head_dim must be even"]),
        (text(rms_norm_eps=-1e-6), ["text_config.rms_norm_eps must be positive"]),
        (text(pad_token_id=1024), ["text_config.pad_token_id must be a token id in [0, 1024)"]),
        (text(eos_token_id=[1, -1]), ["text_config.eos_token_id must be a token id"]),
        (text(max_position_embeddings=8), ["canvas_length (16) exceeds max_position_embeddings (8)"]),
        (lambda c: c.update(canvas_length=0), ["canvas_length must be a positive integer, got 0"]),
        (
            lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(partial_rotary_factor=1.5),
            ["rope_parameters.full_attention.partial_rotary_factor must be in (0, 1]"],
        ),
        (
            lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_type="yarn"),
            ["rope_parameters.sliding_attention.rope_type 'yarn' is not supported"],
        ),
        (
            text(layer_types=[SLIDING, FULL, SLIDING, "global", FULL]),
            ["text_config.layer_types[3] is 'global'"],
        ),
    ],
    ids=[
        "zero",
        "negative",
        "window",
        "heads",
        "global-kv",
        "odd-head",
        "eps",
        "pad",
        "eos",
        "canvas-positions",
        "canvas",
        "rotary",
        "rope-type",
        "layer-type",
    ],
)
def test_out_of_range_is_one_line_naming_the_field(source, tmp_path, edit, needles):
    refused(ask(variant(source, tmp_path / "m", edit))[0], *needles)


def test_top_k_above_num_experts_is_refused(source, tmp_path):
    # before: accepted silently, changing the answers
    line = refused(ask(variant(source, tmp_path / "m", text(top_k_experts=9)))[0])
    assert "text_config.top_k_experts (9) must not exceed num_experts (8)" in line


def test_a_billion_layers_without_layer_types_fails_fast_naming_the_memory_estimate(source, tmp_path):
    # before: 5.6 GB allocated for 71 s, then a MemoryError
    model = variant(source, tmp_path / "m", text(num_hidden_layers=10**9, layer_types=DELETE))
    proc, seconds = ask(model, isolated=True)
    line = refused(proc, "num_hidden_layers=1000000000", "even at 4 bits a weight", "of RAM")
    assert "GiB" in line
    assert seconds < 60  # loosely: an interpreter start and an import, not minutes of tables


def test_the_memory_estimate_bounds_a_real_size_config(monkeypatch):
    """The guard is arithmetic on the sizes, not a cap on layers: the real 26B config passes on a machine of 64 GiB
    and is refused on one of 8 GiB (25B weights need 11.7 GiB at 4 bits)."""
    monkeypatch.setattr(config_module, "machine_memory", lambda: 64 * 2**30)
    assert ModelConfig.from_dict(REAL_CONFIG).num_layers == 30
    monkeypatch.setattr(config_module, "machine_memory", lambda: 8 * 2**30)
    with pytest.raises(ConfigError, match=r"imply 2\.\d+e\+10 weights .*1[01]\.\d GiB even at 4 bits"):
        ModelConfig.from_dict(REAL_CONFIG)


def test_layer_types_of_the_wrong_length_are_refused(source, tmp_path):
    model = variant(source, tmp_path / "m", text(layer_types=[SLIDING, FULL, SLIDING, SLIDING]))
    refused(ask(model)[0], "text_config.layer_types lists 4 layers; num_hidden_layers is 5")


def test_a_layer_count_the_checkpoint_does_not_hold_is_refused(source, tmp_path):
    # 4 layers of a 5-layer checkpoint loaded before with only an "ignoring unknown tensors" line
    fewer = variant(
        source, tmp_path / "a", text(num_hidden_layers=4, layer_types=[SLIDING, FULL, SLIDING, SLIDING])
    )
    refused(ask(fewer)[0], "num_hidden_layers is 4, but the checkpoint holds layers 0 to 4")
    more = variant(source, tmp_path / "b", text(num_hidden_layers=1000, layer_types=DELETE))
    refused(ask(more)[0], "num_hidden_layers is 1000, but the checkpoint holds layers 0 to 4")


def test_a_layer_type_the_tensors_contradict_is_refused(source, tmp_path):
    model = variant(source, tmp_path / "m", text(layer_types=[SLIDING, SLIDING, SLIDING, SLIDING, FULL]))
    refused(ask(model)[0], "layer_types makes layer 1 sliding_attention", "is full_attention")


@pytest.mark.parametrize(
    "edit, needles",
    [
        (
            text(vocab_size=1000),
            ["embed_tokens.weight has shape (1024, 64), the config expects (1000, 64)", "vocab_size"],
        ),
        (text(moe_intermediate_size=32), ["experts.gate_up_proj has shape", "2 x moe_intermediate_size"]),
        (text(global_head_dim=64), ["layers.1.self_attn.q_proj.weight", "global_head_dim"]),
        (text(intermediate_size=128), ["intermediate_size"]),
    ],
    ids=["vocab", "moe", "global-head-dim", "intermediate"],
)
def test_a_tensor_shape_the_config_contradicts_names_the_field(source, tmp_path, edit, needles):
    line = refused(
        ask(variant(source, tmp_path / "m", edit))[0], "config.json and the checkpoint disagree", *needles
    )
    assert "hidden_size" not in line.split("(from ")[-1]  # only the dims that disagree are named


def test_the_transformers_spelling_is_checked_too(source_hf, tmp_path):
    def edit(c: dict) -> None:
        c["text_config"]["per_layer_config"]["4"]["head_dim"] = 64

    refused(
        ask(variant(source_hf, tmp_path / "m", edit))[0],
        "layers.4.self_attn.q_proj.weight",
        "head_dim of layer 4",
    )
    bad_key = variant(
        source_hf, tmp_path / "k", lambda c: c["text_config"]["per_layer_config"].update({"9": {}})
    )
    refused(ask(bad_key)[0], "text_config.per_layer_config.9 is neither a layer type nor a layer index")


def test_weights_beyond_the_free_memory_are_refused_before_any_read(source):
    proc, _ = ask(
        source, prelude="import diffgemma.weights.loader as L; L.free_memory = lambda device: 2**20"
    )
    refused(proc, "the weights its sizes imply need", "on cpu in float32", "only 1.0 MiB is free")


def test_the_estimate_counts_what_lands_on_the_device(source, tmp_path):
    """fp32 on CPU: 4 bytes a weight, every weight the model has; an int4 pack stays quantized on CPU, so less."""
    model = load_model(source, "cpu", torch.float32)
    bytes_fp32 = check_checkpoint(model.cfg, source, "cpu", torch.float32)
    params = sum(getattr(o, a).numel() for _, o, a in checkpoint_names(model))
    assert bytes_fp32 == 4 * params
    assert check_checkpoint(model.cfg, source, "cpu", torch.bfloat16) == 2 * params
    quantizable = write_tiny_checkpoint(tmp_path / "q", seed=3, tokenizer=False, moe_intermediate_size=32)
    out = pack.quantize(quantizable, tmp_path / "pack", "int4", quiet=True)
    cfg = ModelConfig.from_dir(out)
    assert check_checkpoint(cfg, out, "cpu", torch.float32) < check_checkpoint(
        cfg, quantizable, "cpu", torch.float32
    )
    load_model(out, "cpu", torch.float32)  # a pack still loads


def test_a_pack_whose_config_contradicts_its_tensors_names_the_field(tmp_path):
    quantizable = write_tiny_checkpoint(tmp_path / "q", seed=3, tokenizer=False, moe_intermediate_size=32)
    out = pack.quantize(quantizable, tmp_path / "pack", "int4", quiet=True)
    bad = variant(out, tmp_path / "bad", text(moe_intermediate_size=64))
    with pytest.raises(ConfigMismatch, match=r"experts\.gate_up_proj has shape .*2 x moe_intermediate_size"):
        load_model(bad, "cpu", torch.float32)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("style", ["real", "transformers"])
def test_expected_weights_are_the_models_own(style, tied):
    """The table the headers are checked against is the model's parameter list, name for name and shape for shape."""
    from diffgemma.testing.checkpoint import _text_config

    cfg = ModelConfig.from_dict({"tie_word_embeddings": tied, "text_config": _text_config(style, {})})
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    ours = [(e.name, e.attr, e.shape) for e in expected_weights(cfg, style == "transformers")]
    theirs = [(n, a, tuple(getattr(o, a).shape)) for n, o, a in checkpoint_names(model)]
    assert ours == theirs
    assert all(len(e.fields) == len(e.shape) for e in expected_weights(cfg))


def test_good_checkpoints_still_load(source, source_hf):
    for path in (DEMO, source, source_hf):
        model = load_model(path, "cpu", torch.float32)
        assert model.cfg == ModelConfig.from_dir(path)
    assert issubclass(ConfigMismatch, CheckpointError) and issubclass(ConfigMismatch, ConfigError)


def test_a_good_checkpoint_answers_through_the_cli(source):
    proc, _ = ask(source)
    assert proc.returncode == 0, proc.stderr
    assert "diffgemma: error" not in proc.stderr
