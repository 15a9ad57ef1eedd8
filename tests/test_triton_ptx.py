"""Triton kernels whose roundings must match the eager ops, compiled for an H100/H200 (sm_90) on this machine
(no GPU needed): their PTX must have no fused multiply-add. With them on (Triton's default) the compiler turned
`(x * cos).to(bf16) + (rotate(x) * sin).to(bf16)` in the Q/K/V norm + RoPE kernel into `fma.rn.bf16`, which left
24% of Q's elements one rounding off on an H200 (docs/performance.md, "Attention kernels")."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")


def _ptx(fn, signature: dict, constexprs: dict, options: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(
        fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs
    )
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except (ImportError, KeyError, RuntimeError) as e:  # a triton build without its NVIDIA backend or ptxas
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    return kernel.asm["ptx"]


def _norm_rope_ptx(options: dict) -> str:
    from diffgemma.kernels import triton_qkv as tq

    ptrs = ("qkv_ptr", "cos_ptr", "sin_ptr", "q_norm_ptr", "k_norm_ptr", "q_ptr", "kv_ptr")
    sig = {**dict.fromkeys(ptrs, "*bf16"), "slot_ptr": "*i32", "T": "i32", "eps": "fp32"}
    sig.update(dict.fromkeys(("stride_t", "stride_ct", "stride_qh", "stride_qt"), "i32"))
    sig.update(dict.fromkeys(("stride_kv2", "stride_kvh", "stride_kvt"), "i32"))
    consts = {"NQ": 16, "NKV": 8, "HAS_V": True, "D": 256, "BLOCK_T": tq.BLOCK_T, "HAS_SLOT": True}
    return _ptx(tq._norm_rope_kernel, sig, consts, options)


def _combine_ptx(options: dict) -> str:
    from diffgemma.kernels import triton_combine as tc

    sig = dict.fromkeys(("h_ptr", "dense_ptr", "y_ptr"), "*bf16")
    sig.update(slot_ptr="*i64", weights_ptr="*fp32")
    sig.update(dict.fromkeys(("w2_ptr", "w1_ptr", "scalar_ptr", "wn_ptr", "h_out_ptr", "x_out_ptr"), "*bf16"))
    sig.update(eps="fp32")
    consts = {"K": 8, "H": 2816, "BLOCK_H": 4096, "HAS_NEXT": True}
    return _ptx(tc._post_ffn_kernel, sig, consts, options)


def test_norm_rope_rounds_each_product_before_the_add():
    from diffgemma.kernels import triton_qkv as tq

    fused = _norm_rope_ptx({**tq.LAUNCH_OPTIONS, "enable_fp_fusion": True})
    assert re.search(r"fma\.rn\.bf16\b", fused), "the check no longer sees the contraction it guards against"
    ptx = _norm_rope_ptx(tq.LAUNCH_OPTIONS)
    assert not re.search(r"\bfma\.", ptx)
    assert re.search(r"mul\.rn\.bf16\b", ptx) and re.search(r"add\.rn\.bf16\b", ptx)


def test_combine_has_no_fused_multiply_add():
    # the grouped path's terms (expert output * routing weight) are summed after rounding to fp32 products
    from diffgemma.kernels import triton_combine as tc

    assert re.search(r"\bfma\.", _combine_ptx({**tc.LAUNCH_OPTIONS, "enable_fp_fusion": True}))
    assert not re.search(r"\bfma\.", _combine_ptx(tc.LAUNCH_OPTIONS))


def test_device_length_kernels_compile_for_sm90():
    # the length-independent denoise graph's kernels, with their lengths read on the device: the split-KV
    # attention (on the tensor cores), the rows' exp and their division; a kernel that fails to compile on the
    # GPU switches its module off for the process, so the compile is checked here first
    from diffgemma.kernels import triton_attn as ta
    from diffgemma.kernels import triton_softmax as ts

    ptrs = ("q_ptr", "k_ptr", "v_ptr")
    sig = {**dict.fromkeys(ptrs, "*bf16"), **dict.fromkeys(("acc_ptr", "max_ptr", "sum_ptr"), "*fp32")}
    sig.update(span_ptr="*i32", M="i32", S="i32")
    sig.update(
        dict.fromkeys(("stride_qh", "stride_qm", "stride_kh", "stride_kn", "stride_vh", "stride_vn"), "i32")
    )
    consts = {"D": 256, "BLOCK_M": 64, "BLOCK_N": 64, "SPLIT_BLOCKS": 10, "HAS_SPAN": True, "PDL": True}
    ptx = _ptx(ta._splitkv_kernel, sig, consts, {"num_warps": 4, "num_stages": 3})
    assert re.search(r"mma\S*\.bf16\.bf16", ptx)
    sig = {"x_ptr": "*fp32", "y_ptr": "*bf16", "sum_ptr": "*fp32", "valid_ptr": "*i32"}
    sig.update(dict.fromkeys(("n_cols", "stride_x", "stride_y", "base", "period"), "i32"))
    ptx = _ptx(ts._exp_rows_kernel, sig, {"BLOCK": 2048, "HAS_VALID": True}, {"num_warps": 8})
    assert re.search(r"ex2\.approx", ptx)  # the exponentials, on the fast path
    sig = {"x_ptr": "*fp32", "sums_ptr": "*fp32", "y_ptr": "*bf16"}
    sig.update(dict.fromkeys(("G", "T", "n_cols", "stride_yh", "stride_yg", "stride_yt"), "i32"))
    assert "div" in _ptx(ts._divide_rows_kernel, sig, {"BLOCK": 512}, {"num_warps": 4})


def _moe_ptx(kernel: str, act: str, tma: bool, pdl: bool = True, swap_ab: bool = False) -> str:
    """An expert kernel for sm_90 at the real shape: activations `act` ("fp32", "bf16") on bf16 weights,
    passed as pointers or as TMA descriptors (tiles of 64 x 128), 32 pairs a tile."""
    from diffgemma.kernels import triton_moe as tm

    w = "tensordesc<bf16[64, 128]>" if tma else "*bf16"
    if kernel == "_gate_up_kernel":
        sig = {
            "x_ptr": f"*{act}",
            "gu_ptr": w,
            "act_ptr": f"*{act}",
            "perm_ptr": "*i64",
            "bounds_ptr": "*i32",
        }
        names = ("TOP_K", "stride_xn", "stride_xh", "stride_ge", "stride_gr", "stride_gh", "stride_an")
        names += ("stride_ai",)
    else:
        sig = {"act_ptr": f"*{act}", "dn_ptr": w, "bounds_ptr": "*i32", "y_ptr": f"*{act}"}
        names = ("stride_an", "stride_ai", "stride_de", "stride_dh", "stride_di", "stride_yn", "stride_yh")
    sig.update(dict.fromkeys(names, "i32"))
    consts = {"BLOCK_M": 32, "M_SLOTS": 2, "BLOCK_N": 64, "BLOCK_K": 128, "H": 2816, "INTER": 704}
    consts.update(SWAP_AB=swap_ab, UPCAST_DOT=False, SPLIT3=act == "fp32", TMA=tma, COLS_FAST=False, PDL=pdl)
    return _ptx(getattr(tm, kernel), sig, consts, {"num_warps": 4, "num_stages": 3})


@pytest.mark.parametrize("kernel", ["_gate_up_kernel", "_down_kernel"])
def test_moe_fp32_activations_compile_to_bf16_tensor_core_products(kernel):
    # fp32 activations on bf16 experts (a short prompt's prefill): x cut into three bf16 parts, each multiplied
    # by a bf16 MMA (a first version did not compile for sm_90: a constexpr branch's early return)
    assert re.search(r"mma\S*\.bf16\.bf16", _moe_ptx(kernel, "fp32", tma=False))


@pytest.mark.parametrize("kernel", ["_gate_up_kernel", "_down_kernel"])
def test_moe_default_tiles_multiply_on_wgmma(kernel):
    # 32 pairs a tile are too few rows for wgmma (64 a warpgroup): the plain product runs on mma.sync fed by
    # ldmatrix, the transposed one (the weights' 64 rows as the M side) on wgmma, which DEFAULT_CONFIG measured
    # faster (triton_moe's comment on it)
    from diffgemma.kernels import triton_moe as tm

    cfg = tm.CONFIGS[tm.DEFAULT_CONFIG]
    tiles = cfg.gate_up if kernel == "_gate_up_kernel" else cfg.down
    assert (tiles.block_m, tiles.block_n, tiles.block_k, tiles.tma) == (32, 64, 128, True)
    ptx = _moe_ptx(kernel, "bf16", tma=True, swap_ab=tiles.swap_ab)
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    plain = _moe_ptx(kernel, "bf16", tma=True)
    assert "wgmma" not in plain and "mma.sync" in plain


@pytest.mark.parametrize("kernel", ["_gate_up_kernel", "_down_kernel"])
def test_moe_weights_through_tma_compile_to_bulk_tensor_loads(kernel):
    ptx = _moe_ptx(kernel, "bf16", tma=True)
    assert "cp.async.bulk.tensor" in ptx and re.search(r"mma\S*\.bf16\.bf16", ptx)
    assert "cp.async.bulk.tensor" not in _moe_ptx(kernel, "bf16", tma=False)


@pytest.mark.parametrize("kernel", ["_gate_up_kernel", "_down_kernel"])
def test_pdl_kernels_wait_for_their_predecessor_first(kernel):
    # a kernel launched with PDL may run beside its predecessor: it must wait before any memory access
    ptx = _moe_ptx(kernel, "bf16", tma=True)
    body = ptx[ptx.index(".entry") :]
    wait = body.index("griddepcontrol.wait")
    assert "griddepcontrol.launch_dependents" in body
    assert not re.search(r"\b(ld\.global|st\.global|cp\.async|atom)", body[:wait])
    assert "griddepcontrol" not in _moe_ptx(kernel, "bf16", tma=True, pdl=False)


def _int4_gate_up_ptx(act: str) -> str:
    from diffgemma.kernels import triton_moe as tm

    sig = {"x_ptr": f"*{act}", "act_ptr": f"*{act}", "gu_ptr": "*u8", "wz_ptr": "*u8", "ws_ptr": "*bf16"}
    sig.update(perm_ptr="*i64", bounds_ptr="*i32", TOP_K="i32")
    strides = ("xn", "xh", "ge", "gr", "gh", "an", "ai", "se", "sr", "sg", "ze", "zr", "zg")
    sig.update(dict.fromkeys((f"stride_{s}" for s in strides), "i32"))
    consts = dict(BLOCK_M=32, M_SLOTS=2, BLOCK_N=64, BLOCK_K=64, H=2816, INTER=704, SWAP_AB=True)
    consts.update(UPCAST_DOT=False, SPLIT3=False, TMA=False, COLS_FAST=False, PDL=False, WFMT=1)
    return _ptx(tm._gate_up_kernel, sig, consts, {"num_warps": 4, "num_stages": 4})


def test_int4_experts_dequantize_in_bf16_pairs_under_bf16():
    # bf16 activations take the inline-PTX decode (prmt/lop3, bf16x2 FMAs); fp16 ones the fp32 bit trick
    ptx = _int4_gate_up_ptx("bf16")
    assert "prmt.b32" in ptx and re.search(r"fma\.rn\.bf16x2", ptx)
    assert not re.search(r"\bor\.b32\s+%r\d+, %r\d+, 1258291200;", ptx)  # 0x4B000000: the fp32 path's bias
    fp16 = _int4_gate_up_ptx("fp16")
    assert not re.search(r"fma\.rn\.bf16x2", fp16) and "1258291200" in fp16


def _sc_embed_ptx(kernel: str, options: dict) -> str:
    """An SC survivor-gather kernel (kernels/triton_sc_embed.py) for sm_90 at the real shape, its pointers and
    strides divisible by 16 as Triton specializes them at launch (262,144 and 2,816)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from diffgemma.kernels import triton_sc_embed as se

    if kernel == "gather":
        fn = se._gather_kernel
        sig = {"idx_ptr": "*i32", "val_ptr": "*bf16", "count_ptr": "*i32", "total_ptr": "*i32"}
        sig.update(e_ptr="*bf16", out_ptr="*bf16", H="i32", stride_e="i32", stride_o="i32")
        consts = {"CAP": se.CAP, "CHUNKS": se.CHUNKS, "BLOCK_H": se.GATHER_BLOCK_H, "UNROLL": se.UNROLL}
    else:
        fn = se._dense_rows_kernel
        t = se.TILES
        sig = {
            "p_ptr": "*bf16",
            "e_ptr": "*bf16",
            "rows_ptr": "*i32",
            "n_over_ptr": "*i32",
            "part_ptr": "*fp32",
        }
        sig.update(dict.fromkeys(("n_rows", "n_cols", "H", "stride_p", "stride_e"), "i32"))
        consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, ITERS=1366, EVEN_K=False)
        consts.update(EVEN_N=True, UPCAST_DOT=False)
        options = {"num_warps": t.num_warps, "num_stages": t.num_stages, **options}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig if n not in ("H",)}
    src = ASTSource(
        fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=attrs
    )
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except (ImportError, KeyError, RuntimeError) as e:
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    return kernel.asm["ptx"]


def _gluon_experts_ptx(fmt: str, gate_up: bool) -> str:
    """`gluon_moe`'s kernel for sm_90 at the real shape (gate_up [E, 1408, 2816] or down [E, 2816, 704]), its pointer
    arguments 16-byte aligned as the launcher specializes them."""
    from triton.backends.compiler import GPUTarget

    gm = pytest.importorskip("diffgemma.kernels.gluon_moe", reason="needs triton with gluon")
    from triton.experimental.gluon._runtime import GluonASTSource

    int4 = fmt == "int4"
    sig = {"a_ptr": "*bf16", "q_ptr": "*i32" if int4 else "*fp8e4nv", "s_ptr": "*bf16" if int4 else "*fp32"}
    sig.update(z_ptr="*i16" if int4 else "*fp32", out_ptr="*bf16", perm_ptr="*i64", bounds_ptr="*i32")
    sig.update(dict.fromkeys(("TOP_K", "stride_an", "stride_on", "stride_se"), "i32"))
    k, r, n_out = (2816, 1408, 704) if gate_up else (704, 2816, 2816)
    consts = dict(
        K=k, R=r, N_OUT=n_out, GATE_UP=gate_up, WFMT=gm.FORMATS[fmt], BLOCK_M=32, PREFETCH=4, PDL=True
    )
    aligned = [n for n in sig if n != "TOP_K"]
    names = [*sig, *consts]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(
        fn=gm._experts_kernel,
        signature={**sig, **dict.fromkeys(consts, "constexpr")},
        constexprs=consts,
        attrs=attrs,
    )
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (ImportError, KeyError, RuntimeError) as e:
        pytest.skip(f"cannot compile for sm_90 here: {type(e).__name__}: {e}")
    return kernel.asm["ptx"]


def test_sc_gather_rounds_each_product_before_the_add():
    # the gather sums its survivors as torch_ref.soft_embedding_survivors does: mul.rn, then add.rn
    from diffgemma.kernels import triton_sc_embed as se

    assert re.search(r"\bfma\.", _sc_embed_ptx("gather", {"num_warps": 1}))
    ptx = _sc_embed_ptx("gather", {"num_warps": 1, **se.LAUNCH_OPTIONS})
    assert not re.search(r"\bfma\.", ptx) and re.search(r"mul\.(rn\.)?f32", ptx)


def test_sc_dense_rows_pipeline_onto_wgmma():
    # the overflow rows' GEMM: operands through cp.async into shared memory, multiplied on wgmma
    ptx = _sc_embed_ptx("dense", {})
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx


@pytest.mark.parametrize("gate_up", [True, False])
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_gluon_experts_feed_wgmma_from_registers(fmt, gate_up):
    # the weights' decoded tile is wgmma's A operand in registers ({%r...}, not a shared-memory descriptor), loaded
    # 128 bits a thread, and never stored to shared memory or read back by ldmatrix: the kernel's only
    # shared-memory stores are x's tile (two 128-bit stores a thread), the B operand (the output's transpose goes
    # through stmatrix)
    ptx = _gluon_experts_ptx(fmt, gate_up)
    mmas = re.findall(
        r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.bf16\.bf16 \{[^}]*\}, \{([^}]*)\}", ptx
    )
    assert len(mmas) == (8 if gate_up else 4)  # 4 k16 steps a 64-input tile, gate and up
    assert all(len(a.split(",")) == 4 for a in mmas)  # A: four b32 registers (8 bf16) a thread
    assert "ldmatrix" not in ptx and len(re.findall(r"st\.shared", ptx)) == 2
    assert len(re.findall(r"ld\.global\S*\.v4", ptx)) >= (4 if gate_up else 2)
    if fmt == "int4":  # each bf16x2 pair of a packed word made by a mask (128.0 | nibbles) and two FMAs
        assert len(re.findall(r"lop3\.b32 t, u, 0x000F000F, 0x43004300", ptx)) == (32 if gate_up else 16)
        assert re.search(r"fma\.rn\.bf16x2", ptx)
    # PDL: only L2 prefetches of the weights (which no kernel writes) come before the wait
    body = ptx[ptx.index(".entry") :]
    before = body[: body.index("griddepcontrol.wait")]
    assert "prefetch.global.L2" in before
    assert not re.search(r"\b(ld\.global|st\.global|cp\.async|atom)", before)
