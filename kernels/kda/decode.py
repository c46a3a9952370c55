"""Triton fused KDA decode: one token per sequence, states in slot pools. Oracle: ``k3rocm.model.kda.kda_decode``.

Two launches, no block barrier in either:

1. ``_step_kernel``, one program per (row, head, BV columns of the state): the short conv of q/k (all K
   channels) and of its BV v channels with the row's saved window (read only), SiLU, L2 norm of q and k, the
   q scale, the gate ``lb * sigmoid(exp(A_log[h]) (raw + dt_bias))``, ``beta = sigmoid(beta_raw)``, the
   state step ``S <- diag(e^g) S; S <- S + beta k (v - S^T k)^T`` on its fp32 ``[K, BV]`` tile of
   ``state_pool[slot, h]`` (columns of S are independent in the delta rule; each element is loaded and
   stored by the one thread that owns it), and the raw ``o = S^T q`` with its sum of squares, both fp32.
2. ``_finish_kernel``, one program per (row, head): the gated per-head RMSNorm
   ``rms_norm(o) * o_norm.weight * sigmoid(gate_raw)`` (K3_FACTS §5; the tile sums added in a fixed order),
   and the conv-window shift of the row's q, k, v channels, after every step program has read the window.
   Its channels lie along a 1-D layout at least as wide as the threads of its one warp, so each channel's
   window is read and rewritten by one thread only.

A padding row (slot id < 0) loads nothing, stores nothing but zeros into its output row. No host
synchronisation, no data-dependent allocation: safe under CUDA / HIP graph capture.
"""

from __future__ import annotations

import torch
import triton.language as tl

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune

from . import configs as C

#: launch options of the finishing kernel: one warp (its channel layout relies on it)
FINISH_OPTS = dict(num_warps=1)


@_interp.kjit
def _conv_read(xr, wt, pool, n, slot, ch, valid, NCH, which: tl.constexpr, W: tl.constexpr):
    """SiLU(conv) of one token for channels ``ch`` with the slot's saved inputs (the window is only read)."""
    m = (valid + 0 * ch) > 0  # vector mask (the interpreter rejects a scalar mask on a vector load)
    x = tl.load(xr + n.to(tl.int64) * NCH + ch, mask=m, other=0.0).to(tl.float32)
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    acc = x * tl.load(wt + ch * W + (W - 1)).to(tl.float32)
    for j in tl.static_range(0, W - 1):
        acc += tl.load(pool + base + j, mask=m, other=0.0) * tl.load(wt + ch * W + j).to(tl.float32)
    return acc * tl.sigmoid(acc)


@_interp.kjit
def _shift(xr, pool, n, slot, ch, m, NCH, which: tl.constexpr, W: tl.constexpr):
    """The slot's window for channels ``ch`` moves one step: positions 1.. move down, the token's input last."""
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    nxt = tl.load(xr + n.to(tl.int64) * NCH + ch, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 2, -1, -1):  # read position j, write position j what came after it
        cur = tl.load(pool + base + j, mask=m, other=0.0)
        tl.store(pool + base + j, nxt, mask=m)
        nxt = cur


@_interp.kjit
def _step_kernel(q_raw, k_raw, v_raw, d_raw, b_raw, wq, wk, wv, A_log, dt_bias, conv_pool, state_pool, slot_ids,
                 oraw, ssq, H, scale, lower_bound,
                 K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BV: tl.constexpr):
    n = tl.program_id(0)
    hh = tl.program_id(1)
    vb = tl.program_id(2)
    slot_raw = tl.load(slot_ids + n)
    valid = (slot_raw >= 0).to(tl.int32)
    slot = tl.maximum(slot_raw, 0)
    offs_k = tl.arange(0, K)
    offs_b = vb * BV + tl.arange(0, BV)
    NCH = H * K
    ck = hh * K + offs_k
    q = _conv_read(q_raw, wq, conv_pool, n, slot, ck, valid, NCH, 0, W)
    k = _conv_read(k_raw, wk, conv_pool, n, slot, ck, valid, NCH, 1, W)
    v = _conv_read(v_raw, wv, conv_pool, n, slot, hh * V + offs_b, valid, NCH, 2, W)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    raw = tl.load(d_raw + n.to(tl.int64) * NCH + ck, mask=(valid + 0 * ck) > 0, other=0.0).to(tl.float32)
    a_h = tl.exp(tl.load(A_log + hh).to(tl.float32))
    g = lower_bound * tl.sigmoid(a_h * (raw + tl.load(dt_bias + ck).to(tl.float32)))
    beta = tl.sigmoid(tl.load(b_raw + n.to(tl.int64) * H + hh).to(tl.float32))
    sp = state_pool + ((slot.to(tl.int64) * H + hh) * K + offs_k[:, None]) * V + offs_b[None, :]
    smask = (valid + 0 * offs_k[:, None] + 0 * offs_b[None, :]) > 0
    S = tl.load(sp, mask=smask, other=0.0)
    S = S * tl.exp(g)[:, None]
    pred = tl.sum(S * k[:, None], 0)
    S += k[:, None] * (beta * (v - pred))[None, :]
    ob = tl.sum(S * q[:, None], 0)
    tl.store(sp, S, mask=smask)
    tl.store(oraw + n.to(tl.int64) * (H * V) + hh * V + offs_b, ob)
    tl.store(ssq + (n.to(tl.int64) * H + hh) * (V // BV) + vb, tl.sum(ob * ob, 0))


@_interp.kjit
def _finish_kernel(q_raw, k_raw, v_raw, g_raw, onw, conv_pool, slot_ids, oraw, ssq, out, H, eps,
                   K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, NVB: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(0)
    hh = tl.program_id(1)
    slot_raw = tl.load(slot_ids + n)
    valid = (slot_raw >= 0).to(tl.int32)
    slot = tl.maximum(slot_raw, 0)
    offs_v = tl.arange(0, V)
    cv = hh * V + offs_v
    rstd = tl.rsqrt(tl.sum(tl.load(ssq + (n.to(tl.int64) * H + hh) * NVB + tl.arange(0, NVB)), 0) / V + eps)
    o = tl.load(oraw + n.to(tl.int64) * (H * V) + cv)
    gr = tl.load(g_raw + n.to(tl.int64) * (H * V) + cv, mask=(valid + 0 * cv) > 0, other=0.0).to(tl.float32)
    y = o * rstd * tl.load(onw + offs_v).to(tl.float32)
    y = tl.where((valid + 0 * cv) > 0, y * tl.sigmoid(gr), 0.0)
    tl.store(out + n.to(tl.int64) * (H * V) + cv, y.to(out.dtype.element_ty))
    c = tl.arange(0, BC)
    NCH = H * K
    mk = ((valid + 0 * c) > 0) & (c < K)
    mv = ((valid + 0 * c) > 0) & (c < V)
    _shift(q_raw, conv_pool, n, slot, hh * K + c, mk, NCH, 0, W)
    _shift(k_raw, conv_pool, n, slot, hh * K + c, mk, NCH, 1, W)
    _shift(v_raw, conv_pool, n, slot, hh * V + c, mv, NCH, 2, W)


def kda_decode(q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw, conv_weights, A_log, dt_bias, o_norm_weight,
               conv_pool, state_pool, slot_ids, eps, scale=None, lower_bound=-5.0, out: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32, config: dict | None = None):
    """Triton fused KDA decode step; contract of :func:`k3rocm.model.kda.kda_decode`.

    Extra args: ``out`` (preallocated ``[N, H*V]`` output, for graph capture), ``out_dtype`` (fp32 by contract),
    ``config`` (one entry of ``configs("decode")`` to force; default: :func:`k3rocm.kernels.tune.pick` keyed
    on ``pow2(N)`` and the head shape, timed once per key on scratch pools of N slots (never on the caller's
    pools, which are advanced exactly once per call); during graph capture, with ``K3ROCM_TUNE=0`` or under
    the interpreter before a key is timed: the first config).
    Returns ``o [N, H*V]``. Raises ConfigError on shape mismatch (before any launch).
    Pools must be contiguous fp32 (they are updated in place); slot ids of valid rows must be distinct.
    """
    N = q_raw.shape[0]
    S_, H, K, V = state_pool.shape
    NCH = H * K
    if K != V or q_raw.shape != (N, NCH) or k_raw.shape != (N, NCH) or v_raw.shape != (N, H * V):
        raise ConfigError(f"kda_decode (triton): q/k/v_raw {tuple(q_raw.shape)} / {tuple(v_raw.shape)} must be "
                          f"[N, H*K] with K == V (state_pool {tuple(state_pool.shape)})")
    W = conv_weights[0].shape[-1]
    if conv_pool.shape[1:] != (3, NCH, W - 1) or not conv_pool.is_contiguous() or not state_pool.is_contiguous():
        raise ConfigError(f"kda_decode (triton): conv_pool {tuple(conv_pool.shape)} must be contiguous "
                          f"[S, 3, {NCH}, {W - 1}] and state_pool contiguous")
    if conv_pool.dtype != torch.float32 or state_pool.dtype != torch.float32:
        raise ConfigError("kda_decode (triton): conv_pool and state_pool must be fp32")
    if K & (K - 1):
        raise ConfigError(f"kda_decode (triton): head dim {K} must be a power of two")
    scale = K ** -0.5 if scale is None else float(scale)
    dev = q_raw.device
    if out is None:
        out = C.empty(N, H * V, dtype=out_dtype, device=dev)
    if N == 0:
        return out
    ws = [w.reshape(-1, W) if w.is_contiguous() and w.dtype == torch.float32 else w.reshape(-1, W).float().contiguous()
          for w in conv_weights]
    xs = [t.contiguous() for t in (q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw)]
    oraw = C.empty(N, H * V, dtype=torch.float32, device=dev)

    def launch(cfg, cp, sp, sid):
        meta, opts = tune.split(cfg)
        bv = min(meta.get("BV", V), V)
        ssq = C.empty(N, H, V // bv, dtype=torch.float32, device=dev)
        _interp.launch(_step_kernel, (N, H, V // bv), *xs[:5], ws[0], ws[1], ws[2], A_log, dt_bias, cp, sp, sid,
                       oraw, ssq, H, scale, float(lower_bound), K=K, V=V, W=W, BV=bv, **opts)
        # one warp; at least 64 channel lanes so that no channel is held by two threads (see the module notes)
        _interp.launch(_finish_kernel, (N, H), xs[0], xs[1], xs[2], xs[5], o_norm_weight, cp, sid, oraw, ssq, out,
                       H, float(eps), K=K, V=V, W=W, NVB=V // bv, BC=max(K, 64), **tune.split(FINISH_OPTS)[1])

    scratch = []

    def timed(c):  # on scratch pools of N slots, made only when timing runs: the caller's states never move
        if not scratch:
            scratch.extend((torch.zeros(N, 3, NCH, W - 1, device=dev), torch.zeros(N, H, K, V, device=dev),
                            torch.arange(N, dtype=torch.int32, device=dev)))
        launch(c, *scratch)

    # bounded specialisation: the row count enters the key as a power of two
    cfg = dict(config) if config is not None else tune.pick(
        "kda_decode", (tune.pow2(N), H, K, V, W, q_raw.dtype), tune.configs(C.DECODE), timed)
    launch(cfg, conv_pool, state_pool, slot_ids)
    return out
