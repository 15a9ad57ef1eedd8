"""Our runner beside transformers' DiffusionGemma on the very same weights (its parameters are our tensors, no copy):
prefill tok/s, denoise step ms and a fixed-step generation of each, in one process, and a logits check of the two
(end to end, on one shared encoder cache, and layer by layer), with transformers against itself as the yardstick.

    python bench/compare_hf.py --contexts 1024,8192,32768 --out bench/results/h200.json
    python bench/compare_hf.py --tiny --device cpu --dtype float32          # a CPU smoke test, in seconds

transformers (5.23.0, `pip install transformers==5.23.0`) is a test and benchmark dependency, never the engine's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import torch

from diffgemma.bench import (
    GIB,
    BenchOptions,
    OursRunner,
    fixed_steps_sampler,
    kv_bytes,
    log,
    measure,
    ours_need,
    save,
    setup,
    table,
)
from diffgemma.model.model import DiffusionGemma
from diffgemma.model.passes import Pass
from diffgemma.model.steps import Steps

TRANSFORMERS_MAX_CONTEXT = 32768  # its one-shot prefill's [ctx, ctx] masks and device time bound it


@torch.no_grad()
def hf_model_sharing(model: DiffusionGemma, cfg_dict: dict[str, Any]):
    """transformers' DiffusionGemmaForBlockDiffusion (grouped_mm experts, sdpa) whose parameters ARE our tensors:
    built with parameters on the meta device, then each one pointed at our storage. Returns (model, setup info)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from diffgemma.weights.loader import checkpoint_names

    hf_cfg = DiffusionGemmaConfig(**cfg_dict)
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg._experts_implementation = "grouped_mm"
    ours = {name: getattr(mod, attr) for name, mod, attr in checkpoint_names(model)}
    enc = "model.encoder.language_model."
    for i, layer in enumerate(model.layers):
        ours[f"{enc}layers.{i}.layer_scalar"] = layer.encoder_layer_scalar
    ours["lm_head.weight"] = model.embed

    def lookup(name: str) -> torch.Tensor | None:
        for cand in (name, name.replace(".linear.", ".")):
            if cand in ours:
                return ours[cand]
            if cand.startswith(enc) and "model.decoder." + cand[len(enc) :] in ours:
                return ours["model.decoder." + cand[len(enc) :]]
        return None

    register = torch.nn.Module.register_parameter

    def register_on_meta(self, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=False)
        register(self, name, param)

    default_dtype = torch.get_default_dtype()
    torch.nn.Module.register_parameter = register_on_meta
    try:
        torch.set_default_dtype(model.dtype)
        with torch.device(model.device):
            hf = DiffusionGemmaForBlockDiffusion(hf_cfg)
    finally:
        torch.nn.Module.register_parameter = register
        torch.set_default_dtype(default_dtype)

    shared, vision = 0, 0
    for name, _ in list(hf.named_parameters(remove_duplicate=False)):
        mod_name, _, attr = name.rpartition(".")
        mod = hf.get_submodule(mod_name)
        t = lookup(name)
        if t is None:  # the vision tower: text never runs it, but transformers must build one
            if ".vision_tower." not in name and ".embed_vision." not in name:
                raise KeyError(f"transformers parameter {name} has no counterpart in our model")
            p = getattr(mod, attr)
            t = torch.randn(p.shape, device=model.device, dtype=model.dtype) * 0.02
            vision += 1
        else:
            shared += 1
        mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    for name, buf in list(hf.named_buffers()):
        t = lookup(name)
        if t is not None:  # e.g. the encoder's layer_scalar, a buffer there
            buf.copy_(t.reshape(buf.shape))
    if any(p.is_meta for p in hf.parameters()) or any(b.is_meta for b in hf.buffers()):
        raise RuntimeError("transformers model still has meta tensors")
    return hf.eval(), {"shared_parameters": shared, "random_vision_parameters": vision}


def _hf_cache(hf):
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=hf.config.get_text_config(decoder=True))


class HFRunner:
    """transformers behind the measuring loop's interface (`bench.measure`)."""

    name = "transformers"

    def __init__(self, hf, model: DiffusionGemma):
        self.hf, self.model = hf, model
        self.cache = None

    def new_cache(self, ctx: int):
        self.cache = None
        gc.collect()

    def prefill(self, ids: torch.Tensor) -> None:
        self.cache = _hf_cache(self.hf)
        self.hf.model.encoder(input_ids=ids.to(self.model.device), past_key_values=self.cache)

    def denoise(self, canvas: torch.Tensor, sc_logits: torch.Tensor) -> torch.Tensor:
        out = self.hf(
            decoder_input_ids=canvas.to(self.model.device),
            past_key_values=self.cache,
            self_conditioning_logits=sc_logits,
        )
        return out.logits

    def generate(self, prompt: list[int], steps: int, new_tokens: int) -> None:
        """transformers' forward inside our block loop's sampler (the same steps and per-step work as ours)."""
        from diffgemma.engine import sampler as S

        cfg = fixed_steps_sampler(steps)
        c, dev = self.model.cfg.canvas_length, self.model.device
        self.prefill(torch.tensor([prompt]))
        blocks = -(-new_tokens // c)
        g = torch.Generator(device=dev).manual_seed(0)
        for b in range(blocks):
            canvas = torch.randint(0, self.model.cfg.vocab_size, (c,), device=dev, generator=g)
            sc = None
            for i in range(steps):
                logits = self.hf(
                    decoder_input_ids=canvas[None], past_key_values=self.cache, self_conditioning_logits=sc
                ).logits.float()
                stats = S.row_stats(logits[0], S.temperature(cfg, steps - i))
                mask = S.accept_mask(stats.entropy, cfg.entropy_bound)
                canvas = torch.where(mask, stats.argmax, canvas)
                sc = logits / S.temperature(cfg, steps - i)
                bool(mask.any())  # the per-step stop read our loop also does
            if b + 1 < blocks:
                self.hf.model.encoder(input_ids=stats.argmax[None], past_key_values=self.cache)


def hf_need(cfg, dtype: torch.dtype) -> Any:
    """Device bytes transformers' one-shot prefill at a context needs: [ctx, ctx] masks, expert activations, K/V."""
    return lambda ctx: (
        3 * ctx * ctx
        + ctx * cfg.top_k_experts * 6 * cfg.hidden_size * 2
        + kv_bytes(cfg, ctx, dtype)
        + 8 * GIB
    )


# -- the logits check --------------------------------------------------------------------------------------


def compare_logits(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """x (ours) against y (transformers), both [1, C, V]: |d| and per-row argmax agreement."""
    x, y = x.float(), y.float()
    d = (x - y).abs()
    top2 = y[0].topk(2, dim=-1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    agree = x[0].argmax(-1) == y[0].argmax(-1)
    clear = margin > 4 * float(d[0].max(-1).values.median())
    in_top2 = (x[0].argmax(-1)[:, None] == top2.indices).any(-1)
    return {
        "max_abs_diff": float(d.max()),
        "mean_abs_diff": float(d.mean()),
        "logit_std": float(y.std()),
        "argmax_agreement": float(agree.float().mean()),
        "ours_argmax_in_hf_top2": float(in_top2.float().mean()),
        "rows": int(agree.numel()),
        "median_top2_margin": float(margin.median()),
        "rows_with_clear_margin": int(clear.sum()),
        "argmax_agreement_clear_margin": float(agree[clear].float().mean()) if clear.any() else None,
    }


def cache_from_hf(runner, cache, ctx: int):
    """Our KVCache holding exactly transformers' encoder K/V, so that the decoders are compared on one prefix."""
    kv = runner.new_cache(ctx + 2 * runner.cfg.canvas_length)
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values  # [1, heads, kept, d]: a sliding layer may keep only its window
        kv.write(i, ctx - k.shape[2], torch.cat([k, v]))
    kv.length = ctx
    return kv


def per_layer(model: DiffusionGemma, kernels: Steps, captured, kv) -> dict[str, Any]:
    """Each decoder layer fed transformers' own input to it, on `kernels`, eagerly: our output against
    transformers', |d| relative to the output's mean magnitude (a real mismatch stands out from bf16 rounding)."""
    c = captured[0][0].shape[1]
    saved, model.steps = model.steps, kernels
    try:
        if kernels.fast:
            geometry = torch.tensor([kv.denoise_geometry(c)], dtype=torch.int32, device=model.device)
            p = Pass.denoise([kv], c, geometry, [kv.length + c])
        else:
            p = Pass.denoise([kv], c)
        rows = []
        for i, layer in enumerate(model.layers):
            hin, hout = captured[i]
            got = model.layer_forward(layer, hin[0], None, p, None)[0].float()
            want = hout[0].float()
            d = (got - want).abs()
            rows.append(
                {
                    "layer": i,
                    "max_abs_diff": float(d.max()),
                    "mean_abs_diff": float(d.mean()),
                    "out_std": float(want.std()),
                    "rel_mean": float(d.mean() / want.abs().mean()),
                }
            )
    finally:
        model.steps = saved
    worst = max(rows, key=lambda r: r["rel_mean"])
    return {"worst_rel_mean": worst["rel_mean"], "worst_layer": worst["layer"], "layers": rows}


def hf_noise_floor(hf, ids, canvas, b, b_sc, sc) -> dict[str, Any]:
    """transformers against itself: eager attention instead of sdpa (another valid implementation) on the same
    weights, prompt and canvas, compared as we are: the agreement rounding alone allows, our yardstick."""
    try:
        hf.set_attn_implementation("eager")
        cache = _hf_cache(hf)
        hf.model.encoder(input_ids=ids, past_key_values=cache)
        alt = hf(decoder_input_ids=canvas, past_key_values=cache).logits.float()
        alt_sc = hf(
            decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc
        ).logits.float()
        return {"alt": "attn eager", "no_sc": compare_logits(alt, b), "sc": compare_logits(alt_sc, b_sc)}
    finally:
        hf.set_attn_implementation("sdpa")


@torch.no_grad()
def check(runner, hf, ctx: int) -> dict[str, Any]:
    """Our denoise logits against transformers' on the same weights, prompt and canvas.

    end_to_end: each with its own prefill (our runner as in production, graphs included).
    on_hf_cache: our decoder reading transformers' encoder K/V (the decoder alone).
    per_layer: each decoder layer on transformers' input to it (no SC), on our runner's kernels and the reference."""
    model, cfg, device = runner.model, runner.cfg, runner.device
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g).to(device)
    kv = runner.new_cache(ctx + 2 * cfg.canvas_length)
    runner.prefill(ids, kv)
    cache = _hf_cache(hf)
    hf.model.encoder(input_ids=ids.to(device), past_key_values=cache)
    kv_hf = cache_from_hf(runner, cache, ctx)

    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(i):
        def keep(mod, args, kwargs, res):
            hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            res = res[0] if isinstance(res, tuple) else res
            captured[i] = (hs.detach().clone(), res.detach().clone())

        return keep

    layers = hf.model.decoder.layers
    handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        b = hf(decoder_input_ids=canvas, past_key_values=cache).logits.float()
    finally:
        for handle in handles:
            handle.remove()
    sc = b / 0.7
    b_sc = hf(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc).logits.float()
    sc_probs = torch.softmax(sc[0], dim=-1, dtype=torch.float32)
    dec_in = model.decoder_input(canvas[0], None, False)
    out: dict[str, Any] = {
        "context": ctx,
        "fast_kernels": runner.fast,
        "end_to_end": {
            "no_sc": compare_logits(runner.denoise(canvas, kv), b),
            "sc": compare_logits(runner.denoise(canvas, kv, sc_logits=sc), b_sc),
        },
        "on_hf_cache": {
            "no_sc": compare_logits(runner.denoise(canvas, kv_hf), b),
            "sc": compare_logits(runner.denoise(canvas, kv_hf, sc_probs=sc_probs), b_sc),
        },
        "per_layer": {
            "decoder_input": {
                "max_abs_diff": float((dec_in.float() - captured[0][0][0].float()).abs().max()),
                "std": float(captured[0][0].float().std()),
            },
            "reference": per_layer(model, Steps(), captured, kv_hf),
        },
    }
    if runner.fast:
        out["per_layer"]["fast"] = per_layer(model, model.steps, captured, kv_hf)
    out["reference_vs_itself"] = hf_noise_floor(hf, ids.to(device), canvas, b, b_sc, sc)
    return out


# -- the command -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/compare_hf.py", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", help="checkpoint directory (default: random weights at the real shape)")
    p.add_argument("--tiny", action="store_true", help="random weights at a tiny shape (a CPU smoke test)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--contexts", help="comma-separated context lengths (as `diffgemma bench`)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (median), at least 10")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--gen-steps", type=int, default=48, help="fixed denoise steps of the generation (0: none)"
    )
    p.add_argument("--gen-prompt", type=int, default=1024)
    p.add_argument("--gen-reps", type=int, default=10, help="timed generations (median), at least 10")
    p.add_argument("--init", default="hf", choices=["hf", "wide"], help="random weights' distribution")
    p.add_argument("--transformers-max-context", type=int, default=TRANSFORMERS_MAX_CONTEXT)
    p.add_argument("--check-context", type=int, default=1024, help="the logits check's prompt length")
    p.add_argument("--no-check", action="store_true", help="skip the logits check")
    p.add_argument("--no-speed", action="store_true", help="skip the timings (the check only)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print(
            "compare_hf: error: transformers is not installed (pip install transformers==5.23.0)",
            file=sys.stderr,
        )
        return 2
    opts = BenchOptions(
        model=args.model,
        tiny=args.tiny,
        device=args.device,
        dtype=args.dtype,
        contexts=args.contexts,
        reps=args.reps,
        warmup=args.warmup,
        gen_steps=args.gen_steps,
        gen_prompt=args.gen_prompt,
        gen_reps=args.gen_reps,
        init=args.init,
        out=args.out,
        max_context={"transformers": args.transformers_max_context},
    )
    try:
        opts.check()
    except ValueError as e:
        print(f"compare_hf: error: {e}", file=sys.stderr)
        return 2
    runner, cfg_dict, results = setup(opts)
    ctxs = opts.context_list()
    if not args.no_speed:
        results["diffgemma"] = measure(OursRunner(runner), ctxs, opts, runner.device, ours_need(runner), log)
        save(results, opts.out, runner.device)
    hf, info = hf_model_sharing(runner.model, cfg_dict)
    text_cfg = hf.config.get_text_config()
    results["transformers_setup"] = {
        **info,
        "version": transformers.__version__,
        "experts_implementation": text_cfg._experts_implementation,
        "attn_implementation": text_cfg._attn_implementation,
    }
    if not args.no_check:
        results["check_hf"] = check(runner, hf, args.check_context)
        log(f"check: {json.dumps(results['check_hf']['end_to_end'])}")
        save(results, opts.out, runner.device)
    if not args.no_speed:
        need = hf_need(runner.cfg, runner.dtype)
        results["transformers"] = measure(HFRunner(hf, runner.model), ctxs, opts, runner.device, need, log)
        print(table(results, ctxs))
    save(results, opts.out, runner.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
