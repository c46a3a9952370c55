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


#: what a config's ``w2`` entry may set for the second GEMM (w2) alone: its n-tile and its launch options
W2_KEYS = ("BLOCK_N", "num_warps", "num_stages", "maxnreg")


def gemm_config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                max_rows: float = math.inf, kind: str = "scaled", split_k: int = 1, w2: dict | None = None,
                persist: int = 0, max_pairs: float = math.inf, **launch) -> Config:
    """One grouped-GEMM launch config: tile M x N x K (K a multiple of 32, N of 32), warps, pipeline stages.

    Returns ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "max_rows", "kind", **launch}``
    (plus ``"split_k"`` when it is not 1, ``"w2"`` when given).
    ``w2``: the second GEMM's own ``BLOCK_N`` / ``num_warps`` / ``num_stages`` / ``maxnreg`` (:data:`W2_KEYS`; the rest, BLOCK_M
    above all, is shared: both GEMMs read one dispatch). w2 reads half the weight bytes of w1|w3 per k-step
    (one matrix, not gate and up), so a wider n-tile keeps as many bytes in flight per program; see
    :func:`stage_config`.
    ``split_k``: decode kinds only — each GEMM's K cut into up to ``split_k`` ranges of whole k-steps, one
    program per range (``split_k`` times the programs in flight for decode-sized groups); fp32 partials summed
    in a fixed order afterwards (w1|w3: ``moe_glu_finish_kernel`` adds them and applies the GLU; w2: the
    per-token reduction adds them), so results are deterministic (no atomics) but not bit-equal to ``split_k=1``
    (another fp32 summation order). A8W4 / fp16 activations (the scaled kernel) run unsplit.
    ``persist``: decode kinds only — 0 = one program per (M block, n tile, split), empty blocks included (they
    exit at once); n > 0 = a persistent grid of n programs per SM (CU on AMD) that walk the live blocks' work
    items (``gemm.moe_gemm_dq_kernel`` ``PERSIST``): no program for an empty block, and the next item's loads in
    the same program. The same bits as 0.
    ``max_rows``: use this config while the mean pairs per active expert is <= max_rows.
    ``max_pairs``: only while the rank expects at most this many local (token, expert) pairs (``ops.gemm_pick``:
    all ranks' pairs times the rank's share of the experts) — decode steps of a few tokens, whose few active experts
    leave most SMs idle without a K split.
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
        ConfigError: ``kind`` is not one of :data:`GEMM_KINDS`; a bad ``w2``, ``split_k`` or ``persist``.
    """
    if kind not in GEMM_KINDS:
        raise ConfigError(f"GEMM config kind {kind!r} is not one of {', '.join(GEMM_KINDS)}; fix kernels/moe/configs.py")
    bad = sorted(set(w2 or {}) - set(W2_KEYS))
    if bad:
        raise ConfigError(f"GEMM config w2 override {bad} unknown: it may set {', '.join(W2_KEYS)}; fix "
                          f"kernels/moe/configs.py")
    if split_k < 1 or (split_k > 1 and kind not in DQ_KINDS):
        raise ConfigError(f"GEMM config split_k {split_k}: must be >= 1, and > 1 only for the decode kinds "
                          f"{', '.join(DQ_KINDS)} (not {kind!r}); fix kernels/moe/configs.py")
    if persist < 0 or (persist > 0 and kind not in DQ_KINDS):
        raise ConfigError(f"GEMM config persist {persist}: must be >= 0, and > 0 only for the decode kinds "
                          f"{', '.join(DQ_KINDS)} (not {kind!r}); fix kernels/moe/configs.py")
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
               max_rows=max_rows, kind=kind, **launch)
    if split_k > 1:
        cfg["split_k"] = split_k
    if max_pairs != math.inf:
        cfg["max_pairs"] = max_pairs
    if persist:
        cfg["persist"] = persist
    if w2:
        cfg["w2"] = dict(w2)
    return cfg


def stage_config(cfg: Config, gated: bool) -> Config:
    """The config one of the two expert GEMMs launches with: ``cfg`` without its ``w2`` entry for w1|w3
    (``gated``), and for w2 the same with that entry's keys in place (:func:`gemm_config`)."""
    out = {k: v for k, v in cfg.items() if k != "w2"}
    if not gated:
        out.update(cfg.get("w2") or {})
    return out


def gemm_name(cfg: Config) -> str:
    """Short name of a GEMM config for reports:
    ``[kind-]m{M}n{N}k{K}w{warps}s{stages}[r{maxnreg}][sk{split_k}][p{persist}][+w2n{N}w{warps}s{stages}[r{maxnreg}]]``
    (no prefix for scaled; the register cap only where one is set; the split suffix only when split_k > 1; the
    persistent-grid suffix, programs per SM, only when set; the w2 suffix, w2's whole tile and launch, only when
    the config overrides it)."""
    pre = "" if cfg["kind"] == "scaled" else f"{cfg['kind']}-"
    sk = f"sk{cfg['split_k']}" if cfg.get("split_k", 1) > 1 else ""
    sk += f"p{cfg['persist']}" if cfg.get("persist") else ""
    reg = lambda c: f"r{c['maxnreg']}" if c.get("maxnreg") else ""  # noqa: E731
    w2 = ""
    if cfg.get("w2"):
        c2 = stage_config(cfg, False)
        w2 = f"+w2n{c2['BLOCK_N']}w{c2['num_warps']}s{c2['num_stages']}{reg(c2)}"
    return (f"{pre}m{cfg['BLOCK_M']}n{cfg['BLOCK_N']}k{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}{reg(cfg)}"
            f"{sk}{w2}")


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
        # Served entries, from one sweep of every entry on the planar bits (H200 2026-12-04, bench_moe --tokens 64 512
        # 2048 8192 --sweep-ep --sweep-layout tiled, 0635b38; one K3 layer, ms; rows = pairs per active expert):
        #   64 tokens (1.7 rows): m16 4 warps 3.503, m16 8 warps 3.903, m16n64 4 warps 3.894; EP8 slice 0.474 / 0.546
        #   512 (9.2 rows): m16 w4 6.351, m16 w8 7.139; EP8 slice (73 rows) m16 w4 0.913, m32 w4 1.126, m64 w8 1.701
        #   2048 (36.6 rows): m32 w4 11.745, m64 w8 (dqp) 11.856, m32 w8 13.200, m16 w4 14.952
        #   8192 (146 rows): m64 w8 (dqp) 33.207, m64 w8 (dq) 36.052, m32 w4 36.435; EP8 slice (1170 rows) m64 dqp
        #   4.747, m32 w4 5.071, m128 6.258; EP8 2048 (292 rows) m64 dqp 1.732, m128 3.484
        # 4 warps: 167 (m16) / 246 (m32) registers per thread on sm_90, no spills; m64 with 4 warps spills (255
        # registers + 256 B of stack), so the 64-row tile keeps 8 warps. 41-96 rows: the m16 tile again (one
        # point, 73 rows: 5 blocks of 16 rows beat 2 of 64 by 1.9 x); above: the 64-row tile at any size.
        # Few local pairs (decode steps of a few tokens on an EP rank): the K split multiplies the programs of the
        # few active experts (one expert: 48 w1|w3 n-tiles on 132 SMs). 1 x H100 2026-12-07 (d73f2dd,
        # gpu-runs/bench_moe_decode.py, graph-replayed, us; tokens: local pairs / experts, unsplit w4s4 -> the pick):
        # EP16 1 token (2 / 2) 75.0 -> sk4 36.9 (sk2 49.4, sk8 41.3); 2 (2 / 2) 79.0 -> sk4 37.3; 4 (6 / 5) 94.1 ->
        # sk2 59.0 (sk4 63.5); 8 (9 / 9) 102.9 -> 8 warps unsplit 78.8 (sk2 84.2); 16 (22 / 18) 153.6, w8 149.5,
        # sk2 152.0 (unsplit from here); EP8 1 token (4 / 4) 78.6 -> sk2 54.0 (sk4 55.0). The thresholds are the
        # expected local pairs (ops.gemm_pick: 1 / 2 / 4 / 8 at EP16 for 1 / 2 / 4 / 8 tokens, 2 / 4 / 8 / 16 at EP8)
        gemm_config(16, 128, 128, 4, 4, max_rows=16, kind="dqp", split_k=4, max_pairs=2),
        gemm_config(16, 128, 128, 4, 4, max_rows=16, kind="dqp", split_k=2, max_pairs=4),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dqp", max_pairs=8),
        # 3 stages instead of 4 on the slices of a rank (same bench, us, 4 / 3 stages): EP16 16 tokens 153.6 / 150.0,
        # 32 201.8 / 198.0, 64 262.9 / 258.3; EP8 16 169.4 / 166.5, 64 456.2 / 447.3 (the whole layer not measured,
        # so only up to 128 local pairs: 64 tokens at EP8, 128 at EP16)
        gemm_config(16, 128, 128, 4, 3, max_rows=16, kind="dqp", max_pairs=128),
        gemm_config(16, 128, 128, 4, 4, max_rows=16, kind="dqp"),
        gemm_config(32, 128, 128, 4, 4, max_rows=40, kind="dqp"),
        gemm_config(16, 128, 128, 4, 4, max_rows=96, kind="dqp"),
        gemm_config(64, 128, 128, 8, 3, kind="dqp"),
        # A/B variants, after the served entries (the pick takes the first fitting one, so serving is unchanged
        # until they move up; bench_moe --sweep times every entry): the 8-warp m16 / m32 tiles served before
        # (`dqp`: the scale tile read a k-step ahead, bit-identical to `dq`; on the nibble bits 2026-12-02: m16
        # 4.350 vs 4.673 ms for `dq` at 64 tokens), the plain-load `dq` tiles, the 64- and 128-row `dq` tiles
        # served before (8192 tokens = 146 rows per expert: 64-row tiles waste 24% of the MMA rows on the last
        # block of a group, 128-row tiles 43%)
        gemm_config(32, 128, 128, 8, 4, max_rows=40, kind="dqp"),
        gemm_config(64, 128, 128, 8, 3, max_rows=192, kind="dq"),
        gemm_config(128, 128, 64, 8, 3, kind="dq"),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dq"),
        gemm_config(32, 128, 128, 8, 4, max_rows=40, kind="dq"),
        # split-K for decode-sized groups (~1-6 rows per expert): 2 or 4 programs per tile, fp32 partials summed in a
        # fixed order. Slower in every sweep (0635b38, 64 tokens: sk2 4.166, sk4 4.734 ms vs 3.903 unsplit, 8 warps)
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dqp", split_k=2),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dqp", split_k=4),
        gemm_config(16, 128, 128, 8, 4, max_rows=16, kind="dq", split_k=4),
        # half / twice the n-tile (sm_90 registers per thread, w1|w3: 120 / 206); slower than the served m16 tile
        # (64 tokens 3.894 / 4.289 ms). (A 256-wide k-step cannot run on the 128-wide k-tiles of the layout.)
        gemm_config(16, 64, 128, 4, 4, max_rows=16, kind="dqp"),
        gemm_config(16, 256, 128, 8, 3, max_rows=16, kind="dqp"),
        # the served 4-warp m16 tile at 5 stages (fewer than 4 warps would leave wgmma for mma.sync on sm_90); 3 stages
        # serves few-pair slices above
        gemm_config(16, 128, 128, 4, 5, max_rows=16, kind="dqp"),
        # Not listed: the served tile on the persistent grid (persist=2 / 3 programs per SM; no program for the empty
        # slots of the block table, 960 for ~600 live blocks at 64 tokens), the same bits, slower everywhere
        # (1 x H100 2026-12-07, 3adc52c, bench_moe --tokens 64 512 --ep-ranks 16, ms, plain / 2 / 3 per SM): 64 tokens
        # 3.790 / 4.178 / 4.723, EP16 slice 0.327 / 0.343 / 0.379, 512 tokens 7.154 / 7.343 / 8.118, EP16 slice
        # 0.630 / 0.654 / 0.716. A program's next item starts its k-loop cold (the pipeliner prefetches within one
        # item's loop only), and fewer programs are resident than the plain grid keeps in flight.
        # Also not listed, measured slower than the served tile (H200 2026-12-04, one K3 layer, 64 / 512 tokens, ms, served
        # 3.564-3.622 / 6.424-6.426): w2 on its own tile (configs may give w2 one: gemm_config(w2=...)) — n256 with 4
        # warps 3.743-4.107 / 6.653-6.817, n256 with 8 warps 4.015 / 7.034, 6 stages 3.764 / 6.589 (221f0d7; with
        # the 4-warp tile w2 already streams its bytes as fast as w1|w3: 1.144 and 2.279 ms for 1/3 and 2/3 of them);
        # register caps (maxnreg, for 4 programs per SM where ncu of the served w1|w3 shows 3 = 12 warps, 1.11
        # eligible per scheduler, 36% of issue slots idle) — 128 registers and 3 stages 3.724 / 6.584, the same
        # with w2 capped too 4.001 / 6.824 (w2 at 96: 4.212 / 7.446), w2 alone capped at 128 3.944 / 6.552, m32 at 168
        # 4.533 / 7.613 vs 4.674 / 7.827 uncapped (52d07ca). Every one gave the
        # served config's bits on the EP8 slice. More warps in flight do not help: each program's k-step is a
        # chain (decode -> wgmma -> wait) that other programs already overlap.
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
        # the persistent grid (one program per "SM" under the interpreter: each walks many items)
        gemm_config(16, 32, 64, 4, 1, kind="dqp", persist=2),
        # w2 on its own n-tile (the decode path and the scaled kernel)
        gemm_config(16, 32, 64, 4, 1, kind="dqp", w2=dict(BLOCK_N=64)),
        gemm_config(16, 32, 64, 4, 1, w2=dict(BLOCK_N=64, num_warps=2)),
    ],
}


#: the reduction's launch (``gemm.moe_reduce_kernel``, one program per token): ``ILP`` its slots unrolled as masked
#: loads (all of a token's rows in flight; the same bits), ``num_warps``. The branchy loop is a chain of 16 dependent
#: index loads per token: 23 us per call at 512 tokens in the K3 rank's mixed step (1 x H100, 2026-12-07), ~5 x its
#: bytes. Unsplit w2 output only (split-K partials keep the loop at 4 warps: 64 rows in flight spill on AMD). Served
#: on CUDA: the EP16 slice's experts 0.6 - 3.0 us faster per call at 8 / 64 / 256 / 512 tokens (1 x H100,
#: 2026-12-07 16:00 UTC, ``gpu-runs/bench_moe_decode.py --reduce-ilp``); off on HIP until timed there
REDUCE_LAUNCH: dict[str, dict] = {"cuda": dict(ILP=True, num_warps=16), "hip": dict(ILP=False, num_warps=16),
                                  "interpreter": dict(ILP=False, num_warps=4)}


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

#: element order within each 32-element block of that layout (``k3rocm.kernels.mx.layout``: 0 = the checkpoint's,
#: 1 = the mma order, from which the decode-path GEMM's decoded tiles come out in the natural K order and its
#: activation tiles go to the matrix unit as loaded: on sm_90, as launched, the w1|w3 k-step loses its two
#: conflicted ``stmatrix`` stores of the permuted activations and two shared-memory reloads; the output equals
#: the checkpoint order's up to the fp32 summation order inside each k16 product). Only the decode path reads
#: order 1. 0 everywhere until the GPU sweep (``bench_moe.py --sweep-layout tiled``) times both.
LAYOUT_ORDER: dict[str, int] = {"cuda": 0, "hip": 0, "interpreter": 0}


ROUTER_CONFIGS: dict[str, list[Config]] = {
    # H200 2026-12-02 (gpu-runs/bench_route.py, K3 gate, fp32 input split into three bf16 products, each config
    # forced and graph-replayed, us at 4 / 64 / 256 tokens): t16e128k128w4s4 15.5 / 31.2 / 93.9,
    # t16e64k128w4s3 15.8 / 31.0 / 101.0, t64e64k128w8s3 32.7 / 33.3 / 89.0, t64e128k64w4s3 18.5 / 18.2 / 31.2.
    # So <= 16 tokens a 16-row tile, above that the 64 x 128 tile with 64-wide k-steps (it was last in the table
    # and never served: 33.3 -> 18.2 us at 64 tokens, 93.9 -> 31.2 at 256); the other two stay as autotune
    # candidates only
    # H100 2026-12-07 (1b5b269, the same sweep, logits + top-k graph-replayed, us at 4 / 64 / 256 tokens):
    # t16e64k128w4s3 15.9 / — / —, t16e128k128w4s4 18.2 / 30.8 / 90.8, t64e128k64w4s3 17.0 / 17.6 / 30.3; so the
    # 64-expert tile leads at <= 16 tokens (equal on the H200). Not listed, timed no faster than the served tiles
    # at 64 / 256 tokens (us; the first 264 programs of K splits, "p528" twice as many): t64e128k64w4s4 18.3 / 30.6,
    # t64e64k64w4s3 17.6 / 39.5, t64e128k64w4s3p528 17.9 / 36.3, t32e128k64w4s3 22.5 / 59.1, t64e64k64w4s4p528
    # 21.2 / 42.3, t64e128k32w4s4p528 18.2 / 36.3: the two launches are latency-bound, not tile-bound
    "cuda": [router_config(16, 64, 128, 4, 3, max_rows=16), router_config(16, 128, 128, 4, 4, max_rows=16),
             router_config(64, 128, 64, 4, 3), router_config(64, 64, 128, 8, 3, max_rows=64)],
    # larger tiles do not fit gfx942 as the launcher specialises them (AOT, 2026-12-07): t64e128k64w4s3 spills 30
    # SGPRs, t64e64k128w8s3 64 VGPRs, t16e128k128w4s4 needs 120 KiB of LDS (64 KiB there)
    "hip": [router_config(32, 64, 64, 4, 2)],
    "interpreter": [router_config(16, 128, 256, 4, 1)],  # large tiles: fewer interpreted programs
}


#: token rows per tile of the fused dispatch (``router.bucket_pairs``; capped at 16384 lanes / the local expert
#: count). HIP's 4 was chosen when the unspecialised AOT compile spilled SGPRs above 4 rows at 896 experts; compiled
#: as the launcher specialises it (``kernels.isa.specialize``) 4, 8 and 16 rows are spill-free on gfx950 and
#: gfx942 (16 rows take all 64 KiB of gfx942's LDS). Not measured on AMD, so 4 stays
ROUTER_BUCKET_TOKENS: dict[str, int] = {"cuda": 16, "hip": 4, "interpreter": 32}

#: warps of the fused top-k + grouping launch (``router.router_topk_kernel`` with ``DISPATCH``): each of its 16
#: picks is one max over the 1024 expert lanes, a cross-warp reduction at 8 warps; fewer warps trade those barriers
#: for more lanes per thread. 8 is what has been measured (the kernel took ~12 us at 1 and at 64 tokens on an H100,
#: 2026-12-07); ``gpu-runs/bench_route.py`` times 1 / 2 / 4 / 8 (``moe_route(topk_warps=)``) for the next pick
ROUTER_TOPK_WARPS: dict[str, int] = {"cuda": 8, "hip": 8, "interpreter": 8}

#: fused routing of at most this many tokens in ONE program (``router.router_topk_small_kernel``: the top-k of every
#: token in one key tile and the grouping straight from it, no counters, no membership matrix through memory)
#: instead of the per-token programs and their two-level grouping. On CUDA one token (the c1 decode step): 17.1 us
#: per layer graph-replayed against 19.7 for the per-token programs, but 29.6 - 31.9 against 21.9 at 4 tokens and
#: 48.0 against 22.4 at 8 (1 x H100, 2026-12-07 16:02 UTC, ``bench_route.py`` ``small`` columns). Off on HIP until
#: timed there; on in the interpreter, so the CPU tests hold it to the same tensors. On HIP at most 4 when turned
#: on: 8 tokens spill on gfx950 / gfx942 (``router.topk_small_isa_case``)
#: how the fused routing groups the pairs by local expert (``ops.moe_route(grouping=)``): ``"fused"``, inside the
#: top-k launch (its last program per token group ranks the group, the last group places every pair: a chain of
#: programs each waiting on the one before), or ``"experts"``, a third launch of one program per local expert
#: (``router.group_pairs_kernel``), none waiting. Both give the same tensors. The value is the most local experts
#: the ``"experts"`` grouping serves (0: never): each of its programs counts every pair over all local experts, so
#: it wins on a rank's slice and loses on all 896. H100, 2026-12-07 (``bench_route.py``, logits + top-k + grouping
#: graph-replayed, us at 4 / 64 / 256 tokens): 56 local experts (a K3 rank of EP16) fused 20.6 / 23.0 / 43.4,
#: experts 18.1 / 21.6 / 38.5; all 896 local fused 21.5 / 25.5 / 57.0, experts 36.9 / 45.9 / 122.7. Not measured
#: on AMD: off there
ROUTER_GROUPING: dict[str, int] = {"cuda": 128, "hip": 0, "interpreter": 0}

#: programs the router logits aim for (token tiles x expert tiles x K splits, at most 32 splits): the splits'
#: fp32 partials ``[S, T, E]`` are what the top-k launch sums per token, so fewer programs read the gate with less
#: parallelism but leave fewer partials (6.4 MB at 64 tokens and 264 programs). 264 (two per SM of an H100) is what
#: has been served; ``gpu-runs/bench_route.py`` times 66 / 132 / 264 / 528 (``programs*`` columns)
ROUTER_LOGIT_PROGRAMS: dict[str, int] = {"cuda": 264, "hip": 264, "interpreter": 264}

#: the top-k launch of the ``"experts"`` grouping picks by one ``tl.topk`` (a partial bitonic sort of the 1024
#: keys) instead of 16 rounds of a max over them, each a cross-warp reduction (~8 us of the 18 us router at 64
#: tokens on an H100, 2026-12-07). Same picks. H100, 2026-12-07, with the per-expert grouping on 56 local experts:
#: 17.5 / 21.6 / 39.6 us at 4 / 64 / 256 tokens against 18.1 / 21.6 / 38.5 for the max rounds: not served
ROUTER_TOPK_SORT: dict[str, bool] = {"cuda": False, "hip": False, "interpreter": False}

ROUTER_SMALL_TOKENS: dict[str, int] = {"cuda": 1, "hip": 0, "interpreter": 8}
