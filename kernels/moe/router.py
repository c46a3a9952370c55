"""Router in Triton: FP32 logits (bf16 x bf16, fp32 accumulate), sigmoid, biased top-k with lowest-id ties,
unbiased renormalised weights (K3_FACTS §5 step 1; oracle ``k3rocm.model.moe.moe_router``).

Two kernels: ``router_logits_kernel`` (grid: token tiles x expert tiles x K splits, partial sums to an fp32
buffer ``[S, T, E]``; splits give enough programs at 64 tokens, where one tile of tokens would read the
whole 12.8 MB gate alone) and ``router_topk_kernel`` (one program per token: sums the splits in a fixed order,
so results are deterministic, then k rounds of max / lowest index among equals).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, part_ptr, T, E, D, K_PER_SPLIT, stride_x, stride_w, stride_ps, stride_pt,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr = False):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    re = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rk = tl.arange(0, BLOCK_K)
    tmask = rt < T
    emask = re < E
    k_lo = pid_s * K_PER_SPLIT
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    x_ptrs = x_ptr + rt[:, None].to(tl.int64) * stride_x + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + re[None, :].to(tl.int64) * stride_w + (k_lo + rk)[:, None]
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        kmask = (k_lo + k0 + rk) < D
        x = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & emask[None, :], other=0.0)
        if IEEE:  # fp32 inputs: full fp32 products (never TF32, which flips marginal picks)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    p_ptrs = part_ptr + pid_s * stride_ps + rt[:, None].to(tl.int64) * stride_pt + re[None, :]
    tl.store(p_ptrs, acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def router_topk_kernel(part_ptr, bias_ptr, ids_ptr, wts_ptr, E, stride_ps, stride_pt, scaling,
                       SPLITS: tl.constexpr, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_KOUT: tl.constexpr):
    t = tl.program_id(0)
    re = tl.arange(0, BLOCK_E)
    emask = re < E
    logit = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s in range(SPLITS):
        logit += tl.load(part_ptr + s * stride_ps + t.to(tl.int64) * stride_pt + re, mask=emask, other=0.0)
    score = tl.sigmoid(logit)
    if HAS_BIAS:
        biased = score + tl.load(bias_ptr + re, mask=emask, other=0.0)
    else:
        biased = score
    biased = tl.where(emask, biased, float("-inf"))
    rj = tl.arange(0, BLOCK_KOUT)
    ids = tl.zeros((BLOCK_KOUT,), dtype=tl.int32)
    wts = tl.zeros((BLOCK_KOUT,), dtype=tl.float32)
    for j in range(TOPK):
        m = tl.max(biased, axis=0)
        idx = tl.min(tl.where(biased == m, re, BLOCK_E), axis=0)
        sel = re == idx
        w = tl.sum(tl.where(sel, score, 0.0), axis=0)
        ids = tl.where(rj == j, idx, ids)
        wts = tl.where(rj == j, w, wts)
        biased = tl.where(sel, float("-inf"), biased)
    if RENORM:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    wts = wts * scaling
    tl.store(ids_ptr + t * TOPK + rj, ids, mask=rj < TOPK)
    tl.store(wts_ptr + t * TOPK + rj, wts, mask=rj < TOPK)
