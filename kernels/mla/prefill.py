"""MLA prefill: causal flash attention (varlen, bottom-right aligned) with a shared k_rope and Dv != Dq.

score = (q[:, :Dn] . k_nope + q[:, Dn:] . k_rope) * scale (K3_FACTS §5: scale = 192^-0.5); the 64 rope
dims of the key are one ``[Tk, Dr]`` tensor shared by all heads, so the kernel reads them once per key
tile instead of materialising a 192-wide per-head key. Online softmax in fp32 (Dao et al., FlashAttention-2,
in base 2); v keeps its own width (128), no padding to 192. Optional fused output gate
``o *= sigmoid(gate)`` (gate = ``g_proj(x)``) in the epilogue.

Oracle: :func:`k3rocm.model.mla.mla_prefill`.
"""

from __future__ import annotations

from functools import partial

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune
from k3rocm.numerics import gather_cache

LOG2E = 1.4426950408889634

#: per-backend configs (the only place vendor knobs live)
PREFILL_CONFIGS: dict[str, list[dict]] = {
    "cuda": [
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=4),
    ],
    # chosen from AOT compiles with the JIT's divisibility hints: no VGPR/SGPR spills on gfx950 and gfx942
    # (128x64 spills one VGPR on gfx942)
    "hip": [
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=1, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
        # two stages: spill-free on both at BLOCK_N 32 (at BLOCK_N 64, gfx942 spills two VGPRs)
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=1),
    ],
    "interpreter": [
        dict(BLOCK_M=16, BLOCK_N=16),
        dict(BLOCK_M=32, BLOCK_N=16),
    ],
}


@_interp.kjit
def load_cols(ptrs, col_ok, DENSE: tl.constexpr):
    """Load a tile whose head-dim lanes are all real (``DENSE``: no mask) or padded (masked, 0 outside)."""
    if DENSE:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=col_ok, other=0.0)


# compiled mode (as _interp.kjit); the per-call counts are not specialised on (== 1, % 16), so a new
# batch size, length or bank depth never compiles while serving
@partial(JITFunction, do_not_specialize=("num_m_blocks",))
def _mla_prefill_kernel(
    Q, KN, KR, V, O, G, CUQ, CUK,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_krt, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_gt, stride_gh,
    qk_scale, num_m_blocks,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    BDN: tl.constexpr, BDR: tl.constexpr, BDV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GATE: tl.constexpr, I64: tl.constexpr,
):
    # head dims are padded to BD* (powers of two >= 16, what tl.dot and tl.arange need); the padded lanes
    # load as 0, add nothing to the scores and are never stored. With BD* == D* the masks are all-true
    # constants and fold away.
    # heavy (late) query blocks first: causal work grows with the block index
    pid_m = num_m_blocks - 1 - tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(CUQ + n)
    lq = tl.load(CUQ + n + 1) - q0
    k0 = tl.load(CUK + n)
    lk = tl.load(CUK + n + 1) - k0
    m_start = pid_m * BLOCK_M
    if m_start >= lq:
        return
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dn = tl.arange(0, BDN)
    dr = tl.arange(0, BDR)
    dv = tl.arange(0, BDV)
    dn_ok = dn < DN
    dr_ok = dr < DR
    dv_ok = dv < DV
    m_ok = offs_m < lq
    q_base = Q + (q0 + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh
    qn = tl.load(q_base + dn[None, :], mask=m_ok[:, None] & dn_ok[None, :], other=0.0)
    qr = tl.load(q_base + DN + dr[None, :], mask=m_ok[:, None] & dr_ok[None, :], other=0.0)

    diag = lk - lq  # query j sees keys 0 .. diag + j
    m_last = tl.minimum(m_start + BLOCK_M, lq) - 1
    hi = tl.minimum(lk, diag + m_last + 1)
    lo = tl.maximum(diag + m_start + 1, 0)
    lo = tl.minimum((lo // BLOCK_N) * BLOCK_N, tl.maximum(hi, 0))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    kn_base = KN + h * stride_knh
    v_base = V + h * stride_vh
    # keys every row of the block sees: no causal mask
    for start in range(0, lo, BLOCK_N):
        kt = k0 + start + offs_n
        if I64:
            kt = kt.to(tl.int64)
        kn = load_cols(kn_base + kt[None, :] * stride_knt + dn[:, None], dn_ok[:, None], BDN == DN)
        kr = load_cols(KR + kt[None, :] * stride_krt + dr[:, None], dr_ok[:, None], BDR == DR)
        s = tl.dot(qr, kr, tl.dot(qn, kn))  # one accumulator for both parts
        # the scale is folded into the exponent (one fma per score): m_i is kept in scaled units
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = load_cols(v_base + kt[:, None] * stride_vt + dv[None, :], dv_ok[None, :], BDV == DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    # the diagonal band: causal + length mask; out-of-range keys are clamped to the last valid one (real,
    # finite data) and masked in the scores, so the loads need no per-lane masks (fewer AMD SGPRs)
    for start in range(lo, hi, BLOCK_N):
        kidx = start + offs_n
        k_ok = kidx < hi
        kt = k0 + tl.minimum(kidx, hi - 1)
        if I64:
            kt = kt.to(tl.int64)
        kn = load_cols(kn_base + kt[None, :] * stride_knt + dn[:, None], dn_ok[:, None], BDN == DN)
        kr = load_cols(KR + kt[None, :] * stride_krt + dr[:, None], dr_ok[:, None], BDR == DR)
        s = tl.dot(qr, kr, tl.dot(qn, kn))  # one accumulator for both parts
        vis = k_ok[None, :] & (kidx[None, :] <= (diag + offs_m)[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0: -inf stays -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = load_cols(v_base + kt[:, None] * stride_vt + dv[None, :], dv_ok[None, :], BDV == DV)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    row = (q0 + offs_m).to(tl.int64)
    st_mask = m_ok[:, None] & dv_ok[None, :]
    if HAS_GATE:
        grow = (q0 + tl.minimum(offs_m, lq - 1)).to(tl.int64)  # clamped rows: no row mask
        g = load_cols(G + grow[:, None] * stride_gt + h * stride_gh + dv[None, :], dv_ok[None, :],
                       BDV == DV).to(tl.float32)
        out = out * tl.sigmoid(g)
    tl.store(O + row[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(O.dtype.element_ty), mask=st_mask)


def mla_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                gate: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: dict | None = None, max_seqlen_q: int | None = None) -> torch.Tensor:
    """Triton MLA prefill; same contract as :func:`k3rocm.model.mla.mla_prefill`.

    Args (beyond the oracle's):
        gate: optional ``[Tq, H*Dv]`` / ``[Tq, H, Dv]`` raw ``g_proj(x)``, fused as ``o * sigmoid(gate)``.
        out: optional preallocated ``[Tq, H, Dv]`` output (its dtype is kept); default ``q.dtype``.
        config: one entry of ``PREFILL_CONFIGS[backend]`` (default: tuned pick).
        max_seqlen_q: longest query segment (avoids a device->host read of cu_seqlens_q).
    Returns:
        o ``[Tq, H, Dv]`` in ``q.dtype`` (or ``out``'s).
    Raises:
        ConfigError: inconsistent shapes, a head dim below 1, or a scale that is not positive. Any other head
            dims run: they are padded to :func:`pad_dim` inside the kernel and masked.
    """
    Tq, H, Dq = q.shape
    Tk, _, Dn = k_nope.shape
    Dr = k_rope.shape[1]
    Dv = v.shape[2]
    if Dq != Dn + Dr or k_nope.shape[1] != H or tuple(v.shape[:2]) != (Tk, H) or k_rope.shape[0] != Tk:
        raise ConfigError(f"mla_prefill: q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, k_rope {tuple(k_rope.shape)}, "
                          f"v {tuple(v.shape)} are inconsistent; expect q [Tq,H,Dn+Dr], k_nope [Tk,H,Dn], k_rope [Tk,Dr]")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ConfigError("mla_prefill: cu_seqlens_q and cu_seqlens_k describe different numbers of sequences")
    for name, t in (("q", q), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
        if t.stride(-1) != 1:
            raise ConfigError(f"mla_prefill: {name} must have a contiguous last dim; call .contiguous()")
    for name, d in (("qk_nope_head_dim", Dn), ("qk_rope_head_dim", Dr), ("v_head_dim", Dv)):
        if d < 1:
            raise ConfigError(f"mla_prefill: {name}={d} must be at least 1")
    if not scale > 0:
        raise ConfigError(f"mla_prefill: softmax scale {scale} must be positive (the kernel folds it into exp2)")
    N = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.empty(Tq, H, Dv, dtype=q.dtype, device=q.device)
    if Tq == 0 or N == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if gate is not None:
        gate = gate.reshape(Tq, H, Dv)
        if gate.stride(-1) != 1:
            gate = gate.contiguous()
    g = gate if gate is not None else out
    cuq = cu_seqlens_q.to(torch.int32)
    cuk = cu_seqlens_k.to(torch.int32)
    qk_scale = float(scale) * LOG2E
    # int32 key offsets unless a key/value tensor spans more than 2^31 elements
    big = max(k_nope.stride(0) * Tk, v.stride(0) * Tk, k_rope.stride(0) * Tk) >= 2 ** 31

    def launch(cfg: dict) -> None:
        meta, opts = tune.split(cfg)
        nmb = triton.cdiv(max(max_seqlen_q, 1), meta["BLOCK_M"])
        _interp.launch(_mla_prefill_kernel, (nmb, N, H),
            q, k_nope, k_rope, v, out, g, cuq, cuk,
            q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_rope.stride(0), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), g.stride(0), g.stride(1),
            qk_scale, nmb,
            DN=Dn, DR=Dr, DV=Dv, BDN=pad_dim(Dn), BDR=pad_dim(Dr), BDV=pad_dim(Dv),
            HAS_GATE=gate is not None, I64=big, **meta, **opts)

    if config is None:
        configs = tune.configs(PREFILL_CONFIGS)
        key = (H, Dn, Dr, Dv, q.dtype, tune.pow2(max_seqlen_q), gate is not None)
        config = tune.pick("mla_prefill", key, configs, launch)
    launch(config)
    return out


def pad_dim(d: int) -> int:
    """Width a head dimension ``d`` is padded to inside the attention kernels: the next power of two, >= 16."""
    return max(16, tune.pow2(d))


def isa_signature(dtype: str = "bf16", has_gate: bool = False, cfg: dict | None = None,
                  dn: int = 128, dr: int = 64, dv: int = 128):
    """(signature, constexprs, options-by-backend) of the prefill kernel (for ``kernels isa``); default K3's
    head dims (128 / 64 / 128), others for the padded-dim compiles."""
    cfg = cfg or dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3)  # spill-free on all three targets
    p = "*" + dtype
    sig = {"Q": p, "KN": p, "KR": p, "V": p, "O": p, "G": p, "CUQ": "*i32", "CUK": "*i32"}
    # The JIT specialises integer arguments divisible by 16, which lets it vectorise the row loads; an
    # ahead-of-time signature has no such hint, so the strides are given as the K3 TP8 values (12 heads of
    # contiguous [T, H, D] tensors) to compile what a real launch compiles.
    H = 12
    dq = dn + dr
    strides = dict(stride_qt=H * dq, stride_qh=dq, stride_knt=H * dn, stride_knh=dn, stride_krt=dr,
                   stride_vt=H * dv, stride_vh=dv, stride_ot=H * dv, stride_oh=dv, stride_gt=H * dv,
                   stride_gh=dv)
    sig["qk_scale"] = "fp32"
    sig["num_m_blocks"] = "i32"
    consts = dict(strides, DN=dn, DR=dr, DV=dv, BDN=pad_dim(dn), BDR=pad_dim(dr), BDV=pad_dim(dv), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  HAS_GATE=has_gate, I64=False)
    for k in consts:
        sig[k] = "constexpr"
    hip = dict(PREFILL_CONFIGS["hip"][0])  # same tile as the default cfg
    opts = {"cuda": {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
            "hip": {k: hip[k] for k in tune.LAUNCH_KEYS if k in hip} | {"num_warps": cfg["num_warps"]}}
    return sig, consts, opts


def default_scale(qk_nope_head_dim: int, qk_rope_head_dim: int) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` (K3_FACTS §5: 192^-0.5)."""
    return 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)


def expand_cached_context(kv_cache: torch.Tensor, block_table: torch.Tensor, cached_lens: list[int],
                          w_kc: torch.Tensor, w_vc: torch.Tensor, kv_scale: float | None = None, dtype=None):
    """Keys and values of the context already in the paged latent cache, expanded through ``kv_b``.

    Returns ``(k_nope [sum(cached), H, Dn], k_rope [sum(cached), Dr], v [sum(cached), H, Dv])`` in ``dtype``
    (default: ``w_kc.dtype``), sequence after sequence: k_nope = W_kc latent, v = W_vc^T latent (K3_FACTS §5).
    """
    H, Dn, R = w_kc.shape
    dtype = dtype or w_kc.dtype
    rows = [gather_cache(kv_cache, block_table, int(L), n, kv_scale) for n, L in enumerate(cached_lens) if L > 0]
    if not rows:
        e = kv_cache.new_zeros
        return (e(0, H, Dn, dtype=dtype), e(0, kv_cache.shape[2] - R, dtype=dtype),
                e(0, H, w_vc.shape[2], dtype=dtype))
    lat_all = torch.cat(rows).to(dtype)
    lat, kr = lat_all[:, :R], lat_all[:, R:]
    k_nope = torch.bmm(w_kc.to(dtype), lat.t()[None].expand(H, R, lat.shape[0])).permute(2, 0, 1)
    v = torch.bmm(lat[None].expand(H, lat.shape[0], R), w_vc.to(dtype)).permute(1, 0, 2)
    return k_nope.contiguous(), kr.contiguous(), v.contiguous()


def mla_prefill_chunked(q: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        cached_lens: list[int], w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float,
                        gate: torch.Tensor | None = None, kv_scale: float | None = None) -> torch.Tensor:
    """Chunked prefill: each sequence's chunk queries attend to its context already in the latent cache plus
    the chunk itself (causal, bottom-right aligned).

    Args:
        q: ``[Tq, H, Dn+Dr]``; k_nope/k_rope/v: the chunk's own keys/values (``[Tq, H, Dn]``, ``[Tq, Dr]``,
            ``[Tq, H, Dv]``); cu_seqlens_q: int32 ``[N+1]`` over the chunks.
        kv_cache, block_table: the paged latent cache; cached_lens: tokens of each sequence already cached
            (before this chunk). w_kc/w_vc: absorbed ``kv_b`` factors (:func:`k3rocm.model.mla.split_kv_b`).
    Returns:
        o ``[Tq, H, Dv]`` (as :func:`mla_prefill`).
    """
    ck, cr, cv = expand_cached_context(kv_cache, block_table, cached_lens, w_kc, w_vc, kv_scale, q.dtype)
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    kn_parts, kr_parts, v_parts, lk = [], [], [], []
    off = 0
    for n, L in enumerate(cached_lens):
        a, b = cq[n], cq[n + 1]
        kn_parts += [ck[off:off + L], k_nope[a:b]]
        kr_parts += [cr[off:off + L], k_rope[a:b]]
        v_parts += [cv[off:off + L], v[a:b]]
        lk.append(L + b - a)
        off += L
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0).tolist()), dtype=torch.int32, device=q.device)
    return mla_prefill(q, torch.cat(kn_parts), torch.cat(kr_parts), torch.cat(v_parts), cu_seqlens_q, cu_k, scale,
                       gate=gate)
