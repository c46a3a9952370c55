"""Triton fused KDA decode: one token per sequence, states in slot pools. Oracle: ``k3rocm.model.kda.kda_decode``.

One launch, one program per (row, head, BV columns of the state); ``NVB = V / BV`` programs per (row, head):

* every program: the short conv of q / k (all K channels) and of its BV v channels with the row's saved window
  (only read here), SiLU, L2 norm of q and k, the q scale, the gate ``lb * sigmoid(exp(A_log[h]) (raw +
  dt_bias))``, ``beta = sigmoid(beta_raw)``, the state step ``S <- diag(e^g) S; S <- S + beta k (v - S^T k)^T``
  on its fp32 ``[K, BV]`` tile of ``state_pool[slot, h]`` (columns of S are independent in the delta rule; the
  tile is read first, so its latency overlaps the conv and gate work) and the raw ``o = S^T q``.
* the finish, by one program per (row, head): the gated per-head RMSNorm ``rms_norm(o) * o_norm.weight *
  sigmoid(gate_raw)`` (K3_FACTS §5) and the conv-window shift of the row's q, k, v channels. With ``NVB = 1``
  it is the program itself, with ``o`` still in registers. With ``NVB > 1`` the tiles leave their raw ``o``
  and its sum of squares in scratch and count themselves in on a per-(row, head) counter (acquire-release
  atomic); the last to arrive finishes (the tile sums added in tile order, so the result does not depend on
  which one that is). Only the finishing program writes the window, after every program of its (row, head)
  has read it; it reads every position it needs into registers, passes one block barrier, then writes, so
  threads that hold the same channel write the same values.

A padding row (slot id < 0) loads nothing, stores nothing but zeros into its output row. No host
synchronisation, no data-dependent allocation: safe under CUDA / HIP graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune

from . import configs as C


@_interp.kjit
def _conv_read(xr, wt, pool, n, slot, ch, valid, NCH, which: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """SiLU(conv) of one token for channels ``ch`` with the slot's saved inputs (the window is only read).
    The window is one ``[channels, WP]`` load (WP: W - 1 rounded up to a power of two, masked)."""
    m = (valid + 0 * ch) > 0  # vector mask (the interpreter rejects a scalar mask on a vector load)
    j = tl.arange(0, WP)
    mj = (j < W - 1)[None, :]
    x = tl.load(xr + n.to(tl.int64) * NCH + ch, mask=m, other=0.0).to(tl.float32)
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    win = tl.load(pool + base[:, None] + j[None, :], mask=m[:, None] & mj, other=0.0)
    wts = tl.load(wt + ch[:, None] * W + j[None, :], mask=mj, other=0.0).to(tl.float32)
    acc = x * tl.load(wt + ch * W + (W - 1)).to(tl.float32) + tl.sum(win * wts, 1)
    return acc * tl.sigmoid(acc)


@_interp.kjit
def _next_window(xr, pool, n, slot, ch, m, NCH, which: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """The slot's window for channels ``ch`` one step on, ``[channels, WP]``: positions 1.. moved down, the
    token's input last (read only; :func:`_store_window` writes it)."""
    j = tl.arange(0, WP)
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    nxt = tl.load(pool + base[:, None] + j[None, :] + 1, mask=m[:, None] & (j < W - 2)[None, :], other=0.0)
    x = tl.load(xr + n.to(tl.int64) * NCH + ch, mask=m, other=0.0).to(tl.float32)
    return tl.where((j == W - 2)[None, :], x[:, None], nxt)


@_interp.kjit
def _store_window(pool, win, slot, ch, m, NCH, which: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    j = tl.arange(0, WP)
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    tl.store(pool + base[:, None] + j[None, :], win, mask=m[:, None] & (j < W - 1)[None, :])


@_interp.kjit
def _finish(q_raw, k_raw, v_raw, g_raw, onw, conv_pool, out, n, hh, slot, valid, o, rstd, H,
            K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Gated RMSNorm of the (row, head)'s raw output ``o [V]`` (``rstd`` its reciprocal RMS), then the
    conv-window shift of the row's q, k, v channels (every read before one barrier, every write after)."""
    offs_v = tl.arange(0, V)
    cv = hh * V + offs_v
    mv = (valid + 0 * cv) > 0
    gr = tl.load(g_raw + n.to(tl.int64) * (H * V) + cv, mask=mv, other=0.0).to(tl.float32)
    y = o * rstd * tl.load(onw + offs_v).to(tl.float32)
    y = tl.where(mv, y * tl.sigmoid(gr), 0.0)
    tl.store(out + n.to(tl.int64) * (H * V) + cv, y.to(out.dtype.element_ty))
    NCH = H * K
    ck = hh * K + tl.arange(0, K)
    mk = (valid + 0 * ck) > 0
    wq = _next_window(q_raw, conv_pool, n, slot, ck, mk, NCH, 0, W, WP)
    wk = _next_window(k_raw, conv_pool, n, slot, ck, mk, NCH, 1, W, WP)
    wv = _next_window(v_raw, conv_pool, n, slot, cv, mv, NCH, 2, W, WP)
    tl.debug_barrier()  # every thread of this program has read the window before any position is rewritten
    _store_window(conv_pool, wq, slot, ck, mk, NCH, 0, W, WP)
    _store_window(conv_pool, wk, slot, ck, mk, NCH, 1, W, WP)
    _store_window(conv_pool, wv, slot, cv, mv, NCH, 2, W, WP)


@_interp.kjit
def _decode_kernel(q_raw, k_raw, v_raw, d_raw, b_raw, g_raw, wq, wk, wv, A_log, dt_bias, onw, conv_pool,
                   state_pool, slot_ids, oraw, ssq, count, out, H, scale, lower_bound, eps,
                   K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                   NVB: tl.constexpr):
    n = tl.program_id(0)
    hh = tl.program_id(1)
    vb = tl.program_id(2)
    slot_raw = tl.load(slot_ids + n)
    valid = (slot_raw >= 0).to(tl.int32)
    slot = tl.maximum(slot_raw, 0)
    offs_k = tl.arange(0, K)
    offs_b = vb * BV + tl.arange(0, BV)
    # int64 scalar base, int32 offsets in the [K, V] state (an int64 offset tile costs two registers an element)
    sp = state_pool + (slot.to(tl.int64) * H + hh) * (K * V) + (offs_k[:, None] * V + offs_b[None, :])
    smask = (valid + 0 * offs_k[:, None] + 0 * offs_b[None, :]) > 0
    S = tl.load(sp, mask=smask, other=0.0)  # first: the kernel's traffic, its latency hidden by what follows
    NCH = H * K
    ck = hh * K + offs_k
    q = _conv_read(q_raw, wq, conv_pool, n, slot, ck, valid, NCH, 0, W, WP)
    k = _conv_read(k_raw, wk, conv_pool, n, slot, ck, valid, NCH, 1, W, WP)
    v = _conv_read(v_raw, wv, conv_pool, n, slot, hh * V + offs_b, valid, NCH, 2, W, WP)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    raw = tl.load(d_raw + n.to(tl.int64) * NCH + ck, mask=(valid + 0 * ck) > 0, other=0.0).to(tl.float32)
    a_h = tl.exp(tl.load(A_log + hh).to(tl.float32))
    g = lower_bound * tl.sigmoid(a_h * (raw + tl.load(dt_bias + ck).to(tl.float32)))
    beta = tl.sigmoid(tl.load(b_raw + n.to(tl.int64) * H + hh).to(tl.float32))
    S = S * tl.exp(g)[:, None]
    pred = tl.sum(S * k[:, None], 0)
    S += k[:, None] * (beta * (v - pred))[None, :]
    ob = tl.sum(S * q[:, None], 0)
    tl.store(sp, S, mask=smask)
    if NVB == 1:
        _finish(q_raw, k_raw, v_raw, g_raw, onw, conv_pool, out, n, hh, slot, valid, ob,
                tl.rsqrt(tl.sum(ob * ob, 0) / V + eps), H, K, V, W, WP)
    else:
        nh = n.to(tl.int64) * H + hh
        tl.store(oraw + nh * V + offs_b, ob)
        tl.store(ssq + nh * NVB + vb, tl.sum(ob * ob, 0))
        tl.debug_barrier()  # this program's window reads and scratch writes precede its arrival
        if tl.atomic_add(count + nh, 1, sem="acq_rel") == NVB - 1:
            ss = tl.sum(tl.load(ssq + nh * NVB + tl.arange(0, NVB), volatile=True), 0)
            o = tl.load(oraw + nh * V + tl.arange(0, V), volatile=True)
            _finish(q_raw, k_raw, v_raw, g_raw, onw, conv_pool, out, n, hh, slot, valid, o,
                    tl.rsqrt(ss / V + eps), H, K, V, W, WP)


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
    wp = triton.next_power_of_2(max(W - 1, 1))

    def launch(cfg, cp, sp, sid):
        meta, opts = tune.split(cfg)
        bv = min(meta.get("BV", V), V)
        nvb = V // bv
        if nvb > 1:  # scratch of the tiled finish; the counters start at zero on every call
            oraw = C.empty(N, H, V, dtype=torch.float32, device=dev)
            ssq = C.empty(N, H, nvb, dtype=torch.float32, device=dev)
            count = torch.zeros(N, H, dtype=torch.int32, device=dev)
        else:
            oraw, ssq, count = ws[0], ws[0], sid  # unread placeholders of fixed types
        _interp.launch(_decode_kernel, (N, H, nvb), *xs, ws[0], ws[1], ws[2], A_log, dt_bias, o_norm_weight, cp, sp,
                       sid, oraw, ssq, count, out, H, scale, float(lower_bound), float(eps), K=K, V=V, W=W, WP=wp,
                       BV=bv, NVB=nvb, **opts)

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
