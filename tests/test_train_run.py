"""A tiny training run lowers the loss, writes a checkpoint `diffgemma.load` reads, and resumes."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch

import diffgemma
from diffgemma.train import data
from diffgemma.train.batches import bucket_rows, retrieval_cap, task_weights
from diffgemma.train.tokenizer import demo_tokenizer
from diffgemma.train.trainer import TrainConfig, train
from diffgemma.weights.download import bundled_model


def test_corpus_is_deterministic_and_heldout_is_disjoint():
    a = data.generate(200, seed=5)
    b = data.generate(200, seed=5)
    assert [e.prompt + e.target for e in a] == [e.prompt + e.target for e in b]
    held = data.heldout_set(10)
    assert {e.task for e in held} == set(data.TASKS)
    assert all(data.is_heldout(e.identity) for e in held)
    assert not any(data.is_heldout(e.identity) for e in a)
    for e in held:
        assert e.prompt.startswith("<bos>") and e.target.endswith(("<turn|>", "<|tool_response>"))
    arith = next(e for e in data.generate(50, 1, tasks={"arith": 1.0}))
    assert str(arith.meta["result"]) in arith.answer


def test_retrieval_curriculum_caps_list_lengths_then_ends():
    cfg = TrainConfig(out="x", curriculum_steps=4000)
    assert [retrieval_cap(cfg, s) for s in (0, 399, 400, 3999, 4000)] == [2, 2, 3, 11, None]
    assert retrieval_cap(TrainConfig(out="x", curriculum_steps=0), 0) is None
    both = {"retrieval": 1.0, "retrieval_short": 1.0}
    capped = data.generate(200, seed=3, tasks=both, max_lines=5)
    assert {e.task for e in capped} == {"retrieval"}
    assert {e.meta["n"] for e in capped} == {2, 3, 4, 5}  # 2..cap lines, the long task included
    assert {e.meta["n"] for e in data.generate(50, seed=3, tasks={"retrieval": 1.0}, max_lines=3)} == {2, 3}
    full = data.generate(60, seed=3, tasks={"retrieval": 1.0})
    assert min(e.meta["n"] for e in full) >= 30
    other = data.generate(20, seed=3, tasks={"arith": 1.0}, max_lines=2)
    assert other == data.generate(20, seed=3, tasks={"arith": 1.0})  # other tasks ignore the cap


def test_retrieval_filler_puts_more_than_a_window_between_list_and_question():
    """The probe's filler: longer than the sliding window, with no key or code word in it."""
    from tokenizers import Tokenizer

    demo = bundled_model()
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    window = json.loads((demo / "config.json").read_text())["text_config"]["sliding_window"]
    rng = random.Random(5)
    for _ in range(20):
        e = data._retrieval(rng, (2, 16), filler=True)
        lines = e.prompt.split("code words.\n")[1].split("\n")
        assert len([ln for ln in lines if ln.startswith("- ")]) == e.meta["n"]
        filler = lines[e.meta["n"]]
        assert len(tok.encode(filler).ids) > window
        words = set(filler.replace(".", "").split())
        assert not words & set(data.ANIMALS + data.OBJECTS + data.CODE_WORDS)  # no key, no code word
        question = lines[e.meta["n"] + 1]
        assert "code word" in question and f" {e.meta['key']}" in question
        assert filler not in e.identity  # the identity is the list without filler


def test_demo_tokenizer_keeps_special_ids_and_splits_digits():
    tok = demo_tokenizer(data.tokenizer_corpus(300), vocab_size=1024)
    real_ids = {
        "<pad>": 0,
        "<eos>": 1,
        "<bos>": 2,
        "<|tool_call>": 48,
        "<|tool_response>": 50,
        '<|"|>': 52,
        "<|channel>": 100,
        "<channel|>": 101,
        "<|turn>": 105,
        "<turn|>": 106,
        "\n": 107,
    }
    for text, i in real_ids.items():
        assert tok.token_to_id(text) == i
    assert tok.encode("17 + 25", add_special_tokens=False).tokens == ["1", "7", "Ġ+", "Ġ", "2", "5"]
    ex = data.generate(20, 3)
    for e in ex:
        ids = tok.encode(e.prompt + e.target, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == e.prompt + e.target


def test_tiny_training_run_lowers_loss_and_loads(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(
        out=str(out),
        preset="tiny",
        steps=24,
        batch=8,
        lr=3e-3,
        warmup=4,
        log_every=4,
        ckpt_every=12,
        vocab_size=1024,
        canvas_length=16,
        max_denoising_steps=4,
    )
    summary = train(cfg)
    log = [
        json.loads(json.dumps(r)) for r in json.loads((out / "train_state" / "state.json").read_text())["log"]
    ]
    assert summary["steps"] == 24
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (out / name).exists()

    eng = diffgemma.load(out, device="cpu")
    assert eng.config.canvas_length == 16 and eng.sampler.max_denoising_steps == 4
    trained = dict(eng.model.named_parameters())
    assert eng.model.layers[0].encoder_layer_scalar.item() == 1.0
    res = eng.generate([2, 105, 108, 109], max_new_tokens=8, seed=0)
    assert res.blocks >= 1

    # Resume: continues from the saved step with the saved weights.
    cfg2 = TrainConfig(**{**cfg.to_json(), "steps": 28, "resume": True})
    assert train(cfg2)["steps"] == 28
    again = diffgemma.load(out, device="cpu")
    changed = any(not torch.equal(p, trained[n]) for n, p in again.model.named_parameters())
    assert changed


def test_task_mix_overrides_weights_and_rejects_bad_input():
    w = task_weights("retrieval_short=0.5,arith=0")
    assert w["retrieval_short"] == 0.5 and w["arith"] == 0.0 and w["yesno"] == data.TASK_WEIGHTS["yesno"]
    rows = bucket_rows(64, task_weights("tool_call=0,tool_answer=0,tool_answer_json=0"))
    assert sum(rows) == 64 and rows[2] == 0  # an empty bucket gets no rows, not one
    for bad, msg in (("foo=1", "unknown task"), ("arith", "not task=weight"), ("arith=-1", "negative")):
        with pytest.raises(ValueError, match=msg):
            task_weights(bad)
    zero = ",".join(f"{t}=0" for t in data.TASK_WEIGHTS)
    with pytest.raises(ValueError, match="every task weight is 0"):
        task_weights(zero)
    short = data.make_example("retrieval_short", random.Random(0))
    assert short.task == "retrieval" and 2 <= short.meta["n"] <= 16


def test_train_cli_rejects_bad_options_in_one_line(tmp_path):
    import subprocess
    import sys

    for args, msg in (
        (["--curriculum-steps", "-1"], "--curriculum-steps must be >= 0, got -1"),
        (["--mix", "foo=1"], "unknown task 'foo'"),
        (["--lookup-weight", "-1"], "--lookup-weight must be >= 0, got -1.0"),
        (["--steps", "abc"], "Invalid value for '--steps'"),
        (["--preset", "huge"], "--preset must be one of demo, tiny, got 'huge'"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "diffgemma.cli", "train", "--out", str(tmp_path / "o"), *args],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and msg in proc.stderr, proc.stderr  # one line, not a usage block
    assert not (tmp_path / "o").exists()  # nothing was written


def test_non_finite_step_is_skipped():
    """A step whose gradient is NaN leaves the weights and the optimizer state untouched."""
    from diffgemma.train import batches, trainer
    from diffgemma.train import checkpoint as ckpt

    tok = demo_tokenizer(data.tokenizer_corpus(200), vocab_size=512)
    cfg = TrainConfig(out="", preset="tiny", batch=6, vocab_size=512, canvas_length=16)
    model = ckpt.build_model(trainer.model_config(cfg, tok.get_vocab_size()), 0, "cpu")
    opt = torch.optim.AdamW(trainer.param_groups(model, 0.05), lr=1e-3)
    micro = batches.batches_for_step(cfg, tok, 0)
    stats = trainer.step_body(model, opt, micro, False, True, 1.0, cfg, contextlib.nullcontext)
    assert stats[4] == 0 and stats[0] > 0  # a normal step: not skipped, a loss
    with torch.no_grad():
        model.embed[5] = float("nan")  # through the tied head, every logit row and so the loss turn NaN
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = trainer.step_body(model, opt, micro, False, True, 1.0, cfg, contextlib.nullcontext)
    assert stats[4] == 1 and torch.isfinite(stats).all()
    for n, p in model.named_parameters():
        assert torch.allclose(p, before[n], rtol=0, atol=0, equal_nan=True), n
