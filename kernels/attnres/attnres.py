"""Block AttnRes in one kernel: score the bank rows and the prefix, softmax, mix, then the following RMSNorm.

Per token (a program handles one token, or walks several: ``PROGS_PER_SM``). The key is the weight-free
RMSNorm of v, so ``score = <v, w> * rsqrt(mean(v^2) + eps)`` needs no key tensor.

* Row fits one block (``BLOCK_D >= D``, K3's 7168 at BLOCK_D 8192): **one pass** over the sources, each
  row read once. ``ROWS`` bank rows are loaded as one ``[ROWS, BLOCK_D]`` tile (their loads in flight
  together, one reduction for their scores: a token is a chain of ceil(rows / ROWS) + 1 dependent steps, not
  rows + 1); the softmax over the sources is online (running max and denominator, the mix rescaled as in
  FlashAttention's online softmax, Milakov & Gimelshein 2018), and ``h`` stays in registers for the
  following RMSNorm ``h_normed = h * rsqrt(mean(h^2) + eps) * norm_weight``.
* ``PIPE`` configs (row fits one block): the same single pass as one software-pipelined stream per persistent
  program (:func:`_attn_res_stream`): the tiles of the next ``PIPE - 1`` steps, the next token's too, are in
  flight in shared memory while a step reduces and stores, so a program is never a chain of dependent load
  phases with nothing in flight (the bf16 plateau of the phased loop: 0.657 of the byte floor at T 8192 on the
  H200, 2026-12-02, whatever its rows / warps / programs).
* Otherwise three passes per token: scores (fp32 vector of ``S_PAD`` sources), mix of the **raw** values
  re-read from L2 (writing ``h``), then the norm from ``h``.

``store_h=False`` (the decoder layer's call: it reads only ``h_normed``) skips the ``h`` store (``STORE_H``);
``h`` stays in registers for the norm (the blocked path mixes each block again for it instead of re-reading ``h``).

The write-layer variant stores the prefix into bank row ``num_rows`` while reading it. The host side keeps
the tuned plan per shape bucket (at decode sizes the launch, not the kernel, is the cost). Any number of
sources runs (``S_PAD`` = :func:`sources_pad`). Outputs are always fresh tensors, never bank storage
(K3_FACTS §5: reusing a bank row's storage for a later output corrupts layers 85–92).

Oracle: :func:`k3rocm.model.attnres.attn_res_norm` (fused) and :func:`k3rocm.model.attnres.attn_res` (op).
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune
from k3rocm.kernels.isa import specialize
from k3rocm.kernels.target import interpreting, multiprocessors
from k3rocm.numerics import check_addend, overlaps

#: per-backend configs
ATTNRES_CONFIGS: dict[str, list[dict]] = {
    # PROGS_PER_SM: programs per multiprocessor walking the tokens (0 = one program per token);
    # ROWS: bank rows loaded as one tile per step of the single-pass path (BLOCK_D >= D; 1 on the blocked path)
    # (ptxas, sm_90a: 8192 x 4 rows at 16 warps takes 128 registers, one program per SM; 32 warps cap at 64
    # and spill a few bytes; 8 rows spill heavily at either width)
    # The first entry is what serving runs untimed (tune mode "first"): the single pass (each source read once)
    # with 4-row tiles. The H200 engine profile of 2026-12-02 ran the old first entry, the 3-pass 1024-wide
    # blocked path, at 27 us per call for 4 tokens and 41 us for 256 (K3 rank, 187 calls per step).
    "cuda": [
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=4, num_warps=16, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=2, num_warps=16, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=1, num_warps=16, num_stages=1),
        dict(BLOCK_D=1024, PROGS_PER_SM=0, ROWS=1, num_warps=4, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=4, num_warps=32, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=4, num_warps=16, num_stages=1),
        # PIPE = S > 0: the software-pipelined stream (_attn_res_stream): each persistent program walks its tokens as
        # one sequence of ROWS-row tiles with S - 1 tiles in flight in shared memory (cp.async) across token
        # boundaries (bf16 at 8192: S - 1 stages x (ROWS + 1) x 16 KiB; lowered to fit PIPE_SMEM_BYTES, an fp32
        # bank gets fewer stages). ptxas sm_90a, bf16, triton 3.9 and 3.6: 16 warps at 122-128 registers (1 program
        # per SM: the tiles in flight, not co-resident programs, hide the latency), 32 warps at 64; spill-free but
        # ROWS=2 PIPE=4 as the write layer without h on 3.6 (8 bytes); ROWS=2 at 32 warps spills on 3.6 (not here).
        # Measured slower than the phased loop on the H200 (2026-12-03, D7168 T8192 bf16: best PIPE 0.571 ms vs 0.513
        # for the first entry; T256 0.022 vs 0.018): they stay candidates after the served entries
        dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=2, PIPE=4, num_warps=16, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=1, PIPE=7, num_warps=16, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=1, PIPE=4, num_warps=16, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=1, PIPE=6, num_warps=32, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=2, PIPE=3, num_warps=16, num_stages=1),
        # EARLY: the first two entries with the prefix / addend loads issued before the bank tiles (the single-pass
        # path; at decode sizes a token is a chain of dependent load phases, 9.4 us at 53 tokens x 8 rows on an H100
        # for ~3.4 us of bytes). 1 x H100 2026-12-07 (bench_attnres_decode.py, graph-replayed, us at 53 tokens x 3 /
        # 6 / 8 bank rows): first entry 7.0 / 9.1 / 9.3, EARLY 4-row 6.8 / 9.1 / 9.4, EARLY 2-row 7.0 / 8.3 / 9.5;
        # slower at 256 tokens (27 vs 24 at 6 rows). The graph-replayed pick serves them where faster. (EARLY with
        # all 8 rows in one tile at 32 warps: 14 - 15 us, not listed)
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=4, EARLY=1, num_warps=16, num_stages=1),
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=2, EARLY=1, num_warps=16, num_stages=1),
        # (Not listed: a split form, two launches over (token, column block) programs with the token's last program
        # writing the norm, for decode-sized calls: slower than the first entry at every size, 1 x H100 2026-12-07,
        # e.g. 14.4 vs 9.4 us at 53 tokens x 8 bank rows graph-replayed; BENCHMARKS "AttnRes at decode sizes")
    ],
    "hip": [
        dict(BLOCK_D=8192, PROGS_PER_SM=0, ROWS=2, num_warps=16, num_stages=1, waves_per_eu=0),
        dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=1, num_warps=16, num_stages=1, waves_per_eu=0),
        dict(BLOCK_D=1024, PROGS_PER_SM=0, ROWS=1, num_warps=4, num_stages=1, waves_per_eu=0),
        dict(BLOCK_D=2048, PROGS_PER_SM=4, ROWS=1, num_warps=8, num_stages=1, waves_per_eu=0),
    ],
    # the interpreter counts as one multiprocessor: PROGS_PER_SM=2 runs the token-walking path with 2 programs
    # BLOCK_D=128 holds the test rows in one block: the single-pass path (ROWS=4: partial, masked row tiles);
    # wider rows run the blocked path (PIPE is ignored there)
    "interpreter": [dict(BLOCK_D=16, PROGS_PER_SM=0, ROWS=1), dict(BLOCK_D=64, PROGS_PER_SM=0, ROWS=1),
                    dict(BLOCK_D=32, PROGS_PER_SM=2, ROWS=1), dict(BLOCK_D=128, PROGS_PER_SM=2, ROWS=1),
                    dict(BLOCK_D=128, PROGS_PER_SM=0, ROWS=4), dict(BLOCK_D=128, PROGS_PER_SM=0, ROWS=4, EARLY=1),
                    # the PIPE stream: 2 / 3 programs walking the tokens, partial row tiles; one token per program
                    dict(BLOCK_D=128, PROGS_PER_SM=2, ROWS=2, PIPE=3),
                    dict(BLOCK_D=128, PROGS_PER_SM=3, ROWS=1, PIPE=4),
                    dict(BLOCK_D=128, PROGS_PER_SM=0, ROWS=4, PIPE=2)],
}

#: smallest width of the in-register score vector of the blocked path (one compile for up to 16 sources)
MIN_SOURCES_PAD = 16


def sources_pad(num_sources: int) -> int:
    """Score-vector width for ``num_sources`` sources: a power of two >= ``MIN_SOURCES_PAD`` (a fixed small set)."""
    return max(MIN_SOURCES_PAD, tune.pow2(num_sources))


@_interp.kjit
def _score(v, w, D, eps):
    """AttnRes score of one source row ``v`` (fp32, 0 past D): ``<v, w> * rsqrt(mean(v^2) + eps)``."""
    return tl.sum(v * w, 0) * tl.rsqrt(tl.sum(v * v, 0) / D + eps)


@_interp.kjit
def _prefix_row(PREFIX, ADDEND, t, stride_pt, stride_at, offs, m, ADD: tl.constexpr):
    """Token ``t``'s prefix source over columns ``offs`` (mask ``m``): the prefix row in its own dtype, or with
    ``ADD`` the prefix plus the addend in fp32."""
    vr = tl.load(PREFIX + t * stride_pt + offs, mask=m, other=0.0)
    if ADD:
        vr = vr.to(tl.float32) + tl.load(ADDEND + t * stride_at + offs, mask=m, other=0.0).to(tl.float32)
    return vr


# compiled mode (as _interp.kjit); the per-call counts are not specialised on (== 1, % 16), so a new
# batch size, length or bank depth never compiles while serving
@partial(JITFunction, do_not_specialize=("num_rows", "T", "nprog", "n_iter"))
def _attn_res_kernel(
    BANK, PREFIX, W, NW, H_OUT, HN_OUT, ADDEND, P_OUT,
    num_rows, T, D, nprog, n_iter, stride_br, stride_bt, stride_pt, stride_ht, stride_hnt, stride_at, stride_pot,
    eps, norm_eps,
    APPEND: tl.constexpr, HAS_NORM: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_BLOCK: tl.constexpr, ROWS: tl.constexpr, PIPE: tl.constexpr = 0, STORE_H: tl.constexpr = True,
    ADD: tl.constexpr = False, EARLY: tl.constexpr = 0,
):
    # ADD: the prefix source is PREFIX + ADDEND (one fp32 add: the decoder's pending "prefix += out"), stored into
    # P_OUT and read from there by the later passes; the bank append takes the sum
    # a fixed number of programs walks the tokens (t = pid, pid + nprog, ...): few resident tokens keep
    # each token's sources in L2 between pass 1 and pass 2
    sidx = tl.arange(0, S_PAD)
    offs = tl.arange(0, BLOCK_D)
    pid = tl.program_id(0)
    if PIPE:
        _attn_res_stream(BANK, PREFIX, W, NW, H_OUT, HN_OUT, ADDEND, P_OUT, pid, num_rows, T, D, nprog, n_iter,
                         stride_br, stride_bt, stride_pt, stride_ht, stride_hnt, stride_at, stride_pot, eps, norm_eps,
                         offs, APPEND, HAS_NORM, BLOCK_D, ROWS, STORE_H, PIPE, ADD)
    else:
        for it in range(0, n_iter):  # n_iter = ceil(T / nprog), from the host
            # past the end: redo the last token (identical values written twice, no branch)
            t = tl.minimum(pid + it * nprog, T - 1)
            if ONE_BLOCK:
                # the row fits one block: a single pass over the sources, each read once. ROWS bank rows are
                # loaded together as one [ROWS, BLOCK_D] tile (independent loads in flight, one reduction for
                # their scores), then folded into an online softmax over the sources (running max / denominator,
                # FlashAttention-style rescaling of h); the prefix is the last source
                m = offs < D
                if EARLY:  # the prefix (and addend) loads issued before the bank tiles': one dependent phase less
                    vr = _prefix_row(PREFIX, ADDEND, t, stride_pt, stride_at, offs, m, ADD)
                w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
                mx = tl.full([], float("-inf"), tl.float32)
                den = tl.zeros([], tl.float32)
                h = tl.zeros([BLOCK_D], tl.float32)
                ridx = tl.arange(0, ROWS)
                src = BANK + t * stride_bt
                for j0 in range(0, num_rows, ROWS):
                    rm = (j0 + ridx) < num_rows
                    v = tl.load(src + (j0 + ridx).to(tl.int64)[:, None] * stride_br + offs[None, :],
                                mask=rm[:, None] & m[None, :], other=0.0).to(tl.float32)
                    sc = tl.sum(v * w[None, :], 1) * tl.rsqrt(tl.sum(v * v, 1) / D + eps)
                    sc = tl.where(rm, sc, float("-inf"))
                    m_new = tl.maximum(mx, tl.max(sc, 0))
                    alpha = tl.exp(mx - m_new)
                    p = tl.exp(sc - m_new)
                    den = den * alpha + tl.sum(p, 0)
                    h = h * alpha + tl.sum(p[:, None] * v, 0)
                    mx = m_new
                if not EARLY:
                    vr = _prefix_row(PREFIX, ADDEND, t, stride_pt, stride_at, offs, m, ADD)
                if ADD:
                    tl.store(P_OUT + t * stride_pot + offs, vr, mask=m)
                if APPEND:
                    tl.store(BANK + num_rows * stride_br + t * stride_bt + offs, vr.to(BANK.dtype.element_ty), mask=m)
                v = vr.to(tl.float32)
                sc = _score(v, w, D, eps)
                m_new = tl.maximum(mx, sc)
                alpha = tl.exp(mx - m_new)
                pj = tl.exp(sc - m_new)
                h = (h * alpha + pj * v) / (den * alpha + pj)
                if STORE_H:
                    tl.store(H_OUT + t * stride_ht + offs, h, mask=m)
                if HAS_NORM:
                    rs = tl.rsqrt(tl.sum(h * h, 0) / D + norm_eps)
                    nw = tl.load(NW + offs, mask=m, other=0.0).to(tl.float32)
                    tl.store(HN_OUT + t * stride_hnt + offs, (h * rs * nw).to(HN_OUT.dtype.element_ty), mask=m)
            else:
                _attn_res_blocked(BANK, PREFIX, W, NW, H_OUT, HN_OUT, ADDEND, P_OUT, t, num_rows, D, stride_br,
                                  stride_bt, stride_pt, stride_ht, stride_hnt, stride_at, stride_pot, eps, norm_eps,
                                  sidx, offs, APPEND, HAS_NORM, S_PAD, BLOCK_D, STORE_H, ADD)


@_interp.kjit
def _attn_res_stream(BANK, PREFIX, W, NW, H_OUT, HN_OUT, ADDEND, P_OUT, pid, num_rows, T, D, nprog, n_iter,
                     stride_br, stride_bt, stride_pt, stride_ht, stride_hnt, stride_at, stride_pot, eps, norm_eps, offs,
                     APPEND: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                     STORE_H: tl.constexpr, STAGES: tl.constexpr, ADD: tl.constexpr):
    """The single-pass path as one software-pipelined stream (``PIPE``; the row fits one block).

    A program's tokens (t = pid, pid + nprog, ...) are one flat sequence of steps; step s loads tile
    ``k = s % nt`` of token ``s // nt``: ``ROWS`` consecutive bank rows (``nt = max(ceil(num_rows / ROWS), 1)``
    tiles per token), and on the token's last tile its prefix row too (a load masked off elsewhere: no traffic).
    The addresses depend on ``s`` only, so the compiler's loop pipeliner (``STAGES`` = the config's ``PIPE``, the
    loop's ``num_stages``) issues the tiles of the next ``STAGES - 1`` steps -- the next token's too -- into shared
    memory (``cp.async``; kept in the source dtype, converted at use) while this step reduces, finishes its token
    and stores. The online softmax state (running
    max, denominator, h) restarts at each token's first tile."""
    m = offs < D
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    ridx = tl.arange(0, ROWS)
    nt = tl.maximum((num_rows + ROWS - 1) // ROWS, 1)
    mx = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    h = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.range(0, n_iter * nt, num_stages=STAGES):
        it = s // nt
        k = s - it * nt
        # past the end: redo the last token (identical values written twice, no branch)
        t = tl.minimum(pid + it * nprog, T - 1)
        r = k * ROWS + ridx
        rm = r < num_rows
        last = k == nt - 1
        v = tl.load(BANK + t * stride_bt + r.to(tl.int64)[:, None] * stride_br + offs[None, :],
                    mask=rm[:, None] & m[None, :], other=0.0).to(tl.float32)
        # (the last-tile test as a vector: the interpreter takes no scalar in a load mask)
        vr = tl.load(PREFIX + t * stride_pt + offs, mask=m & (offs * 0 + k == nt - 1), other=0.0)
        if ADD:
            vr = vr.to(tl.float32) + tl.load(ADDEND + t * stride_at + offs, mask=m & (offs * 0 + k == nt - 1),
                                             other=0.0).to(tl.float32)
        vp = vr.to(tl.float32)
        first = k == 0
        mx = tl.where(first, float("-inf"), mx)
        den = tl.where(first, 0.0, den)
        h = tl.where(first, 0.0, h)
        sc = tl.sum(v * w[None, :], 1) * tl.rsqrt(tl.sum(v * v, 1) / D + eps)
        sc = tl.where(rm, sc, float("-inf"))
        scp = tl.where(last, _score(vp, w, D, eps), float("-inf"))
        m_new = tl.maximum(tl.maximum(mx, tl.max(sc, 0)), scp)
        alpha = tl.exp(mx - m_new)
        p = tl.exp(sc - m_new)
        pp = tl.exp(scp - m_new)
        den = den * alpha + tl.sum(p, 0) + pp
        h = h * alpha + tl.sum(p[:, None] * v, 0) + pp * vp
        mx = m_new
        if last:  # the token is complete
            if ADD:
                tl.store(P_OUT + t * stride_pot + offs, vp, mask=m)
            if APPEND:
                tl.store(BANK + num_rows * stride_br + t * stride_bt + offs, vr.to(BANK.dtype.element_ty), mask=m)
            hf = h / den
            if STORE_H:
                tl.store(H_OUT + t * stride_ht + offs, hf, mask=m)
            if HAS_NORM:
                rs = tl.rsqrt(tl.sum(hf * hf, 0) / D + norm_eps)
                nw = tl.load(NW + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(HN_OUT + t * stride_hnt + offs, (hf * rs * nw).to(HN_OUT.dtype.element_ty), mask=m)


@_interp.kjit
def _mix_block(vp, pp, m, p, sidx, num_rows, stride_br, BLOCK_D: tl.constexpr):
    """One ``BLOCK_D`` block of h = sum_j p_j v_j over the bank rows (``vp``: row 0 at this block, rows
    ``stride_br`` apart) and the prefix (``pp``, weight ``p[num_rows]``), in fp32."""
    h = tl.zeros([BLOCK_D], tl.float32)
    for j in range(0, num_rows):
        pj = tl.sum(tl.where(sidx == j, p, 0.0), 0)
        h += pj * tl.load(vp, mask=m, other=0.0).to(tl.float32)
        vp += stride_br
    pl = tl.sum(tl.where(sidx == num_rows, p, 0.0), 0)
    return h + pl * tl.load(pp, mask=m, other=0.0).to(tl.float32)


@_interp.kjit
def _attn_res_blocked(BANK, PREFIX, W, NW, H_OUT, HN_OUT, ADDEND, P_OUT, t, num_rows, D, stride_br, stride_bt,
                      stride_pt, stride_ht, stride_hnt, stride_at, stride_pot, eps, norm_eps, sidx, offs,
                      APPEND: tl.constexpr, HAS_NORM: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                      STORE_H: tl.constexpr, ADD: tl.constexpr):
    """One token when its row spans several blocks: scores (pass 1), mix (pass 2, from L2), norm (pass 3).
    Without ``STORE_H`` pass 2 only sums h^2 and pass 3 mixes each block again (same operations, same h). With
    ``ADD`` pass 1 stores the prefix + addend sum into ``P_OUT`` and the later passes read the prefix there."""
    scores = tl.full([S_PAD], float("-inf"), tl.float32)
    # pass 1: scores of the bank rows
    src = BANK + t * stride_bt
    for j in range(0, num_rows):
        ss = tl.zeros([BLOCK_D], tl.float32)
        dt = tl.zeros([BLOCK_D], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs
            m = d < D
            v = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
            w = tl.load(W + d, mask=m, other=0.0).to(tl.float32)
            ss += v * v
            dt += v * w
        sc = tl.sum(dt, 0) * tl.rsqrt(tl.sum(ss, 0) / D + eps)
        scores = tl.where(sidx == j, sc, scores)
        src += stride_br
    # ... and of the prefix (appended to the bank on a write layer)
    pre = PREFIX + t * stride_pt
    ss = tl.zeros([BLOCK_D], tl.float32)
    dt = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs
        m = d < D
        vr = tl.load(pre + d, mask=m, other=0.0)
        if ADD:
            vr = vr.to(tl.float32) + tl.load(ADDEND + t * stride_at + d, mask=m, other=0.0).to(tl.float32)
            tl.store(P_OUT + t * stride_pot + d, vr, mask=m)
        v = vr.to(tl.float32)
        w = tl.load(W + d, mask=m, other=0.0).to(tl.float32)
        ss += v * v
        dt += v * w
        if APPEND:
            tl.store(BANK + num_rows * stride_br + t * stride_bt + d, vr.to(BANK.dtype.element_ty), mask=m)
    sc = tl.sum(dt, 0) * tl.rsqrt(tl.sum(ss, 0) / D + eps)
    scores = tl.where(sidx == num_rows, sc, scores)
    if ADD:  # the later passes read the sum back (each element by the thread that stored it; the barrier anyway)
        pre = P_OUT + t * stride_pot
        tl.debug_barrier()
    mx = tl.max(scores, 0)
    p = tl.exp(scores - mx)
    p = p / tl.sum(p, 0)
    # pass 2: mix raw values
    hss = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs
        m = d < D
        h = _mix_block(BANK + t * stride_bt + d, pre + d, m, p, sidx, num_rows, stride_br, BLOCK_D)
        if STORE_H:
            tl.store(H_OUT + t * stride_ht + d, h.to(H_OUT.dtype.element_ty), mask=m)
        hss += h * h
    if HAS_NORM:
        rs = tl.rsqrt(tl.sum(hss, 0) / D + norm_eps)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs
            m = d < D
            if STORE_H:
                hv = tl.load(H_OUT + t * stride_ht + d, mask=m, other=0.0).to(tl.float32)
            else:
                hv = _mix_block(BANK + t * stride_bt + d, pre + d, m, p, sidx, num_rows, stride_br, BLOCK_D)
            nw = tl.load(NW + d, mask=m, other=0.0).to(tl.float32)
            tl.store(HN_OUT + t * stride_hnt + d, (hv * rs * nw).to(HN_OUT.dtype.element_ty), mask=m)


#: (tune key) -> (meta, options, programs per SM) of the picked config: skips per-call host work at decode sizes,
#: where the launch, not the kernel, is the cost.
_PLANS: dict[tuple, tuple[dict, dict, int]] = {}


#: shared memory the ``PIPE`` stream may stage per program: its stage count is lowered until the ``PIPE - 1``
#: buffers in flight, ``ROWS`` bank rows and a prefix row of ``BLOCK_D`` elements each, fit (an fp32 bank stages
#: twice a bf16 one's bytes; sm_90 allows 227 KiB per block, the reductions take 16 KiB of it at 16 warps)
PIPE_SMEM_BYTES = {"cuda": 192 * 1024, "hip": 64 * 1024}


def _pipe_stages(num_stages: int, rows: int, block_d: int, elem_bytes: int, backend: str, add: bool = False) -> int:
    """The stage count ``PIPE`` of a config, lowered (to at least 2) to fit :data:`PIPE_SMEM_BYTES` of
    ``backend`` (a stage holds ``rows`` bank rows and a prefix row of ``block_d`` elements, and an addend row with
    ``add``)."""
    budget = PIPE_SMEM_BYTES.get(backend)
    if budget is None:
        return num_stages
    while num_stages > 2 and (num_stages - 1) * (rows + 1 + int(add)) * block_d * elem_bytes > budget:
        num_stages -= 1
    return num_stages


def _launch(bank, num_rows, prefix, weight, norm_weight, eps, norm_eps, append, h, hn, config, store_h=True,
            addend=None, p_out=None):
    T, D = prefix.shape
    if T == 0:
        return
    interp = interpreting()
    n_sm = 1 if interp else multiprocessors(prefix.device)
    if hn is None:
        hn = h
    if h is None:
        h = hn  # not stored (store_h False): any pointer of the right dtype family serves
    has_norm = norm_weight is not None
    # without an addend the ADDEND / P_OUT arguments are never read or written: the prefix stands in
    add, pout = (addend, p_out) if addend is not None else (prefix, prefix)

    def run(meta, opts, per_sm):
        nprog = T if per_sm == 0 else min(T, per_sm * n_sm)
        one_block = meta["BLOCK_D"] >= D
        pipe = meta.get("PIPE", 0) if one_block else 0
        if pipe > 2 and not interp:
            pipe = _pipe_stages(pipe, meta.get("ROWS", 1), meta["BLOCK_D"], max(bank.element_size(),
                                prefix.element_size(), add.element_size()), "hip" if torch.version.hip else "cuda",
                                add=addend is not None)
        meta = dict(meta, PIPE=pipe)
        _interp.launch(_attn_res_kernel, (nprog,),
            bank, prefix, weight, norm_weight if has_norm else weight, h, hn, add, pout,
            num_rows, T, D, nprog, triton.cdiv(T, nprog), bank.stride(0), bank.stride(1), prefix.stride(0),
            h.stride(0), hn.stride(0), add.stride(0), pout.stride(0), float(eps), float(norm_eps),
            APPEND=append, HAS_NORM=has_norm, S_PAD=sources_pad(num_rows + 1), ONE_BLOCK=one_block,
            STORE_H=store_h, ADD=addend is not None, **meta, **opts)

    def plan(cfg):
        meta, opts = tune.split(cfg)
        return meta, opts, meta.pop("PROGS_PER_SM", 0)

    if config is not None:
        run(*plan(config))
        return
    # (with or without an addend: one key, so layer 0's appending call, which has none and is never timed, takes
    # the plan its twins timed)
    key = (D, tune.pow2(T), bank.dtype, prefix.dtype, has_norm, store_h)
    p = None if interp else _PLANS.get(key)
    if p is None:
        # timing must not append twice into a live bank: tune on the non-appending variant's shape
        # timed as graph replays, as the engine runs every AttnRes call (inside its step graphs: no host launch gap)
        cfg = tune.pick("attn_res", key, tune.configs(ATTNRES_CONFIGS), lambda c: run(*plan(c)), can_time=not append,
                        graphed=True)
        p = plan(cfg)
        if not interp and tune._CACHE.get(("attn_res", key)) is cfg:
            _PLANS[key] = p  # only a timed (cached) choice is final
    run(*p)


def _check(bank, num_rows, prefix, append):
    R_max = bank.shape[0]
    if not 0 <= num_rows <= R_max or (append and num_rows >= R_max):
        raise ConfigError(f"attn_res_norm: num_rows={num_rows} (append={append}) does not fit a bank of {R_max} rows; "
                          f"size the bank with K3Config.num_attn_res_bank_rows")
    if tuple(bank.shape[1:]) != tuple(prefix.shape):
        raise ConfigError(f"attn_res_norm: bank rows {tuple(bank.shape[1:])} and prefix {tuple(prefix.shape)} differ")
    if bank.stride(-1) != 1 or prefix.stride(-1) != 1:
        raise ConfigError("attn_res_norm: bank and prefix need a contiguous last dim")


def attn_res_norm(bank: torch.Tensor, num_rows: int, prefix: torch.Tensor, weight: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, append: bool = False, norm_eps: float | None = None,
                  out_dtype: torch.dtype | None = None, config: dict | None = None,
                  out: tuple[torch.Tensor | None, torch.Tensor] | None = None, store_h: bool = True,
                  addend: torch.Tensor | None = None, prefix_out: torch.Tensor | None = None):
    """Triton fused AttnRes step; same contract as :func:`k3rocm.model.attnres.attn_res_norm` (``addend`` /
    ``prefix_out`` too: the prefix source is ``prefix + addend`` in fp32, stored into ``prefix_out``, one launch
    instead of an add and this one).

    Args (beyond the oracle's):
        out_dtype: dtype of ``h_normed`` (default fp32; ``h`` is always fp32).
        config: one entry of ``ATTNRES_CONFIGS[backend]`` (default: tuned pick).
        out: optional preallocated ``(h, h_normed)`` (must not overlap the bank; checked); ``h`` may be None
            when ``store_h`` is False (it is not written then).
        store_h: False: ``h`` is not stored at all (it stays in registers for the norm, ``T * D * 4`` bytes less
            written) and None is returned in its place -- for callers that use only ``h_normed`` (the decoder
            layer). The bank append is unchanged.
    Returns:
        ``(h [T, D] fp32, h_normed [T, D])`` (``h`` None when ``store_h`` is False), freshly allocated unless
        ``out`` is given.
    Raises:
        ConfigError: bank full / shapes disagree, an output overlaps the bank, ``addend`` without a fitting
            ``prefix_out`` (:func:`k3rocm.model.attnres.check_addend`).
    """
    _check(bank, num_rows, prefix, append)
    if addend is not None:
        check_addend(prefix, addend, prefix_out, bank)
        if addend.stride(-1) != 1 or prefix_out.stride(-1) != 1:
            raise ConfigError("attn_res_norm: addend and prefix_out need a contiguous last dim")
    T, D = prefix.shape
    if out is None:
        h = torch.empty(T, D, dtype=torch.float32, device=prefix.device) if store_h else None
        hn = torch.empty(T, D, dtype=out_dtype or torch.float32, device=prefix.device)
    else:
        h, hn = out
        h = h if store_h else None
        b0, b1 = bank.data_ptr(), bank.data_ptr() + bank.numel() * bank.element_size()
        for o in (h, hn):
            if o is not None and b0 < o.data_ptr() + o.numel() * o.element_size() and o.data_ptr() < b1:
                raise ConfigError("attn_res_norm: an output buffer overlaps the bank; bank rows must stay live "
                                  "(K3_FACTS §5), allocate outputs separately")
        for o in (h, hn):
            if o is not None and addend is not None and overlaps(o, prefix_out):
                raise ConfigError("attn_res_norm: an output buffer overlaps prefix_out; allocate them separately")
    _launch(bank, num_rows, prefix, weight, norm_weight, eps, eps if norm_eps is None else norm_eps, append, h, hn,
            config, store_h=store_h, addend=addend, p_out=prefix_out)
    return h, hn


def attn_res(sources: torch.Tensor, weight: torch.Tensor, eps: float, config: dict | None = None) -> torch.Tensor:
    """Triton ``attn_res`` op (registry contract): ``sources [S, T, D]`` -> ``[T, D]`` fp32 (no following norm).

    Raises:
        ConfigError: ``S`` is 0, or widths disagree.
    """
    if sources.dim() != 3 or sources.shape[0] == 0 or weight.shape[-1] != sources.shape[-1]:
        raise ConfigError(f"attn_res: sources {tuple(sources.shape)} must be [S>0, T, D] with weight [D]")
    if sources.stride(-1) != 1:
        sources = sources.contiguous()
    S, T, D = sources.shape
    h = torch.empty(T, D, dtype=torch.float32, device=sources.device)
    _launch(sources, S - 1, sources[S - 1], weight, None, eps, eps, False, h, None, config)
    return h


def isa_signature(dtype: str = "bf16", append: bool = True, block_d: int = 1024, one_block: bool = False,
                  rows: int = 1, pipe: int = 0, store_h: bool = True, add: bool = False, early: int = 0):
    """(signature, constexprs, options) of the AttnRes kernel for ``kernels isa`` (``pipe``: the ``PIPE`` stream's
    stage count, 0 = the phased path; ``store_h``: the ``STORE_H`` variant; ``add``: the ``ADD`` variant, the
    decoder's pending prefix add in the step; ``early``: the ``EARLY`` variant, prefix loads before the bank tiles)."""
    p = "*" + dtype
    sig = {"BANK": p, "PREFIX": p, "W": "*fp32", "NW": "*fp32", "H_OUT": "*fp32", "HN_OUT": p, "ADDEND": "*fp32",
           "P_OUT": "*fp32", "num_rows": "i32", "T": "i32", "D": "i32", "nprog": "i32", "n_iter": "i32",
           "stride_br": "i64", "stride_bt": "i32", "stride_pt": "i32", "stride_ht": "i32", "stride_hnt": "i32",
           "stride_at": "i32", "stride_pot": "i32", "eps": "fp32", "norm_eps": "fp32"}
    consts = dict(APPEND=append, HAS_NORM=True, S_PAD=MIN_SOURCES_PAD, BLOCK_D=block_d, ONE_BLOCK=one_block,
                  ROWS=rows, PIPE=pipe, STORE_H=store_h, ADD=add, EARLY=early)
    for k in consts:
        sig[k] = "constexpr"
    # K3's hidden width; every row stride is a multiple of it (bank rows T x D). The row / token / program counts
    # are never specialised (do_not_specialize)
    D = 7168
    sig = specialize(sig, dict(D=D, stride_br=53 * D, stride_bt=D, stride_pt=D, stride_ht=D, stride_hnt=D,
                               stride_at=D, stride_pot=D))
    return sig, consts, {"cuda": {"num_warps": 4, "num_stages": 1}, "hip": {"num_warps": 4, "num_stages": 1}}
