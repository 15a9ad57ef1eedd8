"""`diffgemma bench`: prefill and denoise speed, a fixed-step generation and peak memory of our runner, on random
weights at the real 26B-A4B shape generated directly on the device (never read from disk) or on a checkpoint.

Timings use CUDA events after warm-up; each number is a median. `bench/compare_hf.py` measures transformers on the
very same weights beside it and checks the two sets of logits.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffgemma.config import ModelConfig, SamplerConfig, load_runtime_config
from diffgemma.model.model import DiffusionGemma
from diffgemma.runner.devices import OMP_WAIT_POLICY, check_device, set_cpu_threads
from diffgemma.runner.parallel import join, leave, release
from diffgemma.runner.runner import ModelRunner

GIB = 1024**3
CONTEXTS = "1024,8192,32768,131072"
TINY_CONTEXTS = "256,1024"  # --tiny's default: what a CPU finishes in seconds

# The real checkpoint's config.json spelling (google/diffusiongemma-26B-A4B-it); the vision tower is the
# tiny test one (text benchmarks never run it, and transformers must still build one).
REAL_CONFIG: dict[str, Any] = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    "model_type": "diffusion_gemma",
    "canvas_length": 256,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "diffusion_gemma_text",
        "vocab_size": 262144,
        "hidden_size": 2816,
        "intermediate_size": 2112,
        "num_hidden_layers": 30,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)],
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
        "enable_moe_block": True,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262144,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    },
    "vision_config": {
        "model_type": "gemma4_vision",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
    },
}


def tiny_config() -> dict[str, Any]:
    """A small config with the same structure, for running the bench's code paths on CPU."""
    from diffgemma.testing.checkpoint import TINY_TEXT_CONFIG, TINY_VISION_CONFIG

    tc = dict(TINY_TEXT_CONFIG, sliding_window=16, moe_intermediate_size=32)  # every format's dimension rule
    return {**REAL_CONFIG, "canvas_length": 32, "text_config": tc, "vision_config": TINY_VISION_CONFIG}


# -- weights ----------------------------------------------------------------------------------------------


@torch.no_grad()
def random_model(
    cfg_dict: dict[str, Any], device: str, dtype: torch.dtype, seed: int = 0, init: str = "wide"
) -> DiffusionGemma:
    """Our model with random weights made on `device` in `dtype`.

    init="wide": statistics as testing.random_tensors (norm weights 1 +- 0.3, router x4, scalars in
    [0.5, 1.5)): exercises every weight, but in bf16 the 30-layer network is chaotic (rounding flips top-k
    expert choices), so two correct bf16 implementations do not agree on the logits.
    init="hf": transformers' own DiffusionGemmaPreTrainedModel._init_weights: normal(0, initializer_range
    = 0.02) for every linear, embedding and expert tensor; RMSNorm weights, router scale, per_expert_scale
    and layer_scalar = 1. The distribution the bf16 check against transformers is run on."""
    if init not in ("wide", "hf"):
        raise ValueError(f"init must be 'wide' or 'hf', not {init!r}")
    from diffgemma.weights.loader import checkpoint_names

    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    h = cfg.hidden_size

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(std)

    for name, module, attr in checkpoint_names(model):
        shape = tuple(getattr(module, attr).shape)
        if init == "hf":
            ones = "norm" in name or name.endswith(("router.scale", "per_expert_scale", "layer_scalar"))
            t = torch.ones(*shape, device=device, dtype=dtype) if ones else randn(*shape, std=0.02)
        elif "embed_tokens" in name:
            t = randn(*shape, std=2.0 * h**-0.5)
        elif name.endswith("experts.gate_up_proj"):
            t = randn(*shape, std=h**-0.5)
        elif name.endswith("experts.down_proj"):
            t = randn(*shape, std=shape[-1] ** -0.5)
        elif "norm" in name or name.endswith("router.scale"):
            t = randn(*shape, std=0.3).add_(1.0)
        elif name.endswith("per_expert_scale") or name.endswith("layer_scalar"):
            t = torch.rand(*shape, generator=g, device=device, dtype=dtype).add_(0.5)
        else:  # linear [out, in]
            t = randn(*shape, std=shape[-1] ** -0.5 * (4.0 if "router.proj" in name else 1.0))
        setattr(module, attr, torch.nn.Parameter(t, requires_grad=False))
    for layer in model.layers:
        layer.encoder_layer_scalar = torch.nn.Parameter(
            layer.layer_scalar.detach().clone(), requires_grad=False
        )
    model.inv_freq = {k: v.to(device) for k, v in model.inv_freq.items()}
    return model


def load_checkpoint(path: str, device: str, dtype: torch.dtype) -> tuple[DiffusionGemma, dict[str, Any]]:
    from diffgemma.weights.loader import load_model

    return load_model(path, device, dtype), json.loads((Path(path) / "config.json").read_text())


# -- timing -----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Milliseconds per call (CUDA events on cuda, perf_counter elsewhere), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def fixed_steps_sampler(steps: int) -> SamplerConfig:
    """Every early stop and re-roll off, no stop tokens: exactly `steps` denoise steps per block."""
    return SamplerConfig(
        max_denoising_steps=steps,
        stability_threshold=0,
        confidence_threshold=1e-30,
        stop_token_ids=(),
        plateau_steps=0,
        pad_gate=False,
        entropy_stop=0.0,
        empty_reply_retry=0,
        commit_conf_trim=0.0,
        pad_block_stop=False,
        prefill_f32_max_tokens=0,
    ).validated()


class OursRunner:
    """Our runner behind the measuring loop's interface: a cache per context, prefill, denoise, generate."""

    name = "diffgemma"

    def __init__(self, runner: ModelRunner):
        self.runner, self.model = runner, runner.model
        self.kv = None

    def new_cache(self, ctx: int):
        self.kv = None
        gc.collect()
        self.kv = self.runner.new_cache(ctx + 2 * self.model.cfg.canvas_length)

    def prefill(self, ids: torch.Tensor) -> None:
        self.kv.reset()
        self.runner.prefill(ids, self.kv)

    def denoise(self, canvas: torch.Tensor, sc_logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(sc_logits[0], dim=-1, dtype=torch.float32)
        return self.runner.denoise(canvas, self.kv, sc_probs=probs)

    def generate(self, prompt: list[int], steps: int, new_tokens: int):
        from diffgemma.engine.generate import generate

        # as Engine.generate does: one cache emptied per call, so its captured graphs serve every call
        if (
            self.kv is None
            or self.kv.max_tokens < len(prompt) + new_tokens + 2 * self.model.cfg.canvas_length
        ):
            self.new_cache(len(prompt) + new_tokens)
        self.kv.reset()
        return generate(self.runner, prompt, self.kv, fixed_steps_sampler(steps), max_new_tokens=new_tokens)


def _fits(device: torch.device, need: int) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    free, _ = torch.cuda.mem_get_info(device)
    return need < free, f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"


@dataclass
class BenchOptions:
    """What `diffgemma bench` measures and on what (the command line's options)."""

    model: str | None = None  # a checkpoint directory; None: random weights
    tiny: bool = False  # random weights at a tiny shape (a CPU smoke test)
    # random weights at the real shape even on CPU; without it (or -m or --tiny) a CPU measures the demo model
    real: bool = False
    device: str | None = None
    dtype: str | None = None  # None: bfloat16 on a GPU, float32 on CPU
    contexts: str | None = None  # comma-separated context lengths (default CONTEXTS, or TINY_CONTEXTS)
    threads: int | None = None
    reps: int = 10
    warmup: int = 3
    prefill_chunk: int = 8192
    gen_steps: int = 48
    gen_prompt: int = 1024
    gen_reps: int = 10
    fixed_steps: int = 16  # generate_tok_s: denoise steps a block, as vLLM's published figure (0 = skip)
    quant: str | None = None  # a quant profile (quant.profiles) applied to the weights on the device
    quant_set: tuple[str, ...] = ()  # --set CLASS=FORMAT on top of it
    init: str = "hf"  # random weights' distribution: transformers' _init_weights, or the "wide" test one
    kernels: str = "auto"
    compile: bool = True
    out: str | None = None  # write the results as JSON here
    concurrency: str | None = (
        None  # "1,2,4": N requests started together through the scheduler (`concurrency`)
    )
    max_context: dict[str, int] | None = None  # runner name -> the largest context it is measured at
    schema: bool = False  # also a 3-question schema scored through `Engine.score` (`schema_timing`)
    topk_error: bool = False  # also top-k sparse against dense attention at each context (`topk_error`)
    expert_parallel: int = 1  # ranks sharing the experts (under torchrun; `runner.parallel`)
    data_parallel: int = 1  # ranks each measuring a replica of its own (under torchrun), their tok/s summed

    def context_list(self) -> list[int]:
        return [
            int(x)
            for x in (self.contexts or (TINY_CONTEXTS if self.tiny else CONTEXTS)).split(",")
            if x.strip()
        ]

    def check(self) -> None:
        if self.real + self.tiny + (self.model is not None) > 1:
            raise ValueError("--real, --tiny and -m each choose the weights: pass one of them")
        if self.dtype is not None and self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        for name in ("reps", "gen_reps"):  # a median of at least 10
            if getattr(self, name) < 10:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 10, got {getattr(self, name)}")
        if self.concurrency is not None:
            ns = [x.strip() for x in self.concurrency.split(",") if x.strip()]
            if not ns or not all(x.isdigit() and int(x) > 0 for x in ns):
                raise ValueError(f"--concurrency takes positive counts like 1,2,4, got {self.concurrency!r}")
        if min(self.expert_parallel, self.data_parallel) < 1 or (
            self.expert_parallel > 1 and self.data_parallel > 1
        ):
            raise ValueError(
                "--expert-parallel and --data-parallel take a count of at least 1, and not both above 1 (their "
                f"combination is not built), got {self.expert_parallel} and {self.data_parallel}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if self.init not in ("hf", "wide"):
            raise ValueError(f"--init must be hf or wide, got {self.init!r}")
        if self.quant is not None or self.quant_set:
            from diffgemma.quant.profiles import resolve

            if self.quant is None:
                raise ValueError("--set needs --quant PROFILE")
            resolve(self.quant, self.quant_set)  # QuantSpecError (a ValueError) names the bad item


def measure(
    runner, ctxs: list[int], opts: BenchOptions, device: torch.device, need_bytes, log
) -> dict[str, Any]:
    """Prefill tok/s and denoise step ms at each context, a fixed-step generation and peak memory, by `runner`
    (ours or another engine's behind the same interface)."""
    model = runner.model
    cfg = model.cfg
    c = cfg.canvas_length
    g = torch.Generator().manual_seed(1)
    res: dict[str, Any] = {"denoise_step_ms": {}, "prefill_tok_s": {}, "skipped": {}}
    canvas = torch.randint(0, cfg.vocab_size, (1, c), generator=g).to(device)
    sc_logits = (torch.randn(1, c, cfg.vocab_size, generator=g) * 4).to(device)
    limits = opts.max_context or {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ctx in ctxs:
        ok, why = _fits(device, need_bytes(ctx))
        if not ok or ctx > limits.get(runner.name, 1 << 30):
            res["skipped"][str(ctx)] = (
                why if not ok else f"above {runner.name}'s largest context (device time)"
            )
            log(f"{runner.name}: skip {ctx}: {res['skipped'][str(ctx)]}")
            continue
        try:
            runner.new_cache(ctx)
            ids = torch.randint(0, cfg.vocab_size, (1, ctx), generator=g)
            runner.prefill(ids[:, : min(ctx, 4096)])  # warm-up: same kernels, short
            ms = timed(lambda ids=ids: runner.prefill(ids), device, 0, opts.reps)
            res["prefill_tok_s"][str(ctx)] = ctx / (_median(ms) / 1e3)
            if runner.name == OursRunner.name:
                t0 = time.perf_counter()  # first call: graph capture (+ inductor compile the first time)
                runner.denoise(canvas, sc_logits)
                _sync(device)
                res.setdefault("denoise_first_call_s", {})[str(ctx)] = time.perf_counter() - t0
            ms = timed(lambda: runner.denoise(canvas, sc_logits), device, opts.warmup, opts.reps)
            res["denoise_step_ms"][str(ctx)] = _median(ms)
            log(
                f"{runner.name} ctx {ctx}: prefill {res['prefill_tok_s'][str(ctx)]:,.0f} tok/s, "
                f"denoise {res['denoise_step_ms'][str(ctx)]:.2f} ms (min {min(ms):.2f}, max {max(ms):.2f})"
            )
        except torch.OutOfMemoryError as e:
            res["skipped"][str(ctx)] = f"out of memory: {str(e).splitlines()[0]}"
            log(f"{runner.name}: ctx {ctx} OOM")
        runner.new_cache(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if opts.gen_steps > 0:
        prompt = torch.randint(0, cfg.vocab_size, (opts.gen_prompt,), generator=g).tolist()
        runner.generate(prompt, opts.gen_steps, c)  # warm-up
        ms = timed(lambda: runner.generate(prompt, opts.gen_steps, c), device, 0, opts.gen_reps)
        res["generate_block_s"] = _median(ms) / 1e3
        res["generate_setup"] = f"prompt {opts.gen_prompt} tokens, {c}-token canvas, {opts.gen_steps} steps"
        log(f"{runner.name}: generate {c} tokens: {res['generate_block_s']:.3f} s")
    if opts.fixed_steps > 0 and runner.name == OursRunner.name:
        res.update(generate_rate(runner, cfg, opts, device, g))
        log(
            f"{runner.name}: {opts.fixed_steps} steps a block: {res['generate_tok_s']:,.0f} tok/s "
            f"({res['generate_tok_s_with_prefill']:,.0f} with the prompt's prefill)"
        )
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    if runner.name == OursRunner.name:
        from diffgemma.kernels import regions

        res["fast_kernels"] = runner.runner.fast
        if runner.runner.fast:
            res["fused_regions"] = regions.regions_report(model.steps.regions)
    runner.new_cache(0)
    return res


def generate_rate(runner, cfg: ModelConfig, opts: BenchOptions, device: torch.device, g) -> dict[str, Any]:
    """Tokens a second of one block at `opts.fixed_steps` steps, early stops off: the canvas over its denoise
    steps plus its commit (the committed block prefilled into the cache), prefill of the prompt excluded as vLLM
    reports it; and with the prompt's prefill."""
    c = cfg.canvas_length
    prompt = torch.randint(0, cfg.vocab_size, (opts.gen_prompt,), generator=g).tolist()
    rows = []
    for i in range(opts.gen_reps + 1):  # the first: warm-up (graph capture)
        out = runner.generate(prompt, opts.fixed_steps, c)
        t0 = time.perf_counter()
        runner.runner.prefill(torch.tensor([out.token_ids], device=device), runner.kv)  # the commit
        _sync(device)
        if i:
            rows.append((out.prefill_seconds, out.denoise_seconds, time.perf_counter() - t0))
    prefill, denoise, commit = (_median([r[j] for r in rows]) for j in range(3))
    return {
        "generate_tok_s": c / (denoise + commit),
        "generate_tok_s_with_prefill": c / (prefill + denoise + commit),
        "generate_fixed_setup": f"prompt {opts.gen_prompt} tokens, {c}-token canvas, {opts.fixed_steps} steps, "
        f"early stops off; denoise {denoise * 1e3:.1f} ms + commit {commit * 1e3:.1f} ms, "
        f"prompt prefill {prefill * 1e3:.1f} ms",
    }


CONCURRENT_BLOCKS = 4  # blocks a request in `concurrency`


def concurrency(runner: ModelRunner, opts: BenchOptions, ns: list[int], g) -> dict[str, Any]:
    """N requests started together through the `Scheduler` (each a `gen_prompt`-token prompt, CONCURRENT_BLOCKS
    blocks of `fixed_steps` steps, early stops off): aggregate generated tok/s, mean ms a scheduler step (one denoise
    step of every running canvas, and the commits due), peak GPU memory. Prompt prefill is excluded, as in
    `generate_tok_s`. For the largest N, each request is then run alone on its cache: `solo_equal` is the share of
    requests whose tokens equal their solo run's (batch invariance, measured)."""
    from diffgemma.engine.batch import Request, Scheduler
    from diffgemma.engine.generate import Turn, drive

    cfg, device = runner.model.cfg, runner.device
    c, steps = cfg.canvas_length, max(opts.fixed_steps, 1)
    sampler = fixed_steps_sampler(steps)
    res: dict[str, Any] = {}
    for n in ns:
        # a cache a request, kept across the repetitions as a server keeps its conversations': the CUDA graphs the
        # warm-up captures (each tied to its caches) serve the timed run
        caches = [runner.new_cache(opts.gen_prompt + (CONCURRENT_BLOCKS + 1) * c) for _ in range(n)]
        for rep in range(2):  # the first: warm-up (compiles, graph captures)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sched = Scheduler(runner, max_batch=max(ns))
            prompts = [
                torch.randint(0, cfg.vocab_size, (opts.gen_prompt,), generator=g).tolist() for _ in caches
            ]
            turns = []
            for kv, prompt in zip(caches, prompts, strict=True):
                kv.reset()
                turns.append(
                    Turn(runner, prompt, kv, sampler, seed=rep, max_new_tokens=CONCURRENT_BLOCKS * c)
                )
            for turn in turns:
                sched.submit(Request(turn))
            _sync(device)
            t0, count = time.perf_counter(), 0
            while sched.active:
                sched.step()
                count += 1
            _sync(device)
            wall = time.perf_counter() - t0
        tokens = sum(len(t.out.token_ids) for t in turns)
        row = res[str(n)] = {
            "tok_s": tokens / wall,
            "step_ms": wall / count * 1e3,
            "canvases_per_forward": max(sched.forwards) if sched.forwards else 0,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
        }
        if opts.data_parallel > 1:  # every rank ran n requests on its replica: the sum is the N GPUs' rate
            total = torch.tensor([row["tok_s"]], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(total)
            row["tok_s_all_ranks"] = float(total)
        if "1" in res and n > 1:
            row["ms_per_added_canvas"] = (row["step_ms"] - res["1"]["step_ms"]) / (n - 1)
            row["speedup"] = row["tok_s"] / res["1"]["tok_s"]
        if n == max(ns) and n > 1:
            batched = [t.out.token_ids for t in turns]
            solo = []
            for kv, prompt in zip(caches, prompts, strict=True):
                kv.reset()
                turn = Turn(runner, prompt, kv, sampler, seed=1, max_new_tokens=CONCURRENT_BLOCKS * c)
                solo.append(drive(turn).token_ids)
            row["solo_equal"] = sum(a == b for a, b in zip(batched, solo, strict=True)) / n
            row["solo_equal_tokens"] = sum(
                x == y for a, b in zip(batched, solo, strict=True) for x, y in zip(a, b, strict=False)
            ) / max(1, sum(len(a) for a in batched))
        log(
            f"diffgemma: {n} concurrent: {row['tok_s']:,.0f} tok/s, {row['step_ms']:.2f} ms a step, "
            f"{row['canvases_per_forward']} canvases a forward, peak {row['peak_gib'] or 0:.1f} GiB"
            + (f", {row['solo_equal']:.0%} of requests equal their solo run" if "solo_equal" in row else "")
        )
        del turns, sched, caches
        gc.collect()
    return res


def demo_schema(i: int) -> dict[str, Any]:
    """A 3-question schema of the demo model's kinds (choice, yes/no, score); `i` makes its prefix its own."""
    return {
        "instructions": f"Order desk {i}.",
        "questions": [
            {"id": "kind", "type": "choice", "instructions": "What kind of thing is the item?",
             "options": [{"name": "fruit"}, {"name": "animal"}, {"name": "object"}]},
            {"id": "late", "type": "noul", "instructions": "Has the order waited more than 5 days?"},
            {"id": "wait", "type": "score", "instructions": "How long has the order waited?",
             "levels": ["1 to 3 days", "4 to 6 days", "7 days or more"]},
        ],
    }  # fmt: skip


def schema_timing(runner: ModelRunner, reps: int) -> dict[str, Any]:
    """`demo_schema` answered through `Engine.score` with the demo tokenizer on the runner's model: a schema's first
    request (its prefix not cached) and a repeat with another state (the prefix reused), wall ms each, the median
    over `reps` schemas after one warm-up pair, with the reply's own prefill and denoise times."""
    from diffgemma.chat.tokenizer import ChatTokenizer
    from diffgemma.session.client import Engine
    from diffgemma.train.tokenizer import LABEL_WORDS, with_words
    from diffgemma.weights.download import bundled_model

    demo = bundled_model()
    if demo is None:
        raise RuntimeError("--schema needs the bundled demo model's tokenizer, and this build has none")
    tok = ChatTokenizer.from_dir(demo)
    # yes and no one token each, as the demo trainer makes them (a no-op on a tokenizer that has them)
    tok = ChatTokenizer(with_words(tok.tokenizer, LABEL_WORDS), chat_template=tok.chat_template)
    if tok.tokenizer.get_vocab_size() > runner.model.cfg.vocab_size:
        raise ValueError(
            f"--schema needs a vocabulary that holds the demo tokenizer's {tok.tokenizer.get_vocab_size()} ids; "
            f"this model has {runner.model.cfg.vocab_size}"
        )
    engine = Engine(runner, SamplerConfig(), tokenizer=tok, max_tokens=4096)
    states = [
        {"item": "apple", "city": "Paris", "days": 9, "count": 12},
        {"item": "lamp", "city": "Berlin", "days": 2, "count": 7},
    ]
    rows: dict[str, list[dict[str, Any]]] = {"first": [], "repeat": []}
    for i in range(-1, reps):  # -1: the warm-up pair (compiles, captures)
        for state, kind in zip(states, rows, strict=True):
            _sync(runner.device)
            t0 = time.perf_counter()
            reply = engine.score(demo_schema(i), state, seed=i)
            wall = (time.perf_counter() - t0) * 1e3
            if i >= 0:
                d = reply["diagnostics"]
                rows[kind].append({"wall_ms": wall, "reads": d["samples"]["n"], **d["timing"]})
    res = {kind: {key: _median([r[key] for r in rs]) for key in rs[0]} for kind, rs in rows.items()}
    for kind, r in res.items():
        log(
            f"diffgemma: 3-question schema, {kind} request: {r['wall_ms']:.1f} ms ({r['prefill_ms']:.1f} ms prefill, "
            f"{r['denoise_ms']:.1f} ms for {r['reads']:.0f} reads, {r['reused_tokens']:.0f} tokens reused)"
        )
    return res


def weight_bytes(model: DiffusionGemma) -> int:
    """Bytes of the model's weights on its device: parameters and quantized weights (views counted once)."""
    from diffgemma.quant.weight import QuantWeight

    seen, total = set(), 0
    tensors = list(model.parameters())
    for m in model.modules():
        tensors += [t for w in vars(m).values() if isinstance(w, QuantWeight) for t in w.parts.values()]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def quantize_weights(model: DiffusionGemma, profile: str, sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """Quantize the model's weights in place on their device, as a pack of this profile would load there
    (formats without a kernel on the device dequantized back, as the loader does). Returns the resolved spec."""
    from diffgemma.quant.formats import FormatError
    from diffgemma.quant.profiles import resolve
    from diffgemma.quant.weight import QuantWeight
    from diffgemma.weights.loader import ATTR_CLASSES, checkpoint_names, runs_quantized, set_weight

    base, fmts, given = resolve(profile, sets)
    for name, module, attr in checkpoint_names(model):
        fmt = fmts.get(ATTR_CLASSES.get(attr, ""), "bf16")
        if fmt == "bf16":
            continue
        w = getattr(module, attr)
        try:
            q = QuantWeight.quantize(w, fmt)
        except FormatError as e:
            raise ValueError(f"{name} cannot be {fmt}: {e}") from None
        set_weight(module, attr, q if runs_quantized(w.device, attr, fmt) else q.dequantize(w.dtype))
        del w, q
    for layer in model.layers:
        layer._merged.clear()
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"profile": base, "formats": fmts, "overrides": given}


@torch.no_grad()
def layer_outputs(model: DiffusionGemma, prompt: torch.Tensor, canvas: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's output over a denoise of `canvas` after prefilling `prompt` (through the model's own kernel
    table, eagerly), then the final logits."""
    cache = model.new_cache(prompt.shape[1] + 2 * canvas.shape[1])
    model.prefill(prompt, cache)
    return denoise_layers(model, canvas, cache)


def quant_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any]:
    """Per-layer and final relative error (Frobenius) of the quantized model against bf16, and the logits' argmax
    agreement."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    return {
        "layer_rel_err": [rel(a, b) for a, b in zip(got[:-1], ref[:-1], strict=True)],
        "logits_rel_err": rel(got[-1], ref[-1]),
        "argmax_agreement": float((got[-1].argmax(-1) == ref[-1].argmax(-1)).float().mean()),
    }


def denoise_layers(model: DiffusionGemma, canvas: torch.Tensor, cache) -> list[torch.Tensor]:
    """Each layer's output over a denoise of `canvas` on a prefilled `cache` (the model's steps, eagerly;
    the cache's length is left as it was), then the final logits."""
    outs: list[torch.Tensor] = []
    real = model.layer_forward

    def record(*args, **kwargs):
        h, x = real(*args, **kwargs)
        outs.append(h.float())
        return h, x

    model.layer_forward = record
    try:
        outs.append(model.denoise(canvas, cache, sc_seed=True).float())
    finally:
        del model.layer_forward
    return outs


def topk_error(runner: ModelRunner, ctxs: list[int], g) -> dict[str, Any]:
    """Top-k sparse against dense full-layer attention on the same weights, at each context: a denoise step after
    one dense prefill, on the reference kernels with `attention_topk` on and off (per-layer and final relative
    error, argmax agreement); beside it the fast kernels' dense step against the reference's, the yardstick of
    what two exact paths differ by."""
    from diffgemma.kernels.torch_ref import topk_keys
    from diffgemma.model.steps import Steps

    model, c = runner.model, runner.cfg.canvas_length
    fast = model.steps
    res: dict[str, Any] = {}
    for ctx in ctxs:
        prompt = torch.randint(0, runner.cfg.vocab_size, (1, ctx), generator=g).to(runner.device)
        canvas = torch.randint(0, runner.cfg.vocab_size, (1, c), generator=g).to(runner.device)
        cache = runner.new_cache(ctx + 2 * c)
        runner.prefill(prompt, cache)
        outs = {}
        try:
            for name, kernels in (("fast", fast), ("dense", Steps()), ("topk", Steps(topk=True))):
                model.steps = kernels
                outs[name] = denoise_layers(model, canvas, cache)
        finally:
            model.steps = fast
        row = res[str(ctx)] = {
            "keep": topk_keys(ctx + c),
            "topk_vs_dense": quant_error(outs["topk"], outs["dense"]),
            "fast_vs_reference": quant_error(outs["fast"], outs["dense"]),
        }
        log(
            f"top-k at {ctx}: keeps {row['keep']} of {ctx + c} keys; logits relative error "
            f"{row['topk_vs_dense']['logits_rel_err']:.4f} against dense, argmax agreement "
            f"{row['topk_vs_dense']['argmax_agreement']:.3f} (the fast kernels against the reference: "
            f"{row['fast_vs_reference']['logits_rel_err']:.4f}, {row['fast_vs_reference']['argmax_agreement']:.3f})"
        )
        del outs, cache
        gc.collect()
    return res


def kv_bytes(cfg: ModelConfig, ctx: int, dtype: torch.dtype) -> int:
    es = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * cfg.num_kv_heads[i] * cfg.head_dims[i] * ctx * es for i in range(cfg.num_layers))


def table(results: dict[str, Any], ctxs: list[int], other: str = "transformers") -> str:
    """The results as a markdown table, ours beside `other`'s when they are there."""
    ours, ref = results.get("diffgemma", {}), results.get(other)
    rows = [f"| metric | context | diffgemma | {other} | ratio |", "| --- | --- | --- | --- | --- |"]

    def row(metric, ctx, key, fmt, better_low):
        a = ours.get(key, {}).get(str(ctx))
        b = ref.get(key, {}).get(str(ctx)) if ref else None
        ratio = (b / a if better_low else a / b) if a and b else None
        rows.append(
            f"| {metric} | {ctx} | {fmt.format(a) if a else '-'} | {fmt.format(b) if b else '-'} | "
            f"{f'{ratio:.2f}x' if ratio else '-'} |"
        )

    for ctx in ctxs:
        row("denoise step ms", ctx, "denoise_step_ms", "{:.2f}", True)
    for ctx in ctxs:
        row("prefill tok/s", ctx, "prefill_tok_s", "{:,.0f}", False)
    ga, gb = ours.get("generate_block_s"), (ref or {}).get("generate_block_s")
    rows.append(
        f"| generate one block s | - | {ga and f'{ga:.3f}' or '-'} | {gb and f'{gb:.3f}' or '-'} | "
        f"{f'{gb / ga:.2f}x' if ga and gb else '-'} |"
    )
    pa, pb = ours.get("peak_gib"), (ref or {}).get("peak_gib")
    rows.append(f"| peak GiB | - | {pa and f'{pa:.1f}' or '-'} | {pb and f'{pb:.1f}' or '-'} | - |")
    return "\n".join(rows)


def log(msg: str) -> None:
    """A progress line on stderr, from the first rank only under torch.distributed."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def join_ranks(opts: BenchOptions) -> int:
    """The process group of an --expert-parallel / --data-parallel run (torchrun's); its size, or 1."""
    want = max(opts.expert_parallel, opts.data_parallel)
    if want == 1:
        return 1
    return join(want, "--expert-parallel" if opts.expert_parallel > 1 else "--data-parallel")[1]


def cpu_available_bytes() -> int | None:
    """Memory this machine can still give a process (MemAvailable on Linux), or None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def random_model_bytes(cfg_dict: dict[str, Any], dtype: torch.dtype, ctx: int) -> tuple[int, int]:
    """Bytes `random_model` allocates for this shape's weights, and a cache of `ctx` tokens (counted on the meta
    device: nothing allocated)."""
    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    es = torch.tensor([], dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * es, kv_bytes(cfg, ctx + 2 * cfg.canvas_length, dtype)


def check_cpu_memory(cfg_dict: dict[str, Any], dtype: torch.dtype, ctx: int, what: str) -> None:
    """ValueError, before anything is allocated, when random weights of this shape and the largest context's cache
    do not fit the memory this machine has available (the kernel would kill the process part-way instead)."""
    available = cpu_available_bytes()
    weights, cache = random_model_bytes(cfg_dict, dtype, ctx)
    need = weights + cache + GIB  # a GiB for activations and the process itself
    if available is not None and need > available:
        raise ValueError(
            f"{what} needs ~{need / GIB:.1f} GiB in {str(dtype).removeprefix('torch.')} ({weights / GIB:.1f} of "
            f"weights, {cache / GIB:.1f} of {ctx}-token cache) and this machine has {available / GIB:.1f} GiB "
            "available: measure the demo model (bare on CPU), --tiny, -m DIR, or on a GPU"
        )


def bench_device(opts: BenchOptions) -> torch.device:
    """--device (ValueError for one this torch cannot run on), else cuda when there is one, else cpu."""
    return (
        check_device(opts.device)
        if opts.device
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )


def choose_weights(opts: BenchOptions, device: torch.device) -> BenchOptions:
    """What a bare bench measures: the real shape on a GPU; on CPU, where the real shape's ~48 GiB of weights
    rarely fit (and would take hours), the bundled demo model (--tiny's shape in a build without it), said on
    stderr. -m, --tiny and --real are taken as given."""
    if device.type != "cpu" or opts.model or opts.tiny or opts.real:
        return opts
    from diffgemma.weights.download import bundled_model

    demo = bundled_model()
    contexts = opts.contexts or TINY_CONTEXTS  # the demo model has 8,192 positions
    if demo is None:
        log(
            "diffgemma: bench on CPU: measuring the tiny shape (--real for the 26B-A4B shape, -m DIR a checkpoint)"
        )
        return dataclasses.replace(opts, tiny=True, contexts=contexts)
    log(
        f"diffgemma: bench on CPU: measuring the bundled demo model ({demo.name}), not the 26B-A4B shape "
        "(--real for it, -m DIR for a checkpoint, --tiny for the tiny shape)"
    )
    return dataclasses.replace(opts, model=str(demo), contexts=contexts)


def setup(opts: BenchOptions) -> tuple[ModelRunner, dict[str, Any], dict[str, Any]]:
    """The model on its device, its runner, the config it was built from and the results' header (`opts` checked
    by the caller)."""
    device = bench_device(opts)
    dtype_name = opts.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "dtype": dtype_name,
        "contexts": opts.context_list(),
    }
    if not opts.model and device.type == "cpu":
        shape = "the tiny shape" if opts.tiny else "the real 26B-A4B shape"
        check_cpu_memory(tiny_config() if opts.tiny else REAL_CONFIG, dtype, max(opts.context_list()), shape)
    t0 = time.perf_counter()
    if opts.model:
        model, cfg_dict = load_checkpoint(opts.model, str(device), dtype)
        results["weights"] = f"checkpoint {opts.model}"
    else:
        cfg_dict = tiny_config() if opts.tiny else REAL_CONFIG
        model = random_model(cfg_dict, str(device), dtype, init=opts.init)
        results["weights"] = (
            "random, generated on device"
            + (" (tiny shape)" if opts.tiny else " (real shape)")
            + (", transformers' _init_weights distribution" if opts.init == "hf" else ", wide test init")
        )
        results["init"] = opts.init
    if device.type == "cpu":
        results["threads"] = set_cpu_threads(model.cfg, opts.threads)
        # PASSIVE unless the user set another or imported torch before diffgemma
        results["omp_wait_policy"] = OMP_WAIT_POLICY
    # DIFFGEMMA_* variables apply, as in every command (`DIFFGEMMA_ATTENTION_TOPK=1`: the sparse full layers)
    runtime = load_runtime_config(
        kernels=opts.kernels,
        compile=opts.compile,
        prefill_chunk=opts.prefill_chunk,
        expert_parallel=opts.expert_parallel,
    )
    results["attention_topk"] = runtime.attention_topk
    runner = ModelRunner(model, runtime)
    if opts.quant:  # the bf16 model's outputs first, then the same weights quantized
        g = torch.Generator().manual_seed(2)
        prompt = torch.randint(0, model.cfg.vocab_size, (1, 512), generator=g).to(device)
        canvas = torch.randint(0, model.cfg.vocab_size, (1, model.cfg.canvas_length), generator=g).to(device)
        ref = layer_outputs(model, prompt, canvas)
        repeat = quant_error(
            ref, layer_outputs(model, prompt, canvas)
        )  # the noise floor: bf16 against itself
        results["bf16_weight_gib"] = weight_bytes(model) / GIB
        results["quant"] = quantize_weights(model, opts.quant, opts.quant_set)
        results["quant"].update(quant_error(ref, layer_outputs(model, prompt, canvas)))
        results["quant"]["bf16_repeat"] = repeat
        del ref
        log(
            f"quantized ({opts.quant}{''.join(' --set ' + s for s in opts.quant_set)}): logits relative error "
            f"{results['quant']['logits_rel_err']:.4f}, argmax agreement {results['quant']['argmax_agreement']:.3f}"
        )
    results["weight_gib"] = weight_bytes(model) / GIB
    log(f"model ready in {time.perf_counter() - t0:.1f} s: {results['weight_gib']:.2f} GiB of weights")
    return runner, cfg_dict, results


def ours_need(runner: ModelRunner) -> Callable[[int], int]:
    """Device bytes our measurement at a context needs: cache, prefill-chunk activations, graph pools, generously."""
    cfg, device = runner.cfg, runner.device
    return lambda ctx: (
        kv_bytes(cfg, ctx + 2 * cfg.canvas_length, runner.dtype) + 8 * GIB if device.type == "cuda" else 0
    )


def save(results: dict[str, Any], out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")


def run(opts: BenchOptions) -> dict[str, Any]:
    """`diffgemma bench`: measure our runner, print the table, write the JSON; returns the results. Under
    torchrun with --data-parallel every rank measures and the first one reports; with --expert-parallel the first
    one measures while the others run their experts' share of its forwards."""
    opts.check()
    opts = choose_weights(opts, bench_device(opts))
    ranks = join_ranks(opts)
    runner, _, results = setup(opts)
    results.update(expert_parallel=opts.expert_parallel, data_parallel=opts.data_parallel, ranks=ranks)
    if opts.expert_parallel > 1 and torch.distributed.get_rank() > 0:
        runner.follow()  # rank 0 measures; this rank runs its experts' share of every forward
        leave()
        return results
    results["diffgemma"] = measure(
        OursRunner(runner), opts.context_list(), opts, runner.device, ours_need(runner), log
    )
    results["diffgemma"]["weights_gib"] = results["weight_gib"]
    if opts.concurrency:
        ns = [int(x) for x in opts.concurrency.split(",") if x.strip()]
        results["concurrency"] = concurrency(runner, opts, ns, torch.Generator().manual_seed(7))
    if opts.schema:
        results["schema"] = schema_timing(runner, opts.reps)
    if opts.topk_error:
        results["topk_error"] = topk_error(runner, opts.context_list(), torch.Generator().manual_seed(11))
    if opts.expert_parallel > 1:
        release()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() > 0:
        leave()
        return results
    save(results, opts.out)
    print(table(results, opts.context_list()))
    leave()
    return results
