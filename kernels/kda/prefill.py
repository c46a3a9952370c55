"""Triton chunked KDA prefill (WY / UT-transform form), varlen, fp32 state. Oracle: ``k3rocm.model.kda.kda_prefill``.

Six launches:

1. ``_gate_kernel``, one program per (chunk of BT = 64 tokens, head): in fp32 the gate
   ``g = lb * sigmoid(exp(A_log[h]) * (raw + dt_bias))``, its in-chunk cumulative sum ``G``, L2-normalised q
   (times ``scale``) and k; stores ``G``, ``qg = q e^G``, ``kg = k e^(G_L - G)`` and ``e^(G_L)``.
2. ``_intra_kernel``, one program per (chunk, head, 16-row block i): in 16 x 16 sub-blocks with
   ``beta = sigmoid(beta_raw)``, ``A[i,j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)`` (j < i) and the causal
   ``Aqk[i,j] = sum_c q_ic k_jc exp(G_ic - G_jc)`` (j <= i), both stored. Pairwise decays use one reference
   row per 16-row block (its middle): ``q_i e^(G_i - G_r)`` and ``k_j e^(G_r - G_j)`` stay within e^(+-8|lb|)
   (so ``lower_bound >= -10``), and never ``exp(-G)``.
3. ``_solve_kernel``, one program per (chunk, head): the UT solve ``M = (I + A)^-1`` (a product of four
   factors on each diagonal block, then block products), stored.
4. ``_wu_kernel``, one program per (chunk, head, w or u): ``w = M (beta k e^G)``, ``u = M (beta v)`` as one
   64-row product each (stored). Until 2026-12-06 steps 2-4 were one program per (chunk, head) holding the
   pairs, the solve and eight ``[16, 128]`` w / u accumulators at once: ptxas put it at 255 registers with
   408-544 bytes of spills on sm_90 (4 / 8 warps), and 12,288 such programs ran B1 T8192 H96 in 2.73 ms.
5. ``_state_kernel`` — the only serial pass: one program per (sequence, head, BV state columns) walks the
   sequence's chunks in order, stores the chunk's initial state ``h_c`` and ``v' = u - w h_c``, and steps
   ``h <- e^(G_L) h + kg^T v'`` (fp32 registers).
6. ``_out_kernel`` — one program per (chunk, head, BV columns), all chunks in parallel:
   ``o = qg h_c + Aqk v'``.

Precision (bf16 / fp16 inputs, and fp32 inputs with ``products="split"``): every product of inputs,
intermediates and states runs on the bf16 matrix unit with fp32 accumulation, as three bf16 products of a
hi / lo split (:func:`_mm`; :data:`PRODUCTS` says what one bf16 product costs in each place); fp32 stays in
the gate, ``G``, ``e^(G_L)``, the diagonal-block inverses of the UT solve (IEEE fp32), its other 16 x 16 block
products (backend fp32 precision: TF32 on sm_90, fp32 MFMA on CDNA), the running state, and the intermediate
buffers. fp32 inputs by default: IEEE fp32 products throughout.

Chunks never cross a sequence boundary, so one launch serves a packed batch of long prefills and 1-token
sequences. Algebra: Yang et al. 2024 (DeltaNet over sequence length), Kimi Linear report 2025 (KDA);
``k3rocm.model.kda._chunk_core`` is the same algebra in torch.
"""

from __future__ import annotations

from functools import partial

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune
from k3rocm.kernels.target import interpreting, multiprocessors

from . import configs as C

BT = 64  # tokens per chunk
BC = 16  # rows per sub-block
# the segmented state pass's combine: state columns a program, rows of h_s a product. 16 / 16 at 8 warps: 64
# registers on sm_90a (ptxas), no spills; 32 / 32 at 4 warps spilled 1,168 bytes and took 0.39 ms at B1 T131072 H12
# (H100, 2026-12-06)
SEG_BV, SEG_BK = 16, 16


@_interp.kjit
def _mm(a, b, OPD: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``OPD``: 0 fp32 operands (IEEE); 1 three bf16 products on the matrix
    unit (``v_mfma_f32_*_bf16`` / bf16 wgmma): with ``x = x_hi + x_lo`` split into two bf16 parts,
    ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` (about 16 mantissa bits, finer than TF32); 2 the same split multiplied
    in fp32 (the interpreter, whose bf16 ``tl.dot`` is wrong); 3 one bf16 product (operands rounded to bf16,
    8 mantissa bits); 4 the same rounding multiplied in fp32 (interpreter); 5 one fp16 product (``v_mfma_f32_*_f16``
    / fp16 wgmma, 11 mantissa bits; operands within fp16's range); 6 the same rounding multiplied in fp32
    (interpreter). 5 / 6 convert the operands straight from their dtype (an fp16 tile as loaded)."""
    if OPD == 5:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    if OPD == 6:
        return tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32), input_precision="ieee")
    a = a.to(tl.float32)
    if OPD == 0:
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")
    ah = a.to(tl.bfloat16)
    return _mm_pre(ah, (a - ah.to(tl.float32)).to(tl.bfloat16), b, OPD)


@_interp.kjit
def _mm_pre(ah, al, b, OPD: tl.constexpr):
    """:func:`_mm` with ``a`` already split in memory: ``ah`` / ``al`` its bf16 hi / lo parts (``al`` unused at
    ``OPD`` 3 / 4). ``OPD`` 1 / 2 / 3 / 4 as :func:`_mm` (no IEEE form: fp32 operands are never stored split)."""
    b = b.to(tl.float32)
    bh = b.to(tl.bfloat16)
    if OPD == 3:
        return tl.dot(ah, bh)
    if OPD == 4:
        return tl.dot(ah.to(tl.float32), bh.to(tl.float32), input_precision="ieee")
    bl = (b - bh.to(tl.float32)).to(tl.bfloat16)
    if OPD == 1:
        return tl.dot(ah, bh) + tl.dot(ah, bl) + tl.dot(al, bh)
    else:
        ah = ah.to(tl.float32)
        bh = bh.to(tl.float32)
        return (tl.dot(ah, bh, input_precision="ieee") + tl.dot(ah, bl.to(tl.float32), input_precision="ieee")
                + tl.dot(al.to(tl.float32), bh, input_precision="ieee"))


@_interp.kjit
def _store_split(ptr, x, t0, rows, hh, H, cols, mask, D: tl.constexpr, SPLIT: tl.constexpr = 1):
    """Store fp32 ``x`` (``[rows, D]`` tile of a ``[tokens, H, D]`` tensor) as its bf16 hi / lo parts in a
    ``[tokens, H, 2 D]`` bf16 buffer (hi in columns ``0 .. D``, ``lo = x - hi`` in ``D .. 2 D``); ``SPLIT = 0``:
    as is, in the dtype of a ``[tokens, H, D]`` buffer."""
    if SPLIT == 0:
        tl.store(_at(ptr, t0, rows, hh, H, cols, D), x.to(ptr.dtype.element_ty), mask=mask)
        return
    hi = x.to(tl.bfloat16)
    tl.store(_at(ptr, t0, rows, hh, H, cols, 2 * D), hi, mask=mask)
    tl.store(_at(ptr, t0, rows, hh, H, D + cols, 2 * D), (x - hi.to(tl.float32)).to(tl.bfloat16), mask=mask)


@_interp.kjit
def _at(ptr, t0, r, hh, H, cols, D: tl.constexpr):
    """Addresses of rows ``t0 + r`` (tokens), head ``hh``, columns ``cols`` of a ``[tokens, H, D]`` tensor. The
    int64 part is one scalar, ``(t0 H + hh) D``; the per-element offsets ``r H D + cols`` are int32 (a chunk
    spans < 2^31 elements), so a tile's offsets hold half the registers of int64 ones (the prefill kernels ran
    at the register limit, spilling, with int64 offset tiles)."""
    return ptr + (t0.to(tl.int64) * H + hh) * D + (r[:, None] * (H * D) + cols[None, :])


@_interp.kjit
def _rows(ptr, t0, L, hh, H, j, D: tl.constexpr, BC: tl.constexpr):
    """Rows j*BC .. j*BC+BC-1 of a chunk of a [tokens, H, D] tensor, head hh, as fp32 (zeros past L)."""
    r = j * BC + tl.arange(0, BC)
    return tl.load(_at(ptr, t0, r, hh, H, tl.arange(0, D), D), mask=(r < L)[:, None], other=0.0).to(tl.float32)


@_interp.kjit
def _l2n(x):
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@_interp.kjit
def _beta(braw, t0, L, hh, H, j, BC: tl.constexpr):
    r = j * BC + tl.arange(0, BC)
    b = tl.load(braw + (t0.to(tl.int64) * H + hh) + r * H, mask=r < L, other=0.0).to(tl.float32)
    return tl.where(r < L, tl.sigmoid(b), 0.0)


@_interp.kjit
def _store_blk(ptr, x, t0, L, hh, H, i, j, D: tl.constexpr, BC: tl.constexpr):
    """Store a [BC, BC] tile at rows i*BC.., cols j*BC.. of a [tokens, H, D] buffer (in the buffer's dtype)."""
    r = i * BC + tl.arange(0, BC)
    c = j * BC + tl.arange(0, BC)
    tl.store(_at(ptr, t0, r, hh, H, c, D), x.to(ptr.dtype.element_ty), mask=(r < L)[:, None])


@_interp.kjit
def _pair(k, gbuf, aqk, t0, L, hh, H, i, j, Gref, ka, qa,
          K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, OPD: tl.constexpr, DIAG: tl.constexpr):
    """Block (i, j) of A (strictly lower overall), returned; block (i, j) of Aqk (lower incl. diagonal),
    stored at once (keeping it live would cost registers), j <= i; ``DIAG = 1``: the diagonal block (i = j), its
    upper part masked."""
    r = j * BC + tl.arange(0, BC)
    kj = _l2n(_rows(k, t0, L, hh, H, j, K, BC))
    Gj = _rows(gbuf, t0, L, hh, H, j, K, BC)
    kb = tl.where((r < L)[:, None], kj * tl.exp(Gref[None, :] - Gj), 0.0)
    a = _mm(ka, tl.trans(kb), OPD)
    s = _mm(qa, tl.trans(kb), OPD)
    if DIAG:
        ri = tl.arange(0, BC)[:, None]
        ci = tl.arange(0, BC)[None, :]
        a = tl.where(ri > ci, a, 0.0)
        s = tl.where(ri >= ci, s, 0.0)
    _store_blk(aqk, s, t0, L, hh, H, i, j, BT, BC)
    return a


@_interp.kjit
def _row_side(q, k, gbuf, braw, t0, L, hh, H, scale, i, K: tl.constexpr, BC: tl.constexpr,
              FIRST: tl.constexpr = 0):
    """(ka_i, qa_i, Gref_i): beta k and scaled q of block i, decayed relative to the block's middle row
    (``FIRST = 1``: its first row, so every factor ``e^(G_r - G_ref)`` <= 1 and, for a block j < i, every
    ``e^(G_ref - G_c)`` <= 1: fp16 operands cannot overflow; not for the diagonal block, whose later columns would
    take ``e^(G_ref - G_c)`` up to ``e^150``)."""
    rref = tl.minimum(i * BC + (0 if FIRST else BC // 2), L - 1)
    Gref = tl.load(gbuf + ((t0 + rref).to(tl.int64) * H + hh) * K + tl.arange(0, K)).to(tl.float32)
    r = i * BC + tl.arange(0, BC)
    m = (r < L)[:, None]
    Gi = _rows(gbuf, t0, L, hh, H, i, K, BC)
    e = tl.exp(Gi - Gref[None, :])
    qi = _l2n(_rows(q, t0, L, hh, H, i, K, BC)) * scale
    ki = _l2n(_rows(k, t0, L, hh, H, i, K, BC))
    bi = _beta(braw, t0, L, hh, H, i, BC)
    ka = tl.where(m, ki * e * bi[:, None], 0.0)
    qa = tl.where(m, qi * e, 0.0)
    return ka, qa, Gref


@_interp.kjit
def _inv_diag(a, BC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [BC, BC] block (BC = 16): a is nilpotent (a^16 = 0), so
    ``(I + a)^-1 = sum_{n<16} (-a)^n = (I - a)(I + a^2)(I + a^4)(I + a^8)`` — three squarings and three
    products on the matrix unit in IEEE fp32, instead of 15 dependent row steps of forward substitution."""
    r = tl.arange(0, BC)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    m = eye - a
    p = a
    for _ in tl.static_range(0, 3):
        p = tl.dot(p, p, input_precision="ieee")
        m = tl.dot(m, eye + p, input_precision="ieee")
    return m


@_interp.kjit
def _pids(INNER: tl.constexpr, NI: tl.constexpr):
    """``(outer, inner)`` program indices of a kernel whose grid splits each outer item (a chunk or a sequence)
    ``NI`` ways (row blocks, w / u, V blocks). ``INNER = 1``: axis 0 is ``outer * NI + inner``, so the programs
    of one item are adjacent in launch order and run together, sharing the item's tiles in L2 (with the split on
    axis 2 they are ``NC * H`` launches apart, and a B1 T8192 H96 prefill's tiles are far larger than L2);
    ``INNER = 0``: ``(axis 0, axis 2)``. Axis 1 is the head either way."""
    if INNER:
        pid = tl.program_id(0)
        return pid // NI, pid % NI
    else:
        return tl.program_id(0), tl.program_id(2)


@_interp.kjit
def _cumsum_rows(g, BT: tl.constexpr, CS: tl.constexpr):
    """Inclusive cumulative sum of fp32 ``g`` ``[BT, K]`` down its rows. ``CS = 0``: ``tl.cumsum``; 1: on the matrix
    unit, ``L g`` with ``L`` the ``[BT, BT]`` lower-triangular ones (exact in bf16) and ``g`` split into three bf16
    parts (hi + mid + lo carry its 24 mantissa bits), three bf16 products with fp32 accumulation: exact products,
    only the summation order differs from a sequential fp32 sum; 2: the same split multiplied in IEEE fp32 (the
    interpreter, whose bf16 ``tl.dot`` is wrong)."""
    if CS == 0:
        return tl.cumsum(g, 0)
    r = tl.arange(0, BT)
    tri = (r[:, None] >= r[None, :]).to(tl.float32)
    hi = g.to(tl.bfloat16)
    rem = g - hi.to(tl.float32)
    mid = rem.to(tl.bfloat16)
    lo = (rem - mid.to(tl.float32)).to(tl.bfloat16)
    if CS == 1:
        tb = tri.to(tl.bfloat16)
        return tl.dot(tb, lo) + tl.dot(tb, mid) + tl.dot(tb, hi)
    else:
        return (tl.dot(tri, lo.to(tl.float32), input_precision="ieee")
                + tl.dot(tri, mid.to(tl.float32), input_precision="ieee")
                + tl.dot(tri, hi.to(tl.float32), input_precision="ieee"))


@_interp.kjit
def _gate_kernel(q, k, draw, A_log, dt_bias, chunk_tok, chunk_len, gbuf, qg, kg, glast, scale, lower_bound, H,
                 K: tl.constexpr, BT: tl.constexpr, KG2: tl.constexpr = 0, QG2: tl.constexpr = 0,
                 CS: tl.constexpr = 0):
    """Phase 1 of a chunk: gate, in-chunk cumulative log-decay G (fp32), ``qg = q e^G``, ``kg = k e^(G_L - G)``
    (in the dtype of their buffers), ``e^G_L`` (fp32), on whole ``[BT, K]`` tiles. (Walking the chunk in 16-row
    slices took the registers from 255 to 144 but the kernel from 1.14 to 1.58 ms at B1 T8192 H96 on an H100,
    2026-12-06: fewer bytes in flight a program; so did a chunk's channels split over 2 or 4 programs, 1.18 / 1.24
    vs 1.17 ms, at 151 / 72 registers.) ``KG2`` / ``QG2`` = 1: ``kg`` / ``qg`` stored split, bf16 hi / lo
    (:func:`_store_split`); ``CS``: how the cumulative sum runs (:func:`_cumsum_rows`)."""
    c, hh, t0, L = _chunk_program(chunk_tok, chunk_len)
    _gate_chunk(q, k, draw, A_log, dt_bias, gbuf, qg, kg, glast, scale, lower_bound, c, t0, L, hh, H, K, BT, KG2, QG2,
                CS)


# n_items (chunks x heads) not specialised on (== 1, % 16): a new chunk count never compiles while serving
@partial(JITFunction, do_not_specialize=("n_items",))
def _gate_ps_kernel(q, k, draw, A_log, dt_bias, chunk_tok, chunk_len, gbuf, qg, kg, glast, scale, lower_bound, H,
                    n_items, K: tl.constexpr, BT: tl.constexpr, KG2: tl.constexpr = 0, QG2: tl.constexpr = 0,
                    CS: tl.constexpr = 0):
    """:func:`_gate_kernel` as a persistent grid: each program walks the ``n_items = chunks x heads`` (chunk,
    head) items ``pid, pid + programs, ...`` in one loop (head fastest), so the loop pipeliner can issue the next
    item's q / k / decay loads while this one's are in use (the launch's ``num_stages``). Same arithmetic per item,
    bit for bit."""
    for it in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        c = it // H
        hh = it % H
        t0 = tl.load(chunk_tok + c)
        L = tl.load(chunk_len + c)
        _gate_chunk(q, k, draw, A_log, dt_bias, gbuf, qg, kg, glast, scale, lower_bound, c, t0, L, hh, H, K, BT, KG2,
                    QG2, CS)


def _programs_per_wave(dev, per_sm: int) -> int:
    """``per_sm`` x the device's multiprocessors (CUs): a persistent grid's size. The interpreter takes 3 programs
    (every loop then runs more than one item on the small test shapes)."""
    return 3 if interpreting() else per_sm * multiprocessors(dev)


@_interp.kjit
def _chunk_program(chunk_tok, chunk_len):
    """``(c, hh, t0, L)`` of a program on a ``(chunks, heads)`` grid: its chunk, head, first token and length."""
    c = tl.program_id(0)
    return c, tl.program_id(1), tl.load(chunk_tok + c), tl.load(chunk_len + c)


@_interp.kjit
def _gate_chunk(q, k, draw, A_log, dt_bias, gbuf, qg, kg, glast, scale, lower_bound, c, t0, L, hh, H,
                K: tl.constexpr, BT: tl.constexpr, KG2: tl.constexpr, QG2: tl.constexpr, CS: tl.constexpr):
    """The gate of chunk ``c`` (tokens ``t0 .. t0 + L``), head ``hh``: :func:`_gate_kernel`'s work, also the first
    phase of :func:`_local_kernel`."""
    rows = tl.arange(0, BT)
    mr = (rows < L)[:, None]
    offs_k = tl.arange(0, K)
    raw = tl.load(_at(draw, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0).to(tl.float32)
    a_h = tl.exp(tl.load(A_log + hh).to(tl.float32))
    dtb = tl.load(dt_bias + hh * K + offs_k).to(tl.float32)
    g = lower_bound * tl.sigmoid(a_h * (raw + dtb[None, :]))
    g = tl.where(mr, g, 0.0)
    G = _cumsum_rows(g, BT, CS)
    gl = tl.sum(g, 0)
    tl.store(_at(gbuf, t0, rows, hh, H, offs_k, K), G, mask=mr)
    tl.store(glast + (c.to(tl.int64) * H + hh) * K + offs_k, tl.exp(gl))
    qn = tl.load(_at(q, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0).to(tl.float32)
    qn = _l2n(qn) * scale
    _store_split(qg, qn * tl.exp(G), t0, rows, hh, H, offs_k, mr, K, QG2)
    kn = tl.load(_at(k, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0).to(tl.float32)
    kn = _l2n(kn)
    kgv = tl.where(mr, kn * tl.exp(gl[None, :] - G), 0.0)
    _store_split(kg, kgv, t0, rows, hh, H, offs_k, mr, K, KG2)


@_interp.kjit
def _intra_kernel(q, k, braw, chunk_tok, chunk_len, gbuf, aqk, abuf, scale, H,
                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, OPD: tl.constexpr, INNER: tl.constexpr = 0,
                  RT: tl.constexpr = 0):
    """Phase 2 of a chunk, one program per (chunk, head, 16-row block i): row block i of A and of Aqk, the
    blocks (i, j <= i), both stored (A in fp32 for :func:`_solve_kernel`, or in abuf's dtype). The products take
    :func:`_mm` with ``OPD``; ``OPD`` 5 / 6 (fp16): the blocks j < i in fp16 about the block's first row, the
    diagonal block split (``OPD`` - 4) about its middle row (:func:`_row_side`). A row block past the chunk's
    length does nothing. ``RT = 1``: one code path for every row block, the blocks j < i in a runtime loop (the
    unrolled form holds the code of all four row blocks, 1 + 2 + 3 + 4 pair products: ncu on an H100 put 32% of its
    stalls on instruction fetch, 2026-12-06)."""
    c, ib = _pids(INNER, BT // BC)
    hh = tl.program_id(1)
    t0 = tl.load(chunk_tok + c)
    L = tl.load(chunk_len + c)
    if RT:
        if ib * BC < L:
            _intra_row(q, k, braw, gbuf, aqk, abuf, t0, L, hh, H, scale, ib, K, BT, BC, OPD, 1)
    else:
        for i in tl.static_range(0, BT // BC):
            if (ib == i) & (i * BC < L):
                _intra_row(q, k, braw, gbuf, aqk, abuf, t0, L, hh, H, scale, i, K, BT, BC, OPD, 0)


@_interp.kjit
def _intra_row(q, k, braw, gbuf, aqk, abuf, t0, L, hh, H, scale, i, K: tl.constexpr, BT: tl.constexpr,
               BC: tl.constexpr, OPD: tl.constexpr, RT: tl.constexpr):
    """Row block i of A and Aqk (:func:`_intra_kernel`): the blocks j < i (a runtime loop where ``RT = 1`` and i is
    a runtime value, else unrolled), then the diagonal.
    fp16 (``OPD`` 5 / 6): the blocks j < i about the block's first row, the diagonal split about its middle row."""
    ka, qa, Gr = _row_side(q, k, gbuf, braw, t0, L, hh, H, scale, i, K, BC, OPD >= 5)
    if RT:
        for j in range(0, i):
            a = _pair(k, gbuf, aqk, t0, L, hh, H, i, j, Gr, ka, qa, K, BT, BC, OPD, 0)
            _store_blk(abuf, a, t0, L, hh, H, i, j, BT, BC)
    else:
        for j in tl.static_range(0, i):
            a = _pair(k, gbuf, aqk, t0, L, hh, H, i, j, Gr, ka, qa, K, BT, BC, OPD, 0)
            _store_blk(abuf, a, t0, L, hh, H, i, j, BT, BC)
    if OPD >= 5:
        ka, qa, Gr = _row_side(q, k, gbuf, braw, t0, L, hh, H, scale, i, K, BC)
    a = _pair(k, gbuf, aqk, t0, L, hh, H, i, i, Gr, ka, qa, K, BT, BC, OPD - 4 * (OPD >= 5), 1)
    _store_blk(abuf, a, t0, L, hh, H, i, i, BT, BC)


@_interp.kjit
def _blk(ptr, t0, L, hh, H, i: tl.constexpr, j: tl.constexpr, D: tl.constexpr, BC: tl.constexpr):
    """The [BC, BC] tile at rows i*BC.., cols j*BC.. of a [tokens, H, D] fp32 buffer (zeros past L)."""
    r = i * BC + tl.arange(0, BC)
    return tl.load(_at(ptr, t0, r, hh, H, j * BC + tl.arange(0, BC), D), mask=(r < L)[:, None],
                   other=0.0).to(tl.float32)


@_interp.kjit
def _solve_kernel(abuf, mbuf, chunk_tok, chunk_len, H, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Phase 3 of a chunk, one program per (chunk, head): the UT solve ``M = (I + A)^-1`` of the stored A (its
    16 x 16 blocks: :func:`_inv_diag` on the diagonal, then block products at ``PREC``), stored in fp32 (lower
    triangle; :func:`_wu_kernel` applies it)."""
    c, hh, t0, L = _chunk_program(chunk_tok, chunk_len)
    _solve_chunk(abuf, mbuf, t0, L, hh, H, BT, BC, PREC)


@_interp.kjit
def _solve_chunk(abuf, mbuf, t0, L, hh, H, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """The UT solve of the chunk at token ``t0`` (``L`` tokens), head ``hh``: ``M = (I + A)^-1`` from ``abuf`` to
    ``mbuf`` (:func:`_solve_kernel`)."""
    a10 = _blk(abuf, t0, L, hh, H, 1, 0, BT, BC)
    a20 = _blk(abuf, t0, L, hh, H, 2, 0, BT, BC)
    a21 = _blk(abuf, t0, L, hh, H, 2, 1, BT, BC)
    a30 = _blk(abuf, t0, L, hh, H, 3, 0, BT, BC)
    a31 = _blk(abuf, t0, L, hh, H, 3, 1, BT, BC)
    a32 = _blk(abuf, t0, L, hh, H, 3, 2, BT, BC)
    m00 = _inv_diag(_blk(abuf, t0, L, hh, H, 0, 0, BT, BC), BC)
    m11 = _inv_diag(_blk(abuf, t0, L, hh, H, 1, 1, BT, BC), BC)
    m22 = _inv_diag(_blk(abuf, t0, L, hh, H, 2, 2, BT, BC), BC)
    m33 = _inv_diag(_blk(abuf, t0, L, hh, H, 3, 3, BT, BC), BC)
    m10 = -tl.dot(m11, tl.dot(a10, m00, input_precision=PREC), input_precision=PREC)
    m21 = -tl.dot(m22, tl.dot(a21, m11, input_precision=PREC), input_precision=PREC)
    m20 = -tl.dot(m22, tl.dot(a20, m00, input_precision=PREC) + tl.dot(a21, m10, input_precision=PREC),
                  input_precision=PREC)
    m32 = -tl.dot(m33, tl.dot(a32, m22, input_precision=PREC), input_precision=PREC)
    m31 = -tl.dot(m33, tl.dot(a31, m11, input_precision=PREC) + tl.dot(a32, m21, input_precision=PREC),
                  input_precision=PREC)
    m30 = -tl.dot(m33, tl.dot(a30, m00, input_precision=PREC) + tl.dot(a31, m10, input_precision=PREC)
                  + tl.dot(a32, m20, input_precision=PREC), input_precision=PREC)
    _store_blk(mbuf, m00, t0, L, hh, H, 0, 0, BT, BC)
    _store_blk(mbuf, m10, t0, L, hh, H, 1, 0, BT, BC)
    _store_blk(mbuf, m11, t0, L, hh, H, 1, 1, BT, BC)
    _store_blk(mbuf, m20, t0, L, hh, H, 2, 0, BT, BC)
    _store_blk(mbuf, m21, t0, L, hh, H, 2, 1, BT, BC)
    _store_blk(mbuf, m22, t0, L, hh, H, 2, 2, BT, BC)
    _store_blk(mbuf, m30, t0, L, hh, H, 3, 0, BT, BC)
    _store_blk(mbuf, m31, t0, L, hh, H, 3, 1, BT, BC)
    _store_blk(mbuf, m32, t0, L, hh, H, 3, 2, BT, BC)
    _store_blk(mbuf, m33, t0, L, hh, H, 3, 3, BT, BC)


@_interp.kjit
def _wu_kernel(k, v, braw, gbuf, mbuf, w, u, chunk_tok, chunk_len, H,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, WOPD: tl.constexpr, UOPD: tl.constexpr,
               INNER: tl.constexpr = 0, W2: tl.constexpr = 0, SV: tl.constexpr = 0, abuf=None, BC: tl.constexpr = 16,
               PREC: tl.constexpr = None):
    """Phase 4 of a chunk, one program per (chunk, head, part): part 0 ``w = M (beta k e^G)`` (``[BT, K]``),
    part 1 ``u = M (beta v)`` (``[BT, V]``), each one ``[BT, BT] x [BT, D]`` product of the stored solve ``M``
    (its upper triangle read as 0) on the matrix unit (64-row tiles: wgmma on sm_90), ``w`` through :func:`_mm`
    with ``WOPD``, ``u`` with ``UOPD``; stored (``W2 = 1``: ``w`` split, bf16 hi / lo, :func:`_store_split`).
    ``SV = 1``: phases 3 and 4 in one program per (chunk, head): the UT solve of ``abuf`` (:func:`_solve_chunk`,
    ``PREC``) stored to ``mbuf`` and read back as one ``[BT, BT]`` tile after a block barrier (from L2: no solve
    launch, M not read from memory twice), then both ``w`` and ``u``."""
    if SV:
        c = tl.program_id(0)
    else:
        c, part = _pids(INNER, 2)
    hh = tl.program_id(1)
    t0 = tl.load(chunk_tok + c)
    L = tl.load(chunk_len + c)
    if SV:
        _solve_chunk(abuf, mbuf, t0, L, hh, H, BT, BC, PREC)
        tl.debug_barrier()  # M's blocks were stored by other threads of this program
        _wu_parts(k, v, braw, gbuf, mbuf, w, u, t0, L, hh, H, 0, K, V, BT, WOPD, UOPD, W2, 1)
    else:
        _wu_parts(k, v, braw, gbuf, mbuf, w, u, t0, L, hh, H, part, K, V, BT, WOPD, UOPD, W2, 0)


@_interp.kjit
def _wu_parts(k, v, braw, gbuf, mbuf, w, u, t0, L, hh, H, part, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
              WOPD: tl.constexpr, UOPD: tl.constexpr, W2: tl.constexpr, BOTH: tl.constexpr):
    """Load the chunk's stored solve ``M`` (``[BT, BT]``, upper triangle as 0) and ``beta``, then ``w`` (``part``
    0) or ``u`` (``part`` 1), or both (``BOTH = 1``; ``part`` ignored)."""
    rows = tl.arange(0, BT)
    ok = rows < L
    mr = ok[:, None]
    m = tl.load(_at(mbuf, t0, rows, hh, H, rows, BT), mask=mr & (rows[None, :] <= rows[:, None]), other=0.0)
    b = tl.load(braw + (t0.to(tl.int64) * H + hh) + rows * H, mask=ok, other=0.0).to(tl.float32)
    b = tl.where(ok, tl.sigmoid(b), 0.0)
    if BOTH:
        _wu_w(k, gbuf, m, b, w, t0, rows, hh, H, mr, K, WOPD, W2)
        _wu_u(v, m, b, u, t0, rows, hh, H, mr, V, UOPD)
    elif part == 0:
        _wu_w(k, gbuf, m, b, w, t0, rows, hh, H, mr, K, WOPD, W2)
    else:
        _wu_u(v, m, b, u, t0, rows, hh, H, mr, V, UOPD)


@_interp.kjit
def _wu_w(k, gbuf, m, b, w, t0, rows, hh, H, mr, K: tl.constexpr, WOPD: tl.constexpr, W2: tl.constexpr):
    """``w = M (beta k e^G)`` of one chunk (:func:`_wu_kernel`), stored."""
    offs_k = tl.arange(0, K)
    kn = _l2n(tl.load(_at(k, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0).to(tl.float32))
    G = tl.load(_at(gbuf, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0)
    bk = tl.where(mr, kn * tl.exp(G) * b[:, None], 0.0)
    _store_split(w, _mm(m, bk, WOPD), t0, rows, hh, H, offs_k, mr, K, W2)


@_interp.kjit
def _wu_u(v, m, b, u, t0, rows, hh, H, mr, V: tl.constexpr, UOPD: tl.constexpr):
    """``u = M (beta v)`` of one chunk (:func:`_wu_kernel`), stored."""
    offs_v = tl.arange(0, V)
    bv = tl.load(_at(v, t0, rows, hh, H, offs_v, V), mask=mr, other=0.0).to(tl.float32) * b[:, None]
    tl.store(_at(u, t0, rows, hh, H, offs_v, V), _mm(m, bv, UOPD).to(u.dtype.element_ty), mask=mr)


@_interp.kjit
def _local_kernel(q, k, v, draw, braw, A_log, dt_bias, chunk_tok, chunk_len, gbuf, qg, kg, glast, aqk, abuf, mbuf,
                  w, u, scale, lower_bound, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                  OPD: tl.constexpr, WOPD: tl.constexpr, UOPD: tl.constexpr, PREC: tl.constexpr, KG2: tl.constexpr,
                  QG2: tl.constexpr, W2: tl.constexpr, CS: tl.constexpr):
    """Phases 1 - 4 of a chunk in one program per (chunk, head) (the intra table's ``LC`` entries): the gate
    (:func:`_gate_chunk`), the row blocks of A and Aqk in a runtime loop (:func:`_intra_row`), the UT solve
    (:func:`_solve_chunk`) and ``w`` / ``u`` (:func:`_wu_parts`), a block barrier between phases (each reads what
    other threads of the program stored). The same arithmetic as the four launches, bit for bit; G, A and M are
    still stored but read back at once, from L2, and q / k / G / M are not read from memory again by later
    launches. Outputs as the four kernels': qg, kg, glast, Aqk, w, u (and the intermediates gbuf, abuf, mbuf)."""
    c, hh, t0, L = _chunk_program(chunk_tok, chunk_len)
    _gate_chunk(q, k, draw, A_log, dt_bias, gbuf, qg, kg, glast, scale, lower_bound, c, t0, L, hh, H, K, BT, KG2, QG2,
                CS)
    tl.debug_barrier()  # G was stored by other threads of this program
    for i in range(0, tl.cdiv(L, BC)):
        _intra_row(q, k, braw, gbuf, aqk, abuf, t0, L, hh, H, scale, i, K, BT, BC, OPD, 1)
    tl.debug_barrier()  # A's blocks
    _solve_chunk(abuf, mbuf, t0, L, hh, H, BT, BC, PREC)
    tl.debug_barrier()  # M's blocks
    _wu_parts(k, v, braw, gbuf, mbuf, w, u, t0, L, hh, H, 0, K, V, BT, WOPD, UOPD, W2, 1)


@_interp.kjit
def _reg(x, mr, one, RB: tl.constexpr):
    """A loaded tile on its way to a matrix product, as is (``RB = 0``), through a select on its row mask
    (``RB = 1``, the wrapper's default for 16-bit tiles) or times the runtime scalar ``one`` = 1.0 (``RB = 2``, in
    x's dtype): both keep the value and keep the load from feeding the product directly. On an H100 with triton
    3.6 (2026-12-06, ``gpu-runs/kda_state_check.py``), 16-bit tiles loaded and multiplied in the same step of the
    state loop as is gave wrong states (rel. RMS 1.7) and an illegal address at B1 T8192 H96; RB 1 and 2 were
    right (6.1e-4, the fp16 form's own error)."""
    if RB == 1:
        return tl.where(mr, x, 0.0)
    elif RB == 2:
        return (x * one).to(x.dtype)
    else:
        return x


@_interp.kjit
def _chunk_tiles(kg, w, u, glast, s0, s1, c0, c, ok, hh, H, offs_v,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """(w_c, kg_c, u_c, e^(G_L), t0, L) of chunk ``c`` of the sequence of tokens ``[s0, s1)`` whose first chunk
    is ``c0`` (chunks are BT tokens of one sequence: the addresses are affine in ``c``, no table read in the
    loop, so the compiler may pipeline the loads); ``ok`` (int) 0: all masked, L <= 0."""
    t0 = s0 + (c - c0) * BT
    L = tl.minimum(s1 - t0, BT) * ok
    offs_k = tl.arange(0, K)
    rows = tl.arange(0, BT)
    mr = (rows < L)[:, None]
    w_c = tl.load(_at(w, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0)
    kg_c = tl.load(_at(kg, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0)
    u_c = tl.load(_at(u, t0, rows, hh, H, offs_v, V), mask=mr, other=0.0).to(tl.float32)
    # masked by the chunk's length, not only by ``ok``: a pipelined loop (2-stage configs) may issue the loads of
    # the step after the last, whose glast row can lie past the buffer's end
    gl = tl.load(glast + (c * H + hh.to(tl.int64)) * K + offs_k, mask=(L + 0 * offs_k) > 0, other=0.0)
    return w_c, kg_c, u_c, gl, t0, L


@_interp.kjit
def _out_tiles(qg, aqk, t0, L, hh, H, K: tl.constexpr, BT: tl.constexpr):
    """(qg_c, Aqk_c) of the chunk at token ``t0`` with ``L`` tokens (zeros past L; Aqk's upper triangle as 0): the
    output's operands when the state loop computes it (``FO``)."""
    rows = tl.arange(0, BT)
    mr = (rows < L)[:, None]
    qg_c = tl.load(_at(qg, t0, rows, hh, H, tl.arange(0, K), K), mask=mr, other=0.0)
    a_c = tl.load(_at(aqk, t0, rows, hh, H, rows, BT), mask=mr & (rows[None, :] <= rows[:, None]), other=0.0)
    return qg_c, a_c


@_interp.kjit
def _state_kernel(kg, w, u, glast, h0, hbuf, vnew, ht, seq_chunk, chunk_tok, chunk_len, H,
                  HAS_H0: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                  OPD: tl.constexpr, PF: tl.constexpr, WHOPD: tl.constexpr, INNER: tl.constexpr = 0,
                  SPL: tl.constexpr = 0, FO: tl.constexpr = 0, qg=None, aqk=None, o=None, OOPD: tl.constexpr = 1,
                  RB: tl.constexpr = 0, one=1.0):
    """The serial pass: one program per (sequence, head, BV state columns) walks the sequence's chunks in order,
    stores the chunk's initial state ``h_c`` and ``v' = u - w h_c``, and steps ``h <- e^(G_L) h + kg^T v'``.
    The state is accumulated in fp32 registers; the two products take their operands through :func:`_mm`,
    ``w h_c`` with ``WHOPD`` and ``kg^T v'`` with ``OPD``.
    ``PF = 1``: the next chunk's tiles are loaded while the current one is computed (they do not depend on the
    state), so their memory latency leaves the serial chain, for twice the tile registers; ``PF = 0``: each
    chunk's tiles are loaded at the top of its step. ``SPL = 1``: ``w`` and ``kg`` are stored split
    (``[tokens, H, 2 K]`` bf16 hi / lo, :func:`_store_split`) and go to :func:`_mm_pre` as loaded (no fp32 tile
    in registers, no split in the serial loop); each chunk's tiles at the top of its step. ``FO = 1`` (with
    ``SPL``, ``qg`` stored split too; without, any precision form): the output in the loop, ``o = qg h_c + Aqk v'`` with ``OOPD``, stored to
    ``o``; no chunk state ``hbuf`` and no ``v'`` written (off the serial chain: nothing later reads ``o``), and no
    output launch; one program per (sequence, head, V block) then does the output's work too, so it pays where
    sequences x heads fill the GPU (B1 T8192 H96), not for one long sequence of few heads."""
    n, vb = _pids(INNER, V // BV)
    hh = tl.program_id(1)
    offs_k = tl.arange(0, K)
    offs_v = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    hoff = offs_k[:, None] * V + offs_v[None, :]  # int32 offsets in one [K, V] state, int64 bases
    hbase = (n.to(tl.int64) * H + hh) * (K * V)
    if HAS_H0:
        h = tl.load(h0 + hbase + hoff).to(tl.float32)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    c0 = tl.load(seq_chunk + n)
    c1 = tl.load(seq_chunk + n + 1)
    some = c0 < c1
    s0 = tl.load(chunk_tok + c0, mask=some, other=0)
    s1 = tl.load(chunk_tok + c1 - 1, mask=some, other=0) + tl.load(chunk_len + c1 - 1, mask=some, other=0)
    if SPL:
        _state_split(kg, w, u, glast, hbuf, vnew, ht, h, hbase, hoff, s0, s1, c0, c1, hh, H, offs_v, K, V, BT, BV,
                     OPD, WHOPD, FO, qg, aqk, o, OOPD, RB, one)
        return
    if PF:
        w_c, kg_c, u_c, gl, t0, L = _chunk_tiles(kg, w, u, glast, s0, s1, c0, c0, some.to(tl.int32), hh, H,
                                                 offs_v, K, V, BT)
        if FO:
            qg_c, a_c = _out_tiles(qg, aqk, t0, L, hh, H, K, BT)
    for c in range(c0, c1):
        if PF:
            w_n, kg_n, u_n, gl_n, t0_n, L_n = _chunk_tiles(kg, w, u, glast, s0, s1, c0, c + 1,
                                                           (c + 1 < c1).to(tl.int32), hh, H, offs_v, K, V, BT)
            if FO:
                qg_n, a_n = _out_tiles(qg, aqk, t0_n, L_n, hh, H, K, BT)
        else:
            w_c, kg_c, u_c, gl, t0, L = _chunk_tiles(kg, w, u, glast, s0, s1, c0, c, 1, hh, H, offs_v, K, V, BT)
            if FO:
                qg_c, a_c = _out_tiles(qg, aqk, t0, L, hh, H, K, BT)
        mr = (rows < L)[:, None]
        w_c = _reg(w_c, mr, one, RB)
        kg_c = _reg(kg_c, mr, one, RB)
        vn = u_c - _mm(w_c, h, WHOPD)
        if FO:
            oc = _mm(_reg(qg_c, mr, one, RB), h, OOPD) + _mm(_reg(a_c, mr, one, RB), vn, OOPD)
            tl.store(_at(o, t0, rows, hh, H, offs_v, V), oc.to(o.dtype.element_ty), mask=mr)
        else:
            ch = c * H + hh.to(tl.int64)  # int64: the chunk states of a long sequence pass 2^31 elements
            tl.store(hbuf + ch * (K * V) + hoff, h.to(hbuf.dtype.element_ty))
            tl.store(_at(vnew, t0, rows, hh, H, offs_v, V), vn.to(vnew.dtype.element_ty), mask=mr)
        h = h * gl[:, None] + _mm(tl.trans(kg_c), vn, OPD)
        if PF:
            w_c, kg_c, u_c, gl, t0, L = w_n, kg_n, u_n, gl_n, t0_n, L_n
            if FO:
                qg_c, a_c = qg_n, a_n
    tl.store(ht + hbase + hoff, h)


@_interp.kjit
def _state_split(kg, w, u, glast, hbuf, vnew, ht, h, hbase, hoff, s0, s1, c0, c1, hh, H, offs_v,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr,
                 WHOPD: tl.constexpr, FO: tl.constexpr, qg, aqk, o, OOPD: tl.constexpr, RB: tl.constexpr, one):
    """:func:`_state_kernel`'s chunk loop on split-stored ``w`` / ``kg`` (``SPL = 1``), the output in the loop
    when ``FO = 1``."""
    offs_k = tl.arange(0, K)
    rows = tl.arange(0, BT)
    for c in range(c0, c1):
        t0 = s0 + (c - c0) * BT
        L = tl.minimum(s1 - t0, BT)
        mr = (rows < L)[:, None]
        w_h = _reg(tl.load(_at(w, t0, rows, hh, H, offs_k, 2 * K), mask=mr, other=0.0), mr, one, RB)
        w_l = _reg(tl.load(_at(w, t0, rows, hh, H, K + offs_k, 2 * K), mask=mr, other=0.0), mr, one, RB)
        kg_h = _reg(tl.load(_at(kg, t0, rows, hh, H, offs_k, 2 * K), mask=mr, other=0.0), mr, one, RB)
        kg_l = _reg(tl.load(_at(kg, t0, rows, hh, H, K + offs_k, 2 * K), mask=mr, other=0.0), mr, one, RB)
        u_c = tl.load(_at(u, t0, rows, hh, H, offs_v, V), mask=mr, other=0.0).to(tl.float32)
        gl = tl.load(glast + (c * H + hh.to(tl.int64)) * K + offs_k)
        vn = u_c - _mm_pre(w_h, w_l, h, WHOPD)
        if FO:
            q_h = _reg(tl.load(_at(qg, t0, rows, hh, H, offs_k, 2 * K), mask=mr, other=0.0), mr, one, RB)
            q_l = _reg(tl.load(_at(qg, t0, rows, hh, H, K + offs_k, 2 * K), mask=mr, other=0.0), mr, one, RB)
            a_c = tl.load(_at(aqk, t0, rows, hh, H, rows, BT), mask=mr & (rows[None, :] <= rows[:, None]), other=0.0)
            oc = _mm_pre(q_h, q_l, h, OOPD) + _mm(a_c, vn, OOPD)
            tl.store(_at(o, t0, rows, hh, H, offs_v, V), oc.to(o.dtype.element_ty), mask=mr)
        else:
            ch = c * H + hh.to(tl.int64)
            tl.store(hbuf + ch * (K * V) + hoff, h.to(hbuf.dtype.element_ty))
            tl.store(_at(vnew, t0, rows, hh, H, offs_v, V), vn.to(vnew.dtype.element_ty), mask=mr)
        h = h * gl[:, None] + _mm_pre(tl.trans(kg_h), tl.trans(kg_l), vn, OPD)
    tl.store(ht + hbase + hoff, h)


@_interp.kjit
def _seg_kernel(kg, w, u, glast, pq, seg_chunk, chunk_tok, chunk_len, H,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, OPD: tl.constexpr,
                WHOPD: tl.constexpr, RB: tl.constexpr = 0, one=1.0):
    """Pass 1 of the segmented state pass (``SEG``): the affine map of a run of chunks. One program per (segment,
    head, BV of the ``V + K`` columns of ``[Q | P]``) walks the segment's chunks in order with the state step
    ``X <- e^(G_L) X + kg^T (U - w X)``: from ``X = 0, U = u`` on the first V columns, which gives ``Q`` (the state
    at the segment's end from a zero state), and from ``X = I, U = 0`` on the last K, which gives ``P`` (how the
    segment maps its initial state: ``h_end = P h_start + Q``, the chunk step ``h <- (e^(G_L) - kg^T w) h + kg^T u``
    composed). Stored to ``pq`` ``[segments, H, K, V + K]`` fp32. Products as :func:`_state_kernel`'s (``WHOPD``,
    ``OPD``); the programs of one segment are adjacent in launch order (they read the same w / kg tiles)."""
    n, cb = _pids(1, (V + K) // BV)
    hh = tl.program_id(1)
    cols = cb * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, K)
    rows = tl.arange(0, BT)
    isq = cols < V
    h = (offs_k[:, None] == cols[None, :] - V).to(tl.float32)  # 0 on the Q columns, I on the P columns
    c0 = tl.load(seg_chunk + n)
    c1 = tl.load(seg_chunk + n + 1)
    s0 = tl.load(chunk_tok + c0)
    s1 = tl.load(chunk_tok + c1 - 1) + tl.load(chunk_len + c1 - 1)
    for c in range(c0, c1):
        t0 = s0 + (c - c0) * BT  # a segment is chunks of one sequence: affine addresses
        L = tl.minimum(s1 - t0, BT)
        mr = (rows < L)[:, None]
        w_c = _reg(tl.load(_at(w, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0), mr, one, RB)
        kg_c = _reg(tl.load(_at(kg, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0), mr, one, RB)
        u_c = tl.load(_at(u, t0, rows, hh, H, cols, V), mask=mr & isq[None, :], other=0.0).to(tl.float32)
        gl = tl.load(glast + (c * H + hh.to(tl.int64)) * K + offs_k, mask=(L + 0 * offs_k) > 0, other=0.0)
        vn = u_c - _mm(w_c, h, WHOPD)
        h = h * gl[:, None] + _mm(tl.trans(kg_c), vn, OPD)
    tl.store(pq + (n.to(tl.int64) * H + hh) * (K * (V + K)) + (offs_k[:, None] * (V + K) + cols[None, :]), h)


@_interp.kjit
def _seg_combine_kernel(pq, h0, hstart, ht, seq_seg, H, HAS_H0: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BV: tl.constexpr, BK: tl.constexpr):
    """Pass 2 of the segmented state pass: one program per (sequence, head, BV state columns) walks the
    sequence's segments in order, stores each segment's initial state ``h_s`` to ``hstart`` ``[segments, H, K,
    V]`` and steps ``h <- P_s h + Q_s`` (IEEE fp32, ``P_s h`` in BK-row slices of ``h_s`` read back from
    ``hstart`` after a block barrier); the sequence's final state to ``ht``. ``h_0`` is ``h0`` (``HAS_H0``) or 0."""
    n = tl.program_id(0)
    hh = tl.program_id(1)
    offs_k = tl.arange(0, K)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    hoff = offs_k[:, None] * V + offs_v[None, :]
    hbase = (n.to(tl.int64) * H + hh) * (K * V)
    if HAS_H0:
        h = tl.load(h0 + hbase + hoff)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    g0 = tl.load(seq_seg + n)
    g1 = tl.load(seq_seg + n + 1)
    for s in range(g0, g1):
        sh = hh.to(tl.int64) + s * H
        tl.store(hstart + sh * (K * V) + hoff, h)
        tl.debug_barrier()  # h_s's rows are read back below by other threads of the program
        pbase = pq + sh * (K * (V + K))
        acc = tl.load(pbase + offs_k[:, None] * (V + K) + offs_v[None, :])
        for kb in tl.static_range(0, K // BK):
            kk = kb * BK + tl.arange(0, BK)
            p = tl.load(pbase + offs_k[:, None] * (V + K) + (V + kk)[None, :])
            hk = tl.load(hstart + sh * (K * V) + kk[:, None] * V + offs_v[None, :])
            acc += tl.dot(p, hk, input_precision="ieee")
        h = acc
    tl.store(ht + hbase + hoff, h)


@_interp.kjit
def _out_kernel(qg, aqk, hbuf, vnew, o, chunk_tok, chunk_len, H,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                OPD: tl.constexpr, INNER: tl.constexpr = 0, Q2: tl.constexpr = 0):
    """The output, all chunks in parallel: one program per (chunk, head, BV columns),
    ``o = qg h_c + Aqk v'`` from the stored chunk state ``h_c`` and ``v'`` (``qg h_c`` in BK-wide slices of K,
    which bounds the live registers)."""
    c, vb = _pids(INNER, V // BV)
    hh = tl.program_id(1)
    t0 = tl.load(chunk_tok + c)
    L = tl.load(chunk_len + c)
    offs_v = vb * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    mr = (rows < L)[:, None]
    a_c = tl.load(_at(aqk, t0, rows, hh, H, rows, BT), mask=mr & (rows[None, :] <= rows[:, None]), other=0.0)
    vn = tl.load(_at(vnew, t0, rows, hh, H, offs_v, V), mask=mr, other=0.0)
    oc = _mm(a_c, vn, OPD)
    for kb in tl.static_range(0, K // BK):
        offs_k = kb * BK + tl.arange(0, BK)
        h_c = tl.load(hbuf + (c.to(tl.int64) * H + hh) * (K * V) + (offs_k[:, None] * V + offs_v[None, :]))
        if Q2:  # qg stored split (bf16 hi / lo)
            q_h = tl.load(_at(qg, t0, rows, hh, H, offs_k, 2 * K), mask=mr, other=0.0)
            q_l = tl.load(_at(qg, t0, rows, hh, H, K + offs_k, 2 * K), mask=mr, other=0.0)
            oc += _mm_pre(q_h, q_l, h_c, OPD)
        else:
            qg_c = tl.load(_at(qg, t0, rows, hh, H, offs_k, K), mask=mr, other=0.0)
            oc += _mm(qg_c, h_c, OPD)
    tl.store(_at(o, t0, rows, hh, H, offs_v, V), oc.to(o.dtype.element_ty), mask=mr)


def _grid(outer: int, H: int, inner: int, meta: dict) -> tuple[int, int, int]:
    """The launch grid of a kernel split ``inner`` ways per outer item (see :func:`_pids`; ``meta["INNER"]``)."""
    return (outer * inner, H, 1) if meta.get("INNER") else (outer, H, inner)


def chunk_table(cu_host: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chunk_tok [NC], chunk_len [NC], seq_chunk [N+1])`` int32 for packed sequences with offsets ``cu_host``.

    Built vectorised on the host (one small asynchronous copy to the device, from pinned memory): a chunk is BT
    tokens of one sequence. The last few tables are remembered per (offsets, device): every KDA layer of a step
    packs the same sequences (69 layers of K3 asked for the same table, 25 ms of host time per mixed step on
    the H200 host). The tensors are read-only inputs of the kernels; callers must not write them.
    """
    return _remember((tuple(int(c) for c in cu_host), str(torch.device(device))),
                     lambda: _chunk_table(cu_host, device))


def segment_table(cu_host: list[int], seg: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(seg_chunk [S+1], seq_seg [N+1], S)`` int32 for the segmented state pass: each sequence's chunks (as
    :func:`chunk_table` numbers them) cut into runs of ``seg`` chunks (the last run shorter); ``seg_chunk`` holds
    the runs' chunk boundaries, ``seq_seg`` each sequence's first run (a sequence without tokens has none).
    Remembered per (offsets, seg, device), like :func:`chunk_table`.

    Raises: ValueError if ``seg < 1``."""
    if seg < 1:
        raise ValueError(f"segment_table: seg = {seg} chunks per segment must be >= 1")
    return _remember((tuple(int(c) for c in cu_host), int(seg), str(torch.device(device))),
                     lambda: _segment_table(cu_host, seg, device))


_TABLES: dict[tuple, tuple] = {}  # the last 32 chunk / segment tables, by (offsets, [seg,] device)


def _remember(key: tuple, build) -> tuple:
    hit = _TABLES.get(key)
    if hit is None:
        hit = build()
        if len(_TABLES) >= 32:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = hit
    return hit


def _to_device(packed: torch.Tensor, device) -> torch.Tensor:
    """``packed`` (host) on ``device``: from pinned memory the copy is queued behind the stream's work; from
    pageable memory the host would wait for the device to drain before every prefill."""
    if torch.device(device).type != "cpu":
        packed = packed.pin_memory().to(device, non_blocking=True)
    return packed


def _segment_table(cu_host: list[int], seg: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    cu = torch.tensor(cu_host, dtype=torch.int64)
    nch = (cu[1:] - cu[:-1] + BT - 1) // BT
    first = torch.zeros(len(cu_host), dtype=torch.int64)
    first[1:] = nch.cumsum(0)  # each sequence's first chunk
    nseg = (nch + seg - 1) // seg
    seq_seg = torch.zeros(len(cu_host), dtype=torch.int64)
    seq_seg[1:] = nseg.cumsum(0)
    S = int(seq_seg[-1])
    owner = torch.repeat_interleave(torch.arange(len(nch)), nseg, output_size=S)
    bounds = first[:-1][owner] + (torch.arange(S) - seq_seg[:-1][owner]) * seg  # each run's first chunk
    packed = _to_device(torch.cat([bounds, first[-1:], seq_seg]).to(torch.int32), device)
    return packed[:S + 1], packed[S + 1:], S


def _chunk_table(cu_host: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cu = torch.tensor(cu_host, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    nch = (lens + BT - 1) // BT
    sc = torch.zeros(len(cu_host), dtype=torch.int64)
    sc[1:] = nch.cumsum(0)
    NC = int(sc[-1])
    seq = torch.repeat_interleave(torch.arange(len(lens)), nch, output_size=NC)
    idx = torch.arange(NC) - sc[:-1][seq]
    tok = cu[:-1][seq] + idx * BT
    ln = torch.minimum(cu[1:][seq] - tok, torch.full_like(tok, BT))
    packed = _to_device(torch.cat([tok, ln, sc]).to(torch.int32), device)
    return packed[:NC], packed[NC:2 * NC], packed[2 * NC:]


#: Where each product of the prefill runs and which intermediates are stored in bf16 (benchmark sweeps pass
#: such a dict as ``products``). Parts: ``pair`` (A, Aqk), ``w`` (w = M beta k e^G), ``u`` (u = M beta v),
#: ``wh`` (w h_c in v' = u - w h_c), ``kv`` (the state step kg^T v'), ``out`` (o = qg h + Aqk v'): ``"ieee"``
#: (fp32 operands), ``"split"`` (split-bf16, :func:`_mm`) or ``"bf16"`` (one bf16 product); ``solve``: the UT
#: solve's off-diagonal block products, ``"ieee"`` or ``"backend"`` (TF32 on sm_90, fp32 MFMA on CDNA);
#: ``store``: names among qg, kg, w, u, vnew, aqk, hbuf kept in bf16 (the rest fp32).
#:
#: ``"fp16"`` (below) is the default for bf16 / fp16 inputs and the serving engine from 2026-12-06; ``"split"``
#: (the default before) splits every product. Measured in the interpreter (K = V =
#: 128, T = 256, fp16-exact inputs; rel. RMS on o / final state): all split 5e-5 / 3e-5; one bf16 product in u,
#: the state step, Aqk or the output 3e-3 to 6e-3 at ordinary decays. The two products that make and apply w
#: (``w`` and ``wh``, w stored in bf16) cost nothing at ordinary decays (1e-4 / 3e-5: the next chunks' residuals
#: ``u - w h`` correct an error in the prediction while the state forgets) but 3.8e-3 / 4.8e-3 where the decay
#: is near 1 (``dt_bias`` shifted by -12, nothing forgotten), past the 3e-3 bound, so they stay split.
#: The chunk states ``hbuf`` (written by the state pass, read once by the output kernel; never the carried state)
#: in bf16 (``store=("hbuf",)``): on an H100 (2026-12-06, B1 T8192 H96) 9e-5 rel. RMS on o against 1e-5 in fp32 and
#: the prefill 6.48 vs 6.88 ms (state pass 1.93 vs 2.21, output 0.90 vs 1.00), but in the interpreter (T 70 / 256,
#: two heads, 6 seeds) 3.0e-3 / 3.2e-3 where the decay is near 1 (``dt_bias`` - 12: the inter-chunk term carries
#: o) against 6e-5 in fp32, past the 3e-3 bound, so they stay fp32 (5e-4 to 1e-3 at ordinary decays).
#: ``pre``: ``()``, ``("kg", "w")`` or ``("kg", "qg", "w")``: those fp32 intermediates stored split (bf16 hi / lo
#: planes, the same bytes as fp32), so the serial loop multiplies them as loaded (:func:`_mm_pre`) with no fp32 tile
#: in registers and no split of its own; the same products as ``"split"`` (bit-identical operands); needs ``wh``,
#: ``kv`` and ``out`` not ``"ieee"`` and the names not in ``store``. The state table's ``FO`` configs (the output
#: computed in the serial loop, no chunk states stored) run without ``pre`` or with ``qg`` in it.
#: ``"fp16"`` (one fp16 product, 11 mantissa bits against bf16's 8) in ``w``, ``u``, ``wh``, ``kv`` and ``out``,
#: and ``half="fp16"``: the names of ``store`` (there, every intermediate but the fp32 cumulative gate G and
#: ``e^(G_L)``) kept in fp16 instead of bf16. ``pair="fp16"``: the blocks j < i of A / Aqk as one fp16 product,
#: decayed about block i's first row (every factor <= 1), the diagonal blocks split about their middle row (their
#: factors reach ``e^40``, past fp16's 65504). Measured in the interpreter (K = V = 128, T = 256, two heads, two
#: seeds; fp16-exact inputs), rel. RMS on o / final state: with the pair split and the rest fp16, 3.5e-4 / 3.4e-4 to
#: 3.6e-4 / 3.7e-4 at ordinary decays and 4.8e-4 / 4.9e-4 near decay 1; the fp16 pair adds < 2e-5 (5.0e-4 / 4.9e-4
#: near decay 1; 6.8e-4 on o at the strongest decay, ``lower_bound`` -10 and ``dt_bias`` + 12, where "split" gives
#: 7.8e-4); "split" 5e-5, the same parts in one bf16 product each 1.2e-2 to 1.4e-2 on o: a sixth of the 3e-3
#: bound with a third of the split form's products and half its intermediate bytes. The range it needs: ``u``,
#: ``v'`` and the chunk states within fp16's 65504 (they scale with ``v``; an overflow shows as inf in o and the
#: state, never a finite wrong value).
PRODUCTS = {
    "ieee": dict(pair="ieee", w="ieee", u="ieee", wh="ieee", kv="ieee", out="ieee", solve="ieee", store=(), pre=(),
                 half="bf16"),
    "split": dict(pair="split", w="split", u="split", wh="split", kv="split", out="split", solve="backend",
                  store=(), pre=(), half="bf16"),
    "fp16": dict(pair="fp16", w="fp16", u="fp16", wh="fp16", kv="fp16", out="fp16", solve="backend",
                 store=("abuf", "aqk", "hbuf", "kg", "mbuf", "qg", "u", "vnew", "w"), pre=(), half="fp16"),
}
_PARTS = ("pair", "w", "u", "wh", "kv", "out")
_STORE = ("qg", "kg", "w", "u", "vnew", "aqk", "hbuf", "abuf", "mbuf")


def _precision(products, dtype: torch.dtype) -> dict:
    """The per-part precision of ``products`` (None, a :data:`PRODUCTS` name, or a dict overriding "split")."""
    if products is None:
        products = "ieee" if dtype == torch.float32 else "fp16"
    if isinstance(products, dict):
        bad = [kk for kk in products if kk not in PRODUCTS["split"]]
        out = dict(PRODUCTS["split"], **products)
        ok = (not bad and all(out[p_] in ("ieee", "split", "bf16", "fp16") for p_ in _PARTS)
              and out["solve"] in ("ieee", "backend") and all(n in _STORE for n in out["store"])
              and out["half"] in ("bf16", "fp16")
              and tuple(sorted(out["pre"])) in ((), ("kg", "w"), ("kg", "qg", "w"))
              and not (out["pre"] and ("ieee" in (out["wh"], out["kv"], out["out"])
                                       or set(out["pre"]) & set(out["store"]))))
        if ok and "w" in out["store"] and out["wh"] == "bf16":
            # measured 2026-12-06 on an H100 (triton 3.6, B1 T8192 H96): the state pass with a PF = 0 config
            # faults (illegal address) when it reads w stored in bf16 into a single-bf16 product; fine with w in
            # fp32 or wh split, and at 1,000 tokens. Refused rather than risk the process's CUDA context
            raise ConfigError("kda_prefill (triton): products store w in bf16 with wh='bf16' is refused (the state "
                              "pass faults on sm_90 with it); keep wh 'split' or w stored in fp32")
        if ok:
            out["store"] = tuple(sorted(out["store"]))
            out["pre"] = tuple(sorted(out["pre"]))
            return out
    elif products in PRODUCTS:
        return PRODUCTS[products]
    raise ConfigError(f"kda_prefill (triton): products {products!r} is not one of None, 'ieee', 'split', 'fp16' "
                      "(or a valid dict of parts, see prefill.PRODUCTS)")


def kda_prefill(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=None,
                lower_bound=-5.0, gate_form="k3", out_dtype: torch.dtype = torch.float32,
                config: dict | None = None, products: str | dict | None = None):
    """Triton chunked KDA prefill; contract of :func:`k3rocm.model.kda.kda_prefill`.

    Args: as the oracle (q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` in fp32 / bf16 / fp16, decay_raw
        ``[B, T, H*K]``, beta_raw ``[B, T, H]``, A_log ``[>= H]``, dt_bias ``[H*K]``, initial_state
        ``[N, H, K, V]`` fp32 or None, cu_seqlens ``[N+1]`` int32 with B = 1), plus
        ``out_dtype`` (dtype of ``o``; fp32 by contract) and ``config``: ``{"gate": cfg, "intra": cfg, "wu": cfg,
        "state": cfg, "out": cfg}`` entries of the :mod:`configs` tables to force (tests; a missing entry is tuned,
        the gate's is the first of its table; its ``CS`` applies to the 16-bit forms, IEEE products keep the
        scan); default:
        :func:`k3rocm.kernels.tune.pick`, keyed on powers of two of the token and sequence counts.
        ``products``: how the matrix products run. ``"ieee"``: IEEE fp32 operands throughout (fp32 FMA on
        Hopper, fp32 MFMA on CDNA); ``"split"``: split-bf16 operands on the bf16 matrix unit (:func:`_mm`, ~16
        mantissa bits) and the UT solve's off-diagonal block products at the backend's fp32 precision, whatever
        the input dtype (the serving engine's fp32 activations inside a bf16 ``matmul_dtype`` scope); ``"fp16"``:
        one fp16 product each but the diagonal pair blocks (split), the intermediates but G stored in fp16
        (:data:`PRODUCTS`: ~5e-4 rel. RMS, a third of the products and half the bytes of ``"split"``); None: by
        input dtype (fp32 inputs ``"ieee"``, bf16 / fp16 ``"fp16"``); a dict of parts (:data:`PRODUCTS`) for
        precision sweeps (``gpu-runs/bench_kda.py --only sweep``).
    Returns:
        ``(o [B, T, H, V] out_dtype, final_state [N, H, K, V] fp32)``.
    Raises:
        ConfigError: gate form other than ``"k3"``, ``lower_bound < -10`` (the in-chunk decay factorisation
        would overflow fp32), K or V not a power of two >= 16, ``products`` not one of None / "ieee" /
        "split" / "fp16" / a valid dict of parts, or inconsistent shapes.
    Note: reads ``cu_seqlens`` on the host once (to build the chunk table); not for graph capture.
    """
    _, o, ht = prefill_launches(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state, cu_seqlens, scale,
                                lower_bound, gate_form, out_dtype, config, products)
    return o, ht


def prefill_launches(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=None,
                     lower_bound=-5.0, gate_form="k3", out_dtype: torch.dtype = torch.float32,
                     config: dict | None = None, products: str | dict | None = None):
    """:func:`kda_prefill`, also returning its launches one by one (to time each kernel alone).

    Args, raises: as :func:`kda_prefill`. Runs the prefill once (tuning each kernel first where needed).
    Returns:
        ``(launches, o, final_state)``: ``launches`` is ``[(name, fn)]`` in launch order, ``name`` one of
        ``"gate"``, ``"intra"``, ``"solve"`` (not with an SV w / u config), ``"wu"``, ``"state"``, ``"out"`` (not with
        an FO state config), ``"local"`` in place of gate, intra, solve and wu with an LC intra config; ``fn()`` runs
        that kernel again with its chosen config on the same buffers (running them all in order recomputes ``o`` and
        ``final_state``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gate_form != "k3":
        raise ConfigError(f"kda_prefill (triton): gate form {gate_form!r} is not supported; use the torch oracle")
    if lower_bound < -10.0 or lower_bound > 0.0:
        raise ConfigError(f"kda_prefill (triton): lower_bound {lower_bound} outside [-10, 0]; use the torch oracle")
    for d, nm in ((K, "K"), (V, "V")):
        if d < 16 or d & (d - 1):
            raise ConfigError(f"kda_prefill (triton): head dim {nm} = {d} must be a power of two >= 16")
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ConfigError(f"kda_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    dev = q.device
    if cu_seqlens is None:
        cu_host = [b * T for b in range(B + 1)]
    else:
        if B != 1:
            raise ConfigError(f"kda_prefill: cu_seqlens needs B = 1 (packed), got B = {B}")
        cu_host = [int(x) for x in cu_seqlens.tolist()]
        if cu_host[0] != 0 or cu_host[-1] != T or any(b < a for a, b in zip(cu_host, cu_host[1:])):
            raise ConfigError(f"kda_prefill: cu_seqlens must start at 0, be non-decreasing and end at T = {T}")
    N = len(cu_host) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ConfigError(f"kda_prefill: initial_state shape {tuple(initial_state.shape)} != [{N}, {H}, {K}, {V}]")
    if A_log.numel() < H or dt_bias.numel() != H * K:
        raise ConfigError(f"kda_prefill: A_log ({A_log.numel()}) / dt_bias ({dt_bias.numel()}) do not fit H={H}, K={K}")
    TT = B * T
    scale = K ** -0.5 if scale is None else float(scale)
    qc = q.reshape(TT, H, K).contiguous()
    kc = k.reshape(TT, H, K).contiguous()
    vc = v.reshape(TT, H, V).contiguous()
    dr = decay_raw.reshape(TT, H * K).contiguous()
    br = beta_raw.reshape(TT, H).contiguous()
    al = A_log.to(torch.float32).contiguous()
    dtb = dt_bias.to(torch.float32).reshape(-1).contiguous()
    chunk_tok, chunk_len, seq_chunk = chunk_table(cu_host, dev)
    NC = chunk_tok.numel()
    f32 = torch.float32
    prec_parts = _precision(products, q.dtype)
    lvl = {"ieee": 0, "split": 2 if interpreting() else 1, "bf16": 4 if interpreting() else 3,
           "fp16": 6 if interpreting() else 5}
    opd = {part: lvl[prec_parts[part]] for part in _PARTS}
    prec = "ieee" if prec_parts["solve"] == "ieee" else None
    half = torch.float16 if prec_parts["half"] == "fp16" else torch.bfloat16
    bf = lambda name: half if name in prec_parts["store"] else f32  # noqa: E731
    gbuf = C.empty(TT, H, K, dtype=f32, device=dev)
    pre = 1 if prec_parts["pre"] else 0  # kg and w stored split: [TT, H, 2K] bf16 hi / lo
    q2 = 1 if "qg" in prec_parts["pre"] else 0  # qg too (the state pass's FO configs need it)
    # 16-bit tiles into the state loop's products go through a select (_reg, RB = 1): as loaded, the same-step loads
    # gave wrong states and an illegal address on an H100 with triton 3.6 (2026-12-06, gpu-runs/kda_state_check.py)
    rb16 = 1 if pre or {"w", "kg"} & set(prec_parts["store"]) else 0
    # the output in the state loop (FO): in the split loop with qg split too, or in the plain loop where its tiles
    # are not split there (one 16-bit product or IEEE fp32; splitting fp32 tiles in the loop spills on gfx942)
    fo_ok = bool(q2) if pre else "split" not in (prec_parts["wh"], prec_parts["kv"], prec_parts["out"])
    qg = C.empty(TT, H, (1 + q2) * K, dtype=torch.bfloat16 if q2 else bf("qg"), device=dev)
    kg = C.empty(TT, H, (1 + pre) * K, dtype=torch.bfloat16 if pre else bf("kg"), device=dev)
    w = C.empty(TT, H, (1 + pre) * K, dtype=torch.bfloat16 if pre else bf("w"), device=dev)
    u = C.empty(TT, H, V, dtype=bf("u"), device=dev)
    vnew = C.empty(TT, H, V, dtype=bf("vnew"), device=dev)
    aqk = C.empty(TT, H, BT, dtype=bf("aqk"), device=dev)
    abuf = C.empty(TT, H, BT, dtype=bf("abuf"), device=dev)  # A, row by row (lower triangle)
    mbuf = C.empty(TT, H, BT, dtype=bf("mbuf"), device=dev)  # the UT solve M = (I + A)^-1, row by row
    glast = C.empty(max(NC, 1), H, K, dtype=f32, device=dev)
    hbuf = C.empty(max(NC, 1), H, K, V, dtype=bf("hbuf"), device=dev)
    o = C.empty(B, T, H, V, dtype=out_dtype, device=dev)
    ht = C.empty(N, H, K, V, dtype=f32, device=dev)
    h0 = initial_state.to(f32).contiguous() if initial_state is not None else ht
    cfg = config or {}

    # the gate's own config (configs.GATE's first entry, not tuned; config["gate"] forces one: tests, sweeps)
    gate_meta, gate_opts = tune.split(cfg.get("gate") or tune.configs(C.GATE)[0])
    if set(gate_meta) - {"CS", "PS"}:
        raise ConfigError(f"kda_prefill: gate config keys {sorted(set(gate_meta) - {'CS', 'PS'})} are not gate options "
                          "(the gate takes CS, PS and launch options: num_warps, num_stages, waves_per_eu)")
    if gate_meta.get("CS") and opd["pair"] == 0:
        # IEEE fp32 products (fp32 inputs): the scan. The three partial sums of CS round apart (the final state's
        # error 4e-6 -> 4.5e-5 in the interpreter); the 16-bit forms' own error is far above that
        gate_meta["CS"] = 0
    if gate_meta.get("CS") and interpreting():
        gate_meta["CS"] = 2  # the split cumulative sum multiplied in fp32 (bf16 tl.dot is wrong in the interpreter)

    gate_ps = gate_meta.pop("PS", 0)  # programs a multiprocessor of a persistent gate grid (0: a program per item)

    def launch_gate(_c=None):  # its own launch options (configs.GATE), whatever the intra kernel's pick
        if NC and gate_ps:
            n_items = NC * H
            _interp.launch(_gate_ps_kernel, (min(n_items, _programs_per_wave(dev, gate_ps)),), qc, kc, dr, al, dtb,
                           chunk_tok, chunk_len, gbuf, qg, kg, glast, scale, float(lower_bound), H, n_items, K=K,
                           BT=BT, KG2=pre, QG2=q2, **gate_meta, **gate_opts)
        elif NC:
            _interp.launch(_gate_kernel, (NC, H), qc, kc, dr, al, dtb, chunk_tok, chunk_len, gbuf, qg, kg, glast,
                           scale, float(lower_bound), H, K=K, BT=BT, KG2=pre, QG2=q2, **gate_meta, **gate_opts)

    def launch_intra(c):
        meta, opts = tune.split(c)
        if NC:
            _interp.launch(_intra_kernel, _grid(NC, H, BT // BC, meta), qc, kc, br, chunk_tok, chunk_len, gbuf, aqk,
                           abuf, scale, H, K=K, BT=BT, BC=BC, OPD=opd["pair"], **meta, **opts)

    solve_opts = tune.split(tune.configs(C.SOLVE)[0])[1]

    def launch_solve(_c=None):  # its own launch options (configs.SOLVE), timed with the w / u kernel
        if NC:
            _interp.launch(_solve_kernel, (NC, H), abuf, mbuf, chunk_tok, chunk_len, H, BT=BT, BC=BC, PREC=prec,
                           **solve_opts)

    def launch_wu(c):
        meta, opts = tune.split(c)
        if NC:
            _interp.launch(_wu_kernel, _grid(NC, H, 1 if meta.get("SV") else 2, meta), kc, vc, br, gbuf, mbuf, w,
                           u, chunk_tok, chunk_len, H, K=K, V=V, BT=BT, WOPD=opd["w"], UOPD=opd["u"], W2=pre,
                           abuf=abuf, BC=BC, PREC=prec, **meta, **opts)

    def launch_solve_wu(c):  # tuning: a w / u config without SV is timed with the solve launch it needs
        if not c.get("SV"):
            launch_solve()
        launch_wu(c)

    lc_rival = [False]  # an LC intra candidate is being timed: the others are timed with the solve and w / u they need

    def launch_local(c):  # an LC intra config: the gate, A / Aqk, the solve and w / u in one launch
        meta, opts = tune.split(c)
        meta.pop("LC")
        if NC:
            _interp.launch(_local_kernel, (NC, H), qc, kc, vc, dr, br, al, dtb, chunk_tok, chunk_len, gbuf, qg, kg,
                           glast, aqk, abuf, mbuf, w, u, scale, float(lower_bound), H, K=K, V=V, BT=BT, BC=BC,
                           OPD=opd["pair"], WOPD=opd["w"], UOPD=opd["u"], PREC=prec, KG2=pre, QG2=q2, W2=pre,
                           CS=gate_meta.get("CS", 0), **meta, **opts)

    def launch_gate_intra(c):  # timed together: the intra kernel reads what the gate kernel writes
        if c.get("LC"):
            launch_local(c)
            return
        launch_gate(c)
        launch_intra(c)
        if lc_rival[0]:
            launch_solve_wu(tune.configs(C.WU)[0])

    def launch_state(c):
        meta, opts = tune.split(c)
        bv = min(meta.pop("BV"), V)
        if meta.get("FO") and not fo_ok:
            raise ConfigError(f"kda_prefill: state config {c} computes the output in the loop (FO); it runs on "
                              "products 'fp16' / 'ieee' or with kg, qg and w stored split "
                              "(products=dict(pre=('kg', 'qg', 'w'))), not on split products splitting fp32 tiles in "
                              "the loop (spills on gfx942)")
        seg = meta.pop("SEG", 0)
        if seg and pre:
            raise ConfigError(f"kda_prefill: state config {c} cuts sequences into segments (SEG); it runs on the "
                              "plain loop, not with kg / w stored split (products 'pre')")
        h_in, has_h0, table, n_run, ht_run = h0, initial_state is not None, seq_chunk, N, ht
        if seg:
            # pass 1: each segment's affine map [Q | P]; pass 2: the segments' initial states in order (and the
            # final states); pass 3 (below): the state loop on every segment at once from its initial state
            seg_chunk, seq_seg, S = segment_table(cu_host, seg, dev)
            hstart = torch.empty(max(S, 1), H, K, V, dtype=f32, device=dev)
            if S:
                pq = torch.empty(S, H, K, V + K, dtype=f32, device=dev)
                _interp.launch(_seg_kernel, (S * ((V + K) // bv), H, 1), kg, w, u, glast, pq, seg_chunk, chunk_tok,
                               chunk_len, H, K=K, V=V, BT=BT, BV=bv, OPD=opd["kv"], WHOPD=opd["wh"],
                               RB=meta.get("RB", rb16), one=1.0, **opts)
            else:
                pq = hstart
            _interp.launch(_seg_combine_kernel, (N, H, V // min(SEG_BV, V)), pq, h0, hstart, ht, seq_seg, H,
                           HAS_H0=initial_state is not None, K=K, V=V, BV=min(SEG_BV, V), BK=min(SEG_BK, K),
                           **seg_opts)
            h_in, has_h0, table, n_run = hstart, True, seg_chunk, S
            ht_run = torch.empty(max(S, 1), H, K, V, dtype=f32, device=dev)  # the loop's own end states, unused
        if n_run:
            _interp.launch(_state_kernel, _grid(n_run, H, V // bv, meta), kg, w, u, glast, h_in, hbuf, vnew, ht_run,
                           table, chunk_tok, chunk_len, H, HAS_H0=has_h0, K=K, V=V, BT=BT, BV=bv,
                           OPD=opd["kv"], WHOPD=opd["wh"], SPL=pre, qg=qg, aqk=aqk, o=o, OOPD=opd["out"], one=1.0,
                           **{"RB": rb16, **meta},
                           **opts)

    out_first = tune.configs(C.OUT)[0]
    seg_opts = tune.split(tune.configs(C.SEG_COMBINE)[0])[1]

    def launch_state_out(c):  # tuning: a state config without FO is timed with the output launch it needs
        launch_state(c)
        if not c.get("FO"):
            launch_out(out_first)

    def launch_out(c):
        meta, opts = tune.split(c)
        bv = min(meta.pop("BV"), V)
        bk = min(meta.pop("BK"), K)
        if NC:
            _interp.launch(_out_kernel, _grid(NC, H, V // bv, meta), qg, aqk, hbuf, vnew, o, chunk_tok,
                           chunk_len, H, K=K, V=V, BT=BT, BV=bv, BK=bk, OPD=opd["out"], Q2=q2, **meta, **opts)

    # bounded specialisation: token and sequence counts enter the key as powers of two
    key = (tune.pow2(TT), tune.pow2(N), H, K, V, q.dtype, tuple(sorted((kk, str(vv)) for kk, vv in prec_parts.items())))
    launches = []
    fused_out = local = False
    for name, table, run, parts in (
            ("intra", C.INTRA, launch_gate_intra, (("gate", launch_gate), ("intra", launch_intra))),
            ("wu", C.WU, launch_solve_wu, (("solve", launch_solve), ("wu", launch_wu))),
            ("state", C.STATE, launch_state_out, (("state", launch_state),)),
            ("out", C.OUT, launch_out, (("out", launch_out),))):
        if name == "out" and fused_out or name == "wu" and local:
            continue  # the state pass wrote o / the local kernel wrote w and u
        cands = [cfg[name]] if name in cfg else tune.configs(table)
        if name == "intra":
            lc_rival[0] = len(cands) > 1 and any(cc.get("LC") for cc in cands)
        if name == "state" and not fo_ok:
            cands = [c for c in cands if not c.get("FO")] or cands  # FO not on this form (a forced one raises)
        if name == "state" and pre:
            cands = [c for c in cands if not c.get("SEG")] or cands  # SEG: the plain loop only (a forced one raises)
        if name == "state" and not any(cc.get("FO") for cc in cands):
            run = launch_state  # no FO candidate: the output launch would add the same time to every config
        c = tune.pick(f"kda_{name}", key, cands, run)
        lc_rival[0] = False
        (launch_state if name == "state" else run)(c)
        fused_out = name == "state" and bool(c.get("FO"))
        local = name == "intra" and bool(c.get("LC"))
        if local:
            parts = (("local", launch_local),)
        launches += [(nm, lambda f=f, c=c: f(c)) for nm, f in parts if not (nm == "solve" and c.get("SV"))]
    return launches, o, ht
