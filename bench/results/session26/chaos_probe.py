"""Session 26, CPU: is the 30-layer network chaotic on random weights? Our model in bf16 against fp32 on the same
weights (and fp32 against fp32 with every weight perturbed by 1e-4 relative), a mid-size config with the real
layer pattern and 128 experts top-8, denoise logits of a 64-row canvas after a 256-token prompt. Inits: transformers'
(std 0.02, norm weights 1), with the q/k norm weights scaled (`qk`: times d^-1/4, so the scores' std is qk^2, not
sqrt(d)), larger router weights (`router_std`), fan-in scaled weights. Outputs: chaos_probe_cpu.txt (the layers
probe ran with n_layers (1, 2, 6, 12, 30), then (6, 12, 30), then (30,)).

    PYTHONPATH=src python chaos_probe.py hf "r1={'router_std': 0.2}" ...
    PYTHONPATH=src python chaos_probe.py layers "{'qk': 0.7, 'router_std': 2.0}"
"""

import sys
import time

import torch

from diffgemma.bench import REAL_CONFIG
from diffgemma.config import ModelConfig
from diffgemma.model.model import DiffusionGemma
from diffgemma.weights.loader import checkpoint_names

torch.set_num_threads(2)
TC = dict(
    REAL_CONFIG["text_config"],
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=384,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    sliding_window=128,
    moe_intermediate_size=128,
)
CFG = {**REAL_CONFIG, "canvas_length": 64, "text_config": TC}


def build(init: dict, seed=0):
    cfg = ModelConfig.from_dict(CFG)
    with torch.device("meta"):
        m = DiffusionGemma(cfg)
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    for name, module, attr in checkpoint_names(m):
        shape = tuple(getattr(module, attr).shape)
        ones = "norm" in name or name.endswith(("router.scale", "per_expert_scale", "layer_scalar"))
        if ones:
            t = torch.ones(*shape)
            if init.get("qk") and name.endswith(("q_norm.weight", "k_norm.weight")):
                t = t * init["qk"] * shape[0] ** -0.25
            if init.get("norm_std") and "norm" in name:
                t = t + init["norm_std"] * torch.randn(*shape, generator=g)
        else:
            std = init.get("std", 0.02)
            if init.get("fan_in"):
                std = init["fan_in"] * shape[-1] ** -0.5
            if "embed_tokens" in name and init.get("embed_std"):
                std = init["embed_std"]
            if "router.proj" in name and init.get("router_std"):
                std = init["router_std"]
            if name.endswith("experts.gate_up_proj") and init.get("fan_in"):
                std = init["fan_in"] * h**-0.5
            t = torch.randn(*shape, generator=g) * std
        setattr(module, attr, torch.nn.Parameter(t, requires_grad=False))
    for layer in m.layers:
        layer.encoder_layer_scalar = torch.nn.Parameter(
            layer.layer_scalar.detach().clone(), requires_grad=False
        )
    m.inv_freq = {k: v for k, v in m.inv_freq.items()}
    return m


@torch.no_grad()
def logits(m, dtype, ids, canvas):
    m = m.to(dtype)
    kv = m.new_cache(ids.shape[1] + 2 * 64)
    m.prefill(ids, kv)
    return (
        m.denoise(canvas, kv).float()[0]
        if m.denoise(canvas, kv).dim() == 3
        else m.denoise(canvas, kv).float()
    )


def run(label, init):
    t0 = time.time()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 16384, (1, 256), generator=g)
    canvas = torch.randint(0, 16384, (1, 64), generator=g)
    m = build(init)
    a = logits(m, torch.float32, ids, canvas)
    b = logits(m, torch.bfloat16, ids, canvas)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    d = (a - b).abs()
    top2 = a.topk(2, -1).values
    print(
        f"{label:40s} rel|d| {float(d.mean() / a.std()):.4f}  argmax {float((a.argmax(-1) == b.argmax(-1)).float().mean()):.3f}"
        f"  argmax=canvas {float((a.argmax(-1) == canvas[0]).float().mean()):.3f}  std {float(a.std()):.3f}"
        f"  margin {float((top2[:, 0] - top2[:, 1]).median()):.3f}  ({time.time() - t0:.0f}s)",
        flush=True,
    )


def layers_probe(init, n_layers_list=(30,)):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 16384, (1, 256), generator=g)
    canvas = torch.randint(0, 16384, (1, 64), generator=g)
    for n in n_layers_list:
        TC["num_hidden_layers"] = n
        TC["layer_types"] = REAL_CONFIG["text_config"]["layer_types"][:n]
        m = build(init)
        a = logits(m, torch.float32, ids, canvas)
        m2 = build(init)
        for p in m2.parameters():
            p.mul_(1 + 1e-4 * torch.randn_like(p))
        c = logits(m2, torch.float32, ids, canvas)
        b = logits(m, torch.bfloat16, ids, canvas)
        a, b, c = (x.reshape(-1, x.shape[-1]) for x in (a, b, c))
        print(
            n,
            "bf16 rel",
            float((a - b).abs().mean() / a.std()),
            "argmax",
            float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "| fp32 1e-4 perturb rel",
            float((a - c).abs().mean() / a.std()),
            "argmax",
            float((a.argmax(-1) == c.argmax(-1)).float().mean()),
            flush=True,
        )


INITS = {
    "hf": {},
    "fan_in": {"fan_in": 1.0},
}
if sys.argv[1:2] == ["layers"]:
    layers_probe(eval(sys.argv[2]) if len(sys.argv) > 2 else {})
    sys.exit()
for arg in sys.argv[1:]:
    label, _, spec = arg.partition("=")
    INITS[label] = eval(spec) if spec else INITS[label]
for label in sys.argv[1:] or INITS:
    label = label.partition("=")[0]
    run(label, INITS[label])
