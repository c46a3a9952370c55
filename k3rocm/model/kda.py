"""fp32 oracle of Kimi Delta Attention (KDA), the linear-attention token mixer of Kimi K3.

Everything here widens its inputs to fp32, computes in fp32 and returns fp32; only
:func:`kda_decode` modifies arguments (the conv and state pools, in place, as its contract says).
The Triton kernels in ``k3rocm.kernels.kda`` are tested against these functions.

Formulas (K3_FACTS §5, "KDA layer"):

* causal depthwise conv (kernel ``W`` = 4, FP32 weights, no bias) on q, k, v separately, then SiLU;
  the conv state of a sequence is its last ``W-1`` inputs per channel, oldest first;
* q, k L2-normalised per head (``x * rsqrt(sum(x^2) + 1e-6)``), ``q *= K**-0.5``;
* ``beta = sigmoid(b_proj(x))``;
* log-decay per channel ``g = lower_bound * sigmoid(exp(A_log[h]) * (decay_raw + dt_bias))`` with
  ``lower_bound = -5`` (form ``"k3"``), or Kimi-Linear's ``-exp(A_log[h]) * softplus(decay_raw + dt_bias)``
  (form ``"kimi_linear"``);
* per head, state ``S`` (K x V, fp32): ``S <- diag(exp(g_t)) S``; ``S <- S + beta_t k_t (v_t - S^T k_t)^T``;
  ``o_t = S^T q_t`` (read after the update);
* output: per-head RMSNorm with ``o_norm.weight`` (eps 1e-5), times ``sigmoid(g_proj(x))``.

The chunked form (:func:`kda_chunked`) is the WY / UT-transform of the same recurrence (Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", 2024; Kimi Linear
technical report, 2025, for the per-channel decay), written here in torch so the Triton kernel's
algebra has an fp32 reference of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3rocm.errors import ConfigError

__all__ = [
    "kda_gate", "short_conv", "kda_recurrent", "kda_chunked", "kda_prefill", "kda_gated_norm", "kda_decode",
]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _l2(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = _f32(x)
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def _seq_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """``[(batch_row, start, end)]`` per sequence. Raises ConfigError for a malformed cu_seqlens."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ConfigError(f"kda: cu_seqlens needs a packed batch (B = 1), got B = {B}; pack the sequences along T")
    cu = [int(c) for c in cu_seqlens.tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ConfigError(f"kda: cu_seqlens {cu[:8]}... must start at 0, be non-decreasing and end at T = {T}")
    return [(0, a, b) for a, b in zip(cu, cu[1:])]


def kda_gate(decay_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_heads: int,
             lower_bound: float = -5.0, form: str = "k3") -> torch.Tensor:
    """Per-channel log-decay ``g`` of KDA (K3_FACTS §5).

    Args:
        decay_raw: ``[..., H*K]`` (or ``[..., H, K]``) pre-activation ``f_b_proj(f_a_proj(x))``, any float dtype.
        A_log: ``[>= H]`` fp32 per-head log rate (checkpoint ``A_log``; K3 stores 128 and uses the first H).
        dt_bias: ``[H*K]`` fp32 (checkpoint ``dt_bias``).
        num_heads: H.
        lower_bound: lower bound of g in form ``"k3"`` (-5.0 in K3).
        form: ``"k3"``: ``g = lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias))``;
            ``"kimi_linear"``: ``g = -exp(A_log[h]) * softplus(raw + dt_bias)``.
    Returns:
        ``g`` ``[..., H, K]`` fp32 (``alpha = exp(g)``).
    Raises:
        ConfigError: unknown form, or sizes that do not match.
    """
    H = num_heads
    raw = _f32(decay_raw)
    if raw.dim() >= 2 and raw.shape[-2] == H and raw.shape[-1] * H == dt_bias.numel():
        raw = raw.reshape(*raw.shape[:-2], H * raw.shape[-1])
    if raw.shape[-1] != dt_bias.numel() or dt_bias.numel() % H:
        raise ConfigError(f"kda_gate: decay_raw last dim {raw.shape[-1]} != dt_bias size {dt_bias.numel()} "
                          f"(= H*K with H = {H}); check f_b_proj / dt_bias shapes")
    if A_log.numel() < H:
        raise ConfigError(f"kda_gate: A_log has {A_log.numel()} entries, need >= {H} heads")
    K = raw.shape[-1] // H
    x = (raw + _f32(dt_bias)).reshape(*raw.shape[:-1], H, K)
    a = torch.exp(_f32(A_log)[:H]).reshape(H, 1)
    if form == "k3":
        return lower_bound * torch.sigmoid(a * x)
    if form == "kimi_linear":
        return -a * F.softplus(x)
    raise ConfigError(f"kda_gate: unknown gate form {form!r}; use 'k3' or 'kimi_linear'")


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU (KDA ``q_conv1d``/``k_conv1d``/``v_conv1d``, kernel 4, K3_FACTS §5).

    ``y[t, c] = SiLU(sum_{i<W} w[c, 0, i] * x[t - (W-1) + i, c])`` where inputs before the start of a
    sequence come from ``conv_state`` (zeros when None).

    Args:
        x: ``[B, T, C]`` any float dtype (B = 1 when ``cu_seqlens`` is given).
        weight: ``[C, 1, W]`` fp32 (checkpoint layout of ``*_conv1d.weight``).
        conv_state: ``[N, C, W-1]`` fp32 or None; the last W-1 inputs before each sequence, oldest first.
        cu_seqlens: ``[N+1]`` int32 offsets of packed sequences, or None (then N = B).
    Returns:
        ``(y [B, T, C] fp32, final_state [N, C, W-1] fp32)`` — final_state = last W-1 inputs of each
        sequence (taking from the initial state when the sequence is shorter than W-1).
    Raises:
        ConfigError: shape mismatch or malformed cu_seqlens.
    """
    B, T, C = x.shape
    if weight.dim() != 3 or weight.shape[0] != C or weight.shape[1] != 1:
        raise ConfigError(f"short_conv: weight shape {tuple(weight.shape)} must be [C={C}, 1, W]")
    W = weight.shape[-1]
    seqs = _seq_bounds(B, T, cu_seqlens)
    N = len(seqs)
    if conv_state is not None and tuple(conv_state.shape) != (N, C, W - 1):
        raise ConfigError(f"short_conv: conv_state shape {tuple(conv_state.shape)} != [N={N}, C={C}, W-1={W - 1}]")
    xf, w = _f32(x), _f32(weight)[:, 0, :]  # [C, W]
    y = torch.zeros(B, T, C, dtype=torch.float32, device=x.device)
    final = torch.zeros(N, C, W - 1, dtype=torch.float32, device=x.device)
    for n, (b, s, e) in enumerate(seqs):
        init = (_f32(conv_state[n]).t() if conv_state is not None
                else torch.zeros(W - 1, C, dtype=torch.float32, device=x.device))  # [W-1, C]
        buf = torch.cat([init, xf[b, s:e]], dim=0)  # [W-1+L, C]
        L = e - s
        acc = torch.zeros(L, C, dtype=torch.float32, device=x.device)
        for i in range(W):
            acc = acc + buf[i:i + L] * w[:, i]
        y[b, s:e] = F.silu(acc)
        final[n] = buf[buf.shape[0] - (W - 1):].t()
    return y, final


def _prep(q, k, v, decay_raw, beta_raw, A_log, dt_bias, scale, lower_bound, gate_form):
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ConfigError(f"kda: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [B, T, H, K/V]")
    if beta_raw.shape[:2] != (B, T) or beta_raw.reshape(B, T, -1).shape[-1] != H:
        raise ConfigError(f"kda: beta_raw shape {tuple(beta_raw.shape)} must be [B={B}, T={T}, H={H}]")
    scale = K ** -0.5 if scale is None else scale
    qn = _l2(q) * scale
    kn = _l2(k)
    g = kda_gate(decay_raw.reshape(B, T, -1), A_log, dt_bias, H, lower_bound, gate_form)  # [B,T,H,K]
    beta = torch.sigmoid(_f32(beta_raw).reshape(B, T, H))
    return qn, kn, _f32(v), g, beta


def _recurrent_core(qn, kn, v, g, beta, initial_state, seqs):
    B, T, H, K = qn.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=qn.device)
    final = torch.zeros(len(seqs), H, K, V, dtype=torch.float32, device=qn.device)
    for n, (b, s, e) in enumerate(seqs):
        S = (_f32(initial_state[n]).clone() if initial_state is not None
             else torch.zeros(H, K, V, dtype=torch.float32, device=qn.device))
        for t in range(s, e):
            S = S * torch.exp(g[b, t]).unsqueeze(-1)
            kt = kn[b, t]  # [H, K]
            pred = torch.einsum("hkv,hk->hv", S, kt)
            delta = beta[b, t].unsqueeze(-1) * (v[b, t] - pred)
            S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
            o[b, t] = torch.einsum("hkv,hk->hv", S, qn[b, t])
        final[n] = S
    return o, final


def _check_state(initial_state, N, H, K, V):
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ConfigError(f"kda: initial_state shape {tuple(initial_state.shape)} != [N={N}, H={H}, K={K}, V={V}]")


def kda_recurrent(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=None,
                  lower_bound=-5.0, gate_form="k3"):
    """Token-by-token KDA recurrence in fp32 (the ground truth; same arguments and returns as :func:`kda_prefill`)."""
    B, T, H, K = q.shape
    seqs = _seq_bounds(B, T, cu_seqlens)
    _check_state(initial_state, len(seqs), H, K, v.shape[-1])
    qn, kn, vf, g, beta = _prep(q, k, v, decay_raw, beta_raw, A_log, dt_bias, scale, lower_bound, gate_form)
    return _recurrent_core(qn, kn, vf, g, beta, initial_state, seqs)


def _chunk_core(qn, kn, v, g, beta, initial_state, seqs, chunk):
    """WY/UT chunked form. Within a chunk of length L with cumulative log-decay G (per channel):

    ``A[i,j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)`` (j < i), ``T = (I + A)^-1``,
    ``U = T (beta V) - T (beta K e^G) S0`` (the pseudo-values), ``o_i = (q_i e^{G_i}) S0 + sum_{j<=i}
    (sum_c q_ic k_jc e^{G_ic - G_jc}) U_j``, ``S_L = e^{G_L} S0 + sum_j (k_j e^{G_L - G_j}) U_j^T``.
    Pairwise decays are formed as differences (never ``exp(-G)``) so nothing overflows.
    """
    B, T, H, K = qn.shape
    V = v.shape[-1]
    dev = qn.device
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=dev)
    final = torch.zeros(len(seqs), H, K, V, dtype=torch.float32, device=dev)
    for n, (b, s, e) in enumerate(seqs):
        S = (_f32(initial_state[n]).clone() if initial_state is not None
             else torch.zeros(H, K, V, dtype=torch.float32, device=dev))
        for c0 in range(s, e, chunk):
            c1 = min(c0 + chunk, e)
            L = c1 - c0
            qc = qn[b, c0:c1].transpose(0, 1)  # [H, L, K]
            kc = kn[b, c0:c1].transpose(0, 1)
            vc = v[b, c0:c1].transpose(0, 1)  # [H, L, V]
            bc = beta[b, c0:c1].transpose(0, 1)  # [H, L]
            G = g[b, c0:c1].transpose(0, 1).cumsum(dim=1)  # [H, L, K]
            D = torch.exp((G.unsqueeze(2) - G.unsqueeze(1)).clamp(max=0.0))  # [H, L(i), L(j), K], valid j <= i
            strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dev), -1)
            incl = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dev))
            A = torch.einsum("hic,hjc,hijc->hij", kc, kc, D) * bc.unsqueeze(-1)
            A = torch.where(strict, A, torch.zeros((), device=dev))
            Aqk = torch.where(incl, torch.einsum("hic,hjc,hijc->hij", qc, kc, D), torch.zeros((), device=dev))
            eye = torch.eye(L, dtype=torch.float32, device=dev).expand(H, L, L)
            Tm = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
            eG = torch.exp(G)
            W = Tm @ (bc.unsqueeze(-1) * kc * eG)  # [H, L, K]
            U = Tm @ (bc.unsqueeze(-1) * vc) - W @ S  # [H, L, V]
            o[b, c0:c1] = ((qc * eG) @ S + Aqk @ U).transpose(0, 1)
            GL = G[:, -1:, :]  # [H, 1, K]
            S = torch.exp(GL).transpose(1, 2) * S + (kc * torch.exp(GL - G)).transpose(1, 2) @ U
        final[n] = S
    return o, final


def kda_chunked(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=None,
                lower_bound=-5.0, gate_form="k3", chunk_size: int = 64):
    """Chunked (WY / UT-transform) KDA in torch fp32; equal to :func:`kda_recurrent` up to fp32 rounding.

    Same arguments and returns as :func:`kda_prefill`, plus ``chunk_size`` (tokens per chunk; chunks never
    cross a sequence boundary). The algebra is documented in ``_chunk_core``.
    """
    B, T, H, K = q.shape
    seqs = _seq_bounds(B, T, cu_seqlens)
    _check_state(initial_state, len(seqs), H, K, v.shape[-1])
    qn, kn, vf, g, beta = _prep(q, k, v, decay_raw, beta_raw, A_log, dt_bias, scale, lower_bound, gate_form)
    return _chunk_core(qn, kn, vf, g, beta, initial_state, seqs, chunk_size)


def kda_prefill(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state=None, cu_seqlens=None, scale=None,
                lower_bound=-5.0, gate_form="k3", products: str | None = None):
    """KDA over whole sequences (prefill), fp32 oracle. Uses the chunked form (exact up to fp32 rounding).

    Args:
        q, k: ``[B, T, H, K]`` after conv + SiLU, before L2 norm (any float dtype).
        v: ``[B, T, H, V]``.
        decay_raw: ``[B, T, H*K]`` (or ``[B, T, H, K]``) decay pre-activation.
        beta_raw: ``[B, T, H]`` beta pre-activation (``b_proj`` output).
        A_log: ``[>= H]`` fp32; dt_bias: ``[H*K]`` fp32 (checkpoint tensors).
        initial_state: ``[N, H, K, V]`` fp32 or None (zeros).
        cu_seqlens: ``[N+1]`` int32 offsets of packed sequences (B = 1) or None (N = B).
        scale: q scale, default ``K**-0.5``.
        lower_bound, gate_form: see :func:`kda_gate`.
        products: a kernel's precision hint (``"ieee"`` / ``"split"`` / ``"fp16"``, see the Triton implementation); the
            oracle always multiplies in fp32 and only checks the value.
    Returns:
        ``(o [B, T, H, V] fp32, final_state [N, H, K, V] fp32)``.
    Raises:
        ConfigError: shapes inconsistent, malformed cu_seqlens, unknown gate form or products.
    """
    if products not in (None, "ieee", "split", "fp16"):
        raise ConfigError(f"kda_prefill: products {products!r} is not one of None, 'ieee', 'split', 'fp16'")
    return kda_chunked(q, k, v, decay_raw, beta_raw, A_log, dt_bias, initial_state, cu_seqlens, scale,
                       lower_bound, gate_form, chunk_size=64)


def kda_gated_norm(o: torch.Tensor, gate_raw: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: per-head RMSNorm with ``o_norm.weight`` then ``* sigmoid(g_proj(x))`` (K3_FACTS §5).

    Args:
        o: ``[..., H, V]`` attention output.
        gate_raw: ``[..., H*V]`` ``g_proj`` output.
        weight: ``[V]`` fp32 ``o_norm.weight``.
        eps: RMSNorm eps (``rms_norm_eps``, 1e-5).
    Returns:
        ``[..., H*V]`` fp32.
    """
    of = _f32(o)
    y = of * torch.rsqrt(of.pow(2).mean(dim=-1, keepdim=True) + eps) * _f32(weight)
    y = y.reshape(*of.shape[:-2], -1)
    return y * torch.sigmoid(_f32(gate_raw))


def kda_decode(q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw, conv_weights, A_log, dt_bias, o_norm_weight,
               conv_pool, state_pool, slot_ids, eps, scale=None, lower_bound=-5.0):
    """One decode step of a KDA layer for N sequences whose states live in slot pools.

    Per valid row n (``slot = slot_ids[n] >= 0``): short conv + SiLU of q/k/v with ``conv_pool[slot, i]``
    (i = 0, 1, 2 for q, k, v), L2 norm, q scale, gate, beta, one recurrence step on ``state_pool[slot]``,
    gated per-head RMSNorm. Padding rows (slot -1) write nothing and return zeros.

    Args:
        q_raw, k_raw, v_raw: ``[N, H*K]`` pre-conv projections (K = V here, so C = H*K for all three).
        decay_raw: ``[N, H*K]``; beta_raw: ``[N, H]``; gate_raw: ``[N, H*V]`` (``g_proj`` output).
        conv_weights: ``(q_w, k_w, v_w)`` each ``[C, 1, W]`` fp32.
        A_log: ``[>= H]`` fp32; dt_bias: ``[H*K]`` fp32; o_norm_weight: ``[V]`` fp32.
        conv_pool: ``[S, 3, C, W-1]`` fp32, updated in place.
        state_pool: ``[S, H, K, V]`` fp32, updated in place.
        slot_ids: ``[N]`` int32, -1 = padding row.
        eps: RMSNorm eps of the output norm; scale: q scale (default ``K**-0.5``); lower_bound: gate bound.
    Returns:
        ``o [N, H*V]`` fp32.
    Raises:
        ConfigError: shapes inconsistent or a slot id out of range.
    """
    N = q_raw.shape[0]
    S_, H, K, V = state_pool.shape
    C = H * K
    if q_raw.shape != (N, C) or k_raw.shape != (N, C) or v_raw.shape != (N, H * V):
        raise ConfigError(f"kda_decode: q/k/v_raw shapes {tuple(q_raw.shape)}, {tuple(k_raw.shape)}, "
                          f"{tuple(v_raw.shape)} must be [N={N}, {C}] (H*K) / [N, {H * V}] (H*V)")
    if K != V:
        raise ConfigError(f"kda_decode: needs K == V (one conv pool width), got K={K}, V={V}")
    out = torch.zeros(N, H * V, dtype=torch.float32, device=q_raw.device)
    sid = [int(s) for s in slot_ids.tolist()]
    for s in sid:
        if s >= S_ or s < -1:
            raise ConfigError(f"kda_decode: slot id {s} outside [-1, {S_}); check the slot table")
    valid = [n for n, s in enumerate(sid) if s >= 0]
    if not valid:
        return out
    idx = torch.tensor(valid, device=q_raw.device)
    slots = torch.tensor([sid[n] for n in valid], device=q_raw.device)
    convs = []
    for i, (xr, w) in enumerate(zip((q_raw, k_raw, v_raw), conv_weights)):
        st = conv_pool[slots, i]  # [n, C, W-1]
        win = torch.cat([_f32(st), _f32(xr[idx]).unsqueeze(-1)], dim=-1)  # [n, C, W]
        convs.append(F.silu((win * _f32(w)[:, 0, :]).sum(-1)))
        conv_pool[slots, i] = win[..., 1:].to(conv_pool.dtype)
    n = len(valid)
    scale = K ** -0.5 if scale is None else scale
    q = _l2(convs[0].reshape(n, H, K)) * scale
    k = _l2(convs[1].reshape(n, H, K))
    v = convs[2].reshape(n, H, V)
    g = kda_gate(_f32(decay_raw[idx]), A_log, dt_bias, H, lower_bound, "k3")  # [n, H, K]
    beta = torch.sigmoid(_f32(beta_raw[idx]))  # [n, H]
    S = _f32(state_pool[slots]) * torch.exp(g).unsqueeze(-1)
    pred = torch.einsum("nhkv,nhk->nhv", S, k)
    S = S + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - pred)).unsqueeze(-2)
    o = torch.einsum("nhkv,nhk->nhv", S, q)
    state_pool[slots] = S.to(state_pool.dtype)
    out[idx] = kda_gated_norm(o, gate_raw[idx], o_norm_weight, eps)
    return out
