"""fp32 oracle of Kimi K3's gated NoPE MLA: prefill attention, the paged latent cache, absorbed decode.

Formulas (K3_FACTS §5, "Gated MLA layer"):

* q = ``q_b``(RMSNorm(``q_a``(x))) -> per head 128 "nope" + 64 "rope" values (no rotary embedding anywhere);
  ``kv_a_proj_with_mqa``(x) -> 512 latent (normed by ``kv_a_layernorm``) + 64 ``k_rope`` shared by all heads;
  ``kv_b_proj`` [H*(Dn+Dv), R] expands the latent to per-head k_nope (first Dn rows of a head) and v (next Dv).
* score = q_nope . k_nope + q_rope . k_rope, times ``scale`` = (Dn+Dr)^-0.5 = 192^-0.5; causal softmax in fp32.
* cache = R + Dr = 576 values per token (normed latent, then k_rope).
* decode absorbs ``kv_b`` (DeepSeek-V2 §2.1.2 "absorb"): q_lat = q_nope @ W_kc, score = q_lat . latent +
  q_rope . k_rope, o = (p @ latent) @ W_vc.
* output gate: ``attn_out * sigmoid(g_proj(x))`` before ``o_proj``.

Every function widens its inputs to fp32, returns fp32 and leaves its inputs untouched, except
:func:`mla_cache_write`, which writes the cache in place. Varlen batches are packed (B = 1) and described
by ``cu_seqlens`` int32 ``[N+1]``.
"""

from __future__ import annotations

import torch

from k3rocm.errors import ConfigError
from k3rocm.numerics import FP8_MAX, gather_cache

__all__ = [
    "mla_prefill", "mla_cache_write", "mla_decode", "mla_gate", "split_kv_b", "fp8_cache_dtype",
]

def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def fp8_cache_dtype(arch: str) -> torch.dtype:
    """The FP8 cache dtype of a target: ``float8_e4m3fnuz`` on gfx942 (CDNA3), ``float8_e4m3fn`` elsewhere
    (gfx950, CUDA). ``arch`` is e.g. ``"gfx942:sramecc+:xnack-"``, ``"gfx950"``, ``"sm_90"``. Source: HARDWARE.md."""
    return torch.float8_e4m3fnuz if arch.split(":")[0] == "gfx942" else torch.float8_e4m3fn


def mla_gate(attn_out: torch.Tensor, gate_raw: torch.Tensor | None) -> torch.Tensor:
    """Output gate ``attn_out * sigmoid(gate_raw)`` in fp32 (K3_FACTS §5: gate_raw = ``g_proj``(x)).

    Args:
        attn_out: ``[..., H, Dv]``.
        gate_raw: ``[..., H*Dv]`` or ``[..., H, Dv]`` or None (returns ``attn_out`` as fp32).
    Returns:
        ``[..., H, Dv]`` fp32.
    """
    o = _f32(attn_out)
    if gate_raw is None:
        return o
    return o * torch.sigmoid(_f32(gate_raw).reshape(o.shape))


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """Split ``kv_b_proj.weight`` ``[H*(Dn+Dv), R]`` into the absorbed decode factors, fp32.

    Rows of head h: ``[h*(Dn+Dv), h*(Dn+Dv)+Dn)`` produce k_nope, the next Dv rows produce v (K3_FACTS §3/§5).

    Returns:
        ``(w_kc [H, Dn, R], w_vc [H, R, Dv])`` so that k_nope_h = W_kc[h] @ latent and v_h = W_vc[h]^T @ latent.
    Raises:
        ConfigError: the weight's row count is not ``H*(Dn+Dv)``.
    """
    w = _f32(kv_b_weight)
    if w.dim() != 2 or w.shape[0] != num_heads * (qk_nope_head_dim + v_head_dim):
        raise ConfigError(f"kv_b_proj.weight has shape {tuple(w.shape)}, expected "
                          f"[{num_heads}*({qk_nope_head_dim}+{v_head_dim}), kv_lora_rank]; check the head split")
    w = w.view(num_heads, qk_nope_head_dim + v_head_dim, w.shape[1])
    return w[:, :qk_nope_head_dim, :].contiguous(), w[:, qk_nope_head_dim:, :].transpose(1, 2).contiguous()


def _check_cu(cu: torch.Tensor, total: int, name: str) -> list[int]:
    c = [int(v) for v in cu.tolist()]
    if len(c) < 2 or c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ConfigError(f"{name} must be non-decreasing, start at 0 and end at {total}; got {c[:8]}...")
    return c


def mla_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA prefill attention (varlen, bottom-right aligned), fp32.

    Sequence n has ``Lq = cu_q[n+1]-cu_q[n]`` queries and ``Lk = cu_k[n+1]-cu_k[n] >= Lq`` keys; its query j
    sees keys ``0 .. Lk-Lq+j`` (the queries are the last Lq positions: chunked prefill passes the earlier
    context's keys ahead of the chunk's own). score = (q[:, :Dn] . k_nope + q[:, Dn:] . k_rope) * scale.

    Args:
        q: ``[Tq, H, Dn+Dr]``; k_nope: ``[Tk, H, Dn]``; k_rope: ``[Tk, Dr]`` shared by all heads;
        v: ``[Tk, H, Dv]`` (Dv may differ from Dn+Dr; no padding).
        cu_seqlens_q, cu_seqlens_k: int32 ``[N+1]``.
        scale: softmax scale, ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` for K3 (K3_FACTS §5).
        gate: optional ``[Tq, H*Dv]`` (or ``[Tq, H, Dv]``) raw ``g_proj(x)``; the output is multiplied by its sigmoid.
    Returns:
        o ``[Tq, H, Dv]`` fp32 (a query that sees no key, possible only when Lk < Lq, gets zeros).
    Raises:
        ConfigError: inconsistent shapes or cu_seqlens.
    """
    Tq, H, Dq = q.shape
    Tk, Dn = k_nope.shape[0], k_nope.shape[2]
    Dr = k_rope.shape[1]
    Dv = v.shape[2]
    if Dq != Dn + Dr or k_nope.shape[1] != H or v.shape[:2] != (Tk, H) or k_rope.shape[0] != Tk:
        raise ConfigError(f"mla_prefill: q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, k_rope {tuple(k_rope.shape)}, "
                          f"v {tuple(v.shape)} are inconsistent; expect q [Tq,H,Dn+Dr], k_nope [Tk,H,Dn], k_rope [Tk,Dr]")
    cq = _check_cu(cu_seqlens_q, Tq, "cu_seqlens_q")
    ck = _check_cu(cu_seqlens_k, Tk, "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ConfigError("mla_prefill: cu_seqlens_q and cu_seqlens_k describe different numbers of sequences")
    qf, knf, krf, vf = _f32(q), _f32(k_nope), _f32(k_rope), _f32(v)
    o = torch.zeros(Tq, H, Dv, dtype=torch.float32, device=q.device)
    for n in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[n], cq[n + 1], ck[n], ck[n + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        qn, qr = qf[q0:q1, :, :Dn], qf[q0:q1, :, Dn:]
        s = torch.einsum("qhd,khd->hqk", qn, knf[k0:k1]) + torch.einsum("qhd,kd->hqk", qr, krf[k0:k1])
        s = s * scale
        qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        ki = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill((ki > qi)[None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
        o[q0:q1] = torch.einsum("hqk,khd->qhd", p, vf[k0:k1])
    return mla_gate(o, gate)


def mla_cache_write(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor,
                    k_rope: torch.Tensor, kv_scale: float | None = None) -> None:
    """Write new tokens into the paged latent cache, in place.

    Slot s = ``block * block_size + offset`` holds ``cache[block, offset] = concat(latent, k_rope) / kv_scale``
    rounded to the cache dtype (bf16, fp16, fp32, or FP8 e4m3fn / e4m3fnuz, saturated to the format's
    finite range). ``kv_scale`` (FP8 only; default 1.0) is the dequantisation multiplier the decode applies.

    Args:
        kv_cache: ``[num_blocks, block_size, R+Dr]``.
        slot_mapping: int64 ``[T]``; -1 = skip this token (padding).
        latent: ``[T, R]`` normed latent (after ``kv_a_layernorm``); k_rope: ``[T, Dr]``.
        kv_scale: FP8 scale (a float > 0).
    Raises:
        ConfigError: widths disagree with the cache, or a slot is out of range.
    """
    nb, bs, W = kv_cache.shape
    T, R = latent.shape
    if R + k_rope.shape[1] != W or k_rope.shape[0] != T or slot_mapping.shape[0] != T:
        raise ConfigError(f"mla_cache_write: latent {tuple(latent.shape)} + k_rope {tuple(k_rope.shape)} do not fill "
                          f"cache rows of width {W} for {slot_mapping.shape[0]} slots")
    sm = slot_mapping.to(torch.int64)
    valid = sm >= 0
    if bool((sm[valid] >= nb * bs).any()):
        raise ConfigError(f"mla_cache_write: slot index >= num_blocks*block_size = {nb * bs}; check the block table")
    row = torch.cat([_f32(latent), _f32(k_rope)], dim=-1)[valid]
    if kv_cache.dtype in FP8_MAX:
        s = 1.0 if kv_scale is None else float(kv_scale)
        m = FP8_MAX[kv_cache.dtype]
        row = (row / s).clamp(-m, m)
    if kv_cache.element_size() == 1:  # FP8: index_put is not implemented for float8 on every backend
        kv_cache.view(torch.uint8).view(nb * bs, W)[sm[valid]] = row.to(kv_cache.dtype).view(torch.uint8)
    else:
        kv_cache.view(nb * bs, W)[sm[valid]] = row.to(kv_cache.dtype)


def mla_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               context_lens: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, scale: float,
               gate: torch.Tensor | None = None, kv_scale: float | None = None) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache, fp32.

    For sequence n with context length L (including its Tq new tokens, already written to the cache), query t
    is position ``L-Tq+t`` and sees cache rows ``0 .. L-Tq+t``:
    q_lat = q_nope @ w_kc[h] (``[R]``); score = (q_lat . latent + q_rope . k_rope) * scale; p = softmax;
    o = (p @ latent) @ w_vc[h]. Equal (up to rounding) to un-absorbed attention with k_nope = W_kc latent,
    v = W_vc^T latent (DeepSeek-V2 §2.1.2).

    Args:
        q_nope: ``[N, Tq, H, Dn]``; q_rope: ``[N, Tq, H, Dr]``.
        kv_cache: ``[num_blocks, block_size, R+Dr]`` (any float dtype, FP8 with ``kv_scale``).
        block_table: int32 ``[N, max_blocks]``; context_lens: int32 ``[N]`` (0 = padding row -> zeros).
        w_kc: ``[H, Dn, R]``; w_vc: ``[H, R, Dv]`` (from :func:`split_kv_b`).
        scale: ``192^-0.5`` for K3.
        gate: optional raw ``g_proj(x)`` ``[N, Tq, H*Dv]`` (or ``[N, Tq, H, Dv]``): output *= sigmoid(gate).
        kv_scale: FP8 dequantisation multiplier.
    Returns:
        o ``[N, Tq, H, Dv]`` fp32; a query that sees no row gets zeros.
    Raises:
        ConfigError: inconsistent widths or a context longer than the block table holds.
    """
    N, Tq, H, Dn = q_nope.shape
    Dr = q_rope.shape[-1]
    R = w_kc.shape[-1]
    Dv = w_vc.shape[-1]
    bs, W = kv_cache.shape[1], kv_cache.shape[2]
    if W != R + Dr or w_kc.shape != (H, Dn, R) or w_vc.shape[:2] != (H, R) or q_rope.shape[:3] != (N, Tq, H):
        raise ConfigError(f"mla_decode: cache width {W}, w_kc {tuple(w_kc.shape)}, w_vc {tuple(w_vc.shape)}, "
                          f"q_nope {tuple(q_nope.shape)}, q_rope {tuple(q_rope.shape)} are inconsistent")
    lens = [int(x) for x in context_lens.tolist()]
    if max(lens, default=0) > block_table.shape[1] * bs:
        raise ConfigError(f"mla_decode: a context of {max(lens)} tokens exceeds the block table "
                          f"({block_table.shape[1]} blocks of {bs})")
    q_lat = torch.einsum("nthd,hdr->nthr", _f32(q_nope), _f32(w_kc))
    qr = _f32(q_rope)
    o = torch.zeros(N, Tq, H, Dv, dtype=torch.float32, device=q_nope.device)
    for n, L in enumerate(lens):
        if L == 0:
            continue
        rows = gather_cache(kv_cache, block_table, L, n, kv_scale)
        lat, kr = rows[:, :R], rows[:, R:]
        s = (torch.einsum("thr,lr->thl", q_lat[n], lat) + torch.einsum("thd,ld->thl", qr[n], kr)) * scale
        qpos = torch.arange(Tq, device=s.device)[:, None, None] + (L - Tq)
        kpos = torch.arange(L, device=s.device)[None, None, :]
        s = s.masked_fill(kpos > qpos, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        ctx = torch.einsum("thl,lr->thr", p, lat)
        o[n] = torch.einsum("thr,hrv->thv", ctx, _f32(w_vc))
    return mla_gate(o, gate)
