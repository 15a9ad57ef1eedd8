"""The Q/K/V norm + RoPE kernel compiled for an H100/H200 (sm_90) on this machine, no GPU needed: its PTX must
round each bf16 product before the add, as the eager ops do. With fused multiply-adds on (Triton's default) the
compiler turned `(x * cos).to(bf16) + (rotate(x) * sin).to(bf16)` into `fma.rn.bf16`, which left 24% of Q's
elements one rounding off on an H200 (bench/results/README.md, tenth session)."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")


def _ptx(**options) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from diffgemma.kernels import triton_qkv as tq

    ptrs = ("qkv_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr", "k_norm_ptr", "q_ptr", "kv_ptr")
    ints = ("T", "stride_t", "stride_ct", "stride_qh", "stride_qt", "stride_kv2", "stride_kvh", "stride_kvt")
    consts = {"NQ": 16, "NKV": 8, "HAS_V": True, "D": 256, "BLOCK_T": tq.BLOCK_T}
    sig = {**dict.fromkeys(ptrs, "*bf16"), **dict.fromkeys(ints, "i32"), "eps": "fp32"}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn=tq._norm_rope_kernel, signature=sig, constexprs=consts)
    try:
        kernel = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tq.NUM_WARPS, **options}
        )
    except (ImportError, KeyError, RuntimeError) as e:  # a triton build without its NVIDIA backend or ptxas
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    return kernel.asm["ptx"]


def test_norm_rope_rounds_each_product_before_the_add():
    from diffgemma.kernels import triton_qkv as tq

    fused = _ptx(enable_fp_fusion=True)
    assert re.search(r"fma\.rn\.bf16\b", fused), "the check no longer sees the contraction it guards against"
    ptx = _ptx(**tq.LAUNCH_OPTIONS)
    assert not re.search(r"\bfma\.", ptx)
    assert re.search(r"mul\.rn\.bf16\b", ptx) and re.search(r"add\.rn\.bf16\b", ptx)
