"""Launch configurations of the MoE kernels, per backend. The only place where tile sizes, warps and stages live.

``GEMM_CONFIGS[backend]`` is an ordered list of :data:`k3rocm.kernels.tune.Config`; ``tune.pick(...,
rows=mean rows per expert group)`` takes the first whose ``max_rows`` covers the problem (``ROUTER_CONFIGS``
the same with rows = tokens). Tests run every entry of every list (interpreter: small tiles only), so every
shipped config is checked against the oracle.
"""

from __future__ import annotations

import math

from k3rocm.errors import ConfigError
from k3rocm.kernels.tune import Config

GEMM_KINDS = ("scaled", "dq", "dqn", "dqp", "dqnp", "dqw")
#: decode-path kinds (``moe_gemm_dq_kernel``); of those, the transposed product (decoded weights = the MMA's
#: register operand) and the ones whose scales are read per weight word one k-step ahead (``SCALE_PF``)
DQ_KINDS = ("dq", "dqn", "dqp", "dqnp", "dqw")
SWAP_KINDS = ("dq", "dqp", "dqw")
#: kind -> the decode kernel's ``SCALE_PF`` (1: scale tile read a k-step ahead; 2: the same, one byte per word)
SCALE_PF_KINDS = {"dqp": 1, "dqnp": 1, "dqw": 2}


def gemm_config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                max_rows: float = math.inf, kind: str = "scaled", split_k: int = 1, **launch) -> Config:
    """One grouped-GEMM launch config: tile M x N x K (K a multiple of 32, N of 32), warps, pipeline stages.

    Returns ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "max_rows", "kind", **launch}``
    (plus ``"split_k"`` when it is not 1).
    ``split_k``: decode kinds only — each GEMM's K cut into up to ``split_k`` ranges of whole k-steps, one
    program per range (``split_k`` times the programs in flight for decode-sized groups); fp32 partials summed
    in a fixed order afterwards (w1|w3: ``moe_glu_finish_kernel`` adds them and applies the GLU; w2: the
    per-token reduction adds them), so results are deterministic (no atomics) but not bit-equal to ``split_k=1``
    (another fp32 summation order). A8W4 / fp16 activations (the scaled kernel) run unsplit.
    ``max_rows``: use this config while the mean pairs per active expert is <= max_rows.
    ``launch``: backend-only launch options (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack`` on HIP).
    ``kind``: which A16W4 kernel runs — ``"scaled"`` (``moe_gemm_kernel``: ``tl.dot_scaled`` with the
    weights as ``e2m1``; native scaled MFMA on gfx950), ``"dq"`` (``moe_gemm_dq_kernel``: integer decode
    of the nibbles to bf16, then ``tl.dot`` with the decoded weights as the register operand and the tokens as
    the narrow side; for Hopper, which has no FP4 hardware) or ``"dqn"`` (the same decode, tokens x weights
    with the decoded weights staged in shared memory; for large groups); ``"dqp"`` / ``"dqnp"``: ``"dq"`` /
    ``"dqn"`` with the scale tile read one k-step ahead into registers (``SCALE_PF=1`` of
    ``moe_gemm_dq_kernel``: the synchronous scale load off the k-step chain; bit-identical); ``"dqw"``: ``"dq"``
    with the scales read a step ahead one byte per weight word (``SCALE_PF=2``). A8W4 always runs the
    scaled kernel with E4M3 activations (the decode path has no A8 mode), and so do fp16 activations (the
    decode path produces bf16 weights); the tiles are the config's in every case.

    Raises:
        ConfigError: ``kind`` is not one of :data:`GEMM_KINDS`.
    """
    if kind not in GEMM_KINDS:
        raise ConfigError(f"GEMM config kind {kind!r} is not one of {', '.join(GEMM_KINDS)}; fix kernels/moe/configs.py")
    if split_k < 1 or (split_k > 1 and kind not in DQ_KINDS):
        raise ConfigError(f"GEMM config split_k {split_k}: must be >= 1, and > 1 only for the decode kinds "
                          f"{', '.join(DQ_KINDS)} (not {kind!r}); fix kernels/moe/configs.py")
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
               max_rows=max_rows, kind=kind, **launch)
    if split_k > 1:
        cfg["split_k"] = split_k
    return cfg


def gemm_name(cfg: Config) -> str:
    """Short name of a GEMM config for reports: ``[kind-]m{M}n{N}k{K}w{warps}s{stages}[sk{split_k}]`` (no prefix
    for scaled; the split suffix only when split_k > 1)."""
    pre = "" if cfg["kind"] == "scaled" else f"{cfg['kind']}-"
    sk = f"sk{cfg['split_k']}" if cfg.get("split_k", 1) > 1 else ""
    return f"{pre}m{cfg['BLOCK_M']}n{cfg['BLOCK_N']}k{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}{sk}"


def router_config(block_t: int, block_e: int, block_k: int, num_warps: int, num_stages: int,
                  max_rows: float = math.inf) -> Config:
    """One router-logits launch config: tile tokens x experts x hidden, warps, stages; used while tokens <=
    ``max_rows``. Returns ``{"BLOCK_T", "BLOCK_E", "BLOCK_K", "num_warps", "num_stages", "max_rows"}``."""
    return dict(BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
                max_rows=max_rows)


GEMM_CONFIGS: dict[str, list[Config]] = {
    # Hopper (no FP4 hardware): the decode path. In sm_90 SASS of the w1|w3 loop (Triton 3.9, K3 strides)
    # dot_scaled's generic FP4 upcast costs ~6.3 instructions per weight element and spills (255 registers,
    # m32n128k128w4s4); the decode path costs 4.3-4.9 with no spills (m16n128k128w8s4: 111 registers, so
    # two 8-warp programs per SM). Few rows per expert: narrow M (the token side of the transposed product);
    # many rows: 128-row tiles, so each decoded weight tile serves more tokens. A8W4 runs the scaled kernel
    # on the same tiles. H200 2026-11-30 (scaled kernel only): m32n128k128w4s4 beat m16n128k256w4s4 at 64
    # and 512 tokens (12.5 vs 17.5 ms, 19.0 vs 27.2 ms); m64n128k128w8s3 was best at 8192 (68.3 ms).
    # H200 2026-11-30, decode kernel: 5.03 ms at 64 tokens, 9.00 at 512 (m16n128k128w8s4); at 8192 tokens
    # m64n128k128w8s3 39.3 ms beat m64n128k64w8s3 47.0 and m128n128k64w8s3 46.3 (gpu-runs/results/moe.md).
    "cuda": [
        # the scale tile read one k-step ahead (kind "dqp", bit-identical to "dq"): H200 2026-12-02, one K3 layer at
        # 64 tokens, tiled layout, every config in one run (bench_moe --sweep-layout tiled --sweep-ep): m16 4.350
        # vs 4.673 ms, m32 6.316 vs 6.774; EP8 slice m16 0.575 vs 0.624; m64 8.656 vs 8.597 (kept "dq")
        # 4 warps on the planar bits: H200 2026-12-04, one K3 layer, tiled layout, every config in one run
        # (bench_moe --sweep-ep --sweep-layout tiled, 475837a): 64 tokens 3.512 ms vs 3.969 for 8 warps (EP8 slice
        # 0.468 vs 0.533), 512 tokens 6.360 vs 7.084 (EP8 slice, 73 rows per expert: 0.890 vs 1.813 for the m64 tile
        # the rows picked); 167 registers per thread, so three programs per SM instead of two
        gemm_config(16, 128, 128, 4, 4, max_rows=16, kind="dqp"),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dqp"),
        gemm_config(32, 128, 128, 8, 4, max_rows=40, kind="dqp"),
        # 8192 tokens = 146 rows per expert: 64-row tiles waste 24% of the MMA rows on the last block of a group,
        # 128-row tiles 43% (2 blocks for 146 rows); 128 rows pay off from ~256 rows per expert
        gemm_config(64, 128, 128, 8, 3, max_rows=192, kind="dq"),
        gemm_config(128, 128, 64, 8, 3, kind="dq"),
        # A/B variants, after the served entries (the pick takes the first fitting one, so serving is unchanged
        # until they move up; bench_moe --sweep times every entry): the plain-load "dq" tiles the "dqp" entries
        # replaced (sm_90 w1|w3 loop 448 vs 428 SASS instructions for "dqp", whose scale LDG is issued a k-step
        # before its use instead of right before a barrier), and "dqp" at 64 rows
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dq"),
        gemm_config(32, 128, 128, 8, 4, max_rows=40, kind="dq"),
        gemm_config(64, 128, 128, 8, 3, max_rows=192, kind="dqp"),
        # split-K for decode-sized groups (~1-6 rows per expert: a 64-token step has ~264 programs in flight for
        # the 28 / 24 k-steps of w1|w3 / w2): 2 or 4 programs per tile, fp32 partials summed in a fixed order.
        # Measured slower (same run): sk2 4.527 ms, sk4 5.077 (dqp) / 5.488 (dq) at 64 tokens; EP8 0.601 / 0.665
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dqp", split_k=2),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dqp", split_k=4),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dq", split_k=4),
        # other decode-sized tiles on the planar bits (fewer integer operations per element moved the balance between
        # the decode and the loads): half / twice the n-tile, half the warps (sm_90 registers per thread, w1|w3: 120,
        # 206, 167; the served tile 120). (A 256-wide k-step cannot run on the 128-wide k-tiles of the layout.)
        gemm_config(16, 64, 128, 4, 4, max_rows=16, kind="dqp"),
        gemm_config(16, 256, 128, 8, 3, max_rows=16, kind="dqp"),
        # 4-warp tiles for more rows per expert (candidates until measured; m64 with 4 warps spills on sm_90: 255
        # registers and 256 B of stack in w1|w3, so none)
        gemm_config(32, 128, 128, 4, 4, max_rows=40, kind="dqp"),
        gemm_config(16, 128, 128, 4, 4, kind="dqp"),
    ],
    # CDNA3/4: 64-wide wavefronts; one scaled MFMA covers 16/32 rows.
    "hip": [
        # (zero VGPR/SGPR spills on gfx950 and gfx942 for both GEMMs and both modes: tests/kernels/test_moe_isa.py)
        gemm_config(16, 64, 128, 4, 2, max_rows=16),
        gemm_config(32, 128, 64, 4, 2, max_rows=48),
        gemm_config(64, 128, 64, 8, 2),
    ],
    # Triton interpreter (CPU tests): small tiles so the grid runs in seconds; semantics are the same.
    "interpreter": [
        gemm_config(16, 32, 64, 4, 1, max_rows=4),
        gemm_config(16, 32, 64, 4, 1, max_rows=4, kind="dq"),
        gemm_config(32, 64, 32, 4, 1, kind="dq"),
        gemm_config(32, 64, 64, 4, 1),
        # the scale-prefetch variants of the decode kernel (never picked: after the unbounded entry)
        gemm_config(16, 32, 64, 4, 1, kind="dqp"),
        gemm_config(16, 32, 64, 4, 1, kind="dqw"),
        gemm_config(32, 64, 32, 4, 1, kind="dqnp"),
        # split-K (K = 64 / 96 in the tests: 2 / 3 k-steps of 32 in 2 ranges, the last one shorter)
        gemm_config(16, 32, 32, 4, 1, kind="dqp", split_k=2),
        gemm_config(32, 64, 32, 4, 1, kind="dqn", split_k=3),
    ],
}


#: (tile_n, tile_k) of the tiled expert weight layout each backend's GEMMs read (``k3rocm.kernels.mx.layout``;
#: made once at load by ``ops.kernel_layout``). Every config's BLOCK_K is fitted to a divisor of tile_k (all
#: shipped BLOCK_K already divide it); BLOCK_N is free (a program's rows may span chunks). 128 x 128: a chunk
#: row is 64 value bytes, and one w1|w3 chunk (gate + up, values then scales) is 17,408 contiguous bytes.
LAYOUT_TILES: dict[str, tuple[int, int]] = {"cuda": (128, 128), "hip": (128, 128), "interpreter": (32, 64)}


#: bits within a value word of that layout (``k3rocm.kernels.mx.layout``: 0 = the checkpoint's nibbles, 1 = planar
#: lanes). CUDA's GEMMs are all decode-path kinds, whose decode needs fewer integer operations on planar lanes (sm_90
#: w1|w3 k-step, m16n128k128: ALU instructions per thread 201 -> 159, the whole loop 426 -> 362). HIP runs the
#: scaled kernel, whose ``tl.dot_scaled`` reads checkpoint nibbles; the interpreter default keeps the nibbles too
#: (its first configs are scaled ones; the tests build planar layouts explicitly).
LAYOUT_BITS: dict[str, int] = {"cuda": 1, "hip": 0, "interpreter": 0}


ROUTER_CONFIGS: dict[str, list[Config]] = {
    # H200 2026-12-02 (gpu-runs/bench_route.py, K3 gate, fp32 input split into three bf16 products, each config
    # forced and graph-replayed, us at 4 / 64 / 256 tokens): t16e128k128w4s4 15.5 / 31.2 / 93.9,
    # t16e64k128w4s3 15.8 / 31.0 / 101.0, t64e64k128w8s3 32.7 / 33.3 / 89.0, t64e128k64w4s3 18.5 / 18.2 / 31.2.
    # So <= 16 tokens a 16-row tile, above that the 64 x 128 tile with 64-wide k-steps (it was last in the table
    # and never served: 33.3 -> 18.2 us at 64 tokens, 93.9 -> 31.2 at 256); the other two stay as autotune
    # candidates only
    "cuda": [router_config(16, 128, 128, 4, 4, max_rows=16), router_config(64, 128, 64, 4, 3),
             router_config(16, 64, 128, 4, 3, max_rows=16), router_config(64, 64, 128, 8, 3, max_rows=64)],
    "hip": [router_config(32, 64, 64, 4, 2)],  # larger tiles spill SGPRs on gfx942
    "interpreter": [router_config(16, 128, 256, 4, 1)],  # large tiles: fewer interpreted programs
}


#: token rows per tile of the fused dispatch (``router.bucket_pairs``; capped at 16384 lanes / the local expert
#: count): gfx942/gfx950 spill SGPRs above 4 rows at 896 experts (tests/kernels/test_moe_isa.py), sm_90 does not
ROUTER_BUCKET_TOKENS: dict[str, int] = {"cuda": 16, "hip": 4, "interpreter": 32}
