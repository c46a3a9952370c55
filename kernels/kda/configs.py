"""Per-backend launch configurations of the KDA kernels (picked by :func:`k3rocm.kernels.tune.pick`).

The kernels have one source for HIP and CUDA; only these lists differ (DESIGN.md §5):

* CUDA (sm_90): ``num_warps``, ``num_stages``.
* HIP (gfx942 / gfx950): ``num_warps``, ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack = 1``.

The prefill's products take 16-bit operands with fp32 accumulation for bf16 / fp16 inputs: the fp16 form
(prefill.PRODUCTS "fp16": fp16 MFMA / wgmma, the diagonal pair blocks split-bf16); the 16 x 16 block products of the
UT solve run at the backend's default fp32 precision (TF32 on sm_90, fp32 MFMA on CDNA). When the inputs are fp32 the wrapper runs every product in IEEE fp32 (``OPD = 0``,
``PREC = "ieee"``) so the kernels match the fp32 oracle to ~1e-5.
The interpreter runs the CUDA lists. Every table is public (:data:`CONV`, :data:`INTRA`, :data:`GATE`, :data:`SOLVE`, :data:`WU`, :data:`STATE`,
:data:`OUT`, :data:`DECODE`, :data:`SEG_COMBINE`; read with :func:`k3rocm.kernels.tune.configs`) so tests can run every
configuration, not only
the tuner's pick.
"""

from __future__ import annotations

import torch

_CUDA = {
    "conv": [dict(BLOCK_T=32, BLOCK_C=128, num_warps=4, num_stages=1),
             dict(BLOCK_T=64, BLOCK_C=64, num_warps=4, num_stages=1),
             dict(BLOCK_T=16, BLOCK_C=256, num_warps=4, num_stages=1)],
    # INNER 1 (intra, wu, state, out): the kernel's inner split (row block, w / u, V block) fastest in launch
    # order, so the programs of one chunk / sequence run together and share its tiles in L2 (prefill._pids).
    # H100 2026-12-06 (gpu-runs/results/h100_2026-12-06b/c1): intra 1.215 vs 1.251 ms at B1 T8192 H96 and 0.601
    # vs 0.637 at B1 T32768 H12, so it leads the intra table; wu / state / out within 0.5% either way (kept after)
    "intra": [dict(RT=1, INNER=1, num_warps=4, num_stages=1),
              dict(RT=1, num_warps=4, num_stages=1),
              dict(INNER=1, num_warps=4, num_stages=1),
              dict(num_warps=4, num_stages=1),
              dict(num_warps=8, num_stages=1),
              dict(RT=1, INNER=1, num_warps=8, num_stages=1),
              # served from 2026-12-06 20:30 UTC (leading the table): RT 1, one code path for every row block with the blocks j < i in a runtime loop (the
              # served form unrolls all four row blocks: ncu, H100 2026-12-06 18:16 UTC, B1 T8192 H96: 174 registers,
              # 2 programs an SM (12.5% occupancy), issue slots 31% busy, 32% of stalls on instruction fetch).
              # ptxas sm_90a: 128 registers at 4 and 8 warps, no spills. H100 2026-12-06 18:33 UTC, fp16 form, B1
              # T8192 H96 alone: 0.940 ms (INNER, 4 warps) / 1.046 / 1.317 (INNER, 8 warps) against the served
              # 1.290 / 1.231. GPU accuracy (gpu-runs/kda_quick_check.py, H100 2026-12-06 20:18 UTC, fp16 form, packed
              # 3000 + 1 + 70, both decays): 3.64e-4 / 6.25e-4 rel. RMS on o as the served entries, 5 x identical,
              # finite at B1 T8192 H96; the tuned prefill took RT there (intra 0.931 ms).
              # Tried and dropped the same day (ms, same row): 2 warps 1.211 (INNER 3.402); each row block's products
              # transposed and whole, 16 - 64 rows tall so the warps split the rows (at 4 warps Triton lays the
              # mma.sync warps along M and every warp computes the whole 16-row block) 1.236 (INNER 1.280); A and its
              # UT solve in one program per (chunk, head), no A buffer and no solve launch, 2.442 against 1.23 + 0.32
              # (the four row blocks then run one after another)
              # LC 1: the gate, A / Aqk, the UT solve and w / u of a chunk in one program (prefill._local_kernel):
              # one launch for four, G / A / M read back from L2 at once instead of from memory by later launches.
              # Tuned against the four launches (each other intra entry timed with the gate, the solve and the w / u
              # table's first entry). H100 2026-12-06 22:40 UTC, fp16 form, B1 T8192 H96 (gpu-runs/results/
              # h100_2026-12-06g): 2.842 ms at 8 warps held to 128 registers (160 bytes of spills, 2 programs an
              # SM) against 2.515 for the four launches at the served entries; 4.256 held to 168 at 4 warps, 5.283 at
              # 4 warps (255 registers): latency-bound by the warps an SM holds. A persistent form with G / A / M in
              # per-program slots kept in L2 (nothing full-size written) took 4.67 – 6.69 ms at 1 – 2 programs an
              # SM (752 bytes of spills at 128 registers) and was removed. GPU accuracy as the served entries
              # (3.64e-4 / 6.25e-4 rel. RMS, 5 x identical, finite at B1 T8192 H96): a candidate, within 13%
              dict(LC=1, candidate=True, num_warps=8, num_stages=1, maxnreg=128),
              ],
    # the UT solve's launch options (first entry, not tuned: timed inside the intra pick)
    "solve": [dict(num_warps=4, num_stages=1)],
    # the segmented state pass's chaining launch (prefill._seg_combine_kernel; first entry, not tuned: timed inside
    # the state pick of a SEG entry)
    "seg_combine": [dict(num_warps=8, num_stages=1)],
    # w = M (beta k e^G), u = M (beta v): one [64, 64] x [64, 128] product a program (wgmma m64 at 4 warps). 8 warps
    # first (serving's untimed pick): the tuned pick on the fp16 form at B1 T8192 H96 in both H100 runs of
    # 2026-12-06 (0.774 against 0.842 ms at 4 warps, each with the solve launch, 22:40 UTC)
    "wu": [dict(num_warps=8, num_stages=1),
           dict(num_warps=4, num_stages=1),
           dict(INNER=1, num_warps=4, num_stages=1),
           # SV 1: the UT solve in the same program, one program per (chunk, head) making M, w and u (no solve launch,
           # M read back from L2 rather than twice from memory; prefill._wu_kernel). GPU accuracy as the served entries
           # (kda_quick_check.py, H100 2026-12-06 20:18 UTC), but the tuned pick, timing each non-SV entry with the
           # solve launch, did not take them at B1 T8192 H96 or B1 T131072 H12: candidates
           dict(SV=1, candidate=True, num_warps=4, num_stages=1),
           dict(SV=1, candidate=True, num_warps=8, num_stages=1)],
    # the gate kernel's launch options (first entry, not tuned). H100, 2026-12-06 17:54 – 18:33 UTC (fp16 outputs, B1
    # T8192 H96, gpu-runs/results/h100_2026-12-06e): tl.cumsum 0.896 ms at 4 warps (1.164 at 8); the in-chunk
    # cumulative sum as three bf16 products with the lower-triangular ones (CS 1, prefill._cumsum_rows) 0.746 at 8
    # warps, 0.722 held to 128 registers (maxnreg), 0.813 at 4, 1.173 at 16. In the interpreter the CS entries
    # hold the fp16 form's accuracy, but on the fp32 inputs' IEEE path the final state's error
    # grows from 4e-6 to 4.5e-5 (B3 T63: the three partial sums round apart), so IEEE products keep the scan
    # (prefill_launches).
    # Tried and dropped: q and k loaded first beside the gate's input (1.007 ms; with CS 1 0.873, 8 warps), the
    # channels split over 2 or 4 programs (1.177 / 1.236 vs 1.168 ms earlier), 1 - 2 warps (3.2+ ms). An H200,
    # earlier: 1.08 ms at 4 warps against 1.33 / 1.41 at 8 / 16 with tl.cumsum.
    # Served from 2026-12-06 20:30 UTC: CS 1 at 8 warps held to 128 registers. GPU accuracy (kda_quick_check.py, H100
    # 2026-12-06 20:18 UTC, fp16 form): every CS entry 3.64e-4 / 6.25e-4 rel. RMS on o (ordinary decays / near decay
    # 1) as tl.cumsum's, 5 x identical, finite at B1 T8192 H96.
    "gate": [dict(CS=1, num_warps=8, num_stages=1, maxnreg=128),
             dict(CS=1, num_warps=8, num_stages=1),
             dict(num_warps=4, num_stages=1),
             dict(CS=1, num_warps=4, num_stages=1),
             # PS: a persistent grid of PS programs a multiprocessor walking the (chunk, head) items in a loop
             # (prefill._gate_ps_kernel), num_stages the loop pipeliner's depth: the next item's q / k / decay tiles
             # come in by cp.async while this one's are used (the one-program-an-item gate holds 2 programs an SM,
             # and each issues its loads only when it starts). ptxas sm_90a: 2 stages / 8 warps held to 128
             # registers 220 bytes of spills (2 an SM), 3 stages / 8 warps 229 registers (1 an SM), 3 stages / 16
             # warps held to 128 by the warp count, 48 bytes; 74 KB of shared memory each
             dict(CS=1, PS=2, candidate=True, num_warps=8, num_stages=2, maxnreg=128),
             dict(CS=1, PS=1, candidate=True, num_warps=8, num_stages=3),
             dict(CS=1, PS=1, candidate=True, num_warps=16, num_stages=3)],
    # num_stages 1: a 2-stage pipeline of the fp32 [64, 128] tiles needs > 228 KB of shared memory on sm_90.
    # PF: the next chunk's tiles prefetched into registers (1) or loaded at each step (0); both run at the
    # register limit on sm_90 (ptxas), so the tuner measures which costs less
    # first (what serving runs untimed, tune mode "first"): the output in the loop at BV 64 / 4 warps, the tuned pick
    # on the 16-bit and IEEE forms (H100 2026-12-06 22:40 UTC, fp16 form, B1 T8192 H96: 0.969 ms against 2.584 for
    # the BV 32 / PF 1 entry that led the table before; gpu-runs/results/h100_2026-12-06g). Forms without FO (split
    # products) take the first entry without it, BV 32 / PF 1, as before
    "state": [dict(BV=64, PF=0, FO=1, num_warps=4, num_stages=1),
              dict(BV=32, PF=1, num_warps=4, num_stages=1),
              dict(BV=16, PF=1, num_warps=8, num_stages=1),
              dict(BV=32, PF=0, num_warps=4, num_stages=1),
              dict(BV=16, PF=0, num_warps=4, num_stages=1),
              dict(BV=64, PF=0, num_warps=4, num_stages=1),
              dict(BV=32, PF=1, INNER=1, num_warps=4, num_stages=1),
              dict(BV=32, PF=0, INNER=1, num_warps=4, num_stages=1),
              # candidates for w / kg stored split (prefill.PRODUCTS "pre"; PF is moot there): ptxas sm_90a puts the
              # split loop at 254 registers and no spills at BV 32 / 4 warps / 2 stages (cp.async staging) and BV 64 /
              # 8 warps / 2 stages, 230 at BV 32 / 8 warps / 1 stage; the served form spills 436 - 944 bytes
              dict(BV=32, PF=0, candidate=True, num_warps=4, num_stages=2),
              dict(BV=32, PF=0, candidate=True, num_warps=8, num_stages=1),
              dict(BV=64, PF=0, candidate=True, num_warps=8, num_stages=2),
              # FO 1: the output in the loop, no chunk states / v' stored and no output launch; it runs on the fp16
              # form (prefill.PRODUCTS "fp16", the default for bf16 inputs and the engine) and with qg / kg / w stored
              # split, not on the split form (prefill.fo_ok). On an H100 (2026-12-06 16:12 UTC) every FO entry gave
              # the fp16 form's 3.6e-4 rel. RMS and the tuned fp16 prefill at B1 T8192 H96 took one (3.917 ms, no
              # output launch; section "The KDA prefill's fp16 form"), so they are served. ptxas sm_90a on fp16 tiles:
              # BV 16 / 2 stages 121 registers, BV 32 / 1 stage 245, BV 32 / 2 stages 162, BV 64 / 8 warps 244, no
              # spills (on split-stored planes: 255 with 40 / 284 bytes of spills at the first two)
              dict(BV=16, PF=0, FO=1, num_warps=4, num_stages=2),
              dict(BV=32, PF=0, FO=1, num_warps=4, num_stages=1),
              dict(BV=32, PF=0, FO=1, num_warps=4, num_stages=2),
              dict(BV=64, PF=0, FO=1, num_warps=8, num_stages=1),
              # candidates for one wave at B1 T8192 H96 (the served FO entries hold 241 - 255 registers: 1 - 2
              # programs an SM, so 192 - 768 programs run in ~1.45 waves), and for fewer V tiles re-reading the same
              # w / kg / qg tiles. ptxas sm_90a, fp16 tiles (RB 1): BV 64 / 4 warps 255 registers, 276 bytes of
              # spills (2 an SM: 264 slots for 192 programs); BV 32 held to 168 registers, 308 bytes (3 an SM: 396
              # for 384); BV 64 / 8 warps held to 128, 476 bytes (2 an SM); BV 128 / 8 warps 255, 460 bytes (96
              # programs, no V tile re-read). GPU accuracy as the served entries (kda_quick_check.py, H100 2026-12-06
              # 20:18 UTC): tuned from then; the prefill with them among the candidates, 0.951 ms state pass at B1
              # T8192 H96 (1.022 before). (BV 64 / 4 warps leads the table from 2026-12-06 23:10 UTC.)
              dict(BV=32, PF=0, FO=1, num_warps=4, num_stages=1, maxnreg=168),
              dict(BV=64, PF=0, FO=1, num_warps=8, num_stages=1, maxnreg=128),
              dict(BV=128, PF=0, FO=1, num_warps=8, num_stages=1),
              # SEG: the segmented state pass for few long sequences (B1 T131072 H12 runs 48 programs of a 2,048-chunk
              # loop): each sequence cut into runs of SEG chunks, their affine maps [Q | P] computed in parallel
              # (prefill._seg_kernel, at this entry's BV and launch options over V + K columns), the runs' initial
              # states chained in order (prefill._seg_combine_kernel, IEEE fp32), then this entry's loop on every run
              # at once: about three times the loop's work for SEG-fold more programs. H100 2026-12-06 20:18 UTC: the
              # state's error as the plain loop's (3.27e-4 / 5.16e-4 rel. RMS, 5 x identical); at B1 T131072 H12 the
              # tuned pick took a SEG entry, 3.65 ms for the three launches against 3.05 + 0.80 (loop + output)
              dict(SEG=32, BV=64, PF=0, FO=1, num_warps=8, num_stages=1),
              dict(SEG=64, BV=64, PF=0, FO=1, num_warps=8, num_stages=1),
              dict(SEG=16, BV=64, PF=0, FO=1, num_warps=8, num_stages=1),
              dict(SEG=32, BV=32, PF=0, FO=1, num_warps=4, num_stages=1),
              # the plain loop on fp16 tiles at BV 64 / 4 warps / 2 stages (243 registers; on fp32 split tiles two
              # stages need more shared memory than sm_90 has)
              dict(BV=64, PF=0, candidate=True, num_warps=4, num_stages=2)],
    # not listed: 2-stage state configs (BV 32 / 16, PF 0, 4 / 8 warps). With the chunks at affine addresses the
    # loop pipeliner stages the next chunk's w / kg / u in shared memory (cp.async), but ptxas still puts them at
    # 255 registers with 148-716 bytes of spills, and the tuned prefill moved by 1-2% (H100, 2026-12-06)
    "out": [dict(BV=64, BK=32, num_warps=4, num_stages=2),
            dict(BV=128, BK=32, num_warps=8, num_stages=2),
            dict(BV=32, BK=64, num_warps=4, num_stages=1),
            dict(BV=64, BK=32, INNER=1, num_warps=4, num_stages=2)],
    # decode: the fused one-launch kernel of b5aae80, kept over the V-tiled-grid rewrite that measured slower on
    # every row (BENCHMARKS, 2026-12-02). WIN 1: the conv window read as one tile behind one barrier (0: a
    # barrier per position); PRE 1: the whole state load issued before the convolutions. H200 2026-12-03, ms at
    # B64 H12 / B64 H96 / B256 H12 (gpu-runs/bench_kda.py --only decode): BV32 WIN1 0.052 / 0.280 / 0.144,
    # BV64 WIN1 0.058 / 0.282 / 0.146, BV64 0.055 / 0.296 / 0.154, BV128 WIN1 0.059 / 0.399 / 0.205, BV128 (the
    # first entry until then, what the engine ran) 0.079 / 0.567 / 0.285, BV128 PRE1 0.077 / 0.568 / 0.289. The
    # engine path takes the tuned pick (kda_decode, config None); the first entry is the untimed fallback
    # From 2026-12-06 the three-launch SPLIT form (described below) leads: graph-replayed on the H100 its BV 64 /
    # 4-warp entry was at or below the fused kernel's best on all three rows (0.0474 / 0.3313 / 0.1694 ms vs
    # 0.0473 / 0.3509 / 0.1759 at B64 H12 / B64 H96 / B256 H12), and the tuned pick times configs graph-replayed
    "decode": [dict(SPLIT=1, BV=64, num_warps=4, num_stages=1),
               dict(BV=32, WIN=1, num_warps=4, num_stages=1), dict(BV=64, WIN=1, num_warps=4, num_stages=1),
               dict(BV=64, num_warps=4, num_stages=1), dict(BV=32, num_warps=4, num_stages=1),
               dict(BV=128, WIN=1, num_warps=8, num_stages=1), dict(BV=128, num_warps=8, num_stages=1),
               dict(BV=128, num_warps=16, num_stages=1), dict(BV=128, PRE=1, num_warps=8, num_stages=1),
               # SPLIT 1: three launches (decode._split_*): the per-(row, head) prologue once, then a (V tile, row,
               # head) grid whose programs each step one [K, BV] state tile (no loop, the tile's load first), then the
               # gated norm; BV and num_warps are the state launch's. H100 2026-12-06 (eager, --bw measure):
               # BV 64 4 warps 0.332 ms at B64 H96 (0.82 of the state floor) vs the fused kernel's best 0.349;
               # slower eagerly at B64 H12 / B256 H12 (0.070 / 0.192 vs 0.050 / 0.178: two more launches). Tried and
               # dropped: the fused kernel with one reduction round per block and the next block prefetched
               # (0.3515 best), SPLIT at BV 16 on 1-2 warps (0.42), the prologue on 2 or 1 warps instead of 4
               # (within 0.3% graph-replayed on all rows)
               dict(SPLIT=1, BV=32, num_warps=4, num_stages=1),
               dict(SPLIT=1, BV=64, num_warps=8, num_stages=1),
               dict(SPLIT=1, BV=128, num_warps=8, num_stages=1),
               # EV 1: the state tile's load and store evict-first. H100 2026-12-06 12:15 UTC, graph-replayed, ms at
               # B64 H12 / B64 H96 / B256 H12: 0.0444 / 0.3425 / 0.1706 against the first entry's 0.0468 / 0.3294 /
               # 0.1686 (both with the one-barrier prologue, which every SPLIT entry runs since; without it 0.0475 /
               # 0.3323 / 0.1707): kept for the tuner, which may take it at small N (the state within L2)
               dict(SPLIT=1, BV=64, EV=1, num_warps=4, num_stages=1)],
}

_HIP = {
    "conv": [dict(BLOCK_T=32, BLOCK_C=128, num_warps=8, waves_per_eu=0),
             dict(BLOCK_T=64, BLOCK_C=64, num_warps=4, waves_per_eu=2)],
    "intra": [dict(num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
              dict(num_warps=4, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
              dict(INNER=1, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
              dict(RT=1, INNER=1, candidate=True, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
              dict(LC=1, candidate=True, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1)],
    "solve": [dict(num_warps=4, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1)],
    "seg_combine": [dict(num_warps=8, waves_per_eu=0)],
    # 8 warps: at 4 the kernel takes 267 VGPRs and spills 27 SGPRs on gfx942 (222 VGPRs on gfx950)
    "wu": [dict(num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
           dict(INNER=1, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
           dict(SV=1, candidate=True, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1)],
    "gate": [dict(num_warps=4, waves_per_eu=0),  # as on CUDA (not measured on CDNA)
             dict(CS=1, candidate=True, num_warps=4, waves_per_eu=0),
             dict(CS=1, PS=2, candidate=True, num_warps=8, waves_per_eu=0, num_stages=2)],
    "state": [dict(BV=32, PF=1, num_warps=8, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
              dict(BV=16, PF=1, num_warps=8, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
              dict(BV=32, PF=0, num_warps=4, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
              dict(BV=16, PF=0, num_warps=4, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
              dict(BV=32, PF=1, INNER=1, num_warps=8, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1,
                   num_stages=1),
              # candidate (as on CUDA; never run on CDNA): the output in the loop with qg / kg / w stored split,
              # 190 / 196 VGPRs and no spills on gfx950 / gfx942 (the non-FO split loop: 162 / 158)
              dict(BV=32, PF=0, FO=1, candidate=True, num_warps=8, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1,
                   num_stages=1),
              # the segmented state pass (as on CUDA; never run on CDNA)
              dict(SEG=32, BV=32, PF=0, candidate=True, num_warps=8, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1,
                   num_stages=1)],
    "out": [dict(BV=64, BK=32, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
            dict(BV=128, BK=16, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
            dict(BV=32, BK=32, num_warps=4, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1, num_stages=1),
            dict(BV=64, BK=32, INNER=1, num_warps=8, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1,
                 num_stages=1)],
    "decode": [dict(BV=32, num_warps=4, waves_per_eu=0), dict(BV=64, num_warps=8, waves_per_eu=0),
               dict(BV=16, num_warps=4, waves_per_eu=2),
               # the one-barrier conv window (fastest on the H200; timed on CDNA by the tuned pick)
               dict(BV=32, WIN=1, num_warps=4, waves_per_eu=0), dict(BV=64, WIN=1, num_warps=8, waves_per_eu=0),
               # the three-launch form (as on CUDA)
               dict(SPLIT=1, BV=64, num_warps=4, waves_per_eu=0),
               dict(SPLIT=1, BV=32, num_warps=4, waves_per_eu=0)],
}


def _table(kernel: str) -> dict[str, list[dict]]:
    return {"cuda": _CUDA[kernel], "hip": _HIP[kernel], "interpreter": _CUDA[kernel]}


#: per-backend tables of the short conv, the prefill gate, intra-chunk and UT-solve kernels, the chunk-parallel w / u
#: products, the prefill state pass, the chunk-parallel prefill output and decode
CONV, INTRA, GATE, SOLVE, WU, STATE, OUT, DECODE, SEG_COMBINE = (
    _table(k) for k in ("conv", "intra", "gate", "solve", "wu", "state", "out", "decode", "seg_combine"))


POISON = False  # tests set True: every output buffer starts as NaN, so an unwritten element cannot pass


def empty(*shape, dtype, device):
    """``torch.empty`` for kernel outputs; NaN-filled when :data:`POISON` is set (tests)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t
