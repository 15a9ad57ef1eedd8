"""Localise a logits mismatch at the real shape: ours (fast, graphed) vs ours (torch reference) vs transformers."""

import torch

from diffgemma import bench

m = bench.random_model(bench.REAL_CONFIG, "cuda", torch.bfloat16)
hf, _ = bench.hf_model_sharing(m, bench.REAL_CONFIG)
from transformers.cache_utils import DynamicCache  # noqa: E402

g = torch.Generator().manual_seed(7)
for ctx in (200, 1024):
    ids = torch.randint(0, m.cfg.vocab_size, (1, ctx), generator=g)
    canvas = torch.randint(0, m.cfg.vocab_size, (1, 256), generator=g).cuda()
    out = {}
    for name, fast in (("fast", True), ("ref", False)):
        m.fast = fast
        kv = m.new_cache(ctx + 512)
        m.prefill(ids, kv)
        out[name] = m.denoise(canvas, kv).float()
        out[name + "_kv"] = kv
    m.fast = True
    out["ref_kv_fast_denoise"] = m.denoise(canvas, out["ref_kv"]).float()
    cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
    hf.model.encoder(input_ids=ids.cuda(), past_key_values=cache)
    out["hf"] = hf(decoder_input_ids=canvas, past_key_values=cache).logits.float()
    names = ["fast", "ref", "ref_kv_fast_denoise", "hf"]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            d = (out[a] - out[b]).abs()
            agree = (out[a].argmax(-1) == out[b].argmax(-1)).float().mean()
            print(
                f"ctx {ctx} {a} vs {b}: mean {d.mean():.4f} max {d.max():.3f} argmax {agree:.3f}", flush=True
            )
    kf, kr = out["fast_kv"], out["ref_kv"]
    for layer in (0, 5):
        a, b = kf.read(layer), kr.read(layer)
        print(
            f"ctx {ctx} kv layer {layer}: k mean|d| {(a[0] - b[0]).float().abs().mean():.4f} "
            f"v {(a[1] - b[1]).float().abs().mean():.4f} |k| {b[0].float().abs().mean():.3f}",
            flush=True,
        )
