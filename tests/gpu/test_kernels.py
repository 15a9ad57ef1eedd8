"""Each fast CUDA op pinned to its torch reference on the device (skipped without CUDA).

Longer than 600 lines on purpose: one test per fast op and per graphed route, the suite a GPU call runs at once."""

from __future__ import annotations

import pytest
import torch

from diffgemma.config import RuntimeConfig
from diffgemma.kernels import dispatch, regions
from diffgemma.kernels import library as fast
from diffgemma.kernels import torch_ref as ref
from diffgemma.runner.runner import ModelRunner
from tests.conftest import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEV = "cuda"


@pytest.mark.parametrize("n", [256, 4096])
def test_moe_grouped_matches_reference(n):
    torch.manual_seed(n)
    e, h, i, k = 128, 2816, 704, 8
    x = torch.randn(n, h, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(e, 2 * i, h, device=DEV, dtype=torch.bfloat16) * h**-0.5
    dn = torch.randn(e, h, i, device=DEV, dtype=torch.bfloat16) * i**-0.5
    w, ids = ref.route(
        x,
        torch.randn(e, h, device=DEV, dtype=torch.bfloat16) * 0.1,
        torch.ones(h, device=DEV, dtype=torch.bfloat16),
        torch.rand(e, device=DEV) + 0.5,
        k,
        1e-6,
    )
    want = ref.moe_experts(x.double(), w.double(), ids, gu.double(), dn.double())
    got = fast.moe_experts(x, w, ids, gu, dn)
    assert rel(got, want) < 1e-2
    assert rel(ref.moe_experts(x, w, ids, gu, dn), want) < 1e-2


@pytest.mark.parametrize(
    "hd,hkv,s,n_valid", [(256, 8, 1279, None), (512, 2, 33024, None), (512, 2, 33792, 33024)]
)
def test_attention_nomask_matches_reference(hd, hkv, s, n_valid):
    q = torch.randn(1, 16, 256, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    k = torch.randn(1, hkv, s, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    v = torch.randn(1, hkv, s, hd, device=DEV, dtype=torch.bfloat16)
    valid = None if n_valid is None else torch.tensor([n_valid], device=DEV, dtype=torch.int32)
    n = n_valid or s
    want = ref.attention(q.float(), k[:, :, :n].float(), v[:, :, :n].float(), None)
    assert rel(fast.attention_nomask(q, k, v, valid=valid), want) < 1e-2
    assert "triton_attn" not in dispatch.failed  # d=256 ran the split-KV kernel, not SDPA
    assert "triton_softmax" not in dispatch.failed  # d=512: its Triton passes, not torch's


def test_exp_to_and_divide_rows_give_the_softmax():
    """p / sums = softmax to within p's bf16 rounding; a row whose max lies far past the first block (written
    again from its max) and a device-side count of valid columns."""
    scores = torch.randn(2, 2048, 33024, device=DEV) * 6  # the shape of a full layer's scores at 32k
    scores[0, 5, 30000] = 300.0  # 250+ above the first block's max: exp(s - c) would overflow
    for n_valid in (None, 20000):
        valid = None if n_valid is None else torch.tensor([n_valid], device=DEV, dtype=torch.int32)
        keep = torch.arange(scores.shape[-1], device=DEV) < (n_valid or scores.shape[-1])
        want = torch.softmax(scores.double().masked_fill(~keep, float("-inf")), dim=-1)
        p, sums = fast.exp_to(scores, torch.bfloat16, valid=valid)
        assert "triton_softmax" not in dispatch.failed
        assert (
            p.dtype == torch.bfloat16 and bool(torch.isfinite(p).all()) and bool((p[..., ~keep] == 0).all())
        )
        got = p.double() / sums.double()[..., None]
        assert bool(((got - want).abs() <= want * (2**-8 + 1e-5) + 1e-30).all())  # half a bf16 ulp
        v = torch.randn(2, 33024, 512, device=DEV, dtype=torch.bfloat16)
        rows = torch.empty(256, 2, 8, 512, device=DEV, dtype=torch.bfloat16)  # [T, Hkv, G, d], T * G = 2048
        out = fast.divide_rows(torch.bmm(p, v, out_dtype=torch.float32), sums, rows.permute(1, 2, 0, 3))
        want_rows = (want @ v.double()).view(2, 8, 256, 512).permute(2, 0, 1, 3)
        assert rel(rows, want_rows) < 1e-2 and out.data_ptr() == rows.data_ptr()


@pytest.mark.parametrize("start", [0, 700, 20000])
def test_attention_window_and_causal_past_match_reference(start):
    # the real shapes; a chunk of 4000 (not a multiple of the window's query block); the window sees 0, 700
    # (masked slots in the first blocks) or window - 1 past positions (one shared mask)
    t, w = 4000, 1024
    for hd, hkv, sliding in [(256, 8, True), (512, 2, False)]:
        p = min(start, w - 1) if sliding else start
        q = torch.randn(1, 16, t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
        k = torch.randn(1, hkv, p + t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
        v = torch.randn(1, hkv, p + t, hd, device=DEV, dtype=torch.bfloat16)
        qpos = torch.arange(start, start + t, device=DEV)
        kpos = torch.arange(start - p, start + t, device=DEV)
        mask = kpos[None] <= qpos[:, None]
        if sliding:
            mask &= kpos[None] > qpos[:, None] - w
            kv = torch.cat([k, v])
            bias = fast.window_bias(p, t, w, 16 // hkv, q.dtype, DEV)
            got = fast.attention_window(q, kv[:, :, :p], kv[:, :, p:], bias)
        else:
            got = fast.attention_causal_past(q, k, v)
        want = ref.rows(ref.attention(q.float(), k.float(), v.float(), mask))
        assert rel(got, want) < 1e-2, (hd, sliding)
    assert "triton_softmax" not in dispatch.failed


def _tiny_bf16_model_with_prompt(tmp_path, **runtime):
    """A tiny bf16 model on the GPU with a runner (`runtime`: RuntimeConfig's fields), a 40-token prompt
    prefilled into a fresh cache, and a canvas."""
    from diffgemma.testing import write_tiny_checkpoint
    from diffgemma.weights.loader import load_model

    m = load_model(write_tiny_checkpoint(tmp_path / "c", seed=3), DEV, torch.bfloat16)
    run = ModelRunner(m, RuntimeConfig(**runtime))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, m.cfg.vocab_size, (1, 40), generator=g)
    canvas = torch.randint(0, m.cfg.vocab_size, (1, m.cfg.canvas_length), generator=g)
    kv = m.new_cache(128)
    run.prefill(prompt, kv)
    return run, canvas, kv


def test_graphed_denoise_matches_eager(tmp_path):
    """The captured and replayed denoise step on the fast kernels against the same step run eagerly: the same
    kernels, so equal up to rounding noise. Across kernel sets the fast ones are pinned to the reference in fp32
    on CPU (tests/test_fast_kernels.py, exact); in bf16 this tiny checkpoint's top-k routing flips dominate any
    comparison across them (fast vs reference: rel 0.185 on this seed, on CPU and on the H200 alike)."""
    eager, canvas, kv = _tiny_bf16_model_with_prompt(tmp_path, graphs=False)
    want = eager.denoise(canvas, kv)
    sc = torch.softmax(want[0] / 0.7, -1)
    want_sc = eager.denoise(canvas, kv, sc_probs=sc)
    graphed = ModelRunner(eager.model, RuntimeConfig())
    for _ in range(2):  # capture, then replay
        assert rel(graphed.denoise(canvas, kv), want) < 1e-3
        assert rel(graphed.denoise(canvas, kv, sc_probs=sc), want_sc) < 1e-3
    assert len(graphed.graphs) == 2 and not any(r.failed for r in graphed.model.steps.regions.values())


def test_graphed_denoise_with_eager_regions_matches_eager(tmp_path):
    """compile=False (a one-shot `ask`): the regions run as plain torch ops inside the captured graph, which
    matches the same step run without graphs, and nothing is compiled."""
    eager, canvas, kv = _tiny_bf16_model_with_prompt(tmp_path, compile=False, graphs=False)
    want = eager.denoise(canvas, kv)
    graphed = ModelRunner(eager.model, RuntimeConfig(compile=False))
    for _ in range(2):  # the capture's replay, then a replay
        assert rel(graphed.denoise(canvas, kv), want) < 1e-3
    kernels = graphed.model.steps
    assert len(graphed.graphs) and not any(
        r._seen for r in [*kernels.regions.values(), *kernels.prefill_regions.values()]
    )


def test_denoise_graphs_of_recent_key_buckets_are_kept(tmp_path, monkeypatch, graph_captures):
    """The engine's cache emptied for a request shorter than the last one: with FULL_KEY_BUCKET at 32 the two
    lengths below fall in different key buckets (64 and 96), and the shorter one's graph, kept, replays instead
    of being captured again; with GRAPH_BUCKETS at 1 only the last bucket's graph is kept, and the next capture
    needs a new memory pool. Every replay matches the step run eagerly. Each replay's output (raw=True: the one
    logits buffer every graph writes) stays referenced past its graph's eviction, as a caller's may."""
    from diffgemma.runner import graphs

    monkeypatch.setattr(graphs, "FULL_KEY_BUCKET", 32)
    eager, canvas, kv = _tiny_bf16_model_with_prompt(tmp_path, graphs=False)
    graphed = ModelRunner(eager.model, RuntimeConfig())
    g = torch.Generator().manual_seed(1)
    short = torch.randint(0, eager.cfg.vocab_size, (1, 40), generator=g)
    long = torch.randint(0, eager.cfg.vocab_size, (1, 60), generator=g)

    held = []

    def captures_at(prompt: torch.Tensor) -> int:
        kv.reset()
        eager.prefill(prompt, kv)
        want = eager.denoise(canvas, kv)
        before = len(graph_captures)
        for _ in range(2):
            assert rel(graphed.denoise(canvas, kv), want) < 1e-3, kv.length
        held.append(graphed.denoise(canvas, kv, raw=True))
        return len(graph_captures) - before

    assert [captures_at(short), captures_at(long)] == [1, 1]
    assert [captures_at(short), captures_at(long)] == [0, 0]
    monkeypatch.setattr(graphs, "GRAPH_BUCKETS", 1)  # the last one used (long's) stays
    assert [captures_at(long), captures_at(short), captures_at(long)] == [0, 1, 1]


def test_denoise_graphs_are_kept_per_cache(tmp_path, monkeypatch, graph_captures):
    """Two caches (a server's two conversations) denoised in turn: each captures its graph once and then
    replays it, every replay equal to the step run eagerly on that cache, and all of them write one logits
    buffer. A kept graph does not keep its cache alive; a cache whose graphs' key another cache takes (a freed
    cache's id and memory reused) captures its own instead of replaying the other's."""
    import gc

    from diffgemma.runner.graphs import DenoiseGraphs

    eager, canvas, kv = _tiny_bf16_model_with_prompt(tmp_path, graphs=False)
    m = eager.model
    kv2 = m.new_cache(128)
    eager.prefill(
        torch.randint(0, m.cfg.vocab_size, (1, 25), generator=torch.Generator().manual_seed(2)), kv2
    )
    want = [eager.denoise(canvas, kv), eager.denoise(canvas, kv2)]
    assert rel(want[0], want[1]) > 1e-2  # the two caches give different steps
    graphed = ModelRunner(m, RuntimeConfig())
    outs = set()
    for _ in range(3):
        for cache, expected in zip((kv, kv2), want, strict=True):
            got = graphed.denoise(canvas, cache, raw=True)
            assert (
                got.dtype == torch.bfloat16
                and rel(ref.softcap(got, m.cfg.final_logit_softcapping), expected) < 1e-3
            )
            outs.add(got.data_ptr())
    assert len(graph_captures) == 2 and len(outs) == 1
    # a kept graph does not keep its cache alive
    nbytes = sum(t.numel() * t.element_size() for t in kv2.kv)
    before = torch.cuda.memory_allocated()
    del cache, kv2  # the loop's variable held the last one
    gc.collect()
    assert torch.cuda.memory_allocated() <= before - nbytes
    kv2 = m.new_cache(128)
    eager.prefill(
        torch.randint(0, m.cfg.vocab_size, (1, 25), generator=torch.Generator().manual_seed(2)), kv2
    )
    monkeypatch.setattr(DenoiseGraphs, "_key", staticmethod(lambda cache, c: "one key"))
    for cache, expected in zip((kv, kv2, kv), want + want[:1], strict=True):
        assert rel(graphed.denoise(canvas, cache), expected) < 1e-3
    assert len(graph_captures) == 5


def test_generate_writes_sc_into_the_graph_buffer(tmp_path, monkeypatch):
    """The sampler writes the next SC input straight into the captured graph's input buffer and reads the
    graph's logits (before the softcap, which the row pass applies) without a copy: the same ids as a path that
    copies them and has no SC buffer, over two blocks (one graph serves both)."""
    from diffgemma.bench import fixed_steps_sampler
    from diffgemma.engine.generate import generate

    run, _, _ = _tiny_bf16_model_with_prompt(tmp_path)
    prompt = list(range(3, 43))
    cfg = fixed_steps_sampler(6)
    used = []
    real = run.sc_input_buffer
    c = run.cfg.canvas_length

    def buffer(kv, canvas_len):
        out = real(kv, canvas_len)
        used.append(out is not None)
        return out

    monkeypatch.setattr(run, "sc_input_buffer", buffer)
    ids = generate(run, prompt, run.new_cache(256), cfg, max_new_tokens=2 * c).token_ids
    assert sum(used) >= 8, used  # steps 2-6 of each block
    monkeypatch.setattr(run, "sc_input_buffer", lambda kv, canvas_len: None)
    real_denoise = run.denoise
    monkeypatch.setattr(run, "denoise", lambda *a, raw=False, **k: real_denoise(*a, raw=True, **k).clone())
    assert generate(run, prompt, run.new_cache(256), cfg, max_new_tokens=2 * c).token_ids == ids


# -- the torch.compile'd regions of the denoise layer, each pinned to its eager self; the FFN half's steps -----


def _real_layer_params(seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h, i, e, mi = 2816, 2112, 128, 704

    def rn(*s, std):
        return torch.randn(*s, generator=g, device=DEV, dtype=torch.bfloat16) * std

    p = {
        n: (1 + rn(h, std=0.3))
        for n in (
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "post_feedforward_layernorm",
            "router_scale",
        )
    }
    p.update(
        mlp_gate=rn(i, h, std=h**-0.5),
        mlp_up=rn(i, h, std=h**-0.5),
        mlp_down=rn(h, i, std=i**-0.5),
        router_proj=rn(e, h, std=h**-0.5),
        per_expert_scale=torch.rand(e, generator=g, device=DEV) + 0.5,
        experts_gate_up=rn(e, 2 * mi, h, std=h**-0.5),
        experts_down=rn(e, h, mi, std=mi**-0.5),
        layer_scalar=torch.tensor([0.8], device=DEV, dtype=torch.bfloat16),
    )
    return p


class _Layer:
    """A real-shape layer's FFN weights, as the FFN steps read them from a `Layer`."""

    def __init__(self, p: dict) -> None:
        self.__dict__.update(p)

    def gate_up_weight(self, dtype):
        return torch.cat([self.mlp_gate, self.mlp_up]).to(dtype)


def _ffn_half(kernels, layer: _Layer, h, attn, p):
    """The FFN half of `DiffusionGemma.layer_forward`, step by step through a layer's steps (`model.steps`)."""
    h1, x_dense, x_moe, r = kernels.pre_ffn(h, attn, layer, 1e-6, p)
    routing = kernels.route(r, layer, 8, p)
    dense = kernels.dense_mlp(x_dense, layer, 1e-6, p)
    y = kernels.experts(x_moe, routing, layer, p)
    return kernels.post_ffn(h1, dense, y, routing, layer, layer.layer_scalar, None, 1e-6, p)[0]


def test_fused_regions_match_eager():
    from diffgemma.model.passes import DENOISE, Pass
    from diffgemma.model.steps import FastSteps, Steps

    torch.manual_seed(0)
    eager = regions.make_regions(enabled=False)
    comp = regions.make_regions(enabled=True)
    c = 256
    # qkv_post, both layer kinds
    for hd, nkv, has_v, rc in [
        (256, 8, True, (10000.0, "default", 1.0)),
        (512, 2, False, (1e6, "proportional", 0.25)),
    ]:
        q = torch.randn(c, 16, hd, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(c, nkv, hd, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(c, nkv, hd, device=DEV, dtype=torch.bfloat16) if has_v else None
        qn, kn = (
            1 + 0.3 * torch.randn(hd, device=DEV, dtype=torch.bfloat16),
            1 + 0.3 * torch.randn(hd, device=DEV, dtype=torch.bfloat16),
        )
        inv = ref.rope_inv_freq(hd, rc[0], rc[1], rc[2]).to(DEV)
        pos = torch.arange(30000, 30000 + c, device=DEV)
        want = eager["qkv_post"](q, k, v, qn, kn, inv, pos, 1e-6)
        got = comp["qkv_post"](q, k, v, qn, kn, inv, pos, 1e-6)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and rel(a, b) < 1e-2, hd
    x = torch.randn(c, 2816, device=DEV, dtype=torch.bfloat16) * 5
    w = 1 + 0.3 * torch.randn(2816, device=DEV, dtype=torch.bfloat16)
    assert rel(comp["norm"](x, w, 1e-6), eager["norm"](x, w, 1e-6)) < 1e-2
    logits = torch.randn(c, 262144, device=DEV, dtype=torch.bfloat16) * 40
    got, want = comp["softcap"](logits, 30.0), eager["softcap"](logits, 30.0)
    assert (got - want).abs().max().item() < 1e-4 and (got.argmax(-1) == want.argmax(-1)).all()
    # the whole FFN half (pre_ffn, the Triton routing and expert kernels, the dense MLP on its stream, the
    # combine) on the fast kernels and the reference ones, against the plain formula
    layer = _Layer(_real_layer_params())
    h = torch.randn(c, 2816, device=DEV, dtype=torch.bfloat16) * 3
    attn = torch.randn(c, 2816, device=DEV, dtype=torch.bfloat16)
    p = Pass(DENOISE, [], c, torch.arange(c, device=DEV), [0])
    fast_k = FastSteps()
    got = _ffn_half(fast_k, layer, h, attn, p)
    want_eager = _ffn_half(Steps(), layer, h, attn, p)
    h1 = h + ref.rms_norm(attn, layer.post_attention_layernorm, 1e-6)
    x1 = ref.rms_norm(h1, layer.pre_feedforward_layernorm, 1e-6)
    dense = ref.rms_norm(
        torch.nn.functional.linear(
            ref.gelu_tanh(x1 @ layer.mlp_gate.T) * (x1 @ layer.mlp_up.T), layer.mlp_down
        ),
        layer.post_feedforward_layernorm_1,
        1e-6,
    )
    wts, ids = ref.route(h1, layer.router_proj, layer.router_scale, layer.per_expert_scale, 8, 1e-6)
    x2 = ref.rms_norm(h1, layer.pre_feedforward_layernorm_2, 1e-6)
    moe = ref.rms_norm(
        fast.moe_experts(x2, wts, ids, layer.experts_gate_up, layer.experts_down),
        layer.post_feedforward_layernorm_2,
        1e-6,
    )
    want = (h1 + ref.rms_norm(dense + moe, layer.post_feedforward_layernorm, 1e-6)) * layer.layer_scalar
    assert rel(want_eager, want) < 1e-2
    assert rel(got, want) < 1e-2
    assert not any(r.failed for r in fast_k.regions.values()), regions.regions_report(fast_k.regions)
    # the Triton kernels ran (where triton exists), no silent fallback
    assert not {"triton_moe", "triton_route", "triton_combine"} & dispatch.failed


# -- prefill: the full layers' materialized attention, the fast prefill routes ------------------------------


@pytest.mark.parametrize("past", [0, 3000])
def test_attention_causal_scores_matches_reference(past, monkeypatch):
    t, hd, hkv = 1000, 512, 2
    q = torch.randn(1, 16, t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    k = torch.randn(1, hkv, past + t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    v = torch.randn(1, hkv, past + t, hd, device=DEV, dtype=torch.bfloat16)
    qpos, kpos = torch.arange(past, past + t, device=DEV), torch.arange(past + t, device=DEV)
    want = ref.rows(ref.attention(q.float(), k.float(), v.float(), kpos[None] <= qpos[:, None]))
    assert rel(fast.attention_causal_past(q, k, v), want) < 1e-2  # one block
    assert rel(fast.attention_causal_scores(q, k, v, block=96), want) < 1e-2  # 11 blocks, the last ragged
    # the block size from the score budget: room for ~300 query rows -> blocks of 256 (3 full, 1 ragged)
    monkeypatch.setattr(fast, "SCORE_BYTES", 4 * 16 * (past + t) * 300)
    assert rel(fast.attention_causal_past(q, k, v), want) < 1e-2
    assert "triton_softmax" not in dispatch.failed


def test_fast_prefill_matches_reference(tmp_path):
    from diffgemma.testing import write_tiny_checkpoint
    from diffgemma.weights.loader import load_model

    # full layers at the real head_dim 512, so that the fast kernels run attention_causal_scores too
    ckpt = write_tiny_checkpoint(tmp_path / "c", seed=3, global_head_dim=512)
    plain = ModelRunner(load_model(ckpt, DEV, torch.bfloat16), RuntimeConfig(kernels="reference"))
    fast_run = ModelRunner(load_model(ckpt, DEV, torch.bfloat16), RuntimeConfig(graphs=False))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, plain.cfg.vocab_size, (1, 540), generator=g)
    canvas = torch.randint(0, plain.cfg.vocab_size, (1, plain.cfg.canvas_length), generator=g)
    kv_plain, kv_fast = plain.new_cache(1024), fast_run.new_cache(1024)
    # 200 tokens into the empty cache (padded), then chunks: 100 and 150 tokens take the grouped expert GEMMs (2
    # pairs a token > 32 per expert of 8), 90 the Triton kernels: each `post_ffn` variant compiles once, the
    # second length of each must not.
    bounds = [0, 200, 300, 450, 540]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        plain.prefill(prompt[:, a:b], kv_plain)
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):
            fast_run.prefill(prompt[:, a:b], kv_fast)
    prefill_regions = fast_run.model.steps.prefill_regions
    assert not any(r.failed for r in prefill_regions.values()), {
        n: r.failed for n, r in prefill_regions.items()
    }
    assert kv_fast.length == kv_plain.length == 540
    # Layer 0's K/V come before any routing: bf16 rounding alone (merged vs separate GEMMs, compiled vs eager
    # norms and RoPE), across all four chunks' positions. Deeper layers inherit top-k flips of the tiny
    # checkpoint (rel up to 0.055 measured on the H200), so there only an O(1) error (a wrong norm, scalar or
    # position) is caught here; the two kernel sets are pinned exactly in fp32 on CPU (tests/test_fast_kernels.py).
    for i in range(plain.cfg.num_layers):
        for got, want in zip(kv_fast.read(i)[:2], kv_plain.read(i)[:2], strict=True):
            assert rel(got, want) < (1e-2 if i == 0 else 0.25), i
    # the denoise that follows on the same (reference) kernels for both: only the caches differ
    assert rel(plain.denoise(canvas, kv_fast), plain.denoise(canvas, kv_plain)) < 0.25


def test_padded_prefill_graph_matches_eager(tmp_path):
    """A prompt into an empty cache prefills padded to its bucket of 256: eagerly the first time, captured the
    second, replayed after that, also for another length of the same bucket. The same kernels each time, so
    the same cache bit for bit as the eager padded prefill; against the unpadded chunks, rounding only."""
    from diffgemma.runner.graphs import GraphStep
    from diffgemma.testing import write_tiny_checkpoint
    from diffgemma.weights.loader import load_model

    ckpt = write_tiny_checkpoint(tmp_path / "c", seed=3, global_head_dim=512)
    m = ModelRunner(load_model(ckpt, DEV, torch.bfloat16), RuntimeConfig())
    eager = ModelRunner(load_model(ckpt, DEV, torch.bfloat16), RuntimeConfig(graphs=False))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, m.cfg.vocab_size, (1, t), generator=g) for t in (300, 300, 300, 270)]
    for p in prompts:
        kv, want = m.new_cache(1024), eager.new_cache(1024)
        m.prefill(p, kv)
        eager.prefill(p, want)
        assert kv.length == want.length == p.shape[1]
        for i in range(m.cfg.num_layers):
            for got, exp in zip(kv.read(i)[:2], want.read(i)[:2], strict=True):
                assert torch.equal(got, exp), i
    assert isinstance(m._prefill_graphs[512], GraphStep) and eager._prefill_graphs == {512: None}
    chunked = eager.new_cache(1024)
    eager.config = eager.config.replace(prefill_chunk=200)  # longer than a chunk: unpadded, in two passes
    eager.prefill(prompts[-1], chunked)
    # routing flips in deeper layers, as in test_fast_prefill_matches_reference
    for i in range(m.cfg.num_layers):
        for got, exp in zip(kv.read(i)[:2], chunked.read(i)[:2], strict=True):
            assert rel(got, exp) < (1e-2 if i == 0 else 0.25), i


@pytest.mark.parametrize("hd,hkv", [(256, 8), (512, 2)])
def test_attention_commit_matches_reference(hd, hkv):
    """attention_commit at the real shapes: a sliding layer's span (1,023 window keys and the 256 canvas keys,
    from a ring slot past the start of the buffer) with the window, a full layer's keys 0 .. 3,000 + 256 of a
    4,096-key bucket with the causal tail; against fp32 attention with the masks built from positions."""
    t, start = 256, 3000
    q = torch.randn(1, 16, t, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
    if hd == 256:
        w = 1024
        first, n_max = 700, w - 1 + t  # the span's first slot and its key count with the canvas
        k = torch.randn(1, hkv, 2400, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
        v = torch.randn(1, hkv, 2400, hd, device=DEV, dtype=torch.bfloat16)
        span = (torch.tensor([first, n_max], device=DEV, dtype=torch.int32), n_max)
        got = fast.attention_commit(q, k, v, span=span, window=w)
        keys, vals = k[:, :, first : first + n_max], v[:, :, first : first + n_max]
        kpos = torch.arange(start - (w - 1), start + t, device=DEV)
    else:
        w = None
        k = torch.randn(1, hkv, 4096, hd, device=DEV, dtype=torch.bfloat16) * hd**-0.25
        v = torch.randn(1, hkv, 4096, hd, device=DEV, dtype=torch.bfloat16)
        valid = torch.tensor([start + t], device=DEV, dtype=torch.int32)
        got = fast.attention_commit(q, k, v, valid=valid)
        keys, vals = k[:, :, : start + t], v[:, :, : start + t]
        kpos = torch.arange(start + t, device=DEV)
    qpos = torch.arange(start, start + t, device=DEV)
    mask = kpos[None] <= qpos[:, None]
    if w is not None:
        mask &= kpos[None] > qpos[:, None] - w
    want = ref.attention(q.float(), keys.float(), vals.float(), mask)
    assert rel(got, want) < 1e-2


def test_commit_graph_matches_eager_commit_and_reference(tmp_path):
    """A block's commit after a prompt (`ModelRunner._commit`: the fast kernels on the canvas slots, causal,
    padded to the canvas): captured on the first commit of a key bucket, replayed after, the same cache bit for
    bit as the same route run eagerly; against the reference kernels' prefill, rounding only in layer 0 and the
    tiny checkpoint's routing flips deeper, as in test_fast_prefill_matches_reference. Full layers at the real
    head_dim 512: the materialized scores with the causal tail in `exp_rows`."""
    from diffgemma.testing import write_tiny_checkpoint
    from diffgemma.weights.loader import load_model

    ckpt = write_tiny_checkpoint(tmp_path / "c", seed=3, global_head_dim=512)
    runs = [
        ModelRunner(load_model(ckpt, DEV, torch.bfloat16), RuntimeConfig(**kw))
        for kw in ({}, {"graphs": False}, {"kernels": "reference"})
    ]
    graphed = runs[0]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, graphed.cfg.vocab_size, (1, 300), generator=g)
    caches = [run.new_cache(1024) for run in runs]
    for run, kv in zip(runs, caches, strict=True):
        run.prefill(prompt, kv)
    c = graphed.cfg.canvas_length
    for t in (c, 5, c, c - 1):
        ids = torch.randint(0, graphed.cfg.vocab_size, (1, t), generator=g)
        for run, kv in zip(runs, caches, strict=True):
            run.prefill(ids, kv)
        kv_g, kv_e, kv_p = caches
        assert kv_g.length == kv_e.length == kv_p.length
        for i in range(graphed.cfg.num_layers):
            for got, exp, plain in zip(kv_g.read(i)[:2], kv_e.read(i)[:2], kv_p.read(i)[:2], strict=True):
                assert torch.equal(got, exp), i
                assert rel(got, plain) < (1e-2 if i == 0 else 0.25), i
    assert any(("commit", c) in graphs for _, graphs in graphed.graphs._graphs.values())
    assert not any(r.failed for r in graphed.model.steps.regions.values())
    assert "triton_softmax" not in dispatch.failed


# -- the router's top-k and sort, the Q/K/V norms and RoPE: one Triton kernel each -----------------------------


@pytest.mark.parametrize("n", [256, 4096])
def test_route_sort_matches_torch(n):
    from tests.test_triton_interpret import check_route_sort

    g = torch.Generator(device=DEV).manual_seed(n)
    logits = (torch.randn(n, 128, generator=g, device=DEV) * 2).bfloat16()  # bf16 logits: ties are common
    pes = torch.rand(128, generator=g, device=DEV) + 0.5
    check_route_sort(logits, pes, 8)
    # the same experts as torch.topk on CUDA, ties included
    from diffgemma.kernels import triton_route as tr

    ids = tr.route_sort(logits, pes, 8)[1].long()
    want = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), 8, dim=-1).indices
    assert bool((ids.sort(1).values == want.sort(1).values).all())


@pytest.mark.parametrize("n", [256, 4096])
def test_route_sort_from_matches_torch(n):
    """The router's GEMM as split partial products summed by the top-k pass, at the real shape: the sum within
    fp32 rounding of x @ proj.T (the tensor cores' accumulation), the routing route_sort's on it, and its bf16
    logits within about two bf16 roundings of cuBLAS's F.linear."""
    from diffgemma.kernels import triton_route as tr
    from tests.test_triton_interpret import check_route_sort_from

    g = torch.Generator(device=DEV).manual_seed(n)
    x = torch.randn(n, 2816, generator=g, device=DEV).bfloat16()
    proj = (torch.randn(128, 2816, generator=g, device=DEV) * 2816**-0.5).bfloat16()
    check_route_sort_from(x, proj, torch.rand(128, generator=g, device=DEV) + 0.5, 8, 1e-4)
    ours = tr.router_partials(x, proj).sum(0)[:, :128].bfloat16().float()
    lib = torch.nn.functional.linear(x, proj).float()
    assert (
        float(((ours - lib).abs() / lib.abs().clamp_min(1e-2)).max()) < 2**-6
    )  # within about two bf16 roundings


@pytest.mark.parametrize("temp", [0.4, 1.0])
def test_row_stats_matches_torch(temp):
    """The sampler's row pass at a denoise step's shape: 256 rows of the vocabulary's 262,144 softcapped logits
    (|logit| < 30), two rows tied at their maximum."""
    from tests.test_triton_interpret import check_row_stats

    g = torch.Generator(device=DEV).manual_seed(0)
    logits = 30 * torch.tanh(torch.randn(256, 262144, generator=g, device=DEV) * 0.2)
    logits[7, [11, 200_000]] = 29.5
    logits[8] = 1.0
    check_row_stats(logits, temp)


@pytest.mark.parametrize("temp", [0.4, 1.0])
def test_row_stats_softcaps_raw_logits(temp):
    """The row pass on a denoise graph's bf16 logits before the final softcap, at the real shape (the LM head's
    outputs of a random model run to ~|40|), against the row pass on their fp32 softcap."""
    from tests.test_triton_interpret import check_row_stats_softcap

    g = torch.Generator(device=DEV).manual_seed(1)
    raw = (torch.randn(256, 262144, generator=g, device=DEV) * 8).to(torch.bfloat16)
    raw[5, [10, 100_000]] = 60.0
    check_row_stats_softcap(raw, temp)


@pytest.mark.parametrize("t", [256, 4000])
def test_norm_rope_matches_region(t):
    from tests.test_triton_interpret import check_norm_rope

    # bf16 on the device: the same roundings as the eager ops; the sums of squares add in another order, so
    # a rare element may round one ulp apart (2 ulps of the largest allowed). A rounding step lost (as a fused
    # multiply-add of x * cos with the add did) leaves ~24% of the elements unequal.
    check_norm_rope(torch.bfloat16, DEV, t, 2**-7, min_exact=0.999)


@pytest.mark.parametrize("n", [256, 4096])
def test_combine_matches_region(n):
    """`triton_combine.post_ffn` against the eager region at the real width, bf16: the same roundings, so all
    but a rare element (sums of squares in another order) bit-equal."""
    from diffgemma.kernels import triton_combine as tc

    g = torch.Generator(device=DEV).manual_seed(n)
    k, hid, dt = 8, 2816, torch.bfloat16
    h, dense = (
        (torch.randn(n, hid, generator=g, device=DEV) * 3).to(dt),
        torch.randn(n, hid, device=DEV).to(dt),
    )
    w = torch.rand(n, k, generator=g, device=DEV)
    perm = torch.randperm(n * k, generator=g, device=DEV)
    slot = torch.empty_like(perm)
    slot[perm] = torch.arange(n * k, device=DEV)
    y = torch.randn(n * k, hid, generator=g, device=DEV).to(dt)
    norms = [(1 + 0.3 * torch.randn(hid, generator=g, device=DEV)).to(dt) for _ in range(3)]
    scalar = torch.tensor([0.8], device=DEV).to(dt)
    args = (h, dense, y, slot, w, norms[0], norms[1], scalar, norms[2], 1e-6)
    for a, b in zip(tc.post_ffn(*args), regions.post_ffn(*args), strict=True):
        assert rel(a, b) < 1e-2
        assert float((a == b).float().mean()) >= 0.999


def test_invalid_logits_guard_on_the_triton_row_pass():
    """A NaN row in the LM head's bf16 output (a degenerate forward): the Triton row pass gives it a non-finite
    entropy, which the guard turns into the filler sentinel; the other rows keep their argmax."""
    from diffgemma.engine import sampler as S

    raw = torch.randn(256, 262144, device=DEV, dtype=torch.bfloat16)
    raw[:, 7] = 40.0
    raw[3] = float("nan")
    stats = S.row_stats(raw, 0.7, sc_sparse=True, need_probs=False, softcap=30.0)
    assert "triton_sampler" not in dispatch.failed
    bad = S.guard_invalid_rows(stats, S.filler_id(262144))
    assert bad.nonzero().flatten().tolist() == [3]
    assert stats.argmax[3] == 262143 and (stats.argmax[bad.logical_not()] == 7).all()
