"""Block-diffusion training of a DiffusionGemma-architecture model on the synthetic instruction corpus.

Objective (one example = one canvas):
  * the reply target T (ending on its stop token) is cut at an offset s: the model sees the prompt plus T[:s]
    through the causal encoder (the KV cache at inference) and must write the canvas T[s : s + C]. s = 0 most of
    the time; for replies longer than one canvas s is also a multiple of C (the next block after committed
    blocks) or, rarely, any offset (the engine's confidence trim can commit a shorter block);
  * the canvas is corrupted by replacing each token with a uniformly random id (over the config's vocab, as
    the engine's noise) at a rate t ~ U(0, 1) per example (t = 1 for 10% of examples: the first step's
    all-noise canvas);
  * cross-entropy against the clean canvas at every position (uniform noise is not marked, so the model must
    also confirm the tokens that survived);
  * self-conditioning on about half the batches: a no-grad first pass on the same noisy canvas gives logits,
    their tempered softmax (T ~ U(0.4, 1.0), the engine's temperature range) is the SC signal of the trained
    pass. Passes without an SC signal use the engine's first-step seed (the canvas's own embedding) 70% of the
    time and no SC otherwise (the reference sampler's first step).

Canvas rows after the stop token are trained to <pad> (id 0). The engine stops at the first stop token of a
block, so those rows are never returned; but the sampler's early stop needs LOW entropy on every row
(`confidence_threshold` on the mean entropy, the plateau rule) and the commit trim looks at row confidence, so a
fixed, easily predicted filler lets a finished block stop after a few steps instead of running to
`max_denoising_steps`. It is also what the engine's pad gate and empty-reply retry expect the filler to be. The
pad rows are down-weighted (`pad_weight`) so that the few content tokens dominate the loss.

AdamW (betas 0.9/0.95, weight decay on matrices only) with linear warm-up and cosine decay to 10% of the peak,
gradient clipping at 1.0 (a step whose gradient is not finite is skipped), bf16 autocast on CUDA (fp32 master
weights), the layers through torch.compile on CUDA. Checkpoints are written in the real
on-disk format (bf16) and training resumes from `train_state/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from diffgemma.train import checkpoint as ckpt
from diffgemma.train import data
from diffgemma.train.batches import Batch, Prefetcher, task_weights
from diffgemma.train.forward import train_forward
from diffgemma.train.tokenizer import WORDS, check_special_ids, demo_tokenizer, with_words
from diffgemma.weights.loader import load_model

# The layers through torch.compile on CUDA (fused elementwise work); eager on CPU, where the tests run.
COMPILE_ON_CUDA = True

PRESETS: dict[str, dict[str, Any]] = {
    # The bundled demo model: 6 layers (sliding, sliding, full) x 2, window 128, 8 experts top-2.
    "demo": dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_experts=8),
    # A very small model for CPU smoke tests.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        head_dim=16,
        global_head_dim=32,
        sliding_window=32,
        layer_types=("sliding_attention", "full_attention"),
    ),
}


@dataclass
class TrainConfig:
    out: str
    steps: int = 3000
    batch: int = 128
    lr: float = 1.5e-3
    warmup: int = 150
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    preset: str = "demo"
    canvas_length: int = 32
    max_denoising_steps: int = 16
    vocab_size: int = 4096  # tokenizer cap; the config's vocab is the tokenizer's size rounded up to 64
    sc_prob: float = 0.5
    pad_weight: float = 0.25
    time_limit: float = 0.0  # seconds of training before a clean stop (0 = none)
    log_every: int = 25
    ckpt_every: int = 500
    max_shard_mb: float = 0.0  # shard model.safetensors above this size (0 = one file)
    resume: bool = False
    init: str = ""  # start from this checkpoint's weights and tokenizer (fine-tuning) instead of a fresh init
    mix: str = ""  # task weights over data.TASK_WEIGHTS, "task=weight,..."
    curriculum_steps: int = 0  # retrieval lists capped at 2 + step // 400 lines before this step (0 = off)
    lookup_weight: float = 0.0  # weight of the two-hop lookup attention loss (`forward`); 0 = off

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(cfg: TrainConfig, step: int, total: int | None = None, progress: float | None = None) -> float:
    total = cfg.steps if total is None else total
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup) if progress is None else progress
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def autocast_for(device: str, cache: bool = True):
    """A context factory: bf16 autocast on CUDA (fp32 master weights), nothing elsewhere. A CUDA graph capture
    needs `cache=False` (autocast's cast cache would hold tensors from outside the graph's memory)."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_config(cfg: TrainConfig, vocab: int) -> dict[str, Any]:
    tc = ckpt.text_config(-(-vocab // 64) * 64, **PRESETS[cfg.preset])
    return ckpt.full_config(tc, cfg.canvas_length)


def set_compile(on: bool) -> None:
    global COMPILE_ON_CUDA
    COMPILE_ON_CUDA = on


# -- the step ---------------------------------------------------------------------------------------------


def corrupt(target: torch.Tensor, vocab: int, gen: torch.Generator | None = None) -> torch.Tensor:
    b, c = target.shape
    dev = target.device
    rate = torch.rand(b, 1, device=dev, generator=gen)
    rate = torch.where(torch.rand(b, 1, device=dev, generator=gen) < 0.1, torch.ones_like(rate), rate)
    noise = torch.randint(0, vocab, (b, c), device=dev, generator=gen)
    hit = torch.rand(b, c, device=dev, generator=gen) < rate
    return torch.where(hit, noise, target)


def hidden_lookups(batch: Batch, noisy: torch.Tensor) -> torch.Tensor:
    """batch.lookup, kept only where the corruption replaced the answer's code word: where the slot still shows
    it, the head can match the slot's own token instead of the asked key (a CPU run learned just that)."""
    slot = batch.lookup[:, 0].clamp_min(0)
    rows = torch.arange(slot.shape[0], device=slot.device)
    hidden = (batch.lookup[:, 0] >= 0) & (noisy[rows, slot] != batch.target[rows, slot])
    return torch.where(hidden[:, None], batch.lookup, torch.full_like(batch.lookup, -1))


def loss_on(
    model,
    batch: Batch,
    sc: bool | torch.Tensor,
    seed_first: bool | torch.Tensor,
    temp: float | torch.Tensor,
    autocast,
    lookup_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss (plus `lookup_weight` x the two-hop lookup attention loss, `forward.lookup_nll`) and,
    detached, (loss, content_loss, content_acc, lookup_nll); lookup_nll is 0 when the weight is 0. `sc` and
    `seed_first` as 0-dim bool tensors: the same step with the choices on the device (the first pass always runs,
    its probabilities zeroed when self-conditioning is off)."""
    vocab = model.cfg.vocab_size
    noisy = corrupt(batch.target, vocab)
    sc_probs = None
    compiled = COMPILE_ON_CUDA and batch.prompt.is_cuda
    flags = isinstance(sc, torch.Tensor)
    with autocast():
        if flags or sc:
            with torch.no_grad():
                first = train_forward(
                    model, batch.prompt, batch.mask, noisy, sc_seed=seed_first, compiled=compiled
                )
                sc_probs = torch.softmax(first.float() / temp, dim=-1)
                if flags:
                    sc_probs = sc_probs * sc
        out = train_forward(
            model,
            batch.prompt,
            batch.mask,
            noisy,
            sc_probs=sc_probs,
            sc_seed=seed_first & ~sc if flags else seed_first and not sc,
            compiled=compiled,
            lookup=hidden_lookups(batch, noisy) if lookup_weight > 0 else None,
            lines=batch.lines,
        )
    logits, nll = out if lookup_weight > 0 else (out, torch.zeros((), device=out.device))
    ce = F.cross_entropy(logits.float().flatten(0, 1), batch.target.flatten(), reduction="none").view_as(
        batch.weight
    )
    loss = (ce * batch.weight).sum() / batch.weight.sum() + lookup_weight * nll
    with torch.no_grad():
        content = batch.content.float()
        correct = (logits.argmax(-1) == batch.target).float()
        stats = torch.stack(
            [
                loss.detach(),
                (ce * content).sum() / content.sum(),
                (correct * content).sum() / content.sum(),
                nll.detach().float(),
            ]
        )
    return loss, stats


def step_choices(rng: random.Random, cfg: TrainConfig) -> tuple[bool, bool, float]:
    """The step's host-side draws: self-conditioning on, first-pass SC seed, SC temperature."""
    return rng.random() < cfg.sc_prob, rng.random() < 0.7, rng.uniform(0.4, 1.0)


def step_body(
    model,
    opt,
    micro: list[Batch],
    sc: bool | torch.Tensor,
    seed_first: bool | torch.Tensor,
    temp,
    cfg: TrainConfig,
    autocast,
):
    """One optimizer step over device-resident microbatches; returns (loss, content_loss, content_acc,
    lookup_nll, skipped, grad_norm). A step whose gradient is not finite is skipped: no update, zero stats."""
    n_rows = sum(b.prompt.shape[0] for b in micro)
    opt.zero_grad(set_to_none=True)
    total = None
    for batch in micro:
        rows = batch.prompt.shape[0]
        loss, stats = loss_on(model, batch, sc, seed_first, temp, autocast, cfg.lookup_weight)
        (loss * rows / n_rows).backward()
        part = stats * (rows / n_rows)
        total = part if total is None else total + part
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    finite = torch.isfinite(norm)
    if opt.defaults.get("fused"):
        opt.found_inf = (~finite).float()  # the fused AdamW skips the update on the device (graph-safe)
        opt.step()
    elif finite:
        opt.step()
    ok = finite.float()
    return torch.cat([torch.nan_to_num(total) * ok, (1 - ok)[None], torch.nan_to_num(norm)[None] * ok])


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def write_readme(out: Path, cfg: TrainConfig, model_cfg: dict[str, Any], info: dict[str, Any]) -> None:
    tc = model_cfg["text_config"]
    n_params = info.get("parameters", 0)
    lines = [
        "# diffgemma demo model",
        "",
        "A small DiffusionGemma-architecture model (Gemma 4 MoE, block diffusion) trained by",
        "`diffgemma train` on the synthetic instruction corpus of `diffgemma.train.data` (arithmetic, key-value",
        "retrieval beyond the sliding window, counting answers longer than one canvas, tool calls, answers after",
        "tool results, short thought-channel answers, yes/no questions), rendered in the Gemma 4 chat format.",
        "It knows nothing else: it exists so that the engine, CLI and server have a real model to run on CPU.",
        "",
        *(
            [f"This run fine-tuned the weights of `{cfg.init}` (its tokenizer and config too).", ""]
            if cfg.init
            else []
        ),
        "## Shape",
        "",
        f"- parameters: {n_params:,} (stored as bf16)",
        f"- vocab {tc['vocab_size']} (byte-level BPE, Gemma 4 special tokens at their real ids, digits split)",
        f"- hidden {tc['hidden_size']}, {tc['num_hidden_layers']} layers {tc['layer_types']}",
        f"- {tc['num_attention_heads']} heads; sliding head_dim {tc['head_dim']} x {tc['num_key_value_heads']} kv"
        f" heads, window {tc['sliding_window']}; full head_dim {tc['global_head_dim']} x"
        f" {tc['num_global_key_value_heads']} kv head (k = v)",
        f"- dense MLP {tc['intermediate_size']} + {tc['num_experts']} experts top-{tc['top_k_experts']}"
        f" ({tc['moe_intermediate_size']} each)",
        f"- canvas_length {model_cfg['canvas_length']}, max_denoising_steps {cfg.max_denoising_steps}",
        "",
        "## Training",
        "",
        "```json",
        json.dumps({"train_config": cfg.to_json(), "result": info}, indent=2),
        "```",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def plot_losses(out: Path, log: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in log], label="weighted loss")
    ax.plot(steps, [r["content_loss"] for r in log], label="loss on reply tokens")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title("diffgemma demo model: block-diffusion training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "loss_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) into cfg.out; returns a summary dict."""
    t_start = time.time()
    task_weights(cfg.mix)  # a bad --mix fails here, not in the data workers
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)

    tok_path = out / "tokenizer.json"
    if cfg.init:  # fine-tune: the init checkpoint's tokenizer, config and weights
        init = Path(cfg.init)
        tok = Tokenizer.from_file(str(init / "tokenizer.json"))
        check_special_ids(tok)
        model_cfg = json.loads((init / "config.json").read_text())
        if "quantization_config" in model_cfg:  # a pack's weights are not trainable parameters
            raise ValueError(f"--init {init} is a quantized pack: fine-tune from a bf16 checkpoint")
        # the words the demo tasks need as one token each, added if the init's tokenizer lacks them
        tok, old_tok = with_words(tok, WORDS), tok
        if model_cfg.get("canvas_length") != cfg.canvas_length:
            raise ValueError(
                f"--init checkpoint has canvas_length {model_cfg.get('canvas_length')}, "
                f"training uses {cfg.canvas_length}"
            )
        model = ckpt.make_trainable(load_model(init, device, torch.float32))
        model, model_cfg = ckpt.grow_vocab(model, model_cfg, old_tok, tok)
    else:
        if cfg.resume and tok_path.exists():
            tok = Tokenizer.from_file(str(tok_path))
            check_special_ids(tok)
        else:
            tok = demo_tokenizer(data.tokenizer_corpus(), vocab_size=cfg.vocab_size)
        model_cfg = model_config(cfg, tok.get_vocab_size())
        model = ckpt.build_model(model_cfg, cfg.seed, device)
    gen_cfg = ckpt.generation_config(cfg.max_denoising_steps)
    n_params = sum(p.numel() for p in model.parameters())
    graphs = device.startswith("cuda")
    # Graph replay needs the optimizer's step count and learning rate on the device (capturable, tensor lr).
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=torch.tensor(cfg.lr, device=device) if graphs else cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=graphs,
        capturable=graphs,
    )
    start, log = 0, []
    if cfg.resume:
        info = ckpt.load_train_state(out, model, opt)
        if info is not None:
            start = int(info["step"])
            log = info.get("log", [])
            print(f"resumed from step {start}", flush=True)
    (out / "train_config.json").write_text(
        json.dumps(
            {"train_config": cfg.to_json(), "model_config": model_cfg, "parameters": n_params}, indent=2
        )
    )
    print(f"model: {n_params:,} parameters, vocab {model.cfg.vocab_size}, device {device}", flush=True)

    autocast = autocast_for(device, cache=not graphs)
    graphed = None

    def save(step: int, final: bool) -> None:
        shard = int(cfg.max_shard_mb * 2**20) if cfg.max_shard_mb > 0 else None
        ckpt.write_checkpoint(model, out, model_cfg, gen_cfg, tok, max_shard_bytes=shard)
        info = {"step": step, "log": log, "parameters": n_params}
        ckpt.save_train_state(out, model, opt, info)
        if final:
            last = log[-1] if log else {}
            write_readme(
                out,
                cfg,
                model_cfg,
                {
                    "parameters": n_params,
                    "steps": step,
                    "final_loss": last.get("loss"),
                    "final_content_loss": last.get("content_loss"),
                    "train_seconds": round(time.time() - t_start, 1),
                    "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                },
            )
            with open(out / "loss_log.csv", "w") as f:
                f.write("step,loss,content_loss,content_acc,lr,seconds\n")
                for r in log:
                    f.write(
                        f"{r['step']},{r['loss']:.5f},{r['content_loss']:.5f},{r['content_acc']:.4f},"
                        f"{r['lr']:.6g},{r['seconds']:.1f}\n"
                    )
            plot_losses(out, log)

    workers = max(0, min(6, (os.cpu_count() or 1) - 4)) if graphs else 0
    prefetch = Prefetcher(cfg, tok, start, cfg.steps, pin=graphs, workers=workers)
    rng = random.Random(f"{cfg.seed}:train:{start}")
    sums: torch.Tensor | None = None  # running step_body stats, kept on the device
    n_acc = 0
    data_wait = 0.0  # seconds the loop waited for batches (the data workers falling behind)
    step = start
    total = cfg.steps
    t_loop = time.time()
    # A time-limited run's cosine follows elapsed time, so that it fully decays by the limit; its clock starts
    # once the one-off startup work is done (torch.compile and the graph capture took ~2 minutes on an
    # H200, which a clock started at the first step spent at the peak learning rate's expense).
    t_sched: float | None = None
    try:
        model.train()
        while step < total:
            now = time.time()
            if cfg.time_limit and now - t_loop > cfg.time_limit:
                print(f"time limit reached at step {step}", flush=True)
                break
            if t_sched is None and (graphed.graph is not None if graphs and graphed else step > start):
                t_sched = now
                print(f"startup done after {now - t_loop:.0f}s (step {step})", flush=True)
            progress = None
            if cfg.time_limit and t_sched is not None:
                progress = max(step / total, (now - t_sched) / max(1.0, cfg.time_limit - (t_sched - t_loop)))
            lr = lr_at(cfg, step, total, progress)
            for g in opt.param_groups:
                if isinstance(g["lr"], torch.Tensor):  # capturable AdamW: the graphs read it on the device
                    g["lr"].fill_(lr)
                else:
                    g["lr"] = lr
            t_get = time.time()
            micro = prefetch.get()
            data_wait += time.time() - t_get
            choices = step_choices(rng, cfg)
            stats = None
            if graphs:
                if graphed is None:
                    from diffgemma.train.graphed import GraphedStep

                    graphed = GraphedStep(model, opt, cfg, micro, device, autocast)
                try:
                    stats = graphed(micro, *choices)
                except Exception as e:  # noqa: BLE001 - a failed compile or capture: eager from here, loudly
                    print(
                        f"CUDA graph step failed ({type(e).__name__}: {e}); eager steps and layers from here",
                        flush=True,
                    )
                    graphs = False
                    set_compile(False)
            if stats is None:
                stats = step_body(model, opt, [b.to(device) for b in micro], *choices, cfg, autocast)
            sums = stats if sums is None else sums + stats
            n_acc += 1
            step += 1
            if step % cfg.log_every == 0 or step == total:
                total_stats = sums.tolist()  # the only host sync
                skipped = int(round(total_stats[4]))
                loss, content_loss, content_acc, lookup_nll, _, grad_norm = (
                    x / max(1, n_acc - skipped) for x in total_stats
                )
                row = {"loss": loss, "content_loss": content_loss, "content_acc": content_acc}
                row.update(step=step, lr=lr, seconds=time.time() - t_start, data_wait=data_wait)
                row.update(grad_norm=grad_norm, skipped=skipped, lookup_nll=lookup_nll)
                log.append(row)
                print(
                    f"step {step:5d}  loss {row['loss']:.4f}  reply-loss {row['content_loss']:.4f}  "
                    f"reply-acc {row['content_acc']:.3f}  grad-norm {grad_norm:.2f}  lr {lr:.2e}  "
                    + (f"lookup-nll {lookup_nll:.3f}  " if cfg.lookup_weight > 0 else "")
                    + f"{row['seconds']:.0f}s (data wait {data_wait:.0f}s)"
                    + (f"  SKIPPED {skipped} non-finite steps" if skipped else ""),
                    flush=True,
                )
                if skipped == n_acc and graphed is not None and COMPILE_ON_CUDA:
                    print("every step of the interval was non-finite: eager layers from here", flush=True)
                    set_compile(False)
                    graphed = None  # recaptured with eager layers
                sums, n_acc = None, 0
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < total:
                save(step, final=False)
    finally:
        prefetch.close()
    model.eval()
    save(step, final=True)
    last = log[-1] if log else {}
    return {
        "steps": step,
        "final_loss": last.get("loss"),
        "final_content_loss": last.get("content_loss"),
        "seconds": time.time() - t_start,
        "parameters": n_params,
    }
