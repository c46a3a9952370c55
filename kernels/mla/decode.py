"""MLA over the paged latent cache: the slot-write kernel and the absorbed split-K decode.

Cache layout (K3_FACTS §5/§7): ``kv_cache [num_blocks, block_size, R+Dr]`` (576 = 512 normed latent + 64
k_rope per token), ``block_table [N, max_blocks]`` int32, ``context_lens [N]`` int32. Dtype bf16 (or fp16 /
fp32), or FP8 e4m3fn (gfx950, CUDA) / e4m3fnuz (gfx942) with one dequantisation scale ``kv_scale``.

Decode absorbs ``kv_b_proj`` (DeepSeek-V2 §2.1.2): the wrapper forms q_lat = q_nope @ W_kc (a batched
matmul, [H, Dn, R]) so the attention kernel reads only the 576-wide cache rows; per (sequence, context
split, head group) it computes an online softmax over its slice and writes an fp32 partial ``[R]`` plus its
log-sum-exp. A second kernel merges the splits, multiplies by W_vc ([H, R, Dv], the value side of the
absorption) and applies the output gate ``sigmoid(g_proj(x))``: the o_proj input comes out ready.

Oracle: :func:`k3rocm.model.mla.mla_decode`, :func:`k3rocm.model.mla.mla_cache_write`.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune
from k3rocm.kernels.mla.prefill import load_cols, pad_dim
from k3rocm.kernels.target import current_target, multiprocessors
from k3rocm.numerics import FP8_MAX

LOG2E = 1.4426950408889634

#: split (attention) kernel configs per backend
DECODE_CONFIGS: dict[str, list[dict]] = {
    # chosen so that ptxas (12.8, sm_90a) reports no spills at K3 dims, except BLOCK_H=64 x BLOCK_N=64
    "cuda": [
        # one 64-token cache page per tile (one block-table read), 4 warps: the fastest on every 12-head row of
        # the H200 sweep (gpu-runs/sweep_attn.py, 2026-12-03: 0.71 / 0.91 / 0.91 / 0.95 of the floor at N64 L8192
        # / N64 L32768 / N256 L8192 / N256 L32768, vs 0.55-0.83 for the table's earlier picks)
        dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2),
        dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2),
        dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=3),
        dict(BLOCK_H=16, BLOCK_N=32, num_warps=8, num_stages=2),
        dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=2),
        dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=2),
        dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=3),
        dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2),
        # 64 heads as the M of the wgmma tiles with twice the key tile of the 16-row one, still spill-free:
        # the 96-head (TP1) shape, where the op is matrix-bound
        dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
    ],
    "hip": [
        dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1, waves_per_eu=1, matrix_instr_nonkdim=16, kpack=1),
        dict(BLOCK_H=32, BLOCK_N=16, num_warps=4, num_stages=1, waves_per_eu=1, matrix_instr_nonkdim=16, kpack=1),
        # two-stage pipelined page tiles: the deepest that compiles without VGPR spills on both gfx942 (64 KB
        # LDS) and gfx950 (160 KB); 32-row tiles or a second stage at BLOCK_N 32 spill on both
        dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=2, waves_per_eu=1, matrix_instr_nonkdim=16, kpack=1),
    ],
    "interpreter": [
        dict(BLOCK_H=16, BLOCK_N=16),
        dict(BLOCK_H=32, BLOCK_N=32),
    ],
}

#: merge + W_vc + gate kernel configs per backend
REDUCE_CONFIGS: dict[str, list[dict]] = {
    "cuda": [dict(BLOCK_M=16, BLOCK_R=64, num_warps=4, num_stages=2)],
    "hip": [dict(BLOCK_M=16, BLOCK_R=64, num_warps=4, num_stages=1, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1)],
    "interpreter": [dict(BLOCK_M=16, BLOCK_R=16)],
}

CACHE_WRITE_CONFIGS: dict[str, list[dict]] = {
    "cuda": [dict(num_warps=4)], "hip": [dict(num_warps=4)], "interpreter": [dict()],
}

#: context slices start at multiples of this many tokens (so a tile of BLOCK_N | 64 rows never crosses a
#: page boundary when BLOCK_N also divides the page)
SPLIT_ALIGN = 64
_SPLIT_ALIGN = tl.constexpr(SPLIT_ALIGN)
#: a context slice shorter than this is not split further
MIN_SPLIT_TOKENS = 256
#: upper bound on the fp32 partial buffer (bytes) that decides how far a batch may be split
PARTIAL_BUDGET = 256 << 20


@_interp.kjit
def _mla_cache_write_kernel(CACHE, SLOT, LAT, KR, stride_cb, stride_cs, stride_lt, stride_kt, block_size, inv_scale,
                            R: tl.constexpr, DR: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr,
                            IS_FP8: tl.constexpr, FP8_LIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot < 0:
        return
    base = CACHE + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    r = tl.arange(0, BR)
    d = tl.arange(0, BDR)
    lat = tl.load(LAT + t.to(tl.int64) * stride_lt + r, mask=r < R, other=0.0).to(tl.float32)
    kr = tl.load(KR + t.to(tl.int64) * stride_kt + d, mask=d < DR, other=0.0).to(tl.float32)
    if IS_FP8:
        lat = tl.minimum(tl.maximum(lat * inv_scale, -FP8_LIM), FP8_LIM)
        kr = tl.minimum(tl.maximum(kr * inv_scale, -FP8_LIM), FP8_LIM)
    tl.store(base + r, lat.to(CACHE.dtype.element_ty), mask=r < R)
    tl.store(base + R + d, kr.to(CACHE.dtype.element_ty), mask=d < DR)


# compiled mode (as _interp.kjit); the per-call counts are not specialised on (== 1, % 16), so a new
# batch size, length or bank depth never compiles while serving
@partial(JITFunction, do_not_specialize=("H", "TQ", "ROWS", "NSEQ", "min_chunk", "n_groups", "n_splits"))
def _mla_decode_split_kernel(
    QL, QR, CACHE, BT, CL, PART, LSE,
    stride_qln, stride_qlt, stride_qlh, stride_qrn, stride_qrt, stride_qrh,
    stride_cb, stride_cs, stride_bt,
    H, TQ, ROWS, NSEQ, min_chunk, n_groups, n_splits, qk_scale, out_scale,
    R: tl.constexpr, DR: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr, XCD: tl.constexpr = 1,
):
    # R / DR are padded to BR / BDR (powers of two >= 16); padded lanes load as 0 and are never stored
    if XCD == 1:
        # head groups vary fastest: the groups reading one context slice run together and share it in L2
        g = tl.program_id(0)
        s = tl.program_id(1)
        n = tl.program_id(2)
    else:
        # one linear grid ordered for a part of XCD dies that takes workgroups round-robin (workgroup p runs on
        # die p % XCD, each die with its own L2): the n_groups head groups of one context slice j get ids
        # x + XCD * (r * n_groups + g) with x = j % XCD and r = j // XCD, so they run on one die and read the
        # slice through one L2; ids past the last slice (the grid is rounded up to whole rows of XCD) exit
        pid = tl.program_id(0)
        x = pid % XCD
        rr = pid // XCD
        g = rr % n_groups
        j = (rr // n_groups) * XCD + x
        if j >= n_splits * NSEQ:
            return
        s = j % n_splits
        n = j // n_splits
    L = tl.load(CL + n)
    # this sequence's slices, from its real context length (read here, so a captured graph replayed with
    # other lengths still spreads each sequence over all its splits): L / num_splits rounded up to the
    # alignment, never shorter than min_chunk (a shorter sequence leaves its last splits empty)
    per = (tl.num_programs(1) if XCD == 1 else n_splits) * _SPLIT_ALIGN
    chunk = tl.maximum(((L + per - 1) // per) * _SPLIT_ALIGN, min_chunk)
    start = s * chunk
    end = tl.minimum(L, start + chunk)
    rows = g * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < ROWS
    lse_ptr = LSE + (s * NSEQ + n).to(tl.int64) * ROWS + rows
    if start >= end:
        tl.store(lse_ptr, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
        return
    t = rows // H
    hh = rows % H
    last = L - TQ + t  # last visible position of each query row
    r = tl.arange(0, BR)
    dr = tl.arange(0, BDR)
    r_ok = r < R
    dr_ok = dr < DR
    ql = tl.load(QL + n.to(tl.int64) * stride_qln + (t * stride_qlt + hh * stride_qlh)[:, None] + r[None, :],
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    qr = tl.load(QR + n.to(tl.int64) * stride_qrn + (t * stride_qrt + hh * stride_qrh)[:, None] + dr[None, :],
                 mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BR], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    bt_row = BT + n.to(tl.int64) * stride_bt
    for k0 in range(start, end, BLOCK_N):
        pos = k0 + offs
        ok = pos < end
        if (PAGE % BLOCK_N == 0) and (_SPLIT_ALIGN % BLOCK_N == 0):
            # the tile lies inside one cache page (slices start at multiples of 64 tokens, BLOCK_N divides
            # the page): one block-table read, consecutive rows; rows past the slice load as 0
            blk = tl.load(bt_row + k0 // PAGE).to(tl.int64)
            rowp = CACHE + blk * stride_cb + ((k0 % PAGE) + offs).to(tl.int64) * stride_cs
            lat = tl.load(rowp[:, None] + r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
            kr = tl.load(rowp[None, :] + R + dr[:, None], mask=ok[None, :] & dr_ok[:, None], other=0.0)
        else:
            # a tile spanning pages: one block-table read per row; positions past the slice are clamped to
            # its last row (real, finite data) and masked in the scores, so the loads need no row masks
            pc = tl.minimum(pos, end - 1)
            blk = tl.load(bt_row + pc // PAGE).to(tl.int64)
            rowp = CACHE + blk * stride_cb + (pc % PAGE).to(tl.int64) * stride_cs
            lat = load_cols(rowp[:, None] + r[None, :], r_ok[None, :], BR == R)
            kr = load_cols(rowp[None, :] + R + dr[:, None], dr_ok[:, None], BDR == DR)
        if IS_FP8:
            lat = lat.to(ql.dtype)
            kr = kr.to(qr.dtype)
        sc = tl.dot(qr, kr, tl.dot(ql, tl.trans(lat)))  # one accumulator
        vis = ok[None, :] & (pos[None, :] <= last[:, None])
        sc = tl.where(vis, sc, float("-inf"))
        # the scale (> 0) is folded into the exponent, one fma per score; m_i is kept in scaled units
        m_new = tl.maximum(m_i, tl.max(sc, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc * qk_scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m_i = m_new
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    part = acc * (out_scale / l_safe)[:, None]
    pp = PART + ((s * NSEQ + n).to(tl.int64) * ROWS + rows)[:, None] * R + r[None, :]
    tl.store(pp, part, mask=row_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr, tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)


# compiled mode (as _interp.kjit); the per-call counts are not specialised on (== 1, % 16), so a new
# batch size, length or bank depth never compiles while serving
@partial(JITFunction, do_not_specialize=("H", "TQ", "ROWS", "NSEQ", "num_splits"))
def _mla_decode_merge_kernel(
    PART, LSE, WVC, G, O,
    H, TQ, ROWS, NSEQ, num_splits,
    stride_wh, stride_wr, stride_gn, stride_gt, stride_on, stride_ot, stride_oh,
    R: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, HAS_GATE: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.program_id(1)
    idx = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # (sequence, query) pairs
    ok = idx < NSEQ * TQ
    n = idx // TQ
    t = idx % TQ
    row = (n.to(tl.int64) * ROWS + t * H + h)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(LSE + s * NSEQ * ROWS + row, mask=ok, other=float("-inf"))
        mx = tl.maximum(mx, lse)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.zeros([BLOCK_M], tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(LSE + s * NSEQ * ROWS + row, mask=ok, other=float("-inf"))
        den += tl.exp2(lse - mx_safe)
    inv = tl.where(den > 0.0, 1.0 / tl.where(den > 0.0, den, 1.0), 0.0)
    dv = tl.arange(0, BDV)
    rr = tl.arange(0, BLOCK_R)
    out = tl.zeros([BLOCK_M, BDV], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        c = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for s in range(0, num_splits):
            lse = tl.load(LSE + s * NSEQ * ROWS + row, mask=ok, other=float("-inf"))
            w = tl.exp2(lse - mx_safe) * inv
            use = ok & (w > 0.0)
            pv = tl.load(PART + (s * NSEQ * ROWS + row)[:, None] * R + r0 + rr[None, :],
                         mask=use[:, None] & ((r0 + rr) < R)[None, :], other=0.0)
            c += w[:, None] * pv
        wv = tl.load(WVC + h * stride_wh + (r0 + rr)[:, None] * stride_wr + dv[None, :],
                     mask=((r0 + rr) < R)[:, None] & (dv[None, :] < DV), other=0.0)
        out += tl.dot(c.to(wv.dtype), wv)
    st = ok[:, None] & (dv[None, :] < DV)
    if HAS_GATE:
        gv = tl.load(G + n[:, None].to(tl.int64) * stride_gn + t[:, None] * stride_gt + h * DV + dv[None, :], mask=st,
                     other=0.0).to(tl.float32)
        out = out * tl.sigmoid(gv)
    tl.store(O + n[:, None].to(tl.int64) * stride_on + t[:, None] * stride_ot + h * stride_oh + dv[None, :],
             out.to(O.dtype.element_ty), mask=st)


def _tl_fp8_ok(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def mla_cache_write(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                    kv_scale: float | None = None) -> None:
    """Triton slot write; same contract as :func:`k3rocm.model.mla.mla_cache_write` (in place, -1 = skip).

    Raises:
        ConfigError: widths disagree with the cache, or the cache's last dim is not contiguous.
    """
    nb, bs, W = kv_cache.shape
    T, R = latent.shape
    Dr = k_rope.shape[1]
    if R + Dr != W or k_rope.shape[0] != T or slot_mapping.shape[0] != T:
        raise ConfigError(f"mla_cache_write: latent {tuple(latent.shape)} + k_rope {tuple(k_rope.shape)} do not fill "
                          f"cache rows of width {W} for {slot_mapping.shape[0]} slots")
    if kv_cache.stride(-1) != 1 or latent.stride(-1) != 1 or k_rope.stride(-1) != 1:
        raise ConfigError("mla_cache_write: kv_cache, latent and k_rope need a contiguous last dim")
    if T == 0:
        return
    fp8 = _tl_fp8_ok(kv_cache.dtype)
    inv = 1.0 / float(kv_scale) if (fp8 and kv_scale is not None) else 1.0
    meta, opts = tune.split(tune.configs(CACHE_WRITE_CONFIGS)[0])
    _interp.launch(_mla_cache_write_kernel, (T,),
        kv_cache, slot_mapping.to(torch.int64), latent, k_rope, kv_cache.stride(0), kv_cache.stride(1),
        latent.stride(0), k_rope.stride(0), bs, inv,
        R=R, DR=Dr, BR=tune.pow2(R), BDR=tune.pow2(Dr), IS_FP8=fp8, FP8_LIM=FP8_MAX.get(kv_cache.dtype, 0.0),
        **meta, **opts)


def num_splits_for(context_lens_max: int, total_tokens: int, n_seq: int, rows: int, R: int, n_sm: int,
                   block_h: int = 16) -> tuple[int, int]:
    """Split-K plan: ``(num_splits, chunk)`` with chunk a multiple of ``SPLIT_ALIGN`` (64) tokens.

    Aims at ~2 programs per multiprocessor (``n_sm``) with slices no shorter than ``MIN_SPLIT_TOKENS``,
    sized from the batch's *total* context so that one long sequence among short ones is cut as finely as
    the work needs, and capped so the fp32 partial buffer stays under ``PARTIAL_BUDGET``. Among the split
    counts from half to twice that aim, the one whose program count ``n_seq * groups * splits`` fills whole
    waves of ``n_sm`` programs best is taken (ties: the nearest to the aim): equal programs in 2.4 waves run
    as long as in 3.
    """
    groups = triton.cdiv(rows, block_h)
    target = 2 * n_sm
    L = max(context_lens_max, 1)
    chunk = max(MIN_SPLIT_TOKENS, triton.cdiv(max(total_tokens, 1) * groups, target))
    chunk = triton.cdiv(chunk, SPLIT_ALIGN) * SPLIT_ALIGN
    splits = max(1, triton.cdiv(L, chunk))
    cap = max(1, min(PARTIAL_BUDGET // max(1, n_seq * rows * R * 4), L // MIN_SPLIT_TOKENS))
    if splits > 1:
        def fill(sp: int) -> float:
            progs = n_seq * groups * sp
            return progs / (triton.cdiv(progs, n_sm) * n_sm)
        cands = range(max(1, (splits + 1) // 2), min(2 * splits, max(cap, splits)) + 1)
        splits = max(cands, key=lambda sp: (round(fill(sp), 3), -abs(sp - splits)))
    splits = min(splits, max(1, PARTIAL_BUDGET // max(1, n_seq * rows * R * 4)))
    chunk = triton.cdiv(triton.cdiv(L, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return splits, chunk


def xcd_count() -> int:
    """Dies of the current GPU that take workgroups round-robin with an L2 each: 8 on MI300 (gfx942) and MI355X
    (gfx950) — AMD CDNA3 / CDNA4 white papers — else 1 (NVIDIA GPUs, the interpreter)."""
    t = current_target()
    return 8 if t.backend == "hip" and t.arch.startswith(("gfx942", "gfx950")) else 1


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float,
               gate: torch.Tensor | None = None, kv_scale: float | None = None, out: torch.Tensor | None = None,
               config: dict | None = None, num_splits: int | None = None,
               max_context_len: int | None = None, total_context_tokens: int | None = None,
               num_xcd: int | None = None) -> torch.Tensor:
    """Triton absorbed MLA decode; same contract as :func:`k3rocm.model.mla.mla_decode`.

    Args (beyond the oracle's):
        out: optional preallocated ``[N, Tq, H, Dv]``; default dtype ``q_nope.dtype``.
        config: one entry of ``DECODE_CONFIGS[backend]`` (default: tuned pick).
        num_splits: force the number of context splits (default: :func:`num_splits_for`).
        max_context_len: the batch's longest context (or an upper bound, as under graph capture);
            total_context_tokens: the sum of the contexts. Passing both avoids device->host reads (without the
            total, ``N * max_context_len`` plans the splits). They only fix the number of splits: each
            sequence's slice boundaries come from its real length, read on the device (a split kernel
            program cuts ``context_lens[n]`` into ``num_splits`` slices of whole 64-token units, at least
            ``MIN_SPLIT_TOKENS`` unless ``num_splits`` is forced), so a graph captured at one bound replays
            correctly and evenly at any lengths below it.
        num_xcd: dies that take workgroups round-robin, each with its own L2 (:func:`xcd_count`: 8 on gfx942 /
            gfx950, else 1). Above 1 the split kernel runs on a linear grid that puts the head groups of one
            context slice on one die (the same values, only the program order differs).
    Returns:
        o ``[N, Tq, H, Dv]``.
    Raises:
        ConfigError: inconsistent widths, non-contiguous cache rows, or a scale that is not positive. Any rank / rope width / head count
            runs (widths padded to :func:`~k3rocm.kernels.mla.prefill.pad_dim` in the kernel and masked).
    """
    N, Tq, H, Dn = q_nope.shape
    Dr = q_rope.shape[-1]
    R = w_kc.shape[-1]
    Dv = w_vc.shape[-1]
    nb, page, W = kv_cache.shape
    if W != R + Dr or tuple(w_kc.shape) != (H, Dn, R) or tuple(w_vc.shape[:2]) != (H, R) \
            or tuple(q_rope.shape[:3]) != (N, Tq, H):
        raise ConfigError(f"mla_decode: cache width {W}, w_kc {tuple(w_kc.shape)}, w_vc {tuple(w_vc.shape)}, "
                          f"q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)} are inconsistent")
    if R < 1 or Dr < 1:
        raise ConfigError(f"mla_decode: kv_lora_rank {R} and qk_rope_head_dim {Dr} must be at least 1")
    if not scale > 0 or (kv_scale is not None and not kv_scale > 0):
        raise ConfigError(f"mla_decode: softmax scale {scale} and kv_scale {kv_scale} must be positive")
    if kv_cache.stride(-1) != 1:
        raise ConfigError("mla_decode: kv_cache rows must be contiguous")
    if out is None:
        out = torch.empty(N, Tq, H, Dv, dtype=q_nope.dtype, device=q_nope.device)
    if N == 0:
        return out
    fp8 = _tl_fp8_ok(kv_cache.dtype)
    cdt = torch.bfloat16 if fp8 else kv_cache.dtype  # dot operand dtype
    # absorption on the query side: [H, N*Tq, Dn] @ [H, Dn, R]
    qn = q_nope.reshape(N * Tq, H, Dn).transpose(0, 1).to(cdt)
    q_lat = torch.bmm(qn, w_kc.to(cdt)).view(H, N, Tq, R)  # strides (n, t, h) below
    q_r = q_rope.to(cdt)
    if q_r.stride(-1) != 1:
        q_r = q_r.contiguous()
    wv = w_vc.to(cdt).contiguous()
    rows = Tq * H
    cl = context_lens.to(torch.int32)
    bt = block_table.to(torch.int32)
    if max_context_len is None:
        max_context_len = int(cl.max())
        if total_context_tokens is None:
            total_context_tokens = int(cl.sum())
    total = total_context_tokens if total_context_tokens is not None else N * max_context_len
    if gate is not None:
        gate = gate.reshape(N, Tq, H * Dv)
        if gate.stride(-1) != 1:
            gate = gate.contiguous()
    gt = gate if gate is not None else out.view(N, Tq, H * Dv)
    n_sm = 1 if current_target().backend == "interpreter" else multiprocessors(q_nope.device)
    min_chunk = MIN_SPLIT_TOKENS if num_splits is None else SPLIT_ALIGN

    def plan(block_h: int) -> tuple[int, int]:
        """(splits, chunk) for head groups of ``block_h`` rows (the grid's program count depends on it)."""
        if num_splits is not None:  # the caller's count: every sequence cut into that many slices of >= 64 tokens
            sp = max(1, int(num_splits))
            return sp, triton.cdiv(triton.cdiv(max(max_context_len, 1), sp), SPLIT_ALIGN) * SPLIT_ALIGN
        return num_splits_for(max_context_len, total, N, rows, R, n_sm, block_h=block_h)

    fold = float(kv_scale) if (fp8 and kv_scale is not None) else 1.0
    qk_scale = float(scale) * LOG2E * fold
    bufs: dict = {}

    def launch(cfg: dict) -> None:
        meta, opts = tune.split(cfg)
        splits, _chunk = plan(meta["BLOCK_H"])
        part = torch.empty(splits, N, rows, R, dtype=torch.float32, device=q_nope.device)
        lse = torch.empty(splits, N, rows, dtype=torch.float32, device=q_nope.device)
        bufs.update(part=part, lse=lse, splits=splits)
        groups = triton.cdiv(rows, meta["BLOCK_H"])
        if xcd > 1 and groups > 1:
            # the XCD order only pays when several head groups share a slice (the counts are runtime ints)
            grid = (xcd * groups * triton.cdiv(splits * N, xcd),)
            order = dict(XCD=xcd)
        else:
            grid = (groups, splits, N)
            order = {}
        _interp.launch(_mla_decode_split_kernel, grid,
            q_lat, q_r, kv_cache, bt, cl, part, lse,
            q_lat.stride(1), q_lat.stride(2), q_lat.stride(0), q_r.stride(0), q_r.stride(1), q_r.stride(2),
            kv_cache.stride(0), kv_cache.stride(1), bt.stride(0),
            H, Tq, rows, N, min_chunk, groups, splits, qk_scale, fold,
            R=R, DR=Dr, BR=pad_dim(R), BDR=pad_dim(Dr), PAGE=page, IS_FP8=fp8, **order, **meta, **opts)

    xcd = xcd_count() if num_xcd is None else max(1, int(num_xcd))
    if config is None:
        # every count in the key is a power-of-two bucket: a new batch size, head count or context length
        # reuses the tuned pick instead of timing while serving
        splits, chunk = plan(16)
        key = (tune.pow2(rows), R, Dr, page, kv_cache.dtype, tune.pow2(splits), tune.pow2(chunk), tune.pow2(N))
        config = tune.pick("mla_decode", key, tune.configs(DECODE_CONFIGS), launch)
    launch(config)
    meta, opts = tune.split(tune.configs(REDUCE_CONFIGS)[0])
    meta["BLOCK_R"] = min(meta["BLOCK_R"], pad_dim(R))
    _interp.launch(_mla_decode_merge_kernel, (H, triton.cdiv(N * Tq, meta["BLOCK_M"])),
        bufs["part"], bufs["lse"], wv, gt, out, H, Tq, rows, N, bufs["splits"],
        wv.stride(0), wv.stride(1), gt.stride(0), gt.stride(1), out.stride(0), out.stride(1), out.stride(2),
        R=R, DV=Dv, BDV=tune.pow2(Dv), HAS_GATE=gate is not None, **meta, **opts)
    return out
