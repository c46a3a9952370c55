"""Triton kernels of the Stable LatentMoE: router, dispatch, grouped MXFP4 GEMMs (A16W4 / A8W4), reduction.

``TRITON_IMPLS`` lists the ``triton`` implementations of ``moe_router`` and ``moe_experts`` for
:mod:`k3rocm.runtime.registry`. Oracle: :mod:`k3rocm.model.moe`. The activation mode of ``moe_experts`` is
an explicit argument (``mode="a16w4"`` or ``"a8w4"``); no environment variable or global selects it.
"""

from __future__ import annotations

import math
import re

from k3rocm.kernels import tune
from k3rocm.kernels.isa import specialize

from .configs import (GEMM_CONFIGS, LAYOUT_BITS, LAYOUT_TILES, ROUTER_BUCKET_TOKENS, ROUTER_CONFIGS, gemm_config,
                      gemm_name, router_config, stage_config)
from .gemm import (K3_LATENT, K3_PAIRS, dq_isa_case, isa_options, k3_gemm_ints, moe_dispatch_kernel, moe_gemm_kernel, moe_glu_finish_kernel,
                   moe_reduce_kernel)
from .mlp import glu
from .mlp import isa_case as _glu_isa_case
from .ops import dispatch_gpu, latent_moe, moe_experts, moe_router
from .router import group_isa_case, router_logits_kernel, topk_isa_case, topk_small_isa_case

__all__ = ["moe_router", "moe_experts", "glu", "dispatch_gpu", "latent_moe", "GEMM_CONFIGS", "ROUTER_CONFIGS",
           "gemm_config", "gemm_name", "router_config", "stage_config", "isa_cases", "TRITON_IMPLS"]


def _packed_only(quantized: bool = True, **_) -> bool:
    return bool(quantized)


#: the ``triton`` implementations of this family: ``(op, fn, supports or None, note)``
TRITON_IMPLS = (
    ("moe_router", moe_router, None,
     "Triton router: split-K fp32 logits, sigmoid, biased top-k (lowest-id ties), renormalised weights"),
    ("moe_experts", moe_experts, _packed_only,
     "Triton grouped GEMM on packed MXFP4 (A16W4 on CUDA: integer E2M1 decode + bf16 tl.dot; A8W4 and "
     "HIP: tl.dot_scaled), SiTU-GLU epilogue, mode a16w4|a8w4 explicit"),
    ("glu", glu, None, "Triton SiTU-/SiLU-GLU of the dense and shared-expert MLPs, one launch, output in the "
     "down projection's operand dtype"),
)


def _gemm_case(gated: bool, a8: bool, cfg: tune.Config, backend: str, tiles: tuple[int, int] = (0, 0)) -> tuple:
    full = cfg
    cfg = stage_config(cfg, gated)
    sig = {
        "a_ptr": "*fp8e4nv" if a8 else "*bf16", "as_ptr": "*u8" if a8 else "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8",
        "out_ptr": ("*fp8e4nv" if a8 else "*bf16") if gated else "*fp32",
        "outs_ptr": ("*u8" if a8 else "*bf16") if gated else "*fp32",
        "sorted_pair_ptr": "*i32", "pair_weight_ptr": "*fp32", "block_expert_ptr": "*i32", "block_start_ptr": "*i32",
        "offsets_ptr": "*i64", "N": "i32", "K": "i32", "HALF_N": "i32",
        "stride_am": "i32", "stride_asm": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_wse": "i64",
        "stride_wsn": "i32", "stride_om": "i32", "stride_osm": "i32",
    }
    consts = {"TOPK": 16, "GATED": gated, "A8": a8, "ACT_FMT": "e4m3" if a8 else "bf16", "ACT": "situ",
              "BETA": 4.0, "BETA_LIN": 25.0, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
              "TILE_N": tiles[0], "TILE_K": tiles[1]}
    for c in consts:
        sig[c] = "constexpr"
    sig = specialize(sig, k3_gemm_ints(gated, tiles, scaled_a8=a8))
    opts = isa_options(cfg, backend)
    lay = f",tiled{tiles[0]}x{tiles[1]}" if tiles[0] else ""
    name = f"gemm_{'w13' if gated else 'w2'}_{'a8w4' if a8 else 'a16w4'}[{gemm_name(full)}{lay}]"
    return name, moe_gemm_kernel, sig, consts, True, opts


def isa_cases() -> list[tuple]:
    """Kernels for ``kernels isa`` (compiled for every target): both grouped GEMMs x both modes with the first
    and last HIP configs (spill-free on gfx950/gfx942; the same tiles compile for sm_90), the router logits
    GEMM (bf16 serving path; fp32 IEEE validation path), the A16W4 decode-path GEMM with the first and last
    CUDA tiles (sm_90 only: ``None`` options for HIP) and one AMD portability tile of it (gfx only), the
    one-program dispatch, the top-k kernel (alone and with the fused dispatch), the per-expert grouping and the reduce kernel (no matrix work).
    Every CUDA config is compiled for sm_90 by tests/kernels/test_moe_isa.py.
    """
    cases = []
    for gated in (True, False):
        for a8 in (False, True):
            for i in (0, len(GEMM_CONFIGS["hip"]) - 1):
                cfg = GEMM_CONFIGS["hip"][i]
                name, fn, sig, consts, expects, hip_opts = _gemm_case(gated, a8, cfg, "hip")
                cuda_opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
                cases.append((name, fn, sig, consts, expects, {"hip": hip_opts, "cuda": cuda_opts}))
    # the A16W4 decode-path GEMM (the CUDA list's decode kinds; the HIP tables serve tl.dot_scaled, so its CUDA
    # tiles, with their inline-PTX bf16x2 multiplies, are compiled for sm_90 only) in its one-multiply variant
    # (every K3 layer) and the general one; plus the AMD portability case of the source: the tile and the layout
    # CUDA serves (4-warp m16, tiled, planar bits) without the inline PTX, at 2 stages, spill-free on gfx950 and
    # gfx942 as the launcher specialises it (the unspecialised compile spilled 24-31 SGPRs; isa.specialize)
    for gated in (True, False):
        big = max(GEMM_CONFIGS["cuda"], key=lambda c: c.get("max_rows", math.inf))  # the served large-group tile
        for cfg, fused in ((GEMM_CONFIGS["cuda"][0], True), (big, True),
                           (GEMM_CONFIGS["cuda"][0], False)):
            name, fn, sig, consts, expects, cuda_opts = dq_isa_case(gated, cfg, "cuda", fused_scale=fused)
            cases.append((name, fn, sig, consts, expects, {"hip": None, "cuda": cuda_opts}))
        # what CUDA serves: the first config on the tiled layout with its planar value bits
        served = GEMM_CONFIGS["cuda"][0]
        name, fn, sig, consts, expects, cuda_opts = dq_isa_case(gated, served, "cuda", LAYOUT_TILES["cuda"],
                                                                bits=LAYOUT_BITS["cuda"])
        cases.append((name, fn, sig, consts, expects, {"hip": None, "cuda": cuda_opts}))
        # the same on the mma element order (the activations to the matrix unit as loaded)
        case = dq_isa_case(gated, served, "cuda", LAYOUT_TILES["cuda"], bits=LAYOUT_BITS["cuda"], order=1)
        cases.append((*case[:5], {"hip": None, "cuda": case[5]}))
        hip_opts = {"num_warps": served["num_warps"], "num_stages": 2, "constexprs": {"PTX": False}}
        base, tag = name[:-1].split("[", 1)  # the tile's name at the 2 stages it compiles with, no inline PTX
        cases.append((f"{base}[{re.sub(r's[0-9]+(?=,)', 's2', tag, count=1)},amd-portability]", fn, sig, consts,
                      expects, {"hip": hip_opts, "cuda": None}))
    # the one-program dispatch at K3 size (896 local experts, up to 8192 pairs), as ops.dispatch_gpu launches it
    dpsig = {"ids_ptr": "*i32", "first": "i32", "num_local": "i32", "P": "i32", "sorted_ptr": "*i32",
             "pos_ptr": "*i32", "counts_ptr": "*i64", "offsets_ptr": "*i64", "bexp_ptr": "*i32", "bstart_ptr": "*i32",
             "run_ptr": "*i32", "UB": "i32", "BLOCK_M": "constexpr", "BLOCK_P": "constexpr", "BLOCK_E": "constexpr",
             "BLOCK_UB": "constexpr"}
    dpsig = specialize(dpsig, dict(first=0, num_local=896, P=8192))  # (UB varies with the routing)
    cases.append(("dispatch_one_program", moe_dispatch_kernel, dpsig,
                  {"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_E": 1024, "BLOCK_UB": 8192}, False,
                  {"hip": {"num_warps": 8}, "cuda": {"num_warps": 8}}))
    rsig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32", "T": "i32", "E": "i32", "D": "i32",
            "K_PER_SPLIT": "i32", "stride_x": "i32", "stride_w": "i32", "stride_ps": "i32", "stride_pt": "i32",
            "BLOCK_T": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr", "IEEE": "constexpr",
            "SPLIT_X": "constexpr"}
    # K3's gate (896 x 7168) at 64 tokens in 16 splits of 448; the token count itself is not specialised on
    rsig = specialize(rsig, dict(E=896, D=7168, K_PER_SPLIT=448, stride_x=7168, stride_w=7168, stride_ps=64 * 896,
                                 stride_pt=896))
    for rc in ROUTER_CONFIGS["hip"]:
        rconst = {"BLOCK_T": rc["BLOCK_T"], "BLOCK_E": rc["BLOCK_E"], "BLOCK_K": rc["BLOCK_K"], "IEEE": False,
                  "SPLIT_X": 0}
        ropts = {"num_warps": rc["num_warps"], "num_stages": rc["num_stages"]}
        cases.append((f"router_logits[t{rc['BLOCK_T']}e{rc['BLOCK_E']}k{rc['BLOCK_K']}]", router_logits_kernel,
                      rsig, rconst, True, {"hip": ropts, "cuda": ropts}))
    # the engine's path: fp32 activations split into three bf16 parts times the bf16 gate, on the matrix unit
    for rc in ROUTER_CONFIGS["hip"]:
        cases.append((f"router_logits_split[t{rc['BLOCK_T']}e{rc['BLOCK_E']}k{rc['BLOCK_K']}]", router_logits_kernel,
                      {**rsig, "x_ptr": "*fp32"},
                      {"BLOCK_T": rc["BLOCK_T"], "BLOCK_E": rc["BLOCK_E"], "BLOCK_K": rc["BLOCK_K"], "IEEE": False,
                       "SPLIT_X": 1}, True,
                      {"hip": {"num_warps": rc["num_warps"], "num_stages": rc["num_stages"]},
                       "cuda": {"num_warps": rc["num_warps"], "num_stages": rc["num_stages"]}}))
    # the fp32 validation path (IEEE fp32 products): compiles everywhere; FMA on sm_90, so no matrix expectation
    rc = ROUTER_CONFIGS["hip"][0]
    cases.append(("router_logits_fp32_ieee", router_logits_kernel, {**rsig, "x_ptr": "*fp32", "w_ptr": "*fp32"},
                  {"BLOCK_T": rc["BLOCK_T"], "BLOCK_E": rc["BLOCK_E"], "BLOCK_K": rc["BLOCK_K"], "IEEE": True,
                   "SPLIT_X": 0}, False,
                  {"hip": {"num_warps": 4, "num_stages": 2}, "cuda": {"num_warps": 4, "num_stages": 2}}))
    cases += [topk_isa_case(False), topk_isa_case(True, ROUTER_BUCKET_TOKENS["hip"]), topk_small_isa_case(4, 8),
              group_isa_case(56), group_isa_case(896)]
    dsig = {"y_ptr": "*fp32", "pos_ptr": "*i32", "out_ptr": "*fp32", "norm_w_ptr": "*bf16", "normed_ptr": "*bf16",
            "D": "i32", "stride_y": "i32", "stride_o": "i32", "stride_n": "i32", "eps": "fp32",
            "TOPK": "constexpr", "NORM": "constexpr", "BLOCK_D": "constexpr", "SPLITS": "constexpr", "stride_ys": "i32",
            "ILP": "constexpr"}
    dsig = specialize(dsig, dict(D=K3_LATENT, stride_y=K3_LATENT, stride_o=K3_LATENT, stride_n=K3_LATENT,
                                 stride_ys=K3_PAIRS * K3_LATENT))
    cases.append(("reduce_norm", moe_reduce_kernel, dsig,
                  {"TOPK": 16, "NORM": True, "BLOCK_D": 4096, "SPLITS": 1, "ILP": False},
                  False, {"hip": {"num_warps": 4}, "cuda": {"num_warps": 4}}))
    # split-K: the reduction over 4 w2 partials per pair, and the w1|w3 finishing step (sum + SiTU-GLU)
    cases.append(("reduce_norm_split4", moe_reduce_kernel, dsig,
                  {"TOPK": 16, "NORM": True, "BLOCK_D": 4096, "SPLITS": 4, "ILP": False}, False,
                  {"hip": {"num_warps": 4}, "cuda": {"num_warps": 4}}))
    # the unrolled form (configs.REDUCE_LAUNCH ILP: a token's rows in flight at once) at 16 warps, unsplit only (ops
    # runs split partials on the loop: 64 rows in flight spill 212 VGPRs on gfx950 / gfx942)
    cases.append(("reduce_norm_ilp", moe_reduce_kernel, dsig,
                  {"TOPK": 16, "NORM": True, "BLOCK_D": 4096, "SPLITS": 1, "ILP": True}, False,
                  {"hip": {"num_warps": 16}, "cuda": {"num_warps": 16}}))
    fsig = {"part_ptr": "*fp32", "h_ptr": "*bf16", "offsets_ptr": "*i64", "num_local": "i32", "I": "i32",
            "stride_ps": "i32", "stride_h": "i32", "SPLITS": "constexpr", "ACT": "constexpr", "BETA": "constexpr",
            "BETA_LIN": "constexpr", "BLOCK_R": "constexpr", "BLOCK_I": "constexpr"}
    fsig = specialize(fsig, dict(num_local=896, I=3072, stride_ps=2 * K3_PAIRS * 3072, stride_h=3072))
    cases.append(("glu_finish_split4", moe_glu_finish_kernel, fsig,
                  {"SPLITS": 4, "ACT": "situ", "BETA": 4.0, "BETA_LIN": 25.0, "BLOCK_R": 16, "BLOCK_I": 256}, False,
                  {"hip": {"num_warps": 4}, "cuda": {"num_warps": 4}}))
    cases.append(_glu_isa_case())
    return cases
