"""A tiny training run lowers the loss, writes a checkpoint `diffgemma.load` reads, and resumes."""

from __future__ import annotations

import json

import torch

import diffgemma
from diffgemma.train import data
from diffgemma.train.tokenizer import demo_tokenizer
from diffgemma.train.trainer import TrainConfig, train


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
