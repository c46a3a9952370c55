"""Grouped GEMM of the routed experts on packed MXFP4 weights, and the per-token weighted reduction.

One kernel source serves both GEMMs of an expert and both activation modes (HIP and CUDA alike):

* ``GATED=True`` (w1|w3): rows of a group are gathered from the activation by token id; the program computes
  the gate tile (weight rows ``n``) and the up tile (rows ``I + n``) of the stacked ``w13`` and applies
  SiTU-GLU (or SiLU-GLU) in fp32 in the epilogue; the output ``h`` is stored per sorted pair, in bf16
  (A16W4) or as MXFP8 E4M3 + E8M0 scales (A8W4, quantized in the epilogue from the fp32 values).
* ``GATED=False`` (w2): the activation is ``h`` in sorted order; the epilogue multiplies by the router weight
  of the pair and stores fp32 per sorted pair.

Weights stay in the checkpoint's own layout (``[E, N, K/2]`` u8, element 2i in the low nibble; scales
``[E, N, K/32]`` u8 E8M0 — K3_FACTS §4); no conversion at load time. Both modes use ``tl.dot_scaled`` with
the weights as ``e2m1``: A16W4 passes bf16 activations with no scale (the compiler decodes FP4 to bf16 in
registers: Hopper, gfx942), A8W4 passes E4M3 activations with their E8M0 scales (native
``v_mfma_scale_f32_*_f8f6f4`` on gfx950; emulated elsewhere: Triton upcasts both operands to bf16 and
uses wgmma / mma on sm_90 and bf16 MFMA on gfx942). ``tl.dot_scaled`` also runs under the Triton
interpreter with bf16 and E4M3 operands, so the CPU tests cover both modes.

The reduction sums the k weighted rows of each token in slot order (deterministic: no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3rocm.kernels.mx.quant import mxfp8_quantize_tile


@triton.jit
def _situ(g, u, BETA: tl.constexpr, BETA_LIN: tl.constexpr):
    # a = beta*tanh(g/beta)*sigmoid(g); u' = beta_lin*tanh(u/beta_lin) (K3_FACTS §5); tanh(y) = 2*sigmoid(2y)-1
    tg = 2.0 * tl.sigmoid(g * (2.0 / BETA)) - 1.0
    tu = 2.0 * tl.sigmoid(u * (2.0 / BETA_LIN)) - 1.0
    return (BETA * tg * tl.sigmoid(g)) * (BETA_LIN * tu)


@triton.jit
def moe_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr,
    sorted_pair_ptr, pair_weight_ptr, block_expert_ptr, block_start_ptr, offsets_ptr,
    N, K, HALF_N,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
    TOPK: tl.constexpr, GATED: tl.constexpr, A8: tl.constexpr, ACT_FMT: tl.constexpr, ACT: tl.constexpr,
    BETA: tl.constexpr, BETA_LIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (m block, n tile). ``block_expert[m]`` = local expert (-1: no work), ``block_start[m]`` = first
    sorted row; rows end at ``offsets[e+1]``. ``N`` is the output width (I for w13, D for w2)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
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
    rk = tl.arange(0, BLOCK_K)
    rk2 = tl.arange(0, BLOCK_K // 2)
    rks = tl.arange(0, BLOCK_K // 32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    ws_base = ws_ptr + e.to(tl.int64) * stride_wse
    # weights read as [BLOCK_K/2, BLOCK_N] (K packed, contiguous in memory), scales as [BLOCK_N, BLOCK_K/32]
    wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + rk2[:, None]
    sg_ptrs = ws_base + offs_n[:, None].to(tl.int64) * stride_wsn + rks[None, :]
    a_ptrs = a_ptr + arow[:, None] * stride_am + rk[None, :]
    as_ptrs = as_ptr + arow[:, None] * stride_asm + rks[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        wu_ptrs = wg_ptrs + HALF_N * stride_wn
        su_ptrs = sg_ptrs + HALF_N * stride_wsn
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
            wu_ptrs += BLOCK_K // 2
            su_ptrs += BLOCK_K // 32
        a_ptrs += BLOCK_K
        as_ptrs += BLOCK_K // 32
        wg_ptrs += BLOCK_K // 2
        sg_ptrs += BLOCK_K // 32
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
                      TOPK: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = sum_j y[pos[t*k+j]] (pos < 0: pair not on this rank), slot order; optional fused RMSNorm
    (``normed[t] = rms_norm(out[t]) * w`` in fp32, stored in normed's dtype: the latent tail, K3_FACTS §5 step 4)."""
    t = tl.program_id(0)
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(TOPK):
        p = tl.load(pos_ptr + t * TOPK + j)
        if p >= 0:
            acc += tl.load(y_ptr + p.to(tl.int64) * stride_y + rd, mask=dmask, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + rd, acc, mask=dmask)
    if NORM:
        ms = tl.sum(acc * acc, axis=0) / D
        w = tl.load(norm_w_ptr + rd, mask=dmask, other=0.0).to(tl.float32)
        yn = acc * (1.0 / tl.sqrt(ms + eps)) * w
        tl.store(normed_ptr + t.to(tl.int64) * stride_n + rd, yn.to(normed_ptr.dtype.element_ty), mask=dmask)
