"""Grouped GEMM of the routed experts on packed MXFP4 weights, and the per-token weighted reduction.

Each GEMM kernel serves both GEMMs of an expert (HIP and CUDA alike):

* ``GATED=True`` (w1|w3): rows of a group are gathered from the activation by token id; the program computes
  the gate tile (weight rows ``n``) and the up tile (rows ``I + n``) of the stacked ``w13`` and applies
  SiTU-GLU (or SiLU-GLU) in fp32 in the epilogue; the output ``h`` is stored per sorted pair, in bf16
  (A16W4) or as MXFP8 E4M3 + E8M0 scales (A8W4, quantized in the epilogue from the fp32 values).
* ``GATED=False`` (w2): the activation is ``h`` in sorted order; the epilogue multiplies by the router weight
  of the pair and stores fp32 per sorted pair.

Weights stay in the checkpoint's own layout (``[E, N, K/2]`` u8, element 2i in the low nibble; scales
``[E, N, K/32]`` u8 E8M0 — K3_FACTS §4); no conversion at load time. Two kernels read them:

* ``moe_gemm_dq_kernel`` (config kind ``"dq"`` / ``"dqn"``; A16W4 with bf16 activations, the Hopper path):
  the nibbles are decoded to exact bf16 values with integer operations, two per 32-bit operation, and a
  plain bf16 ``tl.dot`` follows (see :func:`mxfp4_decode_tile`).
* ``moe_gemm_kernel`` (kind ``"scaled"``, and A8W4 / fp16 activations under any kind) uses ``tl.dot_scaled``
  with the weights as ``e2m1``: A16W4 passes bf16 activations with no scale (the compiler decodes FP4 to bf16
  in registers: Hopper, gfx942), A8W4 passes E4M3 activations with their E8M0 scales (native
  ``v_mfma_scale_f32_*_f8f6f4`` on gfx950; emulated elsewhere: Triton upcasts both operands to bf16 and
  uses wgmma / mma on sm_90 and bf16 MFMA on gfx942). ``tl.dot_scaled`` also runs under the Triton
  interpreter with bf16 and E4M3 operands, so the CPU tests cover both modes.

The reduction sums the k weighted rows of each token in slot order (deterministic: no atomics).
``moe_dispatch_kernel`` groups decode-sized batches by expert in one program (``ops.dispatch_gpu``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3rocm.kernels import tune
from k3rocm.kernels.isa import specialize
from k3rocm.kernels.moe.configs import SCALE_PF_KINDS, SWAP_KINDS, gemm_name, stage_config
from k3rocm.kernels.mx.quant import mxfp8_quantize_tile


@triton.jit
def _situ(g, u, BETA: tl.constexpr, BETA_LIN: tl.constexpr):
    # a = beta*tanh(g/beta)*sigmoid(g); u' = beta_lin*tanh(u/beta_lin) (K3_FACTS §5); tanh(y) = 2*sigmoid(2y)-1
    tg = 2.0 * tl.sigmoid(g * (2.0 / BETA)) - 1.0
    tu = 2.0 * tl.sigmoid(u * (2.0 / BETA_LIN)) - 1.0
    return (BETA * tg * tl.sigmoid(g)) * (BETA_LIN * tu)


@triton.jit
def _tile_rows(sorted_pair_ptr, block_start_ptr, offsets_ptr, e, pid_m, pid_n, N,
               TOPK: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns of program (m block ``pid_m``, n tile ``pid_n``) of local expert ``e``, for both GEMM
    kernels: sorted rows ``block_start[m] + [0, BLOCK_M)`` valid below ``offsets[e+1]``; the activation row of
    each (its token, ``sorted_pair // TOPK``, when ``GATED``; the sorted row itself otherwise, int64); the
    output columns ``pid_n * BLOCK_N + [0, BLOCK_N)``, those at or past ``N`` masked and clamped to 0."""
    row0 = tl.load(block_start_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    if GATED:
        pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
        arow = (pair // TOPK).to(tl.int64)
    else:
        arow = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_n = tl.where(nmask, offs_n, 0)
    return rows, rmask, arow, offs_n, nmask


@triton.jit
def _w_rows(offs_n, K, stride_wn, stride_wsn, HALF_N, G: tl.constexpr, TILE_N: tl.constexpr,
            TILE_K: tl.constexpr):
    """Byte offsets (from the expert's base; int64 in the checkpoint layout, int32 in the tiled one) of the first
    value byte and the first scale byte of gate rows ``offs_n``, and the scalar distances (values, scales)
    from a gate row to its up row. ``TILE_N == 0``: checkpoint layout (values and scales in two tensors, up rows
    ``HALF_N`` rows further); else the tiled layout of ``k3rocm.kernels.mx.layout`` (one buffer, chunks of
    ``G * TILE_N`` rows x ``TILE_K`` elements, values then scales; up rows ``TILE_N`` rows further)."""
    if TILE_N == 0:
        r = offs_n.to(tl.int64)
        return r * stride_wn, r * stride_wsn, HALF_N * stride_wn, HALF_N * stride_wsn
    else:
        CHUNK: tl.constexpr = G * TILE_N * (TILE_K // 2 + TILE_K // 32)
        # int32: offsets within one expert's buffer (NT * KT * CHUNK bytes, < 2^31 for any K3 expert)
        t = (offs_n // TILE_N) * ((K // TILE_K) * CHUNK)
        i = offs_n % TILE_N
        return (t + i * (TILE_K // 2), t + G * TILE_N * (TILE_K // 2) + i * (TILE_K // 32),
                TILE_N * (TILE_K // 2), TILE_N * (TILE_K // 32))


@triton.jit
def _w_step(k0, G: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointer increments (values, scales; bytes) from k-step ``k0`` to the next (``BLOCK_K`` divides
    ``TILE_K``; see :func:`_w_rows`): within a row of a chunk the steps are contiguous, the step after a chunk's
    last starts the next chunk (``CHUNK`` bytes after the chunk's start)."""
    if TILE_N == 0:
        return BLOCK_K // 2, BLOCK_K // 32
    else:
        CHUNK: tl.constexpr = G * TILE_N * (TILE_K // 2 + TILE_K // 32)
        if BLOCK_K == TILE_K:  # one chunk per step (the shipped tiles): a constant stride
            return CHUNK, CHUNK
        else:
            last = ((k0 + BLOCK_K) % TILE_K) == 0
            return (tl.where(last, CHUNK - (TILE_K - BLOCK_K) // 2, BLOCK_K // 2),
                    tl.where(last, CHUNK - (TILE_K - BLOCK_K) // 32, BLOCK_K // 32))


@triton.jit
def _w_split(pid_s, K_PER, G: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """First element ``k_lo`` of split ``pid_s`` (``K_PER`` elements per split) and the byte offsets (values,
    scales) of that element from a row's first bytes (see :func:`_w_rows`). Written so that the compiler can
    prove the alignment the full-width loads need: ``k_lo`` a product with ``BLOCK_K``; in the tiled layout
    ``K_PER`` is a multiple of ``TILE_K`` (``ops._split_k``), so a split starts at a chunk: offsets ``c * CHUNK``."""
    if TILE_N == 0:
        k_lo = (pid_s * (K_PER // BLOCK_K)) * BLOCK_K
        return k_lo, k_lo // 2, k_lo // 32
    else:
        CHUNK: tl.constexpr = G * TILE_N * (TILE_K // 2 + TILE_K // 32)
        c = pid_s * (K_PER // TILE_K)
        return c * TILE_K, c * CHUNK, c * CHUNK


@triton.jit
def moe_glu_finish_kernel(part_ptr, h_ptr, offsets_ptr, num_local, I, stride_ps, stride_h,
                          SPLITS: tl.constexpr, ACT: tl.constexpr, BETA: tl.constexpr, BETA_LIN: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """Finish a split-K w1|w3 GEMM: ``h[r, n] = glu(sum_s g[s, r, n], sum_s u[s, r, n])`` for the sorted rows
    below ``offsets[num_local]`` (the rows of this rank's experts; the partials of the others were never
    written). part ``[SPLITS, 2, P, I]`` fp32 (``stride_ps`` elements per split, gate then up partials ``stride_ps
    / 2`` apart, rows ``I`` apart); h ``[P, I]`` bf16 (``stride_h``). Splits added in order (deterministic); the
    GLU (SiTU or SiLU, K3_FACTS §5) in fp32 as in the unsplit kernel's epilogue. Grid ``(cdiv(P, BLOCK_R),
    cdiv(I, BLOCK_I))``."""
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rmask = rr < tl.load(offsets_ptr + num_local)
    m = rmask[:, None] & (rn < I)[None, :]
    off = rr.to(tl.int64)[:, None] * I + rn[None, :]
    g = tl.zeros((BLOCK_R, BLOCK_I), dtype=tl.float32)
    u = tl.zeros((BLOCK_R, BLOCK_I), dtype=tl.float32)
    pp = part_ptr + off
    for sp in tl.static_range(SPLITS):  # (pointer steps: SPLITS * stride_ps may pass 2^31)
        g += tl.load(pp, mask=m, other=0.0)
        u += tl.load(pp + stride_ps // 2, mask=m, other=0.0)
        pp += stride_ps
    if ACT == "situ":
        h = _situ(g, u, BETA, BETA_LIN)
    else:
        h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + rr.to(tl.int64)[:, None] * stride_h + rn[None, :], h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def moe_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr,
    sorted_pair_ptr, pair_weight_ptr, block_expert_ptr, block_start_ptr, offsets_ptr,
    N, K, HALF_N,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
    TOPK: tl.constexpr, GATED: tl.constexpr, A8: tl.constexpr, ACT_FMT: tl.constexpr, ACT: tl.constexpr,
    BETA: tl.constexpr, BETA_LIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_N: tl.constexpr = 0, TILE_K: tl.constexpr = 0,
):
    """Program (m block, n tile). ``block_expert[m]`` = local expert (-1: no work), ``block_start[m]`` = first
    sorted row; rows end at ``offsets[e+1]``. ``N`` is the output width (I for w13, D for w2).
    ``TILE_N``/``TILE_K``: 0 = checkpoint layout; else ``w_ptr`` and ``ws_ptr`` are the same tiled buffer
    (``k3rocm.kernels.mx.layout``; ``BLOCK_K`` divides ``TILE_K``; ``stride_we`` = bytes per expert)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    rows, rmask, arow, offs_n, nmask = _tile_rows(sorted_pair_ptr, block_start_ptr, offsets_ptr, e, pid_m, pid_n, N,
                                                  TOPK, GATED, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rk2 = tl.arange(0, BLOCK_K // 2)
    rks = tl.arange(0, BLOCK_K // 32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    if TILE_N == 0:
        ws_base = ws_ptr + e.to(tl.int64) * stride_wse
    else:  # scales in the same buffer: one base pointer
        ws_base = w_base
    # weights read as [BLOCK_K/2, BLOCK_N] (K packed, contiguous in memory), scales as [BLOCK_N, BLOCK_K/32]
    G: tl.constexpr = 2 if GATED else 1
    rv, rs, up_v, up_s = _w_rows(offs_n, K, stride_wn, stride_wsn, HALF_N, G, TILE_N, TILE_K)
    wg_ptrs = w_base + rv[None, :] + rk2[:, None]
    sg_ptrs = ws_base + rs[:, None] + rks[None, :]
    if GATED:
        wu_ptrs = wg_ptrs + up_v
        su_ptrs = sg_ptrs + up_s
    a_ptrs = a_ptr + arow[:, None] * stride_am + rk[None, :]
    as_ptrs = as_ptr + arow[:, None] * stride_asm + rks[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        wg = tl.load(wg_ptrs)
        sg = tl.load(sg_ptrs)
        if A8:
            a_s = tl.load(as_ptrs, mask=rmask[:, None], other=0)
            acc_g = tl.dot_scaled(a, a_s, "e4m3", wg, sg, "e2m1", acc_g)
        else:
            acc_g = tl.dot_scaled(a, None, ACT_FMT, wg, sg, "e2m1", acc_g)
        if GATED:
            wu = tl.load(wu_ptrs)
            su = tl.load(su_ptrs)
            if A8:
                acc_u = tl.dot_scaled(a, a_s, "e4m3", wu, su, "e2m1", acc_u)
            else:
                acc_u = tl.dot_scaled(a, None, ACT_FMT, wu, su, "e2m1", acc_u)
        dv, ds = _w_step(k0, G, TILE_N, TILE_K, BLOCK_K)
        wg_ptrs += dv
        sg_ptrs += ds
        if GATED:
            wu_ptrs += dv
            su_ptrs += ds
        a_ptrs += BLOCK_K
        as_ptrs += BLOCK_K // 32
    orow = rows.to(tl.int64)
    omask = rmask[:, None] & nmask[None, :]
    if GATED:
        if ACT == "situ":
            h = _situ(acc_g, acc_u, BETA, BETA_LIN)
        else:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        if A8:
            q, qs = mxfp8_quantize_tile(h, BLOCK_M, BLOCK_N)
            tl.store(out_ptr + orow[:, None] * stride_om + offs_n[None, :], q, mask=omask)
            rsn = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            tl.store(outs_ptr + orow[:, None] * stride_osm + rsn[None, :], qs,
                     mask=rmask[:, None] & (rsn[None, :] < N // 32))
        else:
            tl.store(out_ptr + orow[:, None] * stride_om + offs_n[None, :], h.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
        wt = tl.load(pair_weight_ptr + pair, mask=rmask, other=0.0)
        y = acc_g * wt[:, None]
        tl.store(out_ptr + orow[:, None] * stride_om + offs_n[None, :], y, mask=omask)


@triton.jit
def moe_reduce_kernel(y_ptr, pos_ptr, out_ptr, norm_w_ptr, normed_ptr, D, stride_y, stride_o, stride_n, eps,
                      TOPK: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr = 1,
                      stride_ys=0, ILP: tl.constexpr = False):
    """out[t] = sum_j y[pos[t*k+j]] (pos < 0: pair not on this rank), slot order; optional fused RMSNorm
    (``normed[t] = rms_norm(out[t]) * w`` in fp32, stored in normed's dtype: the latent tail, K3_FACTS §5 step 4).
    ``SPLITS`` > 1: y holds the split-K partials of the w2 GEMM, ``[SPLITS, P, D]`` fp32 (``stride_ys`` elements
    apart); each pair's partials are added split by split in order inside the slot order (fixed order: no atomics,
    the same bits every run).
    ``ILP`` (``configs.REDUCE_LAUNCH``): the slots unrolled with no branch, a pair of another rank read as a masked
    load of -0.0 (x + -0.0 == x for every x, signed zeros too: the same bits), so a token's loads are all in flight
    at once instead of a chain of ``TOPK`` dependent index loads and branches."""
    t = tl.program_id(0)
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if ILP:
        for j in tl.static_range(TOPK):
            p = tl.load(pos_ptr + t * TOPK + j)
            yp = y_ptr + tl.maximum(p, 0).to(tl.int64) * stride_y + rd
            m = dmask & ((rd * 0 + p) >= 0)
            for sp in tl.static_range(SPLITS):
                acc += tl.load(yp, mask=m, other=-0.0)
                yp += stride_ys
    else:
        for j in range(TOPK):
            p = tl.load(pos_ptr + t * TOPK + j)
            if p >= 0:
                if SPLITS == 1:
                    acc += tl.load(y_ptr + p.to(tl.int64) * stride_y + rd, mask=dmask, other=0.0)
                else:
                    yp = y_ptr + p.to(tl.int64) * stride_y + rd
                    for sp in tl.static_range(SPLITS):  # (pointer steps: SPLITS * stride_ys may pass 2^31)
                        acc += tl.load(yp, mask=dmask, other=0.0)
                        yp += stride_ys
    tl.store(out_ptr + t.to(tl.int64) * stride_o + rd, acc, mask=dmask)
    if NORM:
        ms = tl.sum(acc * acc, axis=0) / D
        w = tl.load(norm_w_ptr + rd, mask=dmask, other=0.0).to(tl.float32)
        yn = acc * (1.0 / tl.sqrt(ms + eps)) * w
        tl.store(normed_ptr + t.to(tl.int64) * stride_n + rd, yn.to(normed_ptr.dtype.element_ty), mask=dmask)


# ----------------------------------------------------------------------------------------------------------
# A16W4 "decode" path (config ``kind == "dq"``): MXFP4 decoded to bf16 with integer ops, then a plain
# bf16 ``tl.dot``. Hopper has no FP4 hardware, so ``tl.dot_scaled`` lowers to a generic upcast there; this
# path decodes two elements per 32-bit operation instead and feeds the tensor cores directly.

_TWO_POW_126 = tl.constexpr(8.507059173023462e37)  # 2^126: bf16 bits 0x7E80


@triton.jit
def _shift(x, S: tl.constexpr):
    """``x`` shifted by ``S`` bits, left for ``S > 0``, right for ``S < 0``, as is for 0 (constexpr)."""
    if S > 0:
        return x << S
    elif S == 0:
        return x
    else:
        return x >> (-S)


@triton.jit
def _mxfp4_pair(wd, SHIFT_MAG: tl.constexpr, SHIFT_SIGN: tl.constexpr, sb, F32: tl.constexpr,
                FUSED_SCALE: tl.constexpr = False, PTX: tl.constexpr = False):
    """Nibbles j (low 16-bit lane) and j+4 (high lane) of each int32 word of 8 packed E2M1 codes -> two bf16
    tensors holding the exact MXFP4 values (code value x scale).

    A code ``s e1 e0 m`` placed as ``em << 6`` (and ``s << 15``) is the bf16 pattern of ``value * 2^-126``
    for all 16 codes: exponent field e, mantissa bit m, and for e = 0 the bf16 subnormal ``m * 2^-127`` =
    0.5 m * 2^-126 (the E2M1 subnormal 0.5 and both zeros come out right). ``SHIFT_MAG`` / ``SHIFT_SIGN`` move
    nibble j's bits 0-2 to bits 6-8 and bit 3 to bit 15 (positive: left) in both lanes at once. The bf16
    products with 2^126 and with the E8M0 scale ``sb`` are exact (powers of two; no overflow below s = 255).
    ``FUSED_SCALE``: ``sb`` is already ``2^126 * scale`` (= 2^(s-1), finite only for s <= 128: see
    :func:`mxfp4_decode_tile`), so one multiply per pair of elements instead of two.
    ``PTX`` (sm_90): ``sb`` is an int32 word holding the bf16 scale in both lanes, and each product is one
    ``mul.rn.bf16x2`` on the word as it is (Triton would split the lanes and re-pack them with PRMTs).
    """
    if SHIFT_MAG == SHIFT_SIGN:  # (the planar layout's aligned pairs) one shift, one mask: 0x81C081C0
        bits = _shift(wd, SHIFT_MAG) & -2118090304
    else:  # magnitude bits 0x01C001C0, sign bits 0x80008000
        bits = (_shift(wd, SHIFT_MAG) & 0x01C001C0) | (_shift(wd, SHIFT_SIGN) & -2147450880)
    if PTX and not F32:
        if FUSED_SCALE:
            prod = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bits, sb], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:  # 2^126 in both lanes (0x7E80), then the scale
            prod = tl.inline_asm_elementwise(
                "{ .reg .b32 c; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 $0, $1, c; mul.rn.bf16x2 $0, $0, $2; }",
                "=r,r,r", [bits, sb], dtype=tl.int32, is_pure=True, pack=1)
        lo = prod.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (prod >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        if F32:
            # the Triton interpreter multiplies bf16 as integers and drops bf16 subnormals when widening: build
            # the fp32 patterns (same values, fp32 subnormal for e = 0) and scale in fp32 there (exact as well)
            lo = (bits << 16).to(tl.float32, bitcast=True)
            hi = (bits & -65536).to(tl.float32, bitcast=True)
        else:  # bf16 multiplies (Triton packs them two per instruction)
            lo = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if FUSED_SCALE:  # sb = 2^126 * scale: one exact product
            lo = lo * sb
            hi = hi * sb
        else:
            lo = (lo * _TWO_POW_126) * sb
            hi = (hi * _TWO_POW_126) * sb
    return tl.join(lo, hi)


@triton.jit
def mxfp4_decode_tile(wd, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
                      MMA_ORDER: tl.constexpr = True, FUSED_SCALE: tl.constexpr = False, PTX: tl.constexpr = False,
                      S_PER_WORD: tl.constexpr = False, BITS: tl.constexpr = 0):
    """Decode one packed MXFP4 weight tile to bf16 (in the K order of :func:`mxfp4_k_order` by default).

    Args:
        wd: ``[BLOCK_N, BLOCK_K/8]`` int32, the checkpoint bytes read as little-endian words (element 2i in
            the low nibble of byte i, K3_FACTS §4; word w holds elements 8w..8w+7, element 8w+j in nibble j).
        s: ``[BLOCK_N, BLOCK_K/32]`` uint8 E8M0 scales (2^(s-127); 0 is 2^-127; 255 is not allowed: the
            loader rejects it, here it would give inf / NaN); with ``S_PER_WORD`` ``[BLOCK_N, BLOCK_K/8]``, the
            scale of each word already repeated (word w's block is w // 4), so no broadcast is made here.
        F32: decode to fp32 and scale in fp32 instead of packed bf16 (the same exact values; for the Triton
            interpreter, whose bf16 arithmetic, bf16 widening and bf16 ``tl.dot`` are not IEEE).
        MMA_ORDER: permute K for a Hopper MMA whose register operand is this tile (below); False: natural order.
        BITS: value bits of ``wd`` (``k3rocm.kernels.mx.layout``): 0 the checkpoint's nibbles, 1 planar lanes
            (pair j of a word is nibble-equivalent elements j and j+4 either way; only the shifts differ).
        FUSED_SCALE: fold the decode's 2^126 into the scale (``2^(s-1)``, one multiply per element pair instead
            of two; on sm_90 a w1|w3 k-step of m16n128k128 drops from 561 to 463 SASS instructions per thread).
            Valid only when every scale byte of the tile is <= 128 (2^(s-1) <= 2^127, the largest bf16 power
            of two): the caller checks the whole tensor once (``ops.fused_scale_ok``); 129 gives inf, 130..254 wrap into the sign bit (wrong values).
    Returns:
        ``[BLOCK_N, BLOCK_K]`` bf16 (fp32 with ``F32``), bit-equal to ``k3rocm.mx.dequantize_mxfp4`` rounded
        to bf16 (exact: an E2M1 value times a power of two is a bf16 number unless it leaves the bf16 range).
        With ``MMA_ORDER``, position ``32c + 8j + 2t + b`` holds element ``32c + 8t + j + 4b`` of the tile:
        each thread of the MMA then finds its bf16 pairs (nibbles j and j+4 of one word) in one register,
        with no shuffles.
    """
    if PTX and not F32:  # the bf16 scale pattern in both 16-bit lanes of a word (see _mxfp4_pair)
        si = s.to(tl.int32)
        if FUSED_SCALE:
            si = (si + 126) << 7
        else:
            si = tl.where(si == 0, 0x40, si << 7)
        sb = si | (si << 16)
    elif FUSED_SCALE:  # 2^126 * 2^(s-127) = 2^(s-1): biased exponent s + 126 (a normal number for s in 0..128)
        if F32:
            sb = ((s.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)
        else:
            sb = ((s.to(tl.int16) + 126) << 7).to(tl.bfloat16, bitcast=True)
    elif F32:
        si = s.to(tl.int32)
        sb = tl.where(si == 0, 0x400000, si << 23).to(tl.float32, bitcast=True)
    else:
        si = s.to(tl.int16)
        sb = tl.where(si == 0, 0x40, si << 7).to(tl.bfloat16, bitcast=True)
    if not S_PER_WORD:
        sb = tl.broadcast_to(sb[:, :, None], (BLOCK_N, BLOCK_K // 32, 4)).reshape(BLOCK_N, BLOCK_K // 8)
    if BITS == 0:  # checkpoint nibbles: element 8w + j in bits 4j .. 4j + 3 (sign on top)
        p0 = _mxfp4_pair(wd, 6, 12, sb, F32, FUSED_SCALE, PTX)
        p1 = _mxfp4_pair(wd, 2, 8, sb, F32, FUSED_SCALE, PTX)
        p2 = _mxfp4_pair(wd, -2, 4, sb, F32, FUSED_SCALE, PTX)
        p3 = _mxfp4_pair(wd, -6, 0, sb, F32, FUSED_SCALE, PTX)
    else:  # the planar bits of k3rocm.kernels.mx.layout (PLANAR_MAG / PLANAR_SIGN): pairs 1 and 2 one mask each
        p0 = _mxfp4_pair(wd, 6, 2, sb, F32, FUSED_SCALE, PTX)
        p1 = _mxfp4_pair(wd, 3, 3, sb, F32, FUSED_SCALE, PTX)
        p2 = _mxfp4_pair(wd, 0, 0, sb, F32, FUSED_SCALE, PTX)
        p3 = _mxfp4_pair(wd, -3, 1, sb, F32, FUSED_SCALE, PTX)
    w = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [n, c*4+t, b, j>>1, j&1]: element 8w + 4b + j
    if MMA_ORDER:
        w = tl.permute(w.reshape(BLOCK_N, BLOCK_K // 32, 4, 2, 4), (0, 1, 4, 2, 3))  # [n, c, j, t, b]
    return w.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def mxfp4_k_order(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reorder the K axis of an activation tile ``[BLOCK_M, BLOCK_K]`` like :func:`mxfp4_decode_tile` does
    the weights (position 32c + 8j + 2t + b <- element 32c + 8t + 4b + j); a dot product over K is unchanged."""
    a = tl.permute(a.reshape(BLOCK_M, BLOCK_K // 32, 4, 2, 4), (0, 1, 4, 2, 3))
    return a.reshape(BLOCK_M, BLOCK_K)


@triton.jit
def mxfp4_decode_probe_kernel(w_ptr, s_ptr, o_ptr, idx_ptr, oi_ptr, BN: tl.constexpr, BK: tl.constexpr,
                              F32: tl.constexpr, FUSED_SCALE: tl.constexpr = False, PTX: tl.constexpr = False,
                              BITS: tl.constexpr = 0):
    """Check aid: decode one contiguous tile ``w [BN, BK/2] u8`` (value bits ``BITS``: 0 checkpoint nibbles, 1
    planar lanes), ``s [BN, BK/32] u8`` into ``o [BN, BK]`` fp32 with :func:`mxfp4_decode_tile`, and apply
    :func:`mxfp4_k_order` to ``idx [BN, BK]`` int32 -> ``oi`` (so a test sees both the values and the K order the
    GEMM uses)."""
    rn = tl.arange(0, BN)
    wd = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rn[:, None] * (BK // 8) + tl.arange(0, BK // 8)[None, :])
    s = tl.load(s_ptr + rn[:, None] * (BK // 32) + tl.arange(0, BK // 32)[None, :])
    w = mxfp4_decode_tile(wd, s, BN, BK, F32, True, FUSED_SCALE, PTX, False, BITS)
    tl.store(o_ptr + rn[:, None] * BK + tl.arange(0, BK)[None, :], w.to(tl.float32))
    idx = tl.load(idx_ptr + rn[:, None] * BK + tl.arange(0, BK)[None, :])
    tl.store(oi_ptr + rn[:, None] * BK + tl.arange(0, BK)[None, :], mxfp4_k_order(idx, BN, BK))


@triton.jit
def _dq_item(a_ptr, w_ptr, ws_ptr, out_ptr, sorted_pair_ptr, pair_weight_ptr, block_start_ptr, offsets_ptr,
             N, K, HALF_N, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, K_PER, stride_os,
             e, pid_m, pid_n, pid_s,
             TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BETA: tl.constexpr, BETA_LIN: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
             F32: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr, FUSED_SCALE: tl.constexpr,
             PTX: tl.constexpr, SCALE_PF: tl.constexpr, SPLIT_K: tl.constexpr, BITS: tl.constexpr,
             KORDER: tl.constexpr):
    """One work item of :func:`moe_gemm_dq_kernel`: M block ``pid_m`` (local expert ``e`` >= 0), n tile ``pid_n``,
    k split ``pid_s`` (0 when ``SPLIT_K`` is 1). The kernel's docstring has the arguments."""
    rows, rmask, arow, offs_n, nmask = _tile_rows(sorted_pair_ptr, block_start_ptr, offsets_ptr, e, pid_m, pid_n, N,
                                                  TOPK, GATED, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rk8 = tl.arange(0, BLOCK_K // 8)
    rks = tl.arange(0, BLOCK_K // 32)
    w_base = w_ptr.to(tl.pointer_type(tl.int32)) + e.to(tl.int64) * (stride_we // 4)
    ws_base = ws_ptr + e.to(tl.int64) * stride_wse
    G: tl.constexpr = 2 if GATED else 1
    rv, rs, up_v, up_s = _w_rows(offs_n, K, stride_wn, stride_wsn, HALF_N, G, TILE_N, TILE_K)
    if SPLIT_K > 1:  # this split's k range; its first value / scale byte of each row
        k_lo, dv0, ds0 = _w_split(pid_s, K_PER, G, TILE_N, TILE_K, BLOCK_K)
        k_hi = tl.minimum(K, k_lo + K_PER)
        rv += dv0
        rs += ds0
    else:
        k_lo = 0
        k_hi = K
    # int32 words (row starts and the up distance are multiples of 4 bytes in both layouts)
    wg_ptrs = w_base + (rv // 4)[:, None] + rk8[None, :]
    sg_ptrs = ws_base + rs[:, None] + rks[None, :]
    wu_ptrs = wg_ptrs + up_v // 4
    su_ptrs = sg_ptrs + up_s
    a_ptrs = a_ptr + arow[:, None] * stride_am + rk[None, :] + k_lo
    if SWAP:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALE_PF == 2:  # one scale byte per weight word, the first k-step's read before the loop
        sg_ptrs = ws_base + rs[:, None] + (rk8 // 4)[None, :]
        su_ptrs = sg_ptrs + up_s
    if SCALE_PF != 0:
        sg_nxt = tl.load(sg_ptrs)
        su_nxt = tl.load(su_ptrs) if GATED else sg_nxt
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SCALE_PF != 0:  # this step's scales from registers; the next step's read now (none after the last)
            # (after the last step: this step's bytes again, in bounds and unused; a select, not a mask)
            dsp = tl.where(k0 + BLOCK_K < k_hi, _w_step(k0, G, TILE_N, TILE_K, BLOCK_K)[1], 0)
            sg_cur = sg_nxt
            su_cur = su_nxt
            sg_nxt = tl.load(sg_ptrs + dsp)
            su_nxt = tl.load(su_ptrs + dsp) if GATED else sg_nxt
        a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
        if F32:
            a = a.to(tl.float32)
        if SWAP:  # decoded weights = the MMA's register operand, in its K order; tokens the narrow side
            if KORDER:  # the layout's element order makes the decode's K order the natural one
                at = tl.trans(a)
            else:
                at = tl.trans(mxfp4_k_order(a, BLOCK_M, BLOCK_K))
            wg = mxfp4_decode_tile(tl.load(wg_ptrs), sg_cur if SCALE_PF != 0 else tl.load(sg_ptrs), BLOCK_N,
                                    BLOCK_K, F32, True, FUSED_SCALE, PTX, SCALE_PF == 2, BITS)
            acc_g = tl.dot(wg, at, acc_g, input_precision="ieee" if F32 else None)
            if GATED:
                wu = mxfp4_decode_tile(tl.load(wu_ptrs), su_cur if SCALE_PF != 0 else tl.load(su_ptrs), BLOCK_N,
                                        BLOCK_K, F32, True, FUSED_SCALE, PTX, SCALE_PF == 2, BITS)
                acc_u = tl.dot(wu, at, acc_u, input_precision="ieee" if F32 else None)
        else:  # activations as they are; decoded weights (natural K order) staged as the shared operand
            # (from the mma element order the decode's MMA K order is the natural one)
            wg = mxfp4_decode_tile(tl.load(wg_ptrs), sg_cur if SCALE_PF != 0 else tl.load(sg_ptrs), BLOCK_N,
                                    BLOCK_K, F32, KORDER == 1, FUSED_SCALE, PTX, SCALE_PF == 2, BITS)
            acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision="ieee" if F32 else None)
            if GATED:
                wu = mxfp4_decode_tile(tl.load(wu_ptrs), su_cur if SCALE_PF != 0 else tl.load(su_ptrs), BLOCK_N,
                                        BLOCK_K, F32, KORDER == 1, FUSED_SCALE, PTX, SCALE_PF == 2, BITS)
                acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision="ieee" if F32 else None)
        dv, ds = _w_step(k0, G, TILE_N, TILE_K, BLOCK_K)
        wg_ptrs += dv // 4
        sg_ptrs += ds
        if GATED:
            wu_ptrs += dv // 4
            su_ptrs += ds
        a_ptrs += BLOCK_K
    orow = rows.to(tl.int64)
    if SWAP:
        omask = nmask[:, None] & rmask[None, :]
        o_ptrs = out_ptr + orow[None, :] * stride_om + offs_n[:, None]
    else:
        omask = rmask[:, None] & nmask[None, :]
        o_ptrs = out_ptr + orow[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K > 1:
        o_ptrs += pid_s.to(tl.int64) * stride_os
    if GATED and SPLIT_K > 1:  # fp32 partials; the GLU after the sum (moe_glu_finish_kernel)
        tl.store(o_ptrs, acc_g, mask=omask)
        tl.store(o_ptrs + stride_os // 2, acc_u, mask=omask)
    elif GATED:
        if ACT == "situ":
            h = _situ(acc_g, acc_u, BETA, BETA_LIN)
        else:
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        pair = tl.load(sorted_pair_ptr + rows, mask=rmask, other=0)
        wt = tl.load(pair_weight_ptr + pair, mask=rmask, other=0.0)
        if SWAP:
            tl.store(o_ptrs, acc_g * wt[None, :], mask=omask)
        else:
            tl.store(o_ptrs, acc_g * wt[:, None], mask=omask)


@triton.jit
def moe_gemm_dq_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr,
    sorted_pair_ptr, pair_weight_ptr, block_expert_ptr, block_start_ptr, offsets_ptr,
    N, K, HALF_N,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, K_PER, stride_os, UB,
    TOPK: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BETA: tl.constexpr, BETA_LIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    F32: tl.constexpr, TILE_N: tl.constexpr = 0, TILE_K: tl.constexpr = 0, FUSED_SCALE: tl.constexpr = False,
    PTX: tl.constexpr = False, SCALE_PF: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1, BITS: tl.constexpr = 0,
    KORDER: tl.constexpr = 0, PERSIST: tl.constexpr = 0,
):
    """A16W4 grouped GEMM, decode path: same grid, block table and epilogues as :func:`moe_gemm_kernel`
    (bf16 activations only; no A8 mode). ``SWAP`` (config kind ``"dq"``): the product is computed transposed,
    ``acc[n, m] = W[n, :] . a[m, :]``, so the decoded weight tile is the MMA's register operand (its 64-row
    side on Hopper) and the few token rows of a decode-sized group are the narrow side; the activations are
    loaded in the decode's K order. Not ``SWAP`` (kind ``"dqn"``): ``acc[m, n] = a[m, :] . W[n, :]`` with the
    activations as they are and the decoded weights staged as the shared-memory operand (large groups, where
    the permuted activation loads would cost more than the staging). Weight strides are in bytes and
    multiples of 4.
    ``F32``: fp32 decode and an IEEE fp32 dot, for the Triton interpreter only (see :func:`mxfp4_decode_tile`).
    ``TILE_N``/``TILE_K``: weight layout, as in :func:`moe_gemm_kernel`; ``BITS``: its value bits (0 checkpoint
    nibbles, 1 planar lanes: the tiled layout of ``mx.layout`` only); ``KORDER``: its element order within a block
    (1: the mma order of ``mx.layout``, whose decode in the MMA K order is the natural K order, so the activations
    are used as loaded in both orientations; 0: the checkpoint's). ``FUSED_SCALE``: one multiply per
    decoded pair (:func:`mxfp4_decode_tile`); only for weights whose scale bytes are all <= 128.
    ``SCALE_PF``: 0 = the E8M0 scales of a k-step read when it decodes (a synchronous load on the k-step chain).
    1 (config kinds ``"dqp"`` / ``"dqnp"``): the ``[BLOCK_N, BLOCK_K/32]`` scale tile of step k+1 is read into
    registers before step k's decode (the last step re-reads its own bytes), so its DRAM latency overlaps a whole
    k-step. 2 (kind ``"dqw"``): the same one step ahead, read one byte per weight word (``[BLOCK_N, BLOCK_K/8]``
    u8, word w takes its block's byte w // 4: no broadcast of the scales inside the decode).
    ``SPLIT_K`` > 1 (config ``split_k``): program ``(m, n, s)`` (grid axis 2 = the split) runs the k-steps of
    ``[s * K_PER, min(K, (s + 1) * K_PER))`` (``K_PER`` a multiple of ``BLOCK_K``, and of ``TILE_K`` in the
    tiled layout; the last split may be shorter)
    and stores fp32 partials at ``out_ptr + s * stride_os`` (elements): w1|w3 the gate partials ``[P, I]`` and
    the up partials ``stride_os / 2`` elements further (``moe_glu_finish_kernel`` adds them in split order and
    applies the GLU), w2 the partials times the router weight, ``[P, D]`` per split (``moe_reduce_kernel`` with
    ``SPLITS``). ``K_PER`` / ``stride_os`` are unused when ``SPLIT_K == 1``.
    ``SCALE_PF`` 1 and 2 give the bits of 0 (same bytes, same decode, same dot order); ``SPLIT_K`` > 1 does not
    give the bits of 1 (another fp32 summation order) but the same bits on every run (fixed order, no atomics).
    ``PERSIST`` > 0 (config ``persist``): a persistent grid of ``(programs,)`` instead of ``(UB, n tiles, splits)``.
    Program i runs the work items i, i + programs, ... of the ``UB * n_tiles * SPLIT_K`` items (block-major:
    item = (block * SPLIT_K + split) * n_tiles + n tile, so programs running at once share a block's activation
    rows), and stops at its first item of an empty block: the block table holds its live blocks first, then -1
    (``ops.GpuDispatch``), so no item after that one is live. Empty blocks cost no program and the next item's
    loads issue in the same program. Each item computes exactly what the program of the same (block, n tile,
    split) computes in the plain grid: the same bits. ``UB``: the block table's length (used only here)."""
    if PERSIST:
        n_tiles = tl.cdiv(N, BLOCK_N)
        per_block = n_tiles * SPLIT_K
        nprog = tl.num_programs(0)
        item = tl.program_id(0)
        blk = item // per_block
        e = tl.load(block_expert_ptr + blk, mask=blk < UB, other=-1)
        while e >= 0:
            r = item - blk * per_block
            _dq_item(a_ptr, w_ptr, ws_ptr, out_ptr, sorted_pair_ptr, pair_weight_ptr, block_start_ptr, offsets_ptr,
                     N, K, HALF_N, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, K_PER,
                     stride_os, e, blk, r % n_tiles, r // n_tiles, TOPK, GATED, ACT, BETA, BETA_LIN, BLOCK_M,
                     BLOCK_N, BLOCK_K, SWAP, F32, TILE_N, TILE_K, FUSED_SCALE, PTX, SCALE_PF, SPLIT_K, BITS, KORDER)
            item += nprog
            blk = item // per_block
            e = tl.load(block_expert_ptr + blk, mask=blk < UB, other=-1)
    else:
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= 0:
            _dq_item(a_ptr, w_ptr, ws_ptr, out_ptr, sorted_pair_ptr, pair_weight_ptr, block_start_ptr, offsets_ptr,
                     N, K, HALF_N, stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, K_PER,
                     stride_os, e, pid_m, tl.program_id(1), tl.program_id(2) if SPLIT_K > 1 else 0, TOPK, GATED,
                     ACT, BETA, BETA_LIN, BLOCK_M, BLOCK_N, BLOCK_K, SWAP, F32, TILE_N, TILE_K, FUSED_SCALE, PTX,
                     SCALE_PF, SPLIT_K, BITS, KORDER)


#: K3's routed-expert sizes for the ahead-of-time cases: latent width, expert intermediate width, (token, expert)
#: pairs of a 64-token step at top-16
K3_LATENT, K3_INTER, K3_PAIRS = 3584, 3072, 64 * 16


def k3_gemm_ints(gated: bool, tiles: tuple[int, int] = (0, 0), split_k: int = 1,
                 scaled_a8: bool | None = None) -> dict[str, int]:
    """The integer arguments of a grouped GEMM as ``ops`` passes them for one K3 layer at 64 tokens (w1|w3 if
    ``gated``, else w2; ``tiles`` the tiled layout, (0, 0) the checkpoint's), for ``k3rocm.kernels.isa.specialize``:
    the launcher specialises the multiples of 16 among them. ``scaled_a8``: None for the decode kernel, else the
    scaled kernel's two extra strides (activation / output scale rows) in that mode."""
    rows, k = (2 * K3_INTER, K3_LATENT) if gated else (K3_LATENT, K3_INTER)
    n = rows // 2 if gated else rows
    if tiles[0]:
        g = 2 if gated else 1
        chunk = g * tiles[0] * (tiles[1] // 2 + tiles[1] // 32)
        per_expert = -(-n // tiles[0]) * (k // tiles[1]) * chunk
        we, wn, wse, wsn = per_expert, 0, per_expert, 0
    else:
        we, wn, wse, wsn = rows * k // 2, k // 2, rows * k // 32, k // 32
    out_w = n if gated else K3_LATENT
    ints = dict(N=n, K=k, HALF_N=n if gated else 0, stride_am=k, stride_we=we, stride_wn=wn, stride_wse=wse,
                stride_wsn=wsn, stride_om=out_w)
    if scaled_a8 is None:
        return dict(ints, K_PER=k // split_k, stride_os=(2 if gated else 1) * K3_PAIRS * out_w)
    return dict(ints, stride_asm=k // 32 if scaled_a8 else k,
                stride_osm=(n // 32 if scaled_a8 else n) if gated else out_w)


def isa_options(cfg: tune.Config, backend: str) -> dict:
    """Compile options of a GEMM config for ``backend``: its launch options on ``"hip"`` (but ``maxnreg``, a CUDA
    option), ``num_warps``, ``num_stages`` and ``maxnreg`` (where set) on ``"cuda"``."""
    opts = tune.split(cfg, interp=False)[1]
    if backend == "hip":
        return {k: v for k, v in opts.items() if k != "maxnreg"}
    return {k: v for k, v in opts.items() if k in ("num_warps", "num_stages", "maxnreg")}


def dq_isa_case(gated: bool, cfg: tune.Config, backend: str, tiles: tuple[int, int] = (0, 0),
                fused_scale: bool = True, bits: int = 0, order: int = 0) -> tuple:
    """``(name, fn, signature, constexprs, expects_matrix, options)`` of the decode-path GEMM for
    ``k3rocm.kernels.isa.compile_kernel`` (K3 sizes: top-16, SiTU); ``tiles``: (TILE_N, TILE_K) of the tiled
    weight layout, (0, 0) = checkpoint layout; ``fused_scale``: the variant for scale bytes <= 128 (what every
    K3 layer runs) or the general one. w2 (not ``gated``) takes the config's w2 overrides (``configs.stage_config``)."""
    full = cfg
    cfg = stage_config(cfg, gated)
    sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16" if gated else "*fp32",
           "sorted_pair_ptr": "*i32", "pair_weight_ptr": "*fp32", "block_expert_ptr": "*i32",
           "block_start_ptr": "*i32", "offsets_ptr": "*i64", "N": "i32", "K": "i32", "HALF_N": "i32",
           "stride_am": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_wse": "i64", "stride_wsn": "i32",
           "stride_om": "i32", "K_PER": "i32", "stride_os": "i64", "UB": "i32"}
    consts = {"TOPK": 16, "GATED": gated, "ACT": "situ", "BETA": 4.0, "BETA_LIN": 25.0,
              "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
              "SWAP": cfg["kind"] in SWAP_KINDS, "F32": False, "TILE_N": tiles[0], "TILE_K": tiles[1],
              "FUSED_SCALE": fused_scale, "PTX": backend == "cuda", "SCALE_PF": SCALE_PF_KINDS.get(cfg["kind"], 0),
              "SPLIT_K": cfg.get("split_k", 1), "BITS": bits, "KORDER": order,
              "PERSIST": cfg.get("persist", 0)}
    for c in consts:
        sig[c] = "constexpr"
    sig = specialize(sig, k3_gemm_ints(gated, tiles, cfg.get("split_k", 1)))
    opts = isa_options(cfg, backend)
    lay = (f",tiled{tiles[0]}x{tiles[1]}" if tiles[0] else "") + (",planar" if bits else "") + (
        ",mma-order" if order else "") + (
        "" if fused_scale else ",general-scale")
    return (f"gemm_dq_{'w13' if gated else 'w2'}_a16w4[{gemm_name(full)}{lay}]", moe_gemm_dq_kernel, sig, consts, True,
            opts)


@triton.jit
def write_block_table(bexp_ptr, bstart_ptr, UB, experts, live, counts, start, BLOCK_M: tl.constexpr,
                      BLOCK_UB: tl.constexpr):
    """The GEMMs' block table from per-expert row counts, in the calling program: every one of the ``UB`` slots
    first reset (expert −1, start 0), then expert ``experts[i]`` (where ``live[i]``) gets ``ceil(counts[i] /
    BLOCK_M)`` consecutive blocks, in expert order, each with its first sorted row (``start[i] + j * BLOCK_M``).
    Shared by both groupings (``moe_dispatch_kernel`` and the fused routing's ``router.bucket_pairs``)."""
    ru = tl.arange(0, BLOCK_UB)
    tl.store(bexp_ptr + ru, tl.full((BLOCK_UB,), -1, tl.int32), mask=ru < UB)
    tl.store(bstart_ptr + ru, tl.zeros((BLOCK_UB,), dtype=tl.int32), mask=ru < UB)
    tl.debug_barrier()
    blocks = tl.where(live, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    first_block = tl.cumsum(blocks, 0) - blocks
    for j in range(0, tl.max(blocks, 0)):
        b = first_block + j
        mb = (j < blocks) & (b < UB)
        tl.store(bexp_ptr + b, experts, mask=mb)
        tl.store(bstart_ptr + b, start + j * BLOCK_M, mask=mb)


@triton.jit
def pair_keys(ids_ptr, rp, m, first, num_local, SPARE: tl.constexpr):
    """The grouping key of the pairs ``rp`` (int32 global expert ids at ``ids_ptr``): the local expert id, the other
    ranks' pairs ``num_local`` (sorted after every local pair), lanes off ``m`` the spare bin ``SPARE``. Shared by
    both groupings that count with ``tl.histogram`` (``moe_dispatch_kernel``, ``router.group_pairs_kernel``)."""
    key = tl.load(ids_ptr + rp, mask=m, other=0) - first
    key = tl.where((key >= 0) & (key < num_local), key, num_local)
    return tl.where(m, key, SPARE)


@triton.jit
def moe_dispatch_kernel(ids_ptr, first, num_local, P, sorted_ptr, pos_ptr, counts_ptr, offsets_ptr,
                        bexp_ptr, bstart_ptr, run_ptr, UB,
                        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_UB: tl.constexpr):
    """Whole device dispatch in ONE program (decode-sized P): counting sort of the (token, slot) pairs by local
    expert, stable, plus the grouped GEMM's M-block table — the contract of ``ops.dispatch_gpu``.

    ids ``[P]`` int32 global expert ids (flat t*k+j); local key = id - first, pairs off this rank take key
    ``num_local`` (sorted after all local pairs, as in the torch path); lanes past P take the spare bin
    ``BLOCK_E - 1`` (BLOCK_E >= num_local + 2). Pass 1: per-expert counts (``tl.histogram`` per chunk of
    BLOCK_P pairs). Pass 2: sorted row of each pair = start of its expert + pairs of that expert in earlier
    chunks (running counters in ``run_ptr`` scratch, int32 [BLOCK_E]) + earlier pairs of the same expert in
    this chunk (a BLOCK_P x BLOCK_P comparison). Pass 3: ``ceil(count / BLOCK_M)`` blocks per expert, laid out
    in expert order; blocks past the last are -1. Writes sorted ``[P]``, pos ``[P]`` (-1 off-rank), counts
    ``[num_local]`` (int64), offsets ``[num_local + 1]`` (int64), block_expert / block_start ``[UB]``.
    """
    re = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        rp = p0 + tl.arange(0, BLOCK_P)
        key = pair_keys(ids_ptr, rp, rp < P, first, num_local, BLOCK_E - 1)
        counts += tl.histogram(key, BLOCK_E)
    counts = tl.where(re <= num_local, counts, 0)
    start = tl.cumsum(counts, 0) - counts  # exclusive prefix: start row of each key
    tl.store(counts_ptr + re, counts.to(tl.int64), mask=re < num_local)
    tl.store(offsets_ptr + re, start.to(tl.int64), mask=re <= num_local)
    tl.store(run_ptr + re, start)
    tl.debug_barrier()
    rq = tl.arange(0, BLOCK_P)
    for p0 in range(0, P, BLOCK_P):
        rp = p0 + rq
        m = rp < P
        key = pair_keys(ids_ptr, rp, m, first, num_local, BLOCK_E - 1)
        valid = key < num_local
        earlier = (key[:, None] == key[None, :]) & (rq[None, :] < rq[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        row = tl.load(run_ptr + key, mask=m, other=0) + rank
        tl.store(sorted_ptr + row, rp, mask=m)
        tl.store(pos_ptr + rp, tl.where(valid, row, -1), mask=m)
        tl.debug_barrier()
        run = tl.load(run_ptr + re) + tl.histogram(key, BLOCK_E)
        tl.debug_barrier()
        tl.store(run_ptr + re, run)
        tl.debug_barrier()
    write_block_table(bexp_ptr, bstart_ptr, UB, re, re < num_local, counts, start, BLOCK_M, BLOCK_UB)
