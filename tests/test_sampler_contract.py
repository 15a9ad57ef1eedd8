"""Seed Part II §6: one test per rule of the entropy-bound sampler; each fails if its rule is broken."""

from __future__ import annotations

import math

import torch

from diffgemma.config import SamplerConfig
from diffgemma.engine import sampler as S
from diffgemma.engine.generate import denoise_block
from diffgemma.engine.rng import Rng
from tests.fake_model import FakeKV, FakeModel, peaked

V, C = 32, 8


def run(script, cfg, seed=3, on_step=None):
    model = FakeModel(V, C, script)
    res = denoise_block(model, FakeKV(), cfg, seed, C, on_step=on_step)
    return model, res


def test_temperature_schedule_counts_down_from_t_max():
    cfg = SamplerConfig()
    assert S.temperature(cfg, cfg.max_denoising_steps) == cfg.t_max
    assert math.isclose(S.temperature(cfg, 1), cfg.t_min + (cfg.t_max - cfg.t_min) / cfg.max_denoising_steps)
    temps = []
    cfg = SamplerConfig(max_denoising_steps=6).reference()
    run(lambda i, c: torch.zeros(C, V), cfg, on_step=lambda s: temps.append(s.temperature))
    assert temps == [S.temperature(cfg, r) for r in range(6, 0, -1)] and temps[0] == 0.8


def test_entropy_is_in_nats_of_the_tempered_distribution():
    stats = S.row_stats(torch.zeros(2, V), 0.5)
    assert torch.allclose(stats.entropy, torch.full((2,), math.log(V)))
    sharp = S.row_stats(peaked([1, 2], 2.0, V), 0.5)  # logits / T sharpen the distribution
    soft = S.row_stats(peaked([1, 2], 2.0, V), 1.0)
    assert (sharp.entropy < soft.entropy).all()


def test_row_stats_softcaps_logits_it_is_given_raw():
    """Generation hands the row pass the LM head's output before the final softcap (`softcap=`): the stats are
    those of the softcapped logits, which differ from the raw ones' where the cap bends them."""
    from diffgemma.kernels.torch_ref import softcap

    raw = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 40
    got = S.row_stats(raw.to(torch.bfloat16), 0.7, sc_sparse=True, softcap=30.0)
    want = S.row_stats(softcap(raw.to(torch.bfloat16), 30.0), 0.7, sc_sparse=True)
    for name in ("probs", "sc", "entropy", "argmax", "p_max"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert not torch.allclose(S.row_stats(raw, 0.7).entropy, want.entropy)


def test_accept_mask_prefix_rule_and_lowest_always_accepted():
    h = torch.tensor([0.05, 0.5, 0.02, 0.04, 0.3])
    # sorted 0.02, 0.04, 0.05, 0.3, 0.5: sums before each 0, .02, .06, .11 -> the first three
    assert S.accept_mask(h, 0.1).tolist() == [True, False, True, True, False]
    assert S.accept_mask(torch.tensor([5.0, 3.0, 4.0]), 0.1).tolist() == [False, True, False]


def test_accept_is_redecided_every_step_and_renoise_hits_fallen_rows():
    # Step 1 accepts rows 0 (sure) and 1 (the next lowest: the sum before it is ~0); step 2 accepts rows 1
    # and 2, so row 0 falls out. Nothing is frozen.
    def script(i, canvas):
        margins = [30.0, 0.1] + [0.0] * (C - 2) if i == 0 else [0.0, 30.0, 0.1] + [0.0] * (C - 3)
        return peaked([7] * C, margins, V)

    cfg = SamplerConfig(max_denoising_steps=3, entropy_bound=0.01).reference().replace(denoiser_argmax=True)
    model, _ = run(script, cfg, seed=5)
    noise = Rng(5).tokens(4 * C, V).reshape(4, C)
    assert model.canvases[0] == noise[0].tolist()  # the initial canvas is the LCG stream
    assert model.canvases[1][:2] == [7, 7]  # accepted at step 1: the argmax
    assert model.canvases[1][2:] == noise[1][2:].tolist()  # the rest renoised with fresh draws
    assert model.canvases[2][0] == noise[2][0]  # fell out of the accept set: renoised, not frozen
    assert model.canvases[2][1:3] == [7, 7]


def test_committed_token_is_the_argmax_or_a_tempered_draw_in_reference_mode():
    def script(i, canvas):
        logits = torch.zeros(C, V)
        logits[:, 3] = 1.0  # argmax 3, but far from certain
        return logits

    cfg = SamplerConfig(max_denoising_steps=2, entropy_bound=1e9)
    model, _ = run(script, cfg.replace(denoiser_argmax=True))
    assert model.canvases[1] == [3] * C
    model, _ = run(script, cfg.reference(), seed=9)
    assert set(model.canvases[1]) != {3}  # categorical draws from a flat-ish distribution


def test_final_commit_is_the_last_argmax_not_the_accepted_canvas():
    def script(i, canvas):  # only row 0 is ever confident; the argmax moves every step
        return peaked([(i + r) % V for r in range(C)], [30.0] + [0.5] * (C - 1), V)

    cfg = SamplerConfig(max_denoising_steps=4, entropy_bound=0.01)
    model, res = run(script, cfg)
    assert res.steps == 4
    assert res.tokens == [(3 + r) % V for r in range(C)]
    assert res.tokens != model.canvases[-1]


def test_first_step_sc_seed_and_sc_from_previous_step():
    cfg = SamplerConfig(max_denoising_steps=3)
    model, _ = run(lambda i, c: torch.zeros(C, V), cfg)
    assert model.sc == ["seed", "probs", "probs"]
    model, _ = run(lambda i, c: torch.zeros(C, V), cfg.reference())
    assert model.sc == ["none", "probs", "probs"]


def test_sc_input_comes_in_the_model_dtype_without_a_graph_buffer():
    # A graph's SC buffer is in the model's dtype; without one (a step before the first capture) the sampler
    # rounds into the same dtype, so that the values do not depend on whether the graph exists yet.
    cfg = SamplerConfig(max_denoising_steps=3)
    model = FakeModel(V, C, lambda i, c: torch.randn(C, V), dtype=torch.bfloat16)
    denoise_block(model, FakeKV(), cfg, 3, C)
    assert model.sc_dtypes == [torch.bfloat16, torch.bfloat16]


def test_sc_sparse_drops_only_the_far_tail():
    probs = torch.softmax(torch.tensor([[0.0, -5.0, -9.9, -10.1, -30.0]]), -1)
    kept = S.sc_probs(probs, sparse=True)
    assert (kept[0, :3] > 0).all() and (kept[0, 3:] == 0).all()
    assert torch.equal(S.sc_probs(probs, sparse=False), probs)


def test_confident_stop_needs_stable_argmax_and_low_mean_entropy():
    cfg = SamplerConfig(max_denoising_steps=20)
    _, res = run(lambda i, c: peaked([4] * C, 40.0, V), cfg)
    assert res.steps == 2  # step 1 has no history; step 2 repeats it with H ~ 0
    _, res = run(
        lambda i, c: peaked([(i + r) % V for r in range(C)], 40.0, V),
        cfg.replace(entropy_stop=0.0, plateau_steps=0),
    )
    assert res.steps == 20  # confident but never stable


def test_plateau_stop_after_eight_unchanged_accept_masks():
    def script(i, canvas):  # argmax moves every step (never "stable"); mean H between 0.005 and 0.05
        return peaked([(i + r) % V for r in range(C)], 11.0, V)

    cfg = SamplerConfig(max_denoising_steps=30, entropy_bound=1e9, entropy_stop=0.0)
    _, res = run(script, cfg)
    assert res.steps == 9
    _, res = run(script, cfg.replace(plateau_steps=0))
    assert res.steps == 30


def test_entropy_only_stop_waits_for_the_floor():
    def script(
        i, canvas
    ):  # mask changes every step (alternating sure rows), argmax moves: only this rule can fire
        margins = [40.0 if (r + i) % 2 else 20.0 for r in range(C)]
        return peaked([(i + r) % V for r in range(C)], margins, V)

    cfg = SamplerConfig(max_denoising_steps=30, entropy_bound=1e-9, plateau_steps=0)
    _, res = run(script, cfg)
    assert res.steps == cfg.entropy_stop_min_steps
    _, res = run(script, cfg.replace(entropy_stop=0.0))
    assert res.steps == 30


def test_pad_gate_never_stops_on_an_all_pad_canvas():
    cfg = SamplerConfig(max_denoising_steps=15)
    _, res = run(lambda i, c: peaked([0] * C, 40.0, V), cfg)
    assert res.steps == 15
    _, res = run(lambda i, c: peaked([0] * C, 40.0, V), cfg.replace(pad_gate=False))
    assert res.steps == 2


def test_pad_gate_counts_the_filler_sentinel_as_pad():
    # all filler, and pad and filler mixed: never converged; one real token among them: the canvas may stop
    cfg = SamplerConfig(max_denoising_steps=15)
    filler = S.filler_id(V)
    for ids, steps in (
        ([filler] * C, 15),
        ([0, filler] * (C // 2), 15),
        ([0, filler] * (C // 2 - 1) + [0, 5], 2),
    ):
        _, res = run(lambda i, c, ids=ids: peaked(ids, 40.0, V), cfg)
        assert res.steps == steps, ids


def test_invalid_logits_become_the_filler_and_never_converge():
    assert S.FILLER_TOKEN_ID == 262143 and S.filler_id(262144) == 262143 and S.filler_id(V) == V - 1
    logits = peaked([4] * C, 40.0, V)
    logits[[2, 5]] = float("nan")
    stats = S.row_stats(logits, 0.5)
    bad = S.guard_invalid_rows(stats, S.filler_id(V))
    assert bad.tolist() == [r in (2, 5) for r in range(C)]
    assert (stats.argmax[bad] == V - 1).all() and (stats.p_max[bad] == 0).all()
    assert (stats.entropy[bad] == math.log(V)).all() and (stats.argmax[~bad] == 4).all()
    # the worst rows: after every valid one in the accept order, so that at most the first of them is accepted
    assert S.accept_mask(stats.entropy, 0.1)[bad].sum() <= 1
    # a forward that is all NaN: every row the filler, the block runs to its last step and commits filler
    cfg = SamplerConfig(max_denoising_steps=6)
    _, res = run(lambda i, c: torch.full((C, V), float("nan")), cfg)
    assert res.steps == 6 and res.tokens == [V - 1] * C


def test_dense_sc_is_the_exact_path_in_fp32():
    # sc_sparse=False (seed §5's exact path): fp32 probabilities with sc_exact, not the 16-bit graph buffer
    model = FakeModel(V, C, lambda i, c: torch.randn(C, V), dtype=torch.bfloat16)
    denoise_block(model, FakeKV(), SamplerConfig(max_denoising_steps=3, sc_sparse=False), 3, C)
    assert model.sc_dtypes == [torch.float32, torch.float32] and model.sc_exact == [False, True, True]
    model = FakeModel(V, C, lambda i, c: torch.randn(C, V), dtype=torch.bfloat16)
    denoise_block(model, FakeKV(), SamplerConfig(max_denoising_steps=3), 3, C)
    assert model.sc_exact == [False, False, False]


def test_lcg_known_values():
    # state <- state * 6966169279 + 1039523323 (mod 2^64) from seed + 1, a draw the high 32 bits (seed §6)
    rng = Rng(0)
    assert [rng.next_u32() for _ in range(4)] == [1, 99832574, 1806711590, 3679581957]
    assert Rng(42).u32(3).tolist() == [69, 2198511578, 3771479198]
    assert Rng(0).tokens(4, 262144).tolist() == [0, 6093, 110272, 224583]  # floor(u32 * V / 2^32)


def test_max_steps_bounds_an_unsure_canvas():
    _, res = run(lambda i, c: torch.zeros(C, V), SamplerConfig(max_denoising_steps=7))
    assert res.steps == 7
