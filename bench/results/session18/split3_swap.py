"""fp32 activations on bf16 experts (a short prompt's prefill: x cut into three bf16 parts, `_mma`'s SPLIT3), one
layer at the real shape, 200 tokens x top 8 (uniform routing): SPLIT3_CONFIG (m32_s2, mma.sync) against the
transposed product (wgmma), with pointer loads and through TMA; graphs of 10 calls (bench/moe_kernels.py's
time_graph); outputs against m32_s2's."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
import moe_kernels as mk  # noqa: E402

tm = mk.tm
T = tm.Tiles
tm.CONFIGS["m32_s2_swap"] = tm.MoeConfig(
    T(block_m=32, m_slots=2, num_stages=3, swap_ab=True), T(block_m=32, m_slots=2, swap_ab=True)
)
tm.CONFIGS["m32_s2_swap_cf"] = tm.MoeConfig(
    T(block_m=32, m_slots=2, num_stages=3, swap_ab=True),
    T(block_m=32, m_slots=2, swap_ab=True, cols_fast=True),
)
tm.CONFIGS["m32_s2_swap_s4"] = tm.MoeConfig(
    T(block_m=32, m_slots=2, num_stages=4, swap_ab=True),
    T(block_m=32, m_slots=2, num_stages=3, swap_ab=True, cols_fast=True),
)
g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(128, 2 * 704, 2816, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(128, 2816, 704, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
for n in (200, 64):
    x = torch.randn(n, 2816, generator=g, device="cuda")
    logits = torch.randn(n, 128, generator=g, device="cuda")
    w, ids = torch.softmax(logits, -1).topk(8, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    want = tm.moe_experts_triton(x, w, ids, gate_up, down, tm.CONFIGS["m32_s2"])
    for name in ["m32_s2", "m32_s2_swap", "m32_s2_swap_cf", "m32_s2_swap_s4", "m32_s2_tma_swap", "m32_s2"]:
        cfg = tm.CONFIGS[name]
        try:
            got = tm.moe_experts_triton(x, w, ids, gate_up, down, cfg)
            diff = float((got - want).abs().max())
            ms = mk.time_graph(
                lambda cfg=cfg, x=x, w=w, ids=ids: tm.moe_experts_triton(x, w, ids, gate_up, down, cfg)
            )
            print(
                f"N={n} {name:16s} {ms * 1e3:8.1f} us a layer  max|diff| vs m32_s2 {diff:.3g} (|out| max {float(want.abs().max()):.3g})"
            )
        except Exception as e:  # noqa: BLE001
            print(f"N={n} {name}: {type(e).__name__}: {str(e)[:150]}")
