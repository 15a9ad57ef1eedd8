"""GPU sweep: which training change lets the retrieval lookup form? One variant per process, small 'exp' model.

Run from the repository root: `python docs/train/retrieval_sweep/sweep.py VARIANT SECONDS OUTDIR` (see README.md);
variants combine the names tested below with "+". The probe noises only the code-word slot of a clean reply.
"""

import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from diffgemma.chat.template import render_gemma4
from diffgemma.kernels import torch_ref as ops
from diffgemma.train import checkpoint as ckpt
from diffgemma.train import data, trainer
from diffgemma.train.forward import layer_forward, positions_and_masks, train_forward

VAR = sys.argv[1]
LIMIT = float(sys.argv[2])
OUTD = sys.argv[3]
torch.set_num_threads(2)
dev = os.environ.get("DEV", "cuda")
log = open(f"{OUTD}/{VAR}.log", "w")  # noqa: SIM115 - open for the whole run


def say(*a):
    print(VAR, *a, file=log, flush=True)


tok = Tokenizer.from_file("src/diffgemma/assets/demo/tokenizer.json")
S, Fu = "sliding_attention", "full_attention"
exp = dict(
    hidden_size=128,
    intermediate_size=192,
    moe_intermediate_size=64,
    num_experts=4,
    head_dim=32,
    global_head_dim=64,
    sliding_window=64,
    layer_types=(S, S, Fu, S),
)
if "heads8" in VAR:
    exp.update(num_attention_heads=8, num_key_value_heads=4)
trainer.PRESETS["exp"] = exp
PRESET = "demo" if "demo" in VAR else "exp"
B = 256 if "b256" in VAR else 64
EVERY = int(os.environ.get("EVERY", 1000))
lr = 3e-3 if "lr3" in VAR else (5e-4 if "lr05" in VAR else 1.5e-3)
cfg = trainer.TrainConfig(out="/tmp/x", batch=B, lr=lr, warmup=200, preset=PRESET)
model = ckpt.build_model(trainer.model_config(cfg, tok.get_vocab_size()), 0, dev)
with torch.no_grad():
    for layer in model.layers:
        if "post" in VAR:
            layer.post_attention_layernorm.fill_(0.1)
            layer.post_feedforward_layernorm.fill_(0.1)
        if "qk" in VAR:
            layer.q_norm.fill_(layer.head_dim**-0.25)
            layer.k_norm.fill_(layer.head_dim**-0.25)
model.train()
opt = torch.optim.AdamW(trainer.param_groups(model, 0.05), lr=lr, betas=(0.9, 0.95), fused=dev == "cuda")
ac = trainer.autocast_for(dev)
KEYS = data.ANIMALS + data.OBJECTS
FIXED = {k: data.CODE_WORDS[i % len(data.CODE_WORDS)] for i, k in enumerate(sorted(KEYS))}


def lst(keys, vals):
    return "\n".join(f"- {k}: {v}" for k, v in zip(keys, vals, strict=True))


def example(rng):
    r = rng.random()
    if "fixed" in VAR and r < 0.4:
        n = rng.randint(2, 24)
        keys = rng.sample(KEYS, n)
        vals = [FIXED[k] for k in keys]
        i = rng.randrange(n)
        user = f"Here is a list of code words.\n{lst(keys, vals)}\nWhat is the code word for {keys[i]}?"
        return data.Example(
            "retrieval",
            render_gemma4([{"role": "user", "content": user}]),
            f"The code word for {keys[i]} is {vals[i]}.{data.TURN_END}",
            user,
        )
    if "copy" in VAR and r > 0.7:
        n = rng.randint(2, 5)
        keys = rng.sample(KEYS, n)
        vals = [rng.choice(data.CODE_WORDS) for _ in keys]
        user = f"Here is a list of code words.\n{lst(keys, vals)}\nRepeat the list."
        return data.Example(
            "retrieval",
            render_gemma4([{"role": "user", "content": user}]),
            lst(keys, vals) + data.TURN_END,
            user,
        )
    if "n2" in VAR:
        return data._retrieval(rng, lines=(2, 2))
    if "cur" in VAR:
        return data._retrieval(rng, lines=(2, min(24, 2 + STEP[0] // 400)))
    return data._retrieval(rng, lines=(2, 8) if rng.random() < 0.6 else (8, 24))


is_id = tok.token_to_id("Ġis")


def probe_set(lines, seed):
    prng = random.Random(seed)
    exs = [data._retrieval(prng, lines=lines) for _ in range(256)]
    rows = trainer.make_batch(tok, exs, random.Random(1), cfg.canvas_length, cfg.pad_weight)
    b = trainer.collate(rows, max(len(r[0]) for r in rows)).to(dev)
    canvas = b.target.clone()
    n = len(exs)
    pos = (canvas == is_id).float().argmax(1) + 1
    canvas[torch.arange(n), pos] = torch.randint(
        3, 2000, (n,), generator=torch.Generator().manual_seed(seed)
    ).to(dev)
    return b, canvas, pos


PROBES = {"2": probe_set((2, 2), 97), "2-8": probe_set((2, 8), 99), "16-24": probe_set((16, 24), 98)}


def probe():
    out = {}
    model.eval()
    with torch.no_grad(), ac():
        for name, (b, canvas, pos) in PROBES.items():
            pred = train_forward(model, b.prompt, b.mask, canvas).argmax(-1)[torch.arange(len(pos)), pos]
            out[name] = round((pred == b.target[torch.arange(len(pos)), pos]).float().mean().item(), 3)
    model.train()
    return out


def ar_loss(batch):
    """Next-token loss on the prompt through the causal encoder (the AR-pretraining a real Gemma starts from)."""
    ids = torch.cat([batch.prompt, batch.target], 1)
    m = torch.cat([batch.mask, batch.target != 0], 1)
    p = ids.shape[1]
    pos, masks = positions_and_masks(model, m, 0)
    h = model._embed_tokens(ids)
    is_prompt = torch.ones(1, p, 1, dtype=torch.bool, device=dev)
    for layer in model.layers:
        cos, sin = ops.rope_cos_sin(
            model.inv_freq[model.cfg.layer_types[layer.idx]].to(dev), pos.reshape(-1), torch.float32
        )
        h = layer_forward(model, layer, h, cos, sin, masks[layer.sliding], is_prompt, "dense")
    logits = model._logits(h[:, :-1]).float()
    tgt = ids[:, 1:].masked_fill(~m[:, 1:], -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)


rng = random.Random(0)
STEP = [0]
if (
    "valonly" in VAR
):  # diagnostic only: noise just the code-word slot, so every example is a clean lookup signal
    _is = tok.token_to_id("Ġis")

    def corrupt_value(target, vocab, gen=None):
        slot = torch.zeros_like(target, dtype=torch.bool)
        slot[:, 1:] = target[:, :-1] == _is
        return torch.where(slot, torch.randint(0, vocab, target.shape, device=target.device), target)

    trainer.corrupt = corrupt_value
t0 = time.time()
step = 0
hist = []
say("start", json.dumps(probe()))
while time.time() - t0 < LIMIT:
    for g in opt.param_groups:
        g["lr"] = lr * min(1.0, (step + 1) / cfg.warmup)
    exs = [example(rng) for _ in range(B)]
    rows = trainer.make_batch(tok, exs, rng, cfg.canvas_length, cfg.pad_weight)
    batch = trainer.collate(rows, max(len(r[0]) for r in rows)).to(dev)
    sc, seed, temp = trainer.step_choices(rng, cfg)
    if "art" in VAR.split("+"):
        opt.zero_grad(set_to_none=True)
        loss, stats = trainer.loss_on(model, batch, sc, seed, temp, ac)
        with ac():
            loss = loss + 0.5 * ar_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    else:
        stats = trainer.step_body(model, opt, [batch], sc, seed, temp, cfg, ac)
    step += 1
    STEP[0] = step
    if step % EVERY == 0:
        pr = probe()
        hist.append((step, round(time.time() - t0), pr))
        say(step, f"{time.time() - t0:.0f}s", [round(x, 3) for x in stats.tolist()[:3]], json.dumps(pr))
with open(f"{OUTD}/{VAR}.json", "w") as f:
    json.dump({"var": VAR, "steps": step, "hist": hist, "final": probe()}, f)
say("done", step)
