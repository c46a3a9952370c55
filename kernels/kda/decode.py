"""Triton fused KDA decode: one token per sequence, states in slot pools. Oracle: ``k3rocm.model.kda.kda_decode``.

One program per (row, head) fuses: the short conv of q/k/v with the row's conv state (and its in-place
update), SiLU, L2 norm of q and k, the q scale, the gate ``lb * sigmoid(exp(A_log[h]) (raw + dt_bias))``,
``beta = sigmoid(beta_raw)``, the state step ``S <- diag(e^g) S; S <- S + beta k (v - S^T k)^T`` on the fp32
``[K, V]`` state read from and written back to ``state_pool[slot, h]``, ``o = S^T q`` and the gated per-head
RMSNorm ``rms_norm(o) * o_norm.weight * sigmoid(gate_raw)`` (K3_FACTS §5).

The SPLIT configs run the same step in three launches, so the state traffic is spread over a
(V tile, row, head) grid with one ``[K, BV]`` tile per program (the layout of fla's recurrent kernel): a
per-(row, head) prologue (convs, window shifts, norms, gate, beta) writes fp32 ``[q, k, e^g, v]`` rows and
``[beta, q . k]``; the state launch steps each tile with both reductions over K taken from the loaded tile
(``o = (e^g q)^T S + (q . k) u``, :func:`_delta_step_one_round`); a last launch applies the gated norm. The
prologue is the windows' only writer, so no V tile reads a window another program is shifting.

A padding row (slot id < 0) loads nothing, stores nothing but zeros into its output row. No host
synchronisation, no data-dependent allocation (the SPLIT intermediates are sized by the call's shapes): safe
under CUDA / HIP graph capture.
"""

from __future__ import annotations

import torch
import triton.language as tl

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune

from . import configs as C


@_interp.kjit
def _conv_step(xr, sx, wt, pool, n, slot, ch, valid, NCH, which: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
               WIN: tl.constexpr):
    """SiLU(conv) of one token for channels ``ch`` with the slot's saved inputs; updates the conv state.

    The window is shifted in place. A channel's value can be held by several threads (``ch`` lives in a slice
    of a 2-D layout, replicated across the other dimension), so every thread must have read a position before
    any thread overwrites it. ``WIN`` 1: the ``W - 1`` saved inputs are loaded together as one ``[C, WP]`` tile,
    one barrier follows, then the shifted window is stored from registers. ``WIN`` 0: position by position,
    a barrier between each read and the store that shifts it down (``W - 1`` barriers). Without the barriers a
    fast thread feeds its neighbours the already-shifted window (wrong q/k/v on the GPU; the interpreter, which
    runs whole blocks at once, cannot show it)."""
    if WIN:
        x, win, base, y = _conv_read(xr, sx, wt, pool, n, slot, ch, valid, NCH, which, W, WP)
        tl.debug_barrier()  # every thread has read the whole window
        _conv_shift(pool, x, win, base, valid, W, WP)
        return y
    valid = (valid + 0 * ch) > 0  # vector mask (the interpreter rejects a scalar mask on a vector load)
    x = tl.load(xr + n.to(tl.int64) * sx + ch, mask=valid, other=0.0).to(tl.float32)
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    acc = x * tl.load(wt + ch * W + (W - 1)).to(tl.float32)
    prev = tl.load(pool + base, mask=valid, other=0.0)
    acc += prev * tl.load(wt + ch * W).to(tl.float32)
    for jj in tl.static_range(1, W - 1):
        cur = tl.load(pool + base + jj, mask=valid, other=0.0)
        acc += cur * tl.load(wt + ch * W + jj).to(tl.float32)
        tl.debug_barrier()  # every thread has read positions <= jj
        tl.store(pool + base + (jj - 1), cur, mask=valid)
    tl.debug_barrier()
    tl.store(pool + base + (W - 2), x, mask=valid)
    return acc * tl.sigmoid(acc)


@_interp.kjit
def _state_ptrs(state_pool, slot, hh, H, offs_k, cols, valid, K: tl.constexpr, V: tl.constexpr):
    """Pointers and mask of state columns ``cols`` of the slot's ``[K, V]`` head state."""
    sp = state_pool + ((slot.to(tl.int64) * H + hh) * K + offs_k[:, None]) * V + cols[None, :]
    smask = (valid + 0 * offs_k[:, None] + 0 * cols[None, :]) > 0
    return sp, smask


@_interp.kjit
def _delta_step(S, sp, smask, eg, k, q, beta, v):
    """The delta-rule step on a loaded ``[K, BV]`` block of state columns (columns of S are independent):
    ``S <- diag(e^g) S; S <- S + beta k (v - S^T k)^T``, written back through ``sp``; returns ``o = S^T q`` for
    those columns."""
    S = S * eg[:, None]
    pred = tl.sum(S * k[:, None], 0)
    S += k[:, None] * (beta * (v - pred))[None, :]
    o = tl.sum(S * q[:, None], 0)
    tl.store(sp, S, mask=smask)
    return o


@_interp.kjit
def _add2(a0, b0, a1, b1):
    """Combine of a two-tensor sum (one reduction round for both)."""
    return a0 + a1, b0 + b1


@_interp.kjit
def _delta_step_one_round(S, sp, eg, k, ke, qe, qk, beta, v, EV: tl.constexpr):
    """:func:`_delta_step` with both reductions over K taken from the loaded (undecayed) block in one round:
    ``pred = (e^g k)^T S``, ``o = (e^g q)^T S + (q . k) u`` with ``u = beta (v - pred)``, the same algebra as
    ``o = q^T (diag(e^g) S + k u^T)``, so ``o`` no longer waits for the updated state. ``ke = e^g k``,
    ``qe = e^g q``, ``qk = q . k`` (a scalar) come precomputed. ``EV``: the store marked evict-first (streamed
    once; the L2 keeps the rows the other V tiles still read)."""
    pred, qs = tl.reduce((S * ke[:, None], S * qe[:, None]), 0, _add2)
    u = beta * (v - pred)
    s_new = S * eg[:, None] + k[:, None] * u[None, :]
    if EV:
        tl.store(sp, s_new, eviction_policy="evict_first")
    else:
        tl.store(sp, s_new)
    return qs + qk * u


@_interp.kjit
def _state_step(state_pool, slot, hh, H, offs_k, cols, valid, eg, k, q, beta, v, K: tl.constexpr, V: tl.constexpr):
    """The delta-rule step on state columns ``cols`` (loaded here): see :func:`_delta_step`. A padding row
    (``valid`` 0) loads zeros and stores nothing."""
    sp, smask = _state_ptrs(state_pool, slot, hh, H, offs_k, cols, valid, K, V)
    return _delta_step(tl.load(sp, mask=smask, other=0.0), sp, smask, eg, k, q, beta, v)


@_interp.kjit
def _decode_kernel(q_raw, k_raw, v_raw, d_raw, b_raw, g_raw, wq, wk, wv, A_log, dt_bias, onw,
                   conv_pool, state_pool, slot_ids, out, H, sq, sk, sv, sd, sb, sg, scale, lower_bound, eps,
                   K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                   PRE: tl.constexpr, WIN: tl.constexpr):
    n = tl.program_id(0)
    hh = tl.program_id(1)
    slot_raw = tl.load(slot_ids + n)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    if slot_raw < 0:
        # a padding row (a graph's padding, or a prefill chunk's row in a mixed step's graph): zeros out, no load,
        # no state traffic; in a mixed step most of a 256-row bucket is such rows (it cost 97 us a layer vs 32)
        tl.store(out + n.to(tl.int64) * (H * V) + hh * V + offs_v, tl.zeros([V], tl.float32).to(out.dtype.element_ty))
        return
    valid = (slot_raw >= 0).to(tl.int32)
    slot = tl.maximum(slot_raw, 0)
    NCH = H * K
    ck = hh * K + offs_k
    cv = hh * V + offs_v
    if PRE and BV == V:
        # the whole state's load issued first: its latency overlaps the convolutions and norms below
        sp, smask = _state_ptrs(state_pool, slot, hh, H, offs_k, offs_v, valid, K, V)
        S0 = tl.load(sp, mask=smask, other=0.0)
    q = _conv_step(q_raw, sq, wq, conv_pool, n, slot, ck, valid, NCH, 0, W, WP, WIN)
    k = _conv_step(k_raw, sk, wk, conv_pool, n, slot, ck, valid, NCH, 1, W, WP, WIN)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    raw = tl.load(d_raw + n.to(tl.int64) * sd + ck, mask=(valid + 0 * ck) > 0, other=0.0).to(tl.float32)
    a_h = tl.exp(tl.load(A_log + hh).to(tl.float32))
    g = lower_bound * tl.sigmoid(a_h * (raw + tl.load(dt_bias + ck).to(tl.float32)))
    beta = tl.sigmoid(tl.load(b_raw + n.to(tl.int64) * sb + hh).to(tl.float32))
    eg = tl.exp(g)
    obase = out + n.to(tl.int64) * (H * V) + hh * V
    gr = tl.load(g_raw + n.to(tl.int64) * sg + cv, mask=(valid + 0 * cv) > 0, other=0.0).to(tl.float32)
    if BV == V:
        # whole state tile at once: the output stays in fp32 registers through the norm
        v = _conv_step(v_raw, sv, wv, conv_pool, n, slot, cv, valid, NCH, 2, W, WP, WIN)
        if PRE:
            o = _delta_step(S0, sp, smask, eg, k, q, beta, v)
        else:
            o = _state_step(state_pool, slot, hh, H, offs_k, offs_v, valid, eg, k, q, beta, v, K, V)
        rstd = tl.rsqrt(tl.sum(o * o, 0) / V + eps)
    else:
        # the state is walked in [K, BV] column blocks (columns of S are independent in the delta rule); each
        # block convolves its own v channels (and updates their conv state); the raw output goes through the
        # output row and is normalised after the loop
        ss = tl.sum(tl.zeros([BV], dtype=tl.float32), 0)
        for vb in range(0, V // BV):
            offs_b = vb * BV + tl.arange(0, BV)
            vblk = _conv_step(v_raw, sv, wv, conv_pool, n, slot, hh * V + offs_b, valid, NCH, 2, W, WP, WIN)
            ob = _state_step(state_pool, slot, hh, H, offs_k, offs_b, valid, eg, k, q, beta, vblk, K, V)
            ss += tl.sum(ob * ob, 0)
            tl.store(obase + offs_b, ob.to(out.dtype.element_ty))
        tl.debug_barrier()
        rstd = tl.rsqrt(ss / V + eps)
        o = tl.load(obase + offs_v).to(tl.float32)
        tl.debug_barrier()  # every thread has read the raw row before the normalised one overwrites it
    y = o * rstd * tl.load(onw + offs_v).to(tl.float32)
    y = tl.where((valid + 0 * cv) > 0, y * tl.sigmoid(gr), 0.0)
    tl.store(obase + offs_v, y.to(out.dtype.element_ty))


@_interp.kjit
def _conv_read(xr, sx, wt, pool, n, slot, ch, valid, NCH, which: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """The loads and SiLU(conv) of one token's channels ``ch`` (``valid`` 0: a padding row, nothing read):
    returns ``(x, window, window offsets, SiLU(conv))``, the ``W - 1`` saved inputs read as one ``[C, WP]``
    tile. The caller shifts the window with :func:`_conv_shift` after a barrier, once every thread of the
    program has read it (a channel's value can be held by several threads)."""
    vm = (valid + 0 * ch) > 0  # vector mask (the interpreter rejects a scalar mask on a vector load)
    x = tl.load(xr + n.to(tl.int64) * sx + ch, mask=vm, other=0.0).to(tl.float32)
    base = ((slot.to(tl.int64) * 3 + which) * NCH + ch) * (W - 1)
    j = tl.arange(0, WP)
    jm = (j < W - 1)[None, :] & vm[:, None]
    win = tl.load(pool + base[:, None] + j[None, :], mask=jm, other=0.0)
    wj = tl.load(wt + ch[:, None] * W + j[None, :], mask=(j < W - 1)[None, :], other=0.0).to(tl.float32)
    acc = x * tl.load(wt + ch * W + (W - 1)).to(tl.float32) + tl.sum(win * wj, 1)
    return x, win, base, acc * tl.sigmoid(acc)


@_interp.kjit
def _conv_shift(pool, x, win, base, valid, W: tl.constexpr, WP: tl.constexpr):
    """Store the shifted window read by :func:`_conv_read` (``valid`` 0: nothing): position j - 1 takes the
    value read at j, the newest input goes last."""
    vm = (valid + 0 * base) > 0
    j = tl.arange(0, WP)
    jm = ((j >= 1) & (j < W - 1))[None, :] & vm[:, None]
    tl.store(pool + base[:, None] + (j - 1)[None, :], win, mask=jm)
    tl.store(pool + base + (W - 2), x, mask=vm)


@_interp.kjit
def _split_prep_kernel(q_raw, k_raw, v_raw, d_raw, b_raw, wq, wk, wv, A_log, dt_bias, conv_pool, slot_ids, vec, sca,
                       H, sq, sk, sv, sd, sb, scale, lower_bound,
                       K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """SPLIT decode, launch 1 of 3, one program per (row, head): the q / k / v short convs (the slot's windows
    shifted here, their only writer), SiLU, L2 norms and q scale, ``e^g`` and beta, written to the row's
    ``vec[n, h] = [q, k, e^g, v]`` (fp32 ``[4, K]``) and ``sca[n, h] = [beta, q . k]``. A padding row writes
    nothing (the state launch skips it, the norm launch writes its zeros). The three convs' window loads are issued
    first (:func:`_conv_read`), then one barrier, then the three window shifts."""
    n = tl.program_id(0)
    hh = tl.program_id(1)
    slot_raw = tl.load(slot_ids + n)
    if slot_raw < 0:
        return
    offs_k = tl.arange(0, K)
    valid = (slot_raw >= 0).to(tl.int32)
    slot = tl.maximum(slot_raw, 0)
    NCH = H * K
    ck = hh * K + offs_k
    # the three convs' loads first, one barrier, then the three window shifts (a barrier per conv, the form
    # until 2026-12-06, ran 0.3323 / 0.0475 / 0.1707 ms graph-replayed against 0.3294 / 0.0468 / 0.1686 at B64 H96 /
    # B64 H12 / B256 H12 on the H100, BV 64)
    xq, wnq, bq, q = _conv_read(q_raw, sq, wq, conv_pool, n, slot, ck, valid, NCH, 0, W, WP)
    xk, wnk, bk, k = _conv_read(k_raw, sk, wk, conv_pool, n, slot, ck, valid, NCH, 1, W, WP)
    xv, wnv, bv, v = _conv_read(v_raw, sv, wv, conv_pool, n, slot, ck, valid, NCH, 2, W, WP)
    tl.debug_barrier()  # every thread has read every window
    _conv_shift(conv_pool, xq, wnq, bq, valid, W, WP)
    _conv_shift(conv_pool, xk, wnk, bk, valid, W, WP)
    _conv_shift(conv_pool, xv, wnv, bv, valid, W, WP)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    raw = tl.load(d_raw + n.to(tl.int64) * sd + ck).to(tl.float32)
    a_h = tl.exp(tl.load(A_log + hh).to(tl.float32))
    eg = tl.exp(lower_bound * tl.sigmoid(a_h * (raw + tl.load(dt_bias + ck).to(tl.float32))))
    base = vec + (n.to(tl.int64) * H + hh) * (4 * K)
    tl.store(base + offs_k, q)
    tl.store(base + K + offs_k, k)
    tl.store(base + 2 * K + offs_k, eg)
    tl.store(base + 3 * K + offs_k, v)
    sbase = sca + (n.to(tl.int64) * H + hh) * 2
    tl.store(sbase, tl.sigmoid(tl.load(b_raw + n.to(tl.int64) * sb + hh).to(tl.float32)))
    tl.store(sbase + 1, tl.sum(q * k, 0))


@_interp.kjit
def _split_state_kernel(vec, sca, state_pool, slot_ids, ob, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                        EV: tl.constexpr):
    """SPLIT decode, launch 2 of 3, one program per (V tile, row, head), V tiles fastest in launch order: the
    delta-rule step on state columns ``[vt BV, (vt + 1) BV)`` (:func:`_delta_step_one_round`), the state tile's
    load issued first; the raw output columns go to ``ob`` (fp32 ``[N, H, V]``). ``EV`` 1: the state tile's
    load and store marked evict-first."""
    vt = tl.program_id(0)
    n = tl.program_id(1)
    hh = tl.program_id(2)
    slot_raw = tl.load(slot_ids + n)
    if slot_raw < 0:
        return
    offs_k = tl.arange(0, K)
    offs_c = tl.arange(0, BV)
    sp = state_pool + (slot_raw.to(tl.int64) * H + hh) * (K * V) + vt * BV + (offs_k[:, None] * V + offs_c[None, :])
    if EV:
        S = tl.load(sp, eviction_policy="evict_first")
    else:
        S = tl.load(sp)
    row = n.to(tl.int64) * H + hh
    base = vec + row * (4 * K)
    q = tl.load(base + offs_k)
    k = tl.load(base + K + offs_k)
    eg = tl.load(base + 2 * K + offs_k)
    v = tl.load(base + 3 * K + vt * BV + offs_c)
    beta = tl.load(sca + row * 2)
    qk = tl.load(sca + row * 2 + 1)
    o = _delta_step_one_round(S, sp, eg, k, k * eg, q * eg, qk, beta, v, EV)
    tl.store(ob + row * V + vt * BV + offs_c, o)


@_interp.kjit
def _split_norm_kernel(ob, g_raw, onw, slot_ids, out, H, sg, eps, V: tl.constexpr):
    """SPLIT decode, launch 3 of 3, one program per (row, head): the gated per-head RMSNorm
    ``rms_norm(o) * o_norm.weight * sigmoid(gate_raw)`` of the raw output row; zeros for a padding row."""
    n = tl.program_id(0)
    hh = tl.program_id(1)
    offs_v = tl.arange(0, V)
    obase = out + n.to(tl.int64) * (H * V) + hh * V
    if tl.load(slot_ids + n) < 0:
        tl.store(obase + offs_v, tl.zeros([V], tl.float32).to(out.dtype.element_ty))
        return
    o = tl.load(ob + (n.to(tl.int64) * H + hh) * V + offs_v)
    rstd = tl.rsqrt(tl.sum(o * o, 0) / V + eps)
    gr = tl.load(g_raw + n.to(tl.int64) * sg + hh * V + offs_v).to(tl.float32)
    y = o * rstd * tl.load(onw + offs_v).to(tl.float32) * tl.sigmoid(gr)
    tl.store(obase + offs_v, y.to(out.dtype.element_ty))


def kda_decode(q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw, conv_weights, A_log, dt_bias, o_norm_weight,
               conv_pool, state_pool, slot_ids, eps, scale=None, lower_bound=-5.0, out: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32, config: dict | None = None):
    """Triton KDA decode step (one fused launch, or three for a ``SPLIT`` config); contract of
    :func:`k3rocm.model.kda.kda_decode`.

    Extra args: ``out`` (preallocated ``[N, H*V]`` output, for graph capture), ``out_dtype`` (fp32 by contract),
    ``config`` (one entry of ``configs("decode")``; default: the tuned pick per heads / widths / power-of-two
    row bucket, timed once, graph-replayed, on scratch pools of N slots so the caller's pools never advance for
    timing; under graph capture or with tuning off, the first entry that launches).
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
    if out is None:
        out = C.empty(N, H * V, dtype=out_dtype, device=q_raw.device)
    ws = [w.reshape(-1, W) if w.is_contiguous() and w.dtype == torch.float32 else w.reshape(-1, W).float().contiguous()
          for w in conv_weights]
    # the per-row inputs are read through their row strides (column views of the layer's one q|k|v|g|b GEMM
    # output need no copy); only a non-unit last-dim stride is copied
    rows = [t if t.stride(-1) == 1 else t.contiguous() for t in (q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw)]
    strides = [t.stride(0) for t in rows]
    args = (*rows, ws[0], ws[1], ws[2], A_log, dt_bias, o_norm_weight)

    def split_work() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The SPLIT form's fp32 intermediates: [q, k, e^g, v] rows, [beta, q . k], the raw output."""
        dev = q_raw.device
        return (C.empty(N, H, 4, K, dtype=torch.float32, device=dev),
                C.empty(N, H, 2, dtype=torch.float32, device=dev),
                C.empty(N, H, V, dtype=torch.float32, device=dev))

    def launch(cfg: dict, cpool: torch.Tensor, spool: torch.Tensor, sids: torch.Tensor, o: torch.Tensor,
               work: tuple | None = None) -> None:
        meta, opts = tune.split(dict(cfg))
        bv = min(meta.get("BV", V), V)
        if meta.get("SPLIT"):
            # three launches: per-(row, head) prologue, a (V tile, row, head) grid over the state, the gated norm
            vec, sca, ob = work or split_work()
            # the config's warps are the state launch's; the prologue runs 4 warps (2 and 1 timed the same), the
            # norm one (none under the interpreter, where opts is empty)
            po = {k: v for k, v in opts.items() if k != "num_warps"}
            _interp.launch(_split_prep_kernel, (N, H), *rows[:5], ws[0], ws[1], ws[2], A_log, dt_bias, cpool, sids,
                           vec, sca, H, *strides[:5], scale, float(lower_bound), K=K, W=W,
                           WP=max(2, tune.pow2(W - 1)),
                           **(dict(po, num_warps=4) if opts else {}))
            _interp.launch(_split_state_kernel, (V // bv, N, H), vec, sca, spool, sids, ob, H, K=K, V=V, BV=bv,
                           EV=int(meta.get("EV", 0)), **opts)
            _interp.launch(_split_norm_kernel, (N, H), ob, rows[5], o_norm_weight, sids, o, H, strides[5],
                           float(eps), V=V, **(dict(po, num_warps=1) if opts else {}))
            return
        _interp.launch(_decode_kernel, (N, H), *args, cpool, spool, sids, o, H, *strides, scale, float(lower_bound),
                       float(eps), K=K, V=V, W=W, WP=max(2, tune.pow2(W - 1)), BV=bv,
                       PRE=int(meta.get("PRE", 0)) if bv == V else 0, WIN=int(meta.get("WIN", 0)), **opts)

    if not N:
        return out
    if config is None:
        # the tuned pick per (heads, widths, power-of-two row bucket), timed on scratch pools of N slots (the
        # caller's pools never advance for timing); during graph capture, or untimed, the table's first entry
        scratch: dict = {}

        def trial(cfg: dict) -> None:
            if not scratch:
                scratch.update(c=torch.zeros(N, *conv_pool.shape[1:], dtype=torch.float32, device=q_raw.device),
                               s=torch.zeros(N, *state_pool.shape[1:], dtype=torch.float32, device=q_raw.device),
                               i=torch.arange(N, dtype=torch.int32, device=q_raw.device), o=torch.empty_like(out),
                               w=split_work())
            launch(cfg, scratch["c"], scratch["s"], scratch["i"], scratch["o"], scratch["w"])

        key = (H, K, W, tune.pow2(N), q_raw.dtype, out.dtype)
        # timed graph-replayed: the engine runs its decode steps inside graphs where capture succeeds, and there
        # the three-launch SPLIT configs pay no host gaps (run eagerly they lose at small N by those gaps alone;
        # serving itself takes the table's first entry, untimed)
        config = tune.pick("kda_decode", key, tune.configs(C.DECODE), trial, graphed=True)
        scratch.clear()
    launch(config, conv_pool, state_pool, slot_ids, out)
    return out
