"""Decoder sublayers of the fp32 oracle on flat varlen tokens ``[T, hidden]``.

Every sublayer reads its weights by checkpoint name through a :class:`WeightView`, widens them to fp32
when it uses them (no fp32 copy is kept) and calls the heavy ops through an ``ops`` mapping
(op name -> callable, the names of :data:`k3rocm.model.ops.ORACLE_OPS`). By default these are the oracle
functions in :mod:`k3rocm.model`; the GPU engine passes kernels with the same signatures.

Sources: K3_FACTS §5 (KDA, gated NoPE MLA, Stable LatentMoE, SiTU-GLU, Block Attention Residuals) and,
for the ``kimi_linear`` family, transformers' ``modeling_kimi_linear.py`` (residual stream, plain MoE,
SiLU-GLU, low-rank output gate, softplus decay gate, MLA without output gate).

Batches: ``B = 1``, tokens of N sequences packed back to back, ``cu_seqlens`` int32 ``[N+1]``. A
:class:`Batch` says where each sequence starts in its cache (``start_pos``) and which cache slot it owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.model.common import f32, linear, rms_norm, silu_glu, situ_glu
from k3rocm.model.ops import ORACLE_OPS

__all__ = [
    "resolve_ops", "WeightView", "Batch", "K3Cache", "AttnResState",
    "kda_mixer", "mla_mixer", "dense_mlp", "moe_block", "fold_res_weight", "attn_side", "mlp_side",
    "final_aggregate",
]


def resolve_ops(ops: Mapping[str, Callable] | None = None) -> dict[str, Callable]:
    """The op table: ``ops`` entries override, the fp32 oracle functions of
    :data:`k3rocm.model.ops.ORACLE_OPS` fill the rest.

    Raises:
        ConfigError: ``ops`` names an unknown op.
    """
    ops = dict(ops or {})
    bad = sorted(set(ops) - set(ORACLE_OPS))
    if bad:
        raise ConfigError(f"unknown op name(s) {bad} in ops; known: {', '.join(ORACLE_OPS)}")
    return {name: ops.get(name, fn) for name, fn in ORACLE_OPS.items()}


# ---------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------


class WeightView:
    """Read-only access to a model's tensors by model-relative checkpoint name.

    ``view("layers.3.self_attn.q_a_proj.weight")`` returns the stored tensor (any dtype, never copied);
    ``view.head()`` the lm_head. Works on

    * a ``Mapping[str, Tensor]`` keyed by full checkpoint names (``language_model.model.…`` for K3,
      ``model.…`` for Kimi-Linear), or
    * a ``Weights`` object (:mod:`k3rocm.model.weights`) offering ``get(name)`` / ``__getitem__`` by full name.

    Routed experts: :meth:`experts` returns the source's own ``ExpertWeights`` when it has an ``experts(layer)``
    method, else stacks the per-expert tensors of that one layer (packed MXFP4 stays packed; nothing is
    dequantized here, ``moe_experts`` dequantizes per expert on the fly).

    Args:
        source: mapping or Weights object.
        prefix: name prefix of model tensors (``language_model.model.`` for K3).
        head: full name of the lm_head weight.
    Raises:
        CheckpointError: (on access) a tensor is missing — the message names it.
    """

    def __init__(self, source: Any, prefix: str = "language_model.model.", head: str = "language_model.lm_head.weight"):
        self.source = source
        self.prefix = prefix
        self.head_name = head

    def _raw(self, full: str) -> torch.Tensor:
        src = self.source
        t = None
        try:
            if hasattr(src, "get"):
                t = src.get(full)
            else:
                t = src[full]
        except KeyError:
            t = None
        if t is None:
            raise CheckpointError(f"tensor {full} is missing from the weights; the checkpoint does not match "
                                  f"its config (re-run 'k3rocm validate --level load')")
        return t

    def __call__(self, name: str) -> torch.Tensor:
        return self._raw(self.prefix + name)

    def has(self, name: str) -> bool:
        try:
            self(name)
            return True
        except CheckpointError:
            return False

    def head(self) -> torch.Tensor:
        return self._raw(self.head_name)

    def experts(self, layer: int, cfg: K3Config) -> Any:
        """Routed experts of MoE layer ``layer`` in the ``ExpertWeights`` layout of the op contract."""
        fn = getattr(self.source, "experts", None)
        if callable(fn):
            return fn(layer)
        E = cfg.num_experts
        base = f"layers.{layer}.block_sparse_moe.experts."
        if cfg.experts_quantized:
            def stack(w: str, kind: str) -> torch.Tensor:
                return torch.stack([self(f"{base}{e}.{w}.weight_{kind}") for e in range(E)])
            return {
                "w13_packed": torch.cat([stack("w1", "packed"), stack("w3", "packed")], dim=1),
                "w13_scale": torch.cat([stack("w1", "scale"), stack("w3", "scale")], dim=1),
                "w2_packed": stack("w2", "packed"), "w2_scale": stack("w2", "scale"),
                "num_experts": E, "first_expert": 0,
            }
        w1 = torch.stack([self(f"{base}{e}.w1.weight") for e in range(E)])
        w3 = torch.stack([self(f"{base}{e}.w3.weight") for e in range(E)])
        return {"w13": torch.cat([w1, w3], dim=1), "w2": torch.stack([self(f"{base}{e}.w2.weight") for e in range(E)]),
                "num_experts": E, "first_expert": 0}


# ---------------------------------------------------------------------------------------------------------
# cache and batch
# ---------------------------------------------------------------------------------------------------------


@dataclass
class K3Cache:
    """Decode state of ``batch`` sequences (slot n = sequence n), fp32.

    Attributes:
        lengths: ``[batch]`` int64 tokens already in the cache per sequence.
        conv: layer -> ``[batch, 3, P, W-1]`` KDA conv state (q, k, v; last W-1 inputs, oldest first).
        ssm: layer -> ``[batch, H, K, V]`` KDA recurrent state.
        kv: layer -> ``[batch * blocks_per_seq, block_size, kv_lora_rank + qk_rope_head_dim]`` MLA latent cache
            (normed latent then un-rotated k_rope); sequence n owns blocks ``n*blocks_per_seq …`` contiguously.
        block_table: ``[batch, blocks_per_seq]`` int32.
        block_size: tokens per block. max_len: capacity per sequence.
    """

    batch: int
    max_len: int
    block_size: int
    lengths: torch.Tensor
    block_table: torch.Tensor
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)
    kv: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def empty(cls, cfg: K3Config, batch: int, max_len: int = 1024, block_size: int = 16,
              device: torch.device | str = "cpu") -> "K3Cache":
        """Zeroed state for ``batch`` sequences of up to ``max_len`` tokens (sizes per K3_FACTS §5/§7)."""
        if batch < 1 or max_len < 1:
            raise ConfigError(f"cache batch {batch} and max_len {max_len} must be positive")
        nb = -(-max_len // block_size)
        c = cls(batch, nb * block_size, block_size, torch.zeros(batch, dtype=torch.int64),
                torch.arange(batch * nb, dtype=torch.int32).view(batch, nb))
        P, W = cfg.kda_proj_size, cfg.short_conv_kernel_size
        for i, t in enumerate(cfg.layer_types):
            if t == "kda":
                c.conv[i] = torch.zeros(batch, 3, P, W - 1, dtype=torch.float32, device=device)
                c.ssm[i] = torch.zeros(batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim,
                                       dtype=torch.float32, device=device)
            else:
                c.kv[i] = torch.zeros(batch * nb, block_size, cfg.mla_cache_width, dtype=torch.float32, device=device)
        return c


@dataclass
class Batch:
    """Where the packed tokens of one step come from.

    Attributes:
        cu_seqlens: ``[N+1]`` int32 token offsets of the N sequences.
        cache: the :class:`K3Cache` to read and update, or None (plain causal forward, no state kept).
        slots: ``[N]`` int64 cache slot of each sequence (``arange(N)`` when None).
        start_pos: ``[N]`` int64 tokens already cached per sequence before this step.
        decode: True when every sequence contributes exactly one token (the decode kernels run).
    """

    cu_seqlens: torch.Tensor
    cache: K3Cache | None = None
    slots: torch.Tensor | None = None
    start_pos: torch.Tensor | None = None
    decode: bool = False

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seqlens(self) -> list[int]:
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]

    def slot_list(self) -> list[int]:
        return list(range(self.num_seqs)) if self.slots is None else [int(s) for s in self.slots]

    def starts(self) -> list[int]:
        return [0] * self.num_seqs if self.start_pos is None else [int(s) for s in self.start_pos]


# ---------------------------------------------------------------------------------------------------------
# token mixers
# ---------------------------------------------------------------------------------------------------------


def kda_mixer(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
              batch: Batch) -> torch.Tensor:
    """KDA token mixer (K3_FACTS §5 "KDA layer"): x ``[T, hidden]`` (after ``input_layernorm``) -> ``[T, hidden]``.

    q, k, v = full-rank projections; causal depthwise conv (``short_conv``, FP32 weights) + SiLU on each;
    decay_raw = ``f_b(f_a(x))``; beta_raw = ``b_proj(x)``; ``kda_prefill`` (L2 norm, scale K^-0.5, gate, delta
    rule) or ``kda_decode`` (one token per sequence, fused); per-head RMSNorm with ``o_norm`` (eps
    ``rms_norm_eps``) then × sigmoid(output gate); ``o_proj``. Output gate: ``g_proj(x)`` (K3, full rank) or
    ``g_b_proj(g_a_proj(x))`` (kimi_linear, low rank). Gate form: ``"k3"`` (bounded sigmoid, lower bound
    ``gate_lower_bound``) or ``"kimi_linear"`` (``-exp(A_log) * softplus``).

    With ``batch.cache``: conv and recurrent states are read from / written to the cache slots.
    """
    p = f"layers.{layer}.self_attn."
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    P = H * K
    T = x.shape[0]
    form = "k3" if cfg.family == "k3" else "kimi_linear"
    q_raw, k_raw, v_raw = (linear(x, w(p + f"{n}_proj.weight")) for n in "qkv")
    decay_raw = linear(linear(x, w(p + "f_a_proj.weight")), w(p + "f_b_proj.weight"))
    beta_raw = linear(x, w(p + "b_proj.weight"))
    if cfg.family == "k3":
        gate_raw = linear(x, w(p + "g_proj.weight"))
    else:
        gate_raw = linear(linear(x, w(p + "g_a_proj.weight")), w(p + "g_b_proj.weight"))
    A_log = f32(w(p + "A_log")).reshape(-1)
    dt_bias = f32(w(p + "dt_bias")).reshape(-1)
    convw = [f32(w(p + f"{n}_conv1d.weight")) for n in "qkv"]
    o_norm = f32(w(p + "o_norm.weight"))
    cache = batch.cache
    dev = x.device
    slots = torch.tensor(batch.slot_list(), dtype=torch.int64, device=dev)
    eps = cfg.rms_norm_eps

    if batch.decode and cache is not None and form == "k3":
        o = ops["kda_decode"](q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw, tuple(convw), A_log, dt_bias,
                              o_norm, cache.conv[layer], cache.ssm[layer], slots.to(torch.int32), eps,
                              None, cfg.gate_lower_bound)
        return linear(o, w(p + "o_proj.weight"))

    cu = batch.cu_seqlens.to(dev)
    conv_states = [None, None, None]
    init = None
    if cache is not None:
        conv_states = [cache.conv[layer][slots, j].clone() for j in range(3)]
        init = cache.ssm[layer][slots].clone()
    qkv = []
    finals = []
    for j, raw in enumerate((q_raw, k_raw, v_raw)):
        y, fin = ops["short_conv"](raw.unsqueeze(0), convw[j], conv_states[j], cu)
        qkv.append(y)
        finals.append(fin)
    q, k, v = (t.reshape(1, T, H, K) for t in qkv)
    o, state = ops["kda_prefill"](q, k, v, decay_raw.unsqueeze(0), beta_raw.unsqueeze(0), A_log, dt_bias,
                                  initial_state=init, cu_seqlens=cu, scale=None, lower_bound=cfg.gate_lower_bound,
                                  gate_form=form)
    if cache is not None:
        for j in range(3):
            cache.conv[layer][slots, j] = f32(finals[j])
        cache.ssm[layer][slots] = f32(state)
    o = o.reshape(T, H, K)
    o = rms_norm(o, o_norm, eps) * torch.sigmoid(gate_raw.view(T, H, K))
    return linear(o.reshape(T, P), w(p + "o_proj.weight"))


def _kv_b_split(w: WeightView, p: str, cfg: K3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj`` [H*(Dn+Dv), R] -> (w_kc [H, Dn, R], w_vc [H, R, Dv]) fp32 (K3_FACTS §3, DeepSeek absorption)."""
    H, Dn, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kvb = f32(w(p + "kv_b_proj.weight")).view(H, Dn + Dv, cfg.kv_lora_rank)
    return kvb[:, :Dn, :].contiguous(), kvb[:, Dn:, :].transpose(1, 2).contiguous()


def mla_mixer(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
              batch: Batch) -> torch.Tensor:
    """Gated NoPE MLA token mixer (K3_FACTS §5 "Gated MLA layer"): x ``[T, hidden]`` -> ``[T, hidden]`` fp32.

    q = ``q_b(RMSNorm_{q_a_layernorm}(q_a(x)))`` (or ``q_proj(x)`` without q_lora) -> H × (nope + rope);
    ``kv_a_proj_with_mqa(x)`` -> latent (``kv_a_layernorm``) + k_rope (neither normed nor rotated);
    ``kv_b`` expands the latent to H × (k_nope + v); causal softmax attention with scale
    ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5`` (192^-0.5 for K3). Output × sigmoid(``g_proj(x)``) when the
    layer has ``g_proj`` (K3; x is this mixer's input), then ``o_proj``.

    Paths: no cache -> ``mla_prefill``; cache and fresh sequences -> ``mla_prefill`` + ``mla_cache_write``;
    cache with earlier context or decode -> ``mla_cache_write`` + absorbed ``mla_decode``.
    """
    p = f"layers.{layer}.self_attn."
    H, Dn, Dr, Dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    T = x.shape[0]
    eps = cfg.rms_norm_eps
    if cfg.q_lora_rank:
        q = linear(rms_norm(linear(x, w(p + "q_a_proj.weight")), w(p + "q_a_layernorm.weight"), eps),
                   w(p + "q_b_proj.weight"))
    else:
        q = linear(x, w(p + "q_proj.weight"))
    q = q.view(T, H, Dn + Dr)
    ckv = linear(x, w(p + "kv_a_proj_with_mqa.weight"))
    latent = rms_norm(ckv[:, :R], w(p + "kv_a_layernorm.weight"), eps)
    k_rope = ckv[:, R:].contiguous()
    scale = (Dn + Dr) ** -0.5
    cache = batch.cache
    starts = batch.starts()
    fresh = all(s == 0 for s in starts)

    if cache is not None:
        slots = batch.slot_list()
        cu = batch.cu_seqlens.tolist()
        bs = cache.block_size
        pos = []
        for n in range(batch.num_seqs):
            L = cu[n + 1] - cu[n]
            if starts[n] + L > cache.max_len:
                raise ConfigError(f"sequence {n}: {starts[n] + L} tokens exceed the cache capacity {cache.max_len}; "
                                  "create the cache with a larger max_len")
            tpos = torch.arange(starts[n], starts[n] + L)
            blocks = cache.block_table[slots[n]].to(torch.int64)[tpos // bs]
            pos.append(blocks * bs + tpos % bs)
        slot_mapping = (torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)).to(x.device)
        ops["mla_cache_write"](cache.kv[layer], slot_mapping, latent, k_rope)

    if cache is None or (fresh and not batch.decode):
        kvb = linear(latent, w(p + "kv_b_proj.weight")).view(T, H, Dn + Dv)
        k_nope, v = kvb[..., :Dn].contiguous(), kvb[..., Dn:].contiguous()
        cu = batch.cu_seqlens.to(x.device)
        o = ops["mla_prefill"](q, k_nope, k_rope, v, cu, cu, scale)
    else:
        w_kc, w_vc = _kv_b_split(w, p, cfg)
        q_nope, q_rope = q[..., :Dn], q[..., Dn:]
        slots_t = torch.tensor(batch.slot_list(), dtype=torch.int64)
        if batch.decode:
            ctx = torch.tensor([s + 1 for s in starts], dtype=torch.int32, device=x.device)
            o = ops["mla_decode"](q_nope.unsqueeze(1).contiguous(), q_rope.unsqueeze(1).contiguous(), cache.kv[layer],
                                  cache.block_table[slots_t].to(x.device), ctx, w_kc, w_vc, scale)
            o = o.reshape(T, H, Dv)
        else:
            outs = []
            cu = batch.cu_seqlens.tolist()
            for n in range(batch.num_seqs):
                a, b = cu[n], cu[n + 1]
                if b == a:
                    continue
                ctx = torch.tensor([starts[n] + b - a], dtype=torch.int32, device=x.device)
                o_n = ops["mla_decode"](q_nope[a:b].unsqueeze(0).contiguous(), q_rope[a:b].unsqueeze(0).contiguous(),
                                        cache.kv[layer], cache.block_table[slots_t[n:n + 1]].to(x.device), ctx,
                                        w_kc, w_vc, scale)
                outs.append(o_n[0])
            o = torch.cat(outs, 0)
    o = f32(o).reshape(T, H * Dv)
    if mla_has_output_gate(cfg):  # decided by the config, so a missing g_proj is an error, never an ungated model
        o = o * torch.sigmoid(linear(x, w(p + "g_proj.weight")))
    return linear(o, w(p + "o_proj.weight"))


def mla_has_output_gate(cfg: K3Config) -> bool:
    """Gated MLA (K3: ``mla_use_output_gate``, attn_out × sigmoid(g_proj(x))); Kimi-Linear's MLA has no gate."""
    text = cfg.raw.get("text_config", cfg.raw) if isinstance(cfg.raw, dict) else {}
    return bool(text.get("mla_use_output_gate", cfg.family == "k3"))


# ---------------------------------------------------------------------------------------------------------
# channel mixers
# ---------------------------------------------------------------------------------------------------------


def _glu(cfg: K3Config, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if cfg.hidden_act == "situ":
        return situ_glu(g, u, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    if cfg.hidden_act == "silu":
        return silu_glu(g, u)
    raise ConfigError(f"hidden_act {cfg.hidden_act!r} is not supported (situ for K3, silu for kimi_linear)")


def dense_mlp(x: torch.Tensor, w: WeightView, prefix: str, cfg: K3Config) -> torch.Tensor:
    """GLU MLP ``down(act(gate(x), up(x)))`` in fp32: x ``[T, hidden]`` -> ``[T, hidden]``.

    ``prefix`` is e.g. ``layers.0.mlp.`` (dense layer 0) or ``layers.i.block_sparse_moe.shared_experts.``
    (the shared experts, stored merged). act = SiTU-GLU (K3_FACTS §5) or SiLU-GLU (kimi_linear).
    """
    h = _glu(cfg, linear(x, w(prefix + "gate_proj.weight")), linear(x, w(prefix + "up_proj.weight")))
    return linear(h, w(prefix + "down_proj.weight"))


def moe_block(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
              mode: str = "a16w4") -> torch.Tensor:
    """MoE channel mixer: Stable LatentMoE (K3) or plain MoE (kimi_linear). x ``[T, hidden]`` -> ``[T, hidden]`` fp32.

    K3_FACTS §5: FP32 router (``moe_router``: sigmoid, biased top-k, unbiased renormalised weights ×
    ``routed_scaling_factor``); K3 only: x_lat = ``routed_expert_down_proj(x)``; ``moe_experts`` (weighted sum,
    SiTU-GLU / SiLU-GLU; ``mode`` "a16w4" or "a8w4" for MXFP4 experts); K3 only: ``routed_expert_norm`` on the
    sum then ``routed_expert_up_proj``; + shared experts on the original x, unweighted.
    """
    p = f"layers.{layer}.block_sparse_moe."
    ids, wts = ops["moe_router"](x, w(p + "gate.weight"), w(p + "gate.e_score_correction_bias"),
                                 cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
    latent = cfg.routed_expert_hidden_size is not None
    xin = linear(x, w(p + "routed_expert_down_proj.weight")) if latent else x
    act = "situ" if cfg.hidden_act == "situ" else "silu"
    y = ops["moe_experts"](xin, ids, wts, w.experts(layer, cfg), act=act,
                           mode=mode if cfg.experts_quantized else "a16w4",
                           beta=cfg.activation_situ_beta, beta_lin=cfg.activation_situ_linear_beta)
    y = f32(y)
    if latent:
        y = linear(rms_norm(y, w(p + "routed_expert_norm.weight"), cfg.rms_norm_eps),
                   w(p + "routed_expert_up_proj.weight"))
    if cfg.num_shared_experts:
        y = y + dense_mlp(x, w, p + "shared_experts.", cfg)
    return y


# ---------------------------------------------------------------------------------------------------------
# Block Attention Residuals bookkeeping (K3_FACTS §5)
# ---------------------------------------------------------------------------------------------------------


def fold_res_weight(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """``norm.weight ⊙ proj.weight[0]`` in fp32 ``[D]`` — the AttnRes score vector, folded once at load."""
    return (f32(norm_weight) * f32(proj_weight).reshape(-1)).contiguous()


@dataclass
class AttnResState:
    """Per-forward Block AttnRes state on flat tokens.

    Attributes:
        bank: completed-block rows (embedding first), each its own ``[T, D]`` fp32 tensor (never a view of
            another row or of the prefix).
        prefix: ``[T, D]`` fp32 running sum of the current block (the embedding before layer 0).
    """

    bank: list[torch.Tensor]
    prefix: torch.Tensor


def _aggregate(ops: Mapping[str, Callable], rows: list[torch.Tensor], weight: torch.Tensor, eps: float) -> torch.Tensor:
    return f32(ops["attn_res"](torch.stack(rows), weight, eps))


def attn_side(state: AttnResState, layer: int, weight: torch.Tensor, cfg: K3Config,
              ops: Mapping[str, Callable]) -> torch.Tensor:
    """Attention-side aggregation of layer ``layer``; returns the token-mixer input before ``input_layernorm``.

    Layer 0: no aggregation, the embedding passes through. On a write layer (``i % attn_res_block_size == 0``)
    the pre-attention prefix becomes a new bank row and the prefix restarts at zero (a fresh tensor).
    """
    if layer == 0:
        h = state.prefix
    else:
        h = _aggregate(ops, state.bank + [state.prefix], weight, cfg.rms_norm_eps)
    if cfg.is_write_layer(layer):
        state.bank.append(state.prefix)
        state.prefix = torch.zeros_like(h)
    return h


def mlp_side(state: AttnResState, weight: torch.Tensor, cfg: K3Config, ops: Mapping[str, Callable]) -> torch.Tensor:
    """MLP-side aggregation over bank rows + prefix (which now holds this layer's attention output)."""
    return _aggregate(ops, state.bank + [state.prefix], weight, cfg.rms_norm_eps)


def final_aggregate(state: AttnResState, weight: torch.Tensor, cfg: K3Config,
                    ops: Mapping[str, Callable]) -> torch.Tensor:
    """``output_attn_res_*`` aggregation over all bank rows + prefix, before the final ``norm``."""
    return _aggregate(ops, state.bank + [state.prefix], weight, cfg.rms_norm_eps)
