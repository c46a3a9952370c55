"""fp32 oracle of the Stable LatentMoE channel mixer: router, dispatch, routed experts, latent tail.

Sources: K3_FACTS §3 (tensor names and shapes), §4 (MXFP4 as stored), §5 "Stable LatentMoE" (router in
FP32, sigmoid, top-16 by score + ``e_score_correction_bias``, unbiased renormalised weights, SiTU-GLU
experts in the 3584-wide latent, ``routed_expert_norm`` on the weighted sum, ``routed_expert_up_proj``,
shared experts of width 6144 on the original x); the OCP Microscaling (MX) v1.0 specification for E2M1,
E4M3 and E8M0.

Everything here widens its inputs to fp32, computes in fp32, returns fp32 and never modifies its inputs.

Activation modes of :func:`moe_experts` (the kernels implement the same two, chosen explicitly):

* ``"a16w4"`` — activations are used as given (bf16 in the kernels), weights are MXFP4 dequantized exactly.
* ``"a8w4"`` — before each of the two GEMMs the activation row is quantized to MXFP8 E4M3 with one E8M0
  scale per 32 consecutive columns, by the rule in :func:`quantize_mxfp8_e4m3` (the smallest shared
  exponent that keeps every scaled value <= 448 — ``k3rocm.mx`` scale rule "round-up" — elements rounded
  to nearest even), then dequantized; the kernels compute the same values with ``tl.dot_scaled``. The
  intermediate ``h`` is quantized from its fp32 value, as the kernel's epilogue does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.mx import dequantize_mxfp4

__all__ = [
    "MODES",
    "E4M3_MAX",
    "Dispatch",
    "moe_router",
    "dispatch",
    "moe_experts",
    "expert_dense_weights",
    "quantize_mxfp8_e4m3",
    "shared_experts",
    "latent_tail",
    "latent_moe",
]

MODES = ("a16w4", "a8w4")
ACTS = ("situ", "silu")
E4M3_MAX = 448.0  # largest finite OCP E4M3 value (1.75 * 2^8)
E4M3_EMAX = 8  # exponent of the largest E4M3 binade


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


# ----------------------------------------------------------------------------------------------------------
# MX formats (exact decoding; the OCP MX v1.0 tables)
# ----------------------------------------------------------------------------------------------------------


def _dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, what: str = "weight") -> torch.Tensor:
    """Packed MXFP4 ``[..., n/2]`` u8 (element 2i in the low nibble) + scale ``[..., n/32]`` u8 -> fp32 ``[..., n]``.

    Exact (``k3rocm.mx.dequantize_mxfp4``). Raises CheckpointError (``MXFormatError``) on 0xFF scales / bad shapes.
    """
    return dequantize_mxfp4(packed, scale, where=f"{what} (MXFP4 expert weight)")


def quantize_mxfp8_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the last dim of ``x`` to MXFP8 E4M3 with one E8M0 scale per 32 values (the A8W4 rule).

    Rule ("no saturation"): per block of 32, ``amax = max|x| = 1.m * 2^E``; the shared exponent is the
    smallest e with ``amax * 2^-e <= 448``, i.e. ``e = E - 8`` when ``1.m <= 1.75`` else ``E - 7``, read from
    the fp32 bits (exact), clamped to -127..127 (amax = 0 or subnormal gives -127); element
    ``q = RNE_e4m3(clamp(x * 2^-e, -448, 448))``. (The OCP "floor" rule ``E - 8`` saturates blocks whose amax
    mantissa exceeds 1.75, a 12.5% error; this rule never saturates.) The Triton A8W4 kernels use the same
    rule bit for bit.

    Args:
        x: ``[..., n]`` any float dtype, n a multiple of 32. NaN/Inf are not expected (activations are finite).
    Returns:
        ``(q [..., n] torch.float8_e4m3fn, scale [..., n/32] uint8 E8M0, dequantized [..., n] fp32)``.
    Raises:
        ConfigError: n is not a multiple of 32.
    """
    x = _f32(x)
    n = x.shape[-1]
    if n % 32:
        raise ConfigError(f"MXFP8 quantization needs the last dim to be a multiple of 32, got {n}; pad the activation")
    blocks = x.reshape(*x.shape[:-1], n // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    bits = amax.view(torch.int32)
    exp_bits = (bits >> 23) & 0xFF  # biased exponent; 0 for zero/subnormal
    bump = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # mantissa above 1.75 would exceed 448
    e = torch.clamp(exp_bits - 127 - E4M3_EMAX + bump, -127, 127)
    inv = torch.ldexp(torch.ones_like(amax), -e)  # 2^-e, exact (|e| <= 127)
    scaled = torch.clamp(blocks * inv.unsqueeze(-1), -E4M3_MAX, E4M3_MAX)
    q = scaled.to(torch.float8_e4m3fn)
    deq = q.float() * torch.ldexp(torch.ones_like(amax), e).unsqueeze(-1)
    return q.reshape(x.shape), (e + 127).to(torch.uint8), deq.reshape(x.shape)


# ----------------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------------


def _topk_lowest_id(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row, ties broken by the lowest index (stable descending sort)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]


def moe_router(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
               renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with correction bias (K3_FACTS §5 step 1; HF ``KimiMoEGate``).

    ``logits = x @ gate_weight^T`` in fp32; ``s = sigmoid(logits)``; the top-k experts by ``s + bias``
    (ties: lowest expert id); weights = the unbiased ``s`` of the chosen, divided by their sum + 1e-20 when
    ``renormalize`` (HF ``moe_renormalize``), times ``scaling`` (``routed_scaling_factor``, 1.0 for K3).

    Args:
        x: ``[T, D]`` any float dtype. gate_weight: ``[E, D]`` (``block_sparse_moe.gate.weight``, bf16).
        bias: ``[E]`` fp32 ``gate.e_score_correction_bias`` or None (no correction).
        top_k: experts per token (``num_experts_per_token``, 16 for K3).
    Returns:
        ``(topk_ids [T, k] int32, topk_weights [T, k] fp32)``; ids in descending biased-score order.
    Raises:
        ConfigError: shapes disagree or top_k is not in 1..E.
    """
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ConfigError(f"moe_router: x {tuple(x.shape)} and gate.weight {tuple(gate_weight.shape)} do not match "
                          "([T, D] and [E, D]); check the gate tensor")
    E = gate_weight.shape[0]
    if not 0 < top_k <= E:
        raise ConfigError(f"moe_router: top_k {top_k} must be in 1..{E} (num_experts_per_token)")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ConfigError(f"moe_router: e_score_correction_bias shape {tuple(bias.shape)} != ({E},)")
    logits = _f32(x) @ _f32(gate_weight).t()
    s = torch.sigmoid(logits)
    biased = s + _f32(bias) if bias is not None else s
    ids = _topk_lowest_id(biased, top_k)
    w = torch.gather(s, 1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), w * float(scaling)


# ----------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Dispatch:
    """(token, expert) pairs grouped by expert (the layout the grouped GEMM consumes).

    Attributes (P = pairs kept on this rank, E_loc = experts of this rank):
        sorted_pair: ``[P]`` int64, index into ``topk_ids.flatten()`` (= token * k + slot), grouped by local
            expert, ascending within a group.
        sorted_token: ``[P]`` int64, token of each sorted pair (= sorted_pair // k).
        sorted_expert: ``[P]`` int64, local expert id of each sorted pair.
        counts: ``[E_loc]`` int64, pairs per local expert (0 allowed).
        offsets: ``[E_loc + 1]`` int64, exclusive prefix sum of counts (group e is offsets[e]:offsets[e+1]).
        global_to_local: ``[num_experts]`` int64, local id of each global expert, -1 when off this rank.
        expert_range: ``(first, end)`` global ids held by this rank (half-open).
    """

    sorted_pair: torch.Tensor
    sorted_token: torch.Tensor
    sorted_expert: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    global_to_local: torch.Tensor
    expert_range: tuple[int, int]

    @property
    def num_local_experts(self) -> int:
        return self.expert_range[1] - self.expert_range[0]


def dispatch(topk_ids: torch.Tensor, num_experts: int, expert_range: tuple[int, int] | None = None) -> Dispatch:
    """Sort (token, expert) pairs by expert; keep only ``expert_range`` for expert parallelism.

    Args:
        topk_ids: ``[T, k]`` int (global expert ids, from :func:`moe_router`).
        num_experts: total (global) experts, 896 for K3.
        expert_range: ``(first, end)`` global ids on this rank (EP: 896/8 = 112 each, DESIGN.md §6);
            None = all experts.
    Returns:
        :class:`Dispatch`; pairs of experts off this rank are dropped, ids are mapped global -> local.
    Raises:
        ConfigError: an id is outside 0..num_experts-1 or the range is not inside it.
    """
    first, end = (0, num_experts) if expert_range is None else (int(expert_range[0]), int(expert_range[1]))
    if not 0 <= first <= end <= num_experts:
        raise ConfigError(f"dispatch: expert_range ({first}, {end}) is not inside 0..{num_experts}")
    dev = topk_ids.device
    k = topk_ids.shape[-1] if topk_ids.dim() == 2 else 1
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ConfigError(f"dispatch: topk_ids holds ids outside 0..{num_experts - 1}; check the router output")
    g2l = torch.full((num_experts,), -1, dtype=torch.int64, device=dev)
    g2l[first:end] = torch.arange(end - first, dtype=torch.int64, device=dev)
    local = g2l[flat] if flat.numel() else flat
    keep = torch.nonzero(local >= 0).flatten()
    local_kept = local[keep]
    order = torch.sort(local_kept, stable=True).indices
    sorted_pair = keep[order]
    sorted_expert = local_kept[order]
    counts = torch.bincount(sorted_expert, minlength=end - first) if sorted_expert.numel() else \
        torch.zeros(end - first, dtype=torch.int64, device=dev)
    offsets = torch.zeros(end - first + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    return Dispatch(sorted_pair, sorted_pair // k, sorted_expert, counts, offsets, g2l, (first, end))


# ----------------------------------------------------------------------------------------------------------
# Routed experts
# ----------------------------------------------------------------------------------------------------------


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def expert_dense_weights(experts: Any, local_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(w13 [2I, D], w2 [D, I])`` of one local expert, MXFP4 dequantized exactly or bf16 widened.

    Args:
        experts: an ``ExpertWeights`` (``k3rocm.model.weights``) or any object / dict with the same fields:
            ``w13_packed [E, 2I, D/2] u8``, ``w13_scale [E, 2I, D/32] u8``, ``w2_packed [E, D, I/2] u8``,
            ``w2_scale [E, D, I/32] u8``, or unquantized ``w13 [E, 2I, D]``, ``w2 [E, D, I]``; an ExpertWeights
            whose stacks were released into the kernel layout is read back through ``expert_mxfp4``.
        local_id: index into the first dim.
    Raises:
        CheckpointError: neither form present, bad dtypes/shapes, or an E8M0 byte 0xFF.
    """
    if _get(experts, "w13_packed") is not None:
        if getattr(experts, "released", False):  # the stacks live in the kernel layout: read this expert back
            p13, s13, p2, s2 = experts.expert_mxfp4(local_id)
        else:
            p13, s13 = _get(experts, "w13_packed")[local_id], _get(experts, "w13_scale")[local_id]
            p2, s2 = _get(experts, "w2_packed")[local_id], _get(experts, "w2_scale")[local_id]
        return _dequantize_mxfp4(p13, s13, "w13"), _dequantize_mxfp4(p2, s2, "w2")
    if _get(experts, "w13") is not None:
        return _f32(_get(experts, "w13")[local_id]), _f32(_get(experts, "w2")[local_id])
    raise CheckpointError("ExpertWeights holds neither w13_packed/w2_packed (MXFP4) nor w13/w2; check the loader")


def _num_local(experts: Any) -> int:
    n = _get(experts, "num_experts")
    if n is not None:
        return int(n)
    t = _get(experts, "w13_packed")
    t = t if t is not None else _get(experts, "w13")
    return int(t.shape[0])


def _act(g: torch.Tensor, u: torch.Tensor, act: str, beta: float, beta_lin: float) -> torch.Tensor:
    if act == "situ":
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        return a * (beta_lin * torch.tanh(u / beta_lin))
    return torch.nn.functional.silu(g) * u


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Any,
                act: str = "situ", mode: str = "a16w4", beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """Weighted sum of the routed experts: ``out[t] = sum_j w[t,j] * W2_e(act(W1_e x_t, W3_e x_t))``, e = ids[t,j].

    K3_FACTS §5 step 3 (SiTU-GLU, beta = ``activation_situ_beta``, beta_lin = ``activation_situ_linear_beta``;
    ``act="silu"`` for the kimi_linear family). Only experts held in ``experts`` contribute (global ids
    ``first_expert .. first_expert + num_experts - 1``): under expert parallelism this is this rank's partial
    sum, to be all-reduced before the latent norm.

    Args:
        x: ``[T, D]`` any float dtype (the latent for K3, D = 3584).
        topk_ids: ``[T, k]`` int global expert ids. topk_weights: ``[T, k]`` float.
        experts: ``ExpertWeights`` (see :func:`expert_dense_weights`), with ``first_expert`` (default 0).
        act: ``"situ"`` or ``"silu"``.
        mode: ``"a16w4"`` or ``"a8w4"`` (see module docstring) — explicit, never read from the environment.
    Returns:
        ``[T, D]`` fp32.
    Raises:
        ConfigError: unknown mode/act, mismatched shapes, or a negative expert id (an unfilled router slot).
        CheckpointError: bad expert tensors.
    """
    if mode not in MODES:
        raise ConfigError(f"moe_experts: mode {mode!r} is not one of {', '.join(MODES)}; pass it explicitly")
    if act not in ACTS:
        raise ConfigError(f"moe_experts: act {act!r} is not one of {', '.join(ACTS)}")
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ConfigError(f"moe_experts: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                          f"{tuple(topk_weights.shape)} must be [T, D], [T, k], [T, k]")
    x = _f32(x)
    T, D = x.shape
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    n_local = _num_local(experts)
    first = int(_get(experts, "first_expert") or 0)
    if topk_ids.numel() == 0:
        return out
    k = topk_ids.shape[1]
    if int(topk_ids.min()) < 0:
        raise ConfigError(f"moe_experts: expert id {int(topk_ids.min())} < 0 in topk_ids (an unfilled router "
                          "slot?); every id must be a global expert id")
    d = dispatch(topk_ids, max(int(topk_ids.max()) + 1, first + n_local), (first, first + n_local))
    xin = quantize_mxfp8_e4m3(x)[2] if mode == "a8w4" else x
    wflat = _f32(topk_weights).reshape(-1)
    counts = d.counts.tolist()
    offs = d.offsets.tolist()
    for e in range(n_local):
        if counts[e] == 0:
            continue
        pairs = d.sorted_pair[offs[e]:offs[e + 1]]
        tok = pairs // k
        w13, w2 = expert_dense_weights(experts, e)
        if w13.shape[1] != D:
            raise ConfigError(f"moe_experts: expert input width {w13.shape[1]} != activation width {D}")
        gu = xin[tok] @ w13.t()
        inter = gu.shape[1] // 2
        h = _act(gu[:, :inter], gu[:, inter:], act, beta, beta_lin)
        if mode == "a8w4":
            h = quantize_mxfp8_e4m3(h)[2]
        y = (h @ w2.t()) * wflat[pairs].unsqueeze(1)
        out.index_add_(0, tok, y)
    return out


# ----------------------------------------------------------------------------------------------------------
# Shared experts, latent tail, full layer
# ----------------------------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = _f32(x)
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * _f32(weight) if weight is not None else y


def shared_experts(x: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor,
                   act: str = "situ", beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """Shared-expert MLP on the original x (K3_FACTS §5 step 5): ``down(act(gate x, up x))``, unweighted.

    Args:
        x: ``[T, H]``. gate_proj, up_proj: ``[S, H]`` (``shared_experts.gate_proj/up_proj.weight``,
            S = 6144 for K3, the 2 experts merged); down_proj: ``[H, S]``.
    Returns:
        ``[T, H]`` fp32.
    """
    x = _f32(x)
    return _act(x @ _f32(gate_proj).t(), x @ _f32(up_proj).t(), act, beta, beta_lin) @ _f32(down_proj).t()


def latent_tail(routed_sum: torch.Tensor, norm_weight: torch.Tensor | None, up_proj: torch.Tensor | None,
                shared: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """Latent tail (K3_FACTS §5 steps 4-5): ``up_proj(rms_norm(routed_sum, norm_weight)) + shared``.

    Args:
        routed_sum: ``[T, L]`` the (all-reduced) weighted expert sum in the latent (L = 3584).
        norm_weight: ``[L]`` ``routed_expert_norm.weight``; None skips the norm (plain MoE).
        up_proj: ``[H, L]`` ``routed_expert_up_proj.weight``; None = identity (plain MoE).
        shared: ``[T, H]`` output of :func:`shared_experts`, or None.
        eps: ``rms_norm_eps`` (1e-5).
    Returns:
        ``[T, H]`` fp32.
    """
    y = _f32(routed_sum)
    if norm_weight is not None:
        y = _rms_norm(y, norm_weight, eps)
    if up_proj is not None:
        y = y @ _f32(up_proj).t()
    return y + _f32(shared) if shared is not None else y


def latent_moe(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, experts: Any, top_k: int,
               down_proj: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               up_proj: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
               shared_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
               eps: float = 1e-5, renormalize: bool = True, scaling: float = 1.0, act: str = "situ",
               mode: str = "a16w4", beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """One whole Stable LatentMoE channel mixer in fp32 (K3_FACTS §5), single rank (all experts local).

    ``router(x)`` -> ``x_lat = down_proj(x)`` -> ``moe_experts(x_lat)`` -> ``latent_tail`` + ``shared_experts(x)``.

    Args:
        x: ``[T, H]`` after ``post_attention_layernorm``. gate_weight ``[E, H]``, bias ``[E]`` fp32.
        experts: ``ExpertWeights`` for all E experts. top_k: ``num_experts_per_token``.
        down_proj: ``[L, H]`` ``routed_expert_down_proj.weight`` (None: experts run on x, plain MoE).
        norm_weight ``[L]``, up_proj ``[H, L]``: the latent tail; shared_*: the shared-expert MLP (None: none).
        eps: ``rms_norm_eps``; renormalize/scaling: ``moe_renormalize`` / ``routed_scaling_factor``.
        act, mode, beta, beta_lin: as :func:`moe_experts`.
    Returns:
        ``[T, H]`` fp32 channel-mixer output (before it is added to the residual prefix).
    """
    ids, w = moe_router(x, gate_weight, bias, top_k, renormalize, scaling)
    xl = _f32(x) @ _f32(down_proj).t() if down_proj is not None else _f32(x)
    routed = moe_experts(xl, ids, w, experts, act=act, mode=mode, beta=beta, beta_lin=beta_lin)
    sh = shared_experts(x, shared_gate, shared_up, shared_down, act, beta, beta_lin) if shared_gate is not None else None
    return latent_tail(routed, norm_weight, up_proj, sh, eps)
