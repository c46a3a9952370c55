"""Ahead-of-time compilation of the MoE / MX kernels for gfx950, gfx942 and sm_90 (no GPU needed).

Asserts: every HIP config of both grouped GEMMs in both modes compiles with zero VGPR/SGPR spills on gfx950
and gfx942; the A8W4 GEMM uses the native scaled MFMA (``v_mfma_scale_f32_*_f8f6f4``) on gfx950 and the
A16W4 GEMM plain bf16 MFMAs (never a scaled one); the CUDA configs compile for sm_90 with tensor-core
instructions, the A16W4 decode kernel (kind "dq") with bf16 wgmma; the decode kernel also compiles for
gfx950 / gfx942 without spills; the router GEMM has matrix instructions everywhere.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":  # pragma: no cover - AOT compile needs compiled kernels
    pytest.skip("TRITON_INTERPRET=1: ahead-of-time compilation needs compiled kernels", allow_module_level=True)

from k3rocm.kernels.isa import compile_kernel  # noqa: E402
from k3rocm.kernels.moe import GEMM_CONFIGS, ROUTER_CONFIGS, isa_cases  # noqa: E402
from k3rocm.kernels.moe.router import router_logits_kernel  # noqa: E402
from k3rocm.kernels.moe import _gemm_case  # noqa: E402
from k3rocm.kernels.moe.configs import LAYOUT_TILES, gemm_config  # noqa: E402
from k3rocm.kernels.moe.gemm import dq_isa_case  # noqa: E402

SCALED_MFMA = re.compile(r"v_mfma_scale_f32_\w+_f8f6f4")


def _compile(case, target):
    name, fn, sig, consts, expects, opts = case
    return compile_kernel(fn, sig, consts, target, name=name, options=opts, expects_matrix=expects)


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
@pytest.mark.parametrize("gated", [True, False], ids=["w13", "w2"])
@pytest.mark.parametrize("a8", [False, True], ids=["a16w4", "a8w4"])
def test_amd_every_config_no_spills(target, gated, a8):
    for cfg in GEMM_CONFIGS["hip"]:
        rep = _compile(_gemm_case(gated, a8, cfg, "hip"), target)
        assert rep.error is None, rep.error
        assert rep.ok, f"{rep.name} on {target}: {rep.problems()}"
        assert rep.vgpr_spill == 0 and rep.sgpr_spill == 0
        scaled = [op for op in rep.matrix_ops if SCALED_MFMA.match(op)]
        if target == "gfx950" and a8:
            assert scaled, f"{rep.name}: no v_mfma_scale_f32_*_f8f6f4 on gfx950 ({rep.matrix_ops})"
        else:
            assert not scaled and rep.matrix_ops, f"{rep.name} on {target}: {rep.matrix_ops}"


@pytest.mark.parametrize("a8", [False, True], ids=["a16w4", "a8w4"])
def test_sm90_configs_compile(a8):
    # each CUDA config compiles as the kernel it runs: A8W4 always the scaled kernel (dot_scaled, E4M3);
    # A16W4 the decode kernel for kind "dq"/"dqn" (bf16 wgmma on the decoded tile), else the scaled one
    for gated in (True, False):
        for cfg in GEMM_CONFIGS["cuda"]:
            case = dq_isa_case(gated, cfg, "cuda") if (cfg["kind"] != "scaled" and not a8) else \
                _gemm_case(gated, a8, cfg, "cuda")
            rep = _compile(case, "sm_90")
            assert rep.error is None, rep.error
            assert rep.matrix_ops, f"{rep.name}: no tensor-core instructions on sm_90"
            if cfg["kind"] != "scaled" and not a8:
                assert any(op.startswith("wgmma.mma_async") and "bf16" in op for op in rep.matrix_ops), \
                    f"{rep.name}: {rep.matrix_ops}"


def test_sm90_decode_multiplies_are_packed_bf16x2():
    # the decode path's scale products run as inline-PTX bf16x2 multiplies on the 32-bit words (one per pair of
    # weights in the one-multiply variant, two in the general one); HIP compiles the same source without them
    cfg = GEMM_CONFIGS["cuda"][0]
    for gated in (True, False):
        fused = _compile(dq_isa_case(gated, cfg, "cuda", fused_scale=True), "sm_90")
        general = _compile(dq_isa_case(gated, cfg, "cuda", fused_scale=False), "sm_90")
        for rep in (fused, general):
            assert rep.error is None, rep.error
            assert any(op.startswith("wgmma.mma_async") and "bf16" in op for op in rep.matrix_ops), rep.matrix_ops
        n_f, n_g = fused.asm.count("mul.rn.bf16x2"), general.asm.count("mul.rn.bf16x2")
        assert n_f > 0 and n_g == 2 * n_f, (n_f, n_g)
        assert "0x7E807E80" in general.asm and "0x7E807E80" not in fused.asm
        hip = _compile(dq_isa_case(gated, cfg, "hip", fused_scale=True), "gfx942")
        assert hip.error is None and "mul.rn.bf16x2" not in hip.asm, hip.error


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_amd_tiled_layout_no_spills(target):
    # the tiled weight layout (the one made at load): every HIP config of both GEMMs spill-free; gfx950 in
    # A8W4 (its native scaled MFMA stays), gfx942 in A16W4
    a8 = target == "gfx950"
    for cfg in GEMM_CONFIGS["hip"]:
        for gated in (True, False):
            rep = _compile(_gemm_case(gated, a8, cfg, "hip", LAYOUT_TILES["hip"]), target)
            assert rep.error is None, rep.error
            assert rep.ok, f"{rep.name} on {target}: {rep.problems()}"
            assert rep.vgpr_spill == 0 and rep.sgpr_spill == 0
            assert any(SCALED_MFMA.match(op) for op in rep.matrix_ops) == a8, f"{rep.name}: {rep.matrix_ops}"


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
def test_sm90_tiled_layout_decode_kernel(bits):
    # the decode kernel on the tiled layout with the CUDA tile the 64-token step picks, on both value-bit layouts
    # (planar is what CUDA serves) and both element orders: bf16 wgmma. In the checkpoint order each k-step
    # permutes the activation tile through registers and writes it back with stmatrix for wgmma's shared
    # operand; from the mma order the tile goes to wgmma as the pipeliner loaded it (no stmatrix in the kernel)
    for gated in (True, False):
        stm = {}
        for order in (0, 1):
            rep = _compile(dq_isa_case(gated, GEMM_CONFIGS["cuda"][0], "cuda", LAYOUT_TILES["cuda"], bits=bits,
                                       order=order), "sm_90")
            assert rep.error is None, rep.error
            assert any(op.startswith("wgmma.mma_async") and "bf16" in op for op in rep.matrix_ops), rep.matrix_ops
            assert "cp.async.cg.shared.global" in rep.asm  # 16-byte copies: the launch's alignment reached it
            stm[order] = len(re.findall(r"\bstmatrix\.", rep.asm))
        assert stm[0] > 0 and stm[1] == 0, stm


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_decode_kernel_compiles_for_amd(target):
    # the decode path is the Hopper choice (HIP keeps dot_scaled: native scaled MFMA on gfx950), but the
    # same source must stay portable: it compiles to bf16 MFMAs without spills (transposed orientation, the
    # shipped Hopper one; the untransposed "dqn" is only a benchmark candidate)
    for cfg in (gemm_config(16, 64, 128, 4, 2, kind="dq"),):
        for gated in (True, False):
            rep = _compile(dq_isa_case(gated, cfg, "hip"), target)
            assert rep.error is None, rep.error
            assert rep.ok, f"{rep.name} on {target}: {rep.problems()}"
            assert rep.matrix_ops and not any(SCALED_MFMA.match(op) for op in rep.matrix_ops), rep.matrix_ops


def test_sm90_router_configs_compile():
    sig = next(c for c in isa_cases() if c[0].startswith("router_logits["))[2]
    for rc in ROUTER_CONFIGS["cuda"]:
        for split, xt in ((0, "*bf16"), (1, "*fp32")):  # bf16 x, and the engine's fp32 x split into bf16 parts
            consts = {"BLOCK_T": rc["BLOCK_T"], "BLOCK_E": rc["BLOCK_E"], "BLOCK_K": rc["BLOCK_K"], "IEEE": False,
                      "SPLIT_X": split}
            rep = compile_kernel(router_logits_kernel, {**sig, "x_ptr": xt}, consts, "sm_90", name="router_logits",
                                 options={"num_warps": rc["num_warps"], "num_stages": rc["num_stages"]},
                                 expects_matrix=True)
            assert rep.ok, rep.problems()


def test_other_kernels_all_targets():
    from k3rocm.kernels.mx import isa_cases as mx_cases

    cases = [c for c in isa_cases() if not c[0].startswith("gemm_")] + list(mx_cases())
    assert any(c[0].startswith("router_logits") for c in cases)
    assert any(c[0] == "router_logits_fp32_ieee" for c in cases)
    assert any(c[0].startswith("router_logits_split[") for c in cases)
    assert any(c[0] == "glu_situ_bf16" for c in cases)  # the dense / shared-expert GLU op
    for name, fn, sig, consts, expects, opts in cases:
        for target in ("gfx950", "gfx942", "sm_90"):
            backend = "hip" if target.startswith("gfx") else "cuda"
            rep = compile_kernel(fn, sig, consts, target, name=name, options=opts[backend], expects_matrix=expects)
            assert rep.ok, f"{name} on {target}: {rep.problems()}"


def test_one_program_dispatch_all_targets():
    # the launch ops.dispatch_gpu makes (K3: 896 local experts, up to 8192 pairs): spill-free everywhere
    from k3rocm.kernels.moe.gemm import moe_dispatch_kernel

    sig = {"ids_ptr": "*i32", "first": "i32", "num_local": "i32", "P": "i32", "sorted_ptr": "*i32",
           "pos_ptr": "*i32", "counts_ptr": "*i64", "offsets_ptr": "*i64", "bexp_ptr": "*i32", "bstart_ptr": "*i32",
           "run_ptr": "*i32", "UB": "i32", "BLOCK_M": "constexpr", "BLOCK_P": "constexpr", "BLOCK_E": "constexpr",
           "BLOCK_UB": "constexpr"}
    consts = {"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_E": 1024, "BLOCK_UB": 8192}
    for target in ("gfx950", "gfx942", "sm_90"):
        rep = compile_kernel(moe_dispatch_kernel, sig, consts, target, name="dispatch", options={"num_warps": 8})
        assert rep.ok, f"dispatch on {target}: {rep.problems()}"


@pytest.mark.parametrize("target", ["sm_90", "gfx950", "gfx942"])
def test_scale_prefetch_variants_compile(target):
    # the decode kernel's scale-prefetch variants (kinds "dqp" / "dqw" / "dqnp": SCALE_PF 1 / 2 / 1) and its
    # split-K ones on the tiled layout: bf16 wgmma on sm_90 (every CUDA-list entry of those kinds), bf16 MFMAs without spills on AMD
    from k3rocm.kernels.moe.configs import SCALE_PF_KINDS

    backend = "hip" if target.startswith("gfx") else "cuda"
    if backend == "cuda":
        cfgs = [c for c in GEMM_CONFIGS["cuda"]
                if c["kind"] in SCALE_PF_KINDS or c.get("split_k", 1) > 1]
        cfgs += [gemm_config(16, 128, 128, 8, 4, kind="dqw"), gemm_config(128, 128, 64, 8, 3, kind="dqnp")]
    else:
        # (dqw at m16n64k128 with 4 warps spills 9 SGPRs in w2 on gfx942; with 8 warps none)
        cfgs = [gemm_config(16, 64, 128, 4, 2, kind="dqp"), gemm_config(16, 64, 128, 8, 2, kind="dqw"),
                gemm_config(16, 64, 128, 4, 2, kind="dqp", split_k=4)]
    assert cfgs
    for cfg in cfgs:
        for gated in (True, False):
            case = dq_isa_case(gated, cfg, backend, LAYOUT_TILES[backend])
            if backend == "hip":
                case = (*case[:3], {**case[3], "PTX": False}, *case[4:])
            rep = _compile(case, target)
            assert rep.error is None, rep.error
            assert rep.ok, f"{rep.name} on {target}: {rep.problems()}"
            if backend == "cuda":
                assert any(op.startswith("wgmma.mma_async") and "bf16" in op for op in rep.matrix_ops), \
                    f"{rep.name}: {rep.matrix_ops}"
            else:
                assert rep.vgpr_spill == 0 and rep.sgpr_spill == 0, rep.name
                assert rep.matrix_ops and not any(SCALED_MFMA.match(op) for op in rep.matrix_ops), rep.matrix_ops


def _assert_like_plain(rep, plain, backend, target):
    """A grid variant of the decode kernel (an outer loop around the k-loop) against its plain-grid compile: it
    compiles with the same matrix instructions; on sm_90 the k-loop is pipelined as in the plain grid (as many
    cp.async copies); on AMD without spills."""
    assert rep.error is None, rep.error
    assert rep.matrix_ops == plain.matrix_ops and rep.matrix_ops, rep.matrix_ops
    if backend == "cuda":
        assert len(re.findall(r"cp\.async\.", rep.asm)) == len(re.findall(r"cp\.async\.", plain.asm)) > 0
    else:
        assert rep.ok, f"{rep.name} on {target}: {rep.problems()}"


@pytest.mark.parametrize("target", ["sm_90", "gfx950", "gfx942"])
def test_persistent_grid_compiles(target):
    # the decode kernel's persistent form (config persist: a while loop over work items around the k-loop) compiles
    # with its matrix instructions; on sm_90 the k-loop inside it is pipelined as in the plain grid (as many
    # cp.async copies: the outer loop does not stop the pipeliner); on AMD without spills at the portable tile
    backend = "cuda" if target == "sm_90" else "hip"
    base = GEMM_CONFIGS["cuda"][0] if backend == "cuda" else gemm_config(16, 64, 128, 4, 2, kind="dq")
    tiles = LAYOUT_TILES["cuda"] if backend == "cuda" else (0, 0)
    for gated in (True, False):
        plain, pers = (_compile(dq_isa_case(gated, dict(base, persist=p), backend, tiles), target) for p in (0, 2))
        _assert_like_plain(pers, plain, backend, target)
