"""bf16 runs on CPU and tracks fp32; short prompts can prefill with fp32 activations (seed §3 / §9 #7)."""

from __future__ import annotations

import torch

from diffgemma.weights.loader import load_model


@torch.no_grad()
def test_bf16_tracks_fp32_and_f32_prefill_is_closer(tiny_a):
    f32 = load_model(tiny_a, "cpu", torch.float32)
    bf16 = load_model(tiny_a, "cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 1000, (1, 30), generator=g)
    canvas = torch.randint(3, 1000, (1, 16), generator=g)
    kv32, kv16, kv16f = f32.new_cache(64), bf16.new_cache(64), bf16.new_cache(64)
    f32.prefill(prompt, kv32)
    bf16.prefill(prompt, kv16)
    bf16.prefill(prompt, kv16f, compute_dtype=torch.float32)
    assert kv16.dtype == kv16f.dtype == torch.bfloat16

    def kv_err(kv):
        return max(
            (kv.read(i)[0].float() - kv32.read(i)[0]).abs().max().item() for i in range(f32.cfg.num_layers)
        )

    assert kv_err(kv16f) < kv_err(kv16)
    a = f32.denoise(canvas, kv32)
    b = bf16.denoise(canvas, kv16f)
    assert b.dtype == torch.float32
    assert (
        torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.95
    )  # random routers flip experts under bf16 noise


def test_route_ties_go_to_the_lower_expert_index():
    # bf16 router logits tie often; the rule (and the Triton kernel) keeps the lower indices, torch.topk need not
    from diffgemma.kernels.torch_ref import route_weights

    logits = torch.full((3, 8), -4.0, dtype=torch.bfloat16)
    logits[0, [1, 2, 6, 7]] = 1.0  # four tied at the top: 1 and 2 win
    logits[1, [7, 3]] = torch.tensor([2.0, 1.0], dtype=torch.bfloat16)  # no tie: by probability
    logits[1, [0, 5]] = 1.0  # (and a tie below the top-2)
    weights, ids = route_weights(logits, torch.ones(8), 2)
    assert ids[0].tolist() == [1, 2] and ids[1].tolist() == [7, 0] and ids[2].tolist() == [0, 1]
    assert torch.allclose(weights[0], torch.tensor([0.5, 0.5]))


@torch.no_grad()
def test_exact_soft_embedding_accumulates_fp32_probabilities(tiny_a, monkeypatch):
    """sc_exact (sc_sparse=False, seed §5): fp32 probabilities on the bf16 embedding in vocabulary chunks, within
    one rounding of the fp64 product; the default casts the probabilities to bf16 first and is further off."""
    from diffgemma.model import model as model_module

    monkeypatch.setattr(model_module, "SC_VOCAB_CHUNK", 100)  # several chunks and a partial last one
    bf16 = load_model(tiny_a, "cpu", torch.bfloat16)
    probs = torch.softmax(
        torch.randn(16, bf16.cfg.vocab_size, generator=torch.Generator().manual_seed(0)) * 3, -1
    )
    want = probs.double() @ bf16.embed.double()
    exact = bf16.soft_embedding(probs, exact=True)
    cast = bf16.soft_embedding(probs)
    assert exact.dtype == cast.dtype == torch.bfloat16
    rounded = want.to(torch.bfloat16)  # the correctly rounded product
    ulp = want.abs().clamp_min(1e-30) * 2.0**-8  # a bf16 ulp at most
    assert ((exact.double() - want).abs() <= ulp).all()
    exact_share = (exact == rounded).double().mean()
    cast_share = (cast == rounded).double().mean()
    assert exact_share > 0.99 and cast_share < exact_share - 0.05
    # the model takes that path when asked: denoise with sc_exact uses it, and the default does not
    kv = bf16.new_cache(64)
    bf16.prefill(torch.arange(3, 20)[None], kv)
    canvas = torch.arange(5, 5 + bf16.cfg.canvas_length)[None]
    a = bf16.denoise(canvas, kv, sc_probs=probs, sc_exact=True)
    b = bf16.denoise(canvas, kv, sc_probs=probs)
    assert not torch.equal(a, b)


@torch.no_grad()
def test_one_prefill_rule_whole_short_prompts_in_fp32_everything_else_fast(tiny_a, monkeypatch):
    """Seed rule 7, in `engine.generate.prefill` alone: on a bf16 runner, a whole prompt of at most
    prefill_f32_max_tokens into an empty cache prefills in fp32; a long prompt, a cross-turn delta, a committed
    block and a Finalize extension take the model-dtype path (compute_dtype None), whichever op asks."""
    import diffgemma
    from diffgemma.session import ops as O

    eng = diffgemma.load(
        tiny_a, device="cpu", dtype="bfloat16", max_denoising_steps=2, prefill_f32_max_tokens=40
    )
    calls: list[tuple[int, int, torch.dtype | None]] = []  # (cached before, new tokens, compute_dtype)
    real = eng.runner.prefill

    def spy(ids, kv, compute_dtype=None):
        calls.append((kv.length, len(torch.as_tensor(ids).reshape(-1)), compute_dtype))
        return real(ids, kv, compute_dtype=compute_dtype)

    monkeypatch.setattr(eng.runner, "prefill", spy)
    s = diffgemma.Session(eng, ctx=512)
    short = list(range(3, 33))  # 30 tokens: within the rule
    out = s.generate(short, max_new_tokens=2 * eng.config.canvas_length, seed=1, stop_token_ids=())
    assert out.blocks == 2
    assert calls == [
        (0, 30, torch.float32),
        (30, eng.config.canvas_length, None),
    ]  # the prompt, block 0's commit

    calls.clear()  # a cross-turn delta of 5 tokens (short, but it extends a cache)
    s.generate(s.log + [7, 8, 9, 10, 11], max_new_tokens=4, seed=2)
    assert calls == [(30 + eng.config.canvas_length, 5, None)]

    calls.clear()  # Finalize: a short extension after the cached log, then a whole short log into an empty cache
    log = s.log
    s._call(O.Finalize(log + [12, 13, 14]))
    s.reset()
    s._call(O.Finalize(short))
    assert calls == [(len(log), 3, None), (0, 30, torch.float32)]

    calls.clear()  # a whole prompt past the rule's length
    s.reset()
    s.generate(list(range(3, 44)), max_new_tokens=4, seed=3)
    assert calls == [(0, 41, None)]
