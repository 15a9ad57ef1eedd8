"""bench/moe_kernels.py's config timing (uniform and skewed routing, the whole Triton MoE of one layer, graphs of
10 calls) for down-kernel variants with one program an expert's column block (m_slots 1: no empty second slots)
beside the default and the previous default; the list twice, for the drift between configs timed in turn."""

import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path("bench").resolve()))
import moe_kernels as mk  # noqa: E402

tm = mk.tm
T = tm.Tiles
VARIANTS = {
    "gu_k256_s2": (dict(block_k=256, num_stages=2), {}),
    "gu_k256_s2_w8": (dict(block_k=256, num_stages=2, num_warps=8), {}),
    "gu_s5": (dict(num_stages=5), {}),
    "gu_s6": (dict(num_stages=6), {}),
    "gu_w8": (dict(num_warps=8), {}),
    "dn_s4": ({}, dict(num_stages=4)),
    "dn_k256_s2": ({}, dict(block_k=256, num_stages=2)),
    "dn_w8": ({}, dict(num_warps=8)),
}
BASE_GU = dict(block_m=32, m_slots=2, tma=True, swap_ab=True, num_stages=4)
BASE_DN = dict(block_m=32, m_slots=2, tma=True, cols_fast=True, swap_ab=True, num_stages=3)
for name, (gu_kw, dn_kw) in VARIANTS.items():
    gu = T(**{**BASE_GU, **gu_kw})
    dn = T(**{**BASE_DN, **dn_kw})
    tm.CONFIGS[name] = tm.MoeConfig(gu, dn)
g = torch.Generator(device="cuda").manual_seed(0)
gate_up = torch.randn(128, 2 * 704, 2816, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
down = torch.randn(128, 2816, 704, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
x = torch.randn(256, 2816, generator=g, device="cuda", dtype=torch.bfloat16)
names = ["m32_s2_tma_swap", *VARIANTS]
mk.bench_configs(names * 2, ["uniform", "skewed"], types.SimpleNamespace(ids=None), gate_up, down, x, g)
