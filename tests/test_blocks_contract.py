"""Seed Part II §7 and §9 #10/#11: block chaining, stop tokens, re-roll, trim, budget, cancellation, determinism."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import diffgemma
from diffgemma.config import SamplerConfig
from diffgemma.engine.generate import CancelToken, confidence_cut, generate
from tests.fake_model import FakeKV, FakeModel, peaked

V, C = 200, 16
CFG = SamplerConfig(max_denoising_steps=4, stop_token_ids=(1, 106, 50))


def sure(tokens: list[int]) -> torch.Tensor:
    return peaked(tokens, 40.0, V)


def test_stop_token_ends_the_turn_and_is_trimmed():
    model = FakeModel(V, C, lambda i, c: sure([10, 11, 12, 106, 13] + [14] * (C - 5)))
    out = generate(model, [5, 6, 7], FakeKV(), CFG, seed=1, max_new_tokens=64)
    assert out.token_ids == [10, 11, 12]
    assert out.finish_reason == "stop" and out.stop_token == 106 and out.blocks == 1
    assert model.prefilled == [[5, 6, 7]]  # the final block is not prefilled


def test_blocks_commit_prefill_and_start_a_fresh_canvas():
    model = FakeModel(V, C, lambda i, c: sure([20 + (i // 2) % 3] * C))
    kv = FakeKV()
    out = generate(model, [5, 6], kv, CFG, seed=1, max_new_tokens=3 * C)
    assert out.blocks == 3 and len(out.token_ids) == 3 * C
    assert model.prefilled[0] == [5, 6]
    assert model.prefilled[1] == out.token_ids[:C] and model.prefilled[2] == out.token_ids[C : 2 * C]
    assert kv.length == 2 + 2 * C == 2 + out.cached_tokens
    starts = [model.canvases[i] for i in range(0, len(model.canvases), 2)]
    assert starts[0] != starts[1] != starts[2]  # each block draws new noise


def test_only_a_short_prompt_into_an_empty_cache_prefills_in_fp32():
    # seed rule 7: the whole prompt, if short; committed blocks and later turns extend the cache in bf16
    model = FakeModel(V, C, lambda i, c: sure([20] * C), dtype=torch.bfloat16)
    kv = FakeKV()
    generate(model, [5, 6], kv, CFG, seed=1, max_new_tokens=3 * C)
    generate(model, [7, 8], kv, CFG, seed=1, max_new_tokens=C)  # a second turn on the same cache
    assert model.prefill_dtypes == [torch.float32, None, None, None]
    model = FakeModel(V, C, lambda i, c: sure([20] * C), dtype=torch.bfloat16)
    generate(model, list(range(3, 3 + 257)), FakeKV(), CFG, seed=1, max_new_tokens=C)
    assert model.prefill_dtypes == [None]  # longer than prefill_f32_max_tokens (256)


def test_max_new_tokens_truncates_the_last_block():
    model = FakeModel(V, C, lambda i, c: sure([30] * C))
    out = generate(model, [5], FakeKV(), CFG, seed=1, max_new_tokens=C + 5)
    assert len(out.token_ids) == C + 5 and out.finish_reason == "length"


def test_empty_reply_rerolls_with_a_halving_canvas():
    canvas = 256
    model = FakeModel(V, canvas, lambda i, c: sure([1] + [40] * (c.shape[0] - 1)))  # always opens on <eos>
    out = generate(model, [5], FakeKV(), CFG, seed=1, max_new_tokens=512)
    lengths = [len(c) for c in model.canvases[::2]]
    assert lengths == [256, 128, 64, 64]  # three re-rolls, then the empty reply is accepted
    assert out.retries == 3 and out.token_ids == [] and out.finish_reason == "stop"
    model = FakeModel(V, canvas, lambda i, c: sure([1] + [40] * (c.shape[0] - 1)))
    out = generate(model, [5], FakeKV(), CFG.replace(empty_reply_retry=0), seed=1, max_new_tokens=512)
    assert out.retries == 0 and len(model.canvases) == 2


def test_rerolls_are_deterministic_and_draw_new_noise():
    runs = []
    for _ in range(2):
        model = FakeModel(V, 128, lambda i, c: sure([1] + [40] * (c.shape[0] - 1)))
        generate(model, [5], FakeKV(), CFG, seed=9, max_new_tokens=128)
        runs.append(model.canvases)
    assert runs[0] == runs[1]
    assert runs[0][0][:64] != runs[0][2][:64]


def test_confidence_trim_cuts_at_a_low_duplicated_row():
    tokens = [5, 6, 7, 7, 8, 9]
    p = [0.99, 0.99, 0.99, 0.5, 0.99, 0.99]
    assert confidence_cut(tokens, p, 0.9, {1}) == 3
    assert confidence_cut(tokens, [0.99] * 6, 0.9, {1}) == 6  # confident: no cut
    assert confidence_cut([5, 6, 7, 8], [0.99, 0.5, 0.5, 0.99], 0.9, {1}) == 4  # low but unique: no cut
    assert (
        confidence_cut([5, 1, 7, 7], [0.99, 0.99, 0.5, 0.5], 0.9, {1}) == 4
    )  # after the stop token: not answer

    def script(i, c):
        logits = sure([150, 151, 152, 153, 153] + [160 + r for r in range(C - 5)])
        logits[4, 153] = 0.3  # row 4 duplicates row 3 with p_max well below 0.9
        return logits

    model = FakeModel(V, C, script)
    out = generate(model, [5], FakeKV(), CFG, seed=1, max_new_tokens=2 * C)
    assert model.prefilled[1] == [150, 151, 152, 153]  # only the rows before the cut were committed
    off = generate(
        FakeModel(V, C, script),
        [5],
        FakeKV(),
        CFG.replace(commit_conf_trim=0.0),
        seed=1,
        max_new_tokens=2 * C,
    )
    assert off.token_ids[:C] == [150, 151, 152, 153, 153] + [160 + r for r in range(C - 5)]
    assert out.token_ids[:8] == [150, 151, 152, 153, 150, 151, 152, 153]


def test_cancel_between_steps_keeps_committed_blocks_consistent():
    token = CancelToken()

    def on_step(info):
        if info.block == 1 and info.step == 2:
            token.cancel()

    model = FakeModel(V, C, lambda i, c: sure([70 + i % 2] * C))  # never stable: blocks run all steps
    kv = FakeKV()
    out = generate(
        model,
        [5, 6],
        kv,
        CFG.replace(max_denoising_steps=6, plateau_steps=0),
        seed=1,
        max_new_tokens=4 * C,
        on_step=on_step,
        cancel=token,
    )
    assert out.finish_reason == "cancelled"
    assert len(out.token_ids) == C and kv.length == 2 + C == 2 + out.cached_tokens


def test_cancel_on_the_real_model_leaves_the_cache_as_a_clean_prefill(tiny_a):
    eng = diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=3)
    token = CancelToken()
    session = diffgemma.Session(eng, ctx=256)
    kv = session.pipeline.active.kv
    prompt = list(range(3, 30))
    out = session.generate(
        prompt,
        max_new_tokens=4 * eng.config.canvas_length,
        seed=3,
        cancel=token,
        on_step=lambda s: s.block == 2 and token.cancel(),
        stop_token_ids=(),
    )
    assert out.finish_reason == "cancelled" and len(out.token_ids) == 2 * eng.config.canvas_length
    clean = eng.new_cache(256)
    eng.model.prefill(torch.tensor([prompt + out.token_ids]), clean)
    assert kv.length == clean.length
    # Block-wise prefill and one-shot prefill differ only by float reassociation.
    for i in range(eng.config.num_layers):
        for a, b in zip(kv.read(i)[:2], clean.read(i)[:2], strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_same_seed_same_ids_in_process_and_across_processes(tiny_a):
    eng = diffgemma.load(tiny_a, device="cpu", dtype="float32", max_denoising_steps=6)
    prompt = list(range(3, 25))
    a = eng.generate(prompt, max_new_tokens=40, seed=42).token_ids
    b = eng.generate(prompt, max_new_tokens=40, seed=42).token_ids
    c = eng.generate(prompt, max_new_tokens=40, seed=43).token_ids
    assert a == b and len(a) > 0
    assert a != c
    code = (
        "import diffgemma, json, sys;"
        f"e = diffgemma.load({str(tiny_a)!r}, device='cpu', dtype='float32', max_denoising_steps=6);"
        f"print(json.dumps(e.generate({prompt!r}, max_new_tokens=40, seed=42).token_ids))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(res.stdout.strip().splitlines()[-1]) == a


def test_canvas_shrink_option_follows_mlx():
    model = FakeModel(V, 256, lambda i, c: sure([30] * c.shape[0]))
    generate(model, [5], FakeKV(), CFG.replace(canvas_shrink=True), seed=1, max_new_tokens=300)
    assert [len(c) for c in model.canvases[::2]] == [256, 64]  # the last canvas is max(remaining, 64)
    model = FakeModel(V, 256, lambda i, c: sure([30] * c.shape[0]))
    generate(model, [5], FakeKV(), CFG, seed=1, max_new_tokens=300)
    assert [len(c) for c in model.canvases[::2]] == [256, 256]  # the seed's fixed canvas
