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

import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import torch

from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.model.common import (current_matmul_dtype, f32, linear, linear_lp, matmul_input, rms_norm, silu_glu,
                                 situ_glu)
from k3rocm.model.ops import ORACLE_OPS

__all__ = [
    "resolve_ops", "WeightView", "Batch", "K3Cache", "AttnResState", "local_config",
    "linears", "kda_mixer", "kda_decode_rows", "mla_mixer", "mla_decode_rows", "mla_project", "mla_output", "mla_kv_split",
    "mla_has_output_gate", "dense_mlp", "moe_block", "attn_side", "mlp_side", "final_aggregate",
    "mla_row_slots", "mixer_input_dtype",
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


#: rows of a concatenated projection are padded to a multiple of this (16-byte aligned bf16 product rows and
#: whole 64-wide GEMM tiles)
FUSED_ROW_ALIGN = 64


class WeightView:
    """Read-only access to a :class:`~k3rocm.model.weights.Weights` by model-relative checkpoint name.

    ``view("layers.3.self_attn.q_a_proj.weight")`` returns the stored tensor (any dtype, never copied);
    ``view.head()`` the lm_head; ``view.experts(layer)`` the layer's routed experts in the op contract's
    ``ExpertWeights`` layout (the Weights' own stacks: packed MXFP4 stays packed, ``moe_experts`` dequantizes
    per expert on the fly). Weights are the one protocol every model reads: the fp32 oracle, the serving
    engine and each rank of a TP/EP layout (a rank's Weights hold its local slices and experts).

    Args:
        source: a :class:`~k3rocm.model.weights.Weights` (or anything with ``get(full_name)`` and
            ``experts(layer)``).
        prefix: name prefix of model tensors (``language_model.model.`` for K3, ``model.`` for Kimi-Linear).
        head: full name of the lm_head weight.
        memo: keep tensors derived from the weights (:meth:`derived`) — the engine's choice; the oracle derives
            them per use and holds no second copy.
    Raises:
        CheckpointError: (on access) a tensor is missing — the message names it.
    """

    def __init__(self, source: Any, prefix: str = "language_model.model.", head: str = "language_model.lm_head.weight",
                 memo: bool = False):
        self.source = source
        self.prefix = prefix
        self.head_name = head
        self._memo: dict[str, Any] | None = {} if memo else None

    def _raw(self, full: str) -> torch.Tensor:
        t = self.source.get(full)
        if t is None:
            raise CheckpointError(f"tensor {full} is missing from the weights; the checkpoint does not match "
                                  f"its config (re-run 'k3rocm validate --level load')")
        return t

    def __call__(self, name: str) -> torch.Tensor:
        return self._raw(self.prefix + name)

    def has(self, name: str) -> bool:
        return self.source.get(self.prefix + name) is not None

    def head(self) -> torch.Tensor:
        return self._raw(self.head_name)

    def experts(self, layer: int) -> Any:
        """Routed experts of MoE layer ``layer`` (``ExpertWeights``: this source's expert range)."""
        return self.source.experts(layer)

    @property
    def memoises(self) -> bool:
        """Whether this view keeps derived tensors (the engine's view; the oracle's does not)."""
        return self._memo is not None

    def derived(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` — kept under ``key`` when this view memoises (see ``memo``), else computed each call."""
        if self._memo is None:
            return fn()
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def f32(self, name: str) -> torch.Tensor:
        """Tensor ``name`` widened to fp32 (exact); widened once when this view memoises, else per call."""
        return self.derived("f32:" + name, lambda: f32(self(name)))

    def fused(self, names: tuple[str, ...]) -> tuple[torch.Tensor, list[int]] | None:
        """Weights ``names`` (``[out_i, in]``, one dtype and device) concatenated along ``out`` —
        ``(W [sum out_i, in], [out_i, ...])``, built once — when this view memoises (the engine's: one GEMM
        then replaces ``len(names)``); None for a view that does not memoise (the oracle multiplies each weight
        alone, so its numerics never change) or weights that cannot be stacked. The concatenation is a second
        copy of those weights next to the source's.

        ``W`` has ``FUSED_ROW_ALIGN``-aligned rows: zero rows pad ``sum out_i`` up (their output columns are
        dropped by :func:`linears`). A rank's KDA projections sum to an odd-aligned width (K3 at TP16:
        4 x 768 + 6 + 128 = 3,206 outputs), whose product rows are only 2-element aligned, which restricts
        cuBLAS to its align-2 kernels (the H200 profile of 2026-12-02 shows ``cutlass_80_wmma ... align2`` at 25
        us per call, most likely this product)."""
        if self._memo is None:
            return None

        def build() -> tuple[torch.Tensor, list[int]] | None:
            ts = [self(n) for n in names]
            if any(t.dim() != 2 for t in ts) or len({(t.dtype, t.device, t.shape[1]) for t in ts}) != 1:
                return None
            sizes = [t.shape[0] for t in ts]
            pad = -sum(sizes) % FUSED_ROW_ALIGN
            if pad:
                ts.append(ts[0].new_zeros(pad, ts[0].shape[1]))
            return torch.cat(ts, 0), sizes
        return self.derived("cat:" + "|".join(names), build)


def linears(x: torch.Tensor, w: WeightView, names: tuple[str, ...]) -> list[torch.Tensor]:
    """``[linear(x, w(n)) for n in names]`` (fp32 ``[T, out_i]`` each), as one GEMM over the concatenated
    weights (column views of one ``[T, sum out_i]`` product) on the low-precision path (a
    :func:`~k3rocm.model.common.matmul_dtype` scope of the weights' dtype) where :meth:`WeightView.fused`
    gives them; fp32 math keeps one GEMM per weight (its summation order, bit for bit)."""
    dt = current_matmul_dtype()
    fused = w.fused(names) if dt is not None and w(names[0]).dtype == dt else None
    if fused is None:
        return [linear(x, w(n)) for n in names]
    cat, sizes = fused
    pad = cat.shape[0] - sum(sizes)  # alignment rows (WeightView.fused), not returned
    return list(torch.split(linear(x, cat), sizes + [pad] if pad else sizes, dim=-1))[:len(sizes)]


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
        """Zeroed state for ``batch`` sequences of up to ``max_len`` tokens (sizes per K3_FACTS §5/§7).

        ``cfg`` is the config the token mixers see: one rank's view under tensor parallelism (its KDA heads)."""
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
        cu_host: the same offsets as a host list, or None. Where cu_seqlens lives on the device (the serving
            engine) the mixers read the offsets here, so no layer waits for the device to drain to read them
            (the K3 rank's mixed step read them 5 times per layer before: ~450 device->host syncs per step).
    """

    cu_seqlens: torch.Tensor
    cache: K3Cache | None = None
    slots: torch.Tensor | None = None
    start_pos: torch.Tensor | None = None
    decode: bool = False
    cu_host: list[int] | None = None
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def device_ints(self, key: str, values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
        """``values`` as a ``dtype`` tensor on ``device``, made once per batch and ``key`` and shared by every
        layer (a GPU copy goes through pinned memory, non-blocking: ``torch.tensor(..., device=cuda)`` would wait
        for the device to drain, once per layer). Callers must not write the tensor."""
        dev = torch.device(device)
        k = (key, dtype, str(dev))
        t = self._on_device.get(k)
        if t is None:
            t = torch.tensor(values, dtype=dtype)
            t = t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)
            self._on_device[k] = t
        return t

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per batch and ``key``, shared by every layer (what depends only on the batch's layout,
        e.g. the MLA cache slots of its tokens: the same in each MLA layer of a step). Callers must not write it."""
        k = ("memo", key)
        if k not in self._on_device:
            self._on_device[k] = make()
        return self._on_device[k]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def cu_list(self) -> list[int]:
        """The offsets ``[N+1]`` as host ints (:attr:`cu_host` when given, else read from cu_seqlens)."""
        return list(self.cu_host) if self.cu_host is not None else [int(c) for c in self.cu_seqlens.tolist()]

    def cu_host_tensor(self) -> torch.Tensor:
        """The offsets as a host int32 tensor (for ops that read them on the host only), made once per batch."""
        return self.device_ints("cu_seqlens", self.cu_list(), torch.int32, "cpu")

    @property
    def seqlens(self) -> list[int]:
        cu = self.cu_list()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]

    def slot_list(self) -> list[int]:
        return list(range(self.num_seqs)) if self.slots is None else [int(s) for s in self.slots]

    def starts(self) -> list[int]:
        return [0] * self.num_seqs if self.start_pos is None else [int(s) for s in self.start_pos]


# ---------------------------------------------------------------------------------------------------------
# token mixers
# ---------------------------------------------------------------------------------------------------------
#
# ``cfg`` below is the config the mixer sees: under tensor parallelism one rank's view (its KDA and MLA head
# counts, :func:`local_config`); each mixer returns its ``o_proj`` output, which under TP is the rank's partial sum
# (the decoder skeleton reduces it).


def local_config(cfg: K3Config, tp: int) -> K3Config:
    """The per-rank view of ``cfg`` under tensor parallelism: KDA and MLA head counts divided by ``tp``.

    Raises:
        ConfigError: a head count is not divisible by ``tp``.
    """
    if tp == 1:
        return cfg
    if cfg.kda_num_heads % tp or cfg.num_attention_heads % tp:
        raise ConfigError(f"heads ({cfg.kda_num_heads} KDA, {cfg.num_attention_heads} MLA) not divisible by tp={tp}")
    return replace(cfg, kda_num_heads=cfg.kda_num_heads // tp, num_attention_heads=cfg.num_attention_heads // tp)


def _kda_inputs(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config) -> dict[str, Any]:
    """KDA projections and fp32 parameters of ``layer`` (K3_FACTS §5): raw q, k, v ``[T, H*K]``, decay_raw
    ``f_b(f_a(x))`` ``[T, H*K]``, beta_raw ``[T, H]``, gate_raw ``[T, H*K]`` (``g_proj`` for K3, low-rank
    ``g_b(g_a(x))`` for kimi_linear), conv weights, ``A_log`` / ``dt_bias`` flat, ``o_norm``."""
    p = f"layers.{layer}.self_attn."
    # every projection of x in one GEMM where the view fuses them (q|k|v|g (or g_a)|b|f_a)
    g_name = "g_proj" if cfg.family == "k3" else "g_a_proj"
    q_raw, k_raw, v_raw, g_raw, beta_raw, f_a = linears(
        x, w, tuple(p + f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", g_name, "b_proj", "f_a_proj")))
    gate_raw = g_raw if cfg.family == "k3" else linear(g_raw, w(p + "g_b_proj.weight"))
    return {"q": q_raw, "k": k_raw, "v": v_raw, "decay": linear(f_a, w(p + "f_b_proj.weight")),
            "beta": beta_raw, "gate": gate_raw,
            "conv": tuple(w.f32(p + f"{n}_conv1d.weight") for n in "qkv"),
            "A_log": w.f32(p + "A_log").reshape(-1), "dt_bias": w.f32(p + "dt_bias").reshape(-1),
            "o_norm": w.f32(p + "o_norm.weight")}


#: the per-row tensors of :func:`_kda_inputs` (the rest are the layer's parameters)
KDA_ROW_INPUTS = ("q", "k", "v", "decay", "beta", "gate")


def kda_input_rows(a: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """:func:`_kda_inputs` of rows ``start:stop`` only (row views of the per-row tensors; parameters shared)."""
    return {**a, **{n: a[n][start:stop] for n in KDA_ROW_INPUTS}}


def kda_decode_core(a: dict[str, Any], cfg: K3Config, ops: Mapping[str, Callable], conv_state: torch.Tensor,
                    ssm_state: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """The fused ``kda_decode`` op on :func:`_kda_inputs` ``a`` of N rows, one token each: ``[N, H*V]`` fp32,
    RMSNorm-ed and gated (the ``o_proj`` input). Padding rows (slot −1) give zeros and write nothing."""
    return ops["kda_decode"](a["q"], a["k"], a["v"], a["decay"], a["beta"], a["gate"], a["conv"], a["A_log"],
                             a["dt_bias"], a["o_norm"], conv_state, ssm_state, slot_ids, cfg.rms_norm_eps, None,
                             cfg.gate_lower_bound)


def kda_output(o: torch.Tensor, w: WeightView, layer: int) -> torch.Tensor:
    """``o_proj`` of the KDA mixer: ``o [T, H*V]`` (normed, gated) -> ``[T, hidden]`` fp32."""
    return linear(o, w(f"layers.{layer}.self_attn.o_proj.weight"))


def kda_decode_rows(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
                    conv_state: torch.Tensor, ssm_state: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """KDA token mixer for one token per row through the fused ``kda_decode`` op (K3 gate form).

    Args:
        x: ``[N, hidden]`` after ``input_layernorm``.
        conv_state: ``[slots, 3, P, W-1]`` fp32 and ssm_state ``[slots, H, K, V]`` fp32, updated in place.
        slot_ids: ``[N]`` int32 on the device; −1 = padding row (the op skips it: graph-capturable).
    Returns:
        ``[N, hidden]`` ``o_proj`` output.
    """
    a = _kda_inputs(x, w, layer, cfg)
    return kda_output(kda_decode_core(a, cfg, ops, conv_state, ssm_state, slot_ids), w, layer)


def kda_mixer(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
              batch: Batch) -> torch.Tensor:
    """KDA token mixer (K3_FACTS §5 "KDA layer"): x ``[T, hidden]`` (after ``input_layernorm``) -> ``[T, hidden]``.

    q, k, v = full-rank projections; causal depthwise conv (``short_conv``, FP32 weights) + SiLU on each;
    decay_raw = ``f_b(f_a(x))``; beta_raw = ``b_proj(x)``; ``kda_prefill`` (L2 norm, scale K^-0.5, gate, delta
    rule) or ``kda_decode`` (one token per sequence, fused: :func:`kda_decode_rows`); per-head RMSNorm with
    ``o_norm`` (eps ``rms_norm_eps``) then × sigmoid(output gate); ``o_proj``. Output gate: ``g_proj(x)`` (K3,
    full rank) or ``g_b_proj(g_a_proj(x))`` (kimi_linear, low rank). Gate form: ``"k3"`` (bounded sigmoid, lower
    bound ``gate_lower_bound``) or ``"kimi_linear"`` (``-exp(A_log) * softplus``).

    With ``batch.cache``: conv and recurrent states are read from / written to the cache slots.
    """
    cache = batch.cache
    if batch.decode and cache is not None and cfg.family == "k3":
        slots = batch.device_ints("slots", batch.slot_list(), torch.int64, x.device)
        return kda_decode_rows(x, w, layer, cfg, ops, cache.conv[layer], cache.ssm[layer], slots.to(torch.int32))
    return kda_output(kda_prefill_core(_kda_inputs(x, w, layer, cfg), w, layer, cfg, ops, batch), w, layer)


def kda_prefill_core(a: dict[str, Any], w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
                     batch: Batch) -> torch.Tensor:
    """The sequence-dependent part of the KDA mixer on chunks (:func:`kda_mixer` without its projections):
    :func:`_kda_inputs` ``a`` of the batch's T rows -> ``[T, H*K]`` fp32, RMSNorm-ed and gated (the ``o_proj``
    input). Reads and writes the batch cache's conv / recurrent state of its slots."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    T = a["q"].shape[0]
    form = "k3" if cfg.family == "k3" else "kimi_linear"
    cache = batch.cache
    dev = a["q"].device
    slots = batch.device_ints("slots", batch.slot_list(), torch.int64, dev)
    cu = batch.cu_seqlens.to(dev)
    init = None
    if cache is not None:
        init = cache.ssm[layer][slots]  # advanced indexing: already a copy
    # the depthwise conv is per channel, so q | k | v run as one conv over their 3P channels: one launch (and
    # one sequence table) instead of three, the same arithmetic per channel; the cache's [slots, 3, P, W-1]
    # conv state is that channel order already
    P = a["q"].shape[1]
    cw = w.derived(f"kda_conv_qkv:{layer}", lambda: torch.cat(a["conv"], 0))
    st = cache.conv[layer][slots].reshape(-1, 3 * P, cw.shape[-1] - 1) if cache is not None else None  # a copy
    y, fin = ops["short_conv"](torch.cat([a["q"], a["k"], a["v"]], -1).unsqueeze(0), cw, st, cu)
    finals = fin.reshape(fin.shape[0], 3, P, fin.shape[-1])
    q, k, v = (y[..., j * P:(j + 1) * P].reshape(1, T, H, K) for j in range(3))
    # the prefill reads the offsets on the host only (its chunk table): hand it the host copy where there is one
    cu_read = batch.cu_host_tensor() if batch.cu_host is not None else cu
    # inside a bf16 / fp16 matmul scope (the serving engine) the fp32 activations take the kernel's fp16 form on the
    # matrix unit, as its bf16 inputs do, instead of IEEE fp32 FMAs (fp16 intermediates and one fp16 product each,
    # the diagonal pair blocks split: 3.6e-4 rel. RMS at ordinary decays and 6.1e-4 near decay 1 against the fp32
    # oracle on an H100, the prefill's bound 3e-3; 1.6 x faster than the split-bf16 form at B1 T8192 H96, BENCHMARKS
    # 2026-12-06 "The KDA prefill's fp16 form"; the fp32 oracle path is unchanged)
    extra = ({"products": "fp16"} if current_matmul_dtype() is not None and _takes(ops["kda_prefill"], "products")
             else {})
    o, state = ops["kda_prefill"](q, k, v, a["decay"].unsqueeze(0), a["beta"].unsqueeze(0), a["A_log"], a["dt_bias"],
                                  initial_state=init, cu_seqlens=cu_read, scale=None, lower_bound=cfg.gate_lower_bound,
                                  gate_form=form, **extra)
    if cache is not None:
        cache.conv[layer][slots] = f32(finals)
        cache.ssm[layer][slots] = f32(state)
    o = o.reshape(T, H, K)
    # the gate is a column view of the projection GEMM: its sigmoid comes out contiguous, so the reshape is free
    o = rms_norm(o, a["o_norm"], cfg.rms_norm_eps) * torch.sigmoid(a["gate"]).reshape(T, H, K)
    return o.reshape(T, H * K)


def mla_kv_split(w: WeightView, layer: int, cfg: K3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj`` [H*(Dn+Dv), R] -> (w_kc [H, Dn, R], w_vc [H, R, Dv]) contiguous, for the absorbed decode
    (K3_FACTS §3, DeepSeek absorption): fp32 for the oracle's view; kept once, in the stored dtype, by a
    memoising :class:`WeightView` (the engine's: its decode kernel multiplies in the bf16 cache's dtype, so a
    widened copy was narrowed back on every call, two casts per MLA layer per step; the stored values are the
    same numbers, and the oracle op widens them)."""
    keep = w.memoises

    def split() -> tuple[torch.Tensor, torch.Tensor]:
        H, Dn, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kvb = w(f"layers.{layer}.self_attn.kv_b_proj.weight")
        kvb = (kvb if keep else f32(kvb)).view(H, Dn + Dv, cfg.kv_lora_rank)
        return kvb[:, :Dn, :].contiguous(), kvb[:, Dn:, :].transpose(1, 2).contiguous()
    return w.derived(f"kv_split.{layer}", split)


def mla_project(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and the latent of gated MLA (K3_FACTS §5): q = ``q_b(RMSNorm_{q_a_layernorm}(q_a(x)))`` (or
    ``q_proj(x)`` without q_lora) ``[T, H, Dn+Dr]``; ``kv_a_proj_with_mqa(x)`` -> normed latent ``[T, R]``
    (``kv_a_layernorm``) and k_rope ``[T, Dr]`` (neither normed nor rotated)."""
    p = f"layers.{layer}.self_attn."
    H, Dn, Dr, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    # q_a (or q) and kv_a in one GEMM where the view fuses them
    qa, ckv = linears(x, w, (p + ("q_a_proj.weight" if cfg.q_lora_rank else "q_proj.weight"),
                             p + "kv_a_proj_with_mqa.weight"))
    if cfg.q_lora_rank:
        q = linear(rms_norm(qa, w.f32(p + "q_a_layernorm.weight"), eps), w(p + "q_b_proj.weight"))
    else:
        q = qa
    latent = rms_norm(ckv[:, :R], w.f32(p + "kv_a_layernorm.weight"), eps)
    # k_rope stays a column view of the projection (row stride R + Dr): the cache write and the prefill read rows
    # by stride, so a contiguous copy bought nothing
    return q.reshape(x.shape[0], H, Dn + Dr), latent, ckv[:, R:]


def mla_output(o: torch.Tensor, x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config) -> torch.Tensor:
    """Attention output ``[T, H, Dv]`` -> × sigmoid(``g_proj(x)``) (gated MLA; x is the mixer's input) ->
    ``o_proj`` ``[T, hidden]``."""
    p = f"layers.{layer}.self_attn."
    o = f32(o).reshape(x.shape[0], -1)
    if mla_has_output_gate(cfg):  # decided by the config, so a missing g_proj is an error, never an ungated model
        o = o * torch.sigmoid(linear(x, w(p + "g_proj.weight")))
    return linear(o, w(p + "o_proj.weight"))


def mla_decode_rows(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
                    kv_cache: torch.Tensor, slot_ids: torch.Tensor, pos: torch.Tensor, block_rows: torch.Tensor,
                    row_slots: tuple[torch.Tensor, torch.Tensor] | None = None, **decode_kw: Any) -> torch.Tensor:
    """Gated MLA token mixer for one token per row, all on the device (graph-capturable): write the token's
    latent + k_rope into its paged slot (``mla_cache_write``), then absorbed ``mla_decode`` (K3_FACTS §5).

    Args:
        x: ``[N, hidden]`` after ``input_layernorm`` (fp32, or already in the matmul scope's dtype).
        kv_cache: ``[blocks, block_size, R + Dr]`` paged latent cache of ``layer``.
        slot_ids: ``[N]`` int; −1 = padding row (writes nothing, context 0: the ops skip it).
        pos: ``[N]`` int64 tokens cached before this one. block_rows: ``[N, blocks_per_seq]`` int32.
        row_slots: :func:`mla_row_slots` of these rows, when the caller made it once for every MLA layer of the
            step (None: made here).
        decode_kw: passed to ``mla_decode`` (static bounds under graph capture).
    """
    q, latent, k_rope = mla_project(x, w, layer, cfg)
    o = mla_decode_core(q, latent, k_rope, w, layer, cfg, ops, kv_cache, slot_ids, pos, block_rows,
                        row_slots=row_slots, **decode_kw)
    return mla_output(o, x, w, layer, cfg)


def mla_row_slots(slot_ids: torch.Tensor, pos: torch.Tensor, block_rows: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where N decode rows go in the paged latent cache: ``(slot_mapping [N] int64, context_lens [N] int32)`` —
    the flat cache slot of each row's token (its block from ``block_rows`` at ``pos // block_size``; −1 for a
    padding row) and its context length after the write (``pos + 1``; 0 for a padding row).

    The same for every MLA layer of a step (one paged layout), so a step makes it once: a dozen small device ops
    (~2 us each on an H200) per MLA layer otherwise. All on the device, graph-capturable.

    Args:
        slot_ids: ``[N]`` int; −1 = padding. pos: ``[N]`` int64 tokens cached before this one.
        block_rows: ``[N, blocks_per_seq]`` int. block_size: tokens per cache block.
    """
    valid = slot_ids >= 0
    col = torch.clamp(pos // block_size, max=block_rows.shape[1] - 1).unsqueeze(1)
    blk = block_rows.to(torch.int64).gather(1, col).squeeze(1)
    slot_mapping = torch.where(valid, blk * block_size + pos % block_size, torch.full_like(pos, -1))
    ctx = torch.where(valid, pos + 1, torch.zeros_like(pos)).to(torch.int32)
    return slot_mapping, ctx


def mla_decode_core(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, w: WeightView, layer: int,
                    cfg: K3Config, ops: Mapping[str, Callable], kv_cache: torch.Tensor, slot_ids: torch.Tensor,
                    pos: torch.Tensor, block_rows: torch.Tensor,
                    row_slots: tuple[torch.Tensor, torch.Tensor] | None = None, **decode_kw: Any) -> torch.Tensor:
    """The cache part of :func:`mla_decode_rows` on :func:`mla_project`'s outputs of N rows (one token each):
    write each row's latent + k_rope into its paged slot, then absorbed ``mla_decode``. Returns ``[N, H*Dv]``
    (``q``'s dtype), the gate's input; padding rows (slot −1) write nothing and give zeros. ``row_slots``:
    :func:`mla_row_slots` of the rows, made once per step by the caller (None: made here)."""
    Dn, Dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if row_slots is None:
        row_slots = mla_row_slots(slot_ids, pos, block_rows, kv_cache.shape[1])
    slot_mapping, ctx = row_slots
    ops["mla_cache_write"](kv_cache, slot_mapping, latent, k_rope)
    w_kc, w_vc = mla_kv_split(w, layer, cfg)
    # q_nope / q_rope as views of q (the decode reads them by stride and narrows q_nope for its absorption GEMM
    # itself): a contiguous copy of each cost two copy kernels per MLA layer per step
    o = ops["mla_decode"](q[..., :Dn].unsqueeze(1), q[..., Dn:].unsqueeze(1), kv_cache,
                          block_rows, ctx, w_kc, w_vc, (Dn + Dr) ** -0.5, **decode_kw)
    return o.reshape(q.shape[0], -1)


def mla_mixer(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
              batch: Batch) -> torch.Tensor:
    """Gated NoPE MLA token mixer (K3_FACTS §5 "Gated MLA layer"): x ``[T, hidden]`` -> ``[T, hidden]`` fp32.

    Projections :func:`mla_project`; ``kv_b`` expands the latent to H × (k_nope + v); causal softmax attention
    with scale ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5`` (192^-0.5 for K3); output gate and ``o_proj``
    :func:`mla_output`.

    Paths: no cache -> ``mla_prefill``; cache and fresh sequences -> ``mla_cache_write`` + ``mla_prefill``;
    decode -> :func:`mla_decode_rows`; cache with earlier context -> ``mla_cache_write`` + absorbed
    ``mla_decode`` per sequence (its queries as the last positions of the cached context).
    """
    cache = batch.cache
    starts = batch.starts()
    slots = batch.slot_list()
    dev = x.device
    if cache is not None:
        cu = batch.cu_list()
        for n in range(batch.num_seqs):
            if starts[n] + cu[n + 1] - cu[n] > cache.max_len:
                raise ConfigError(f"sequence {n}: {starts[n] + cu[n + 1] - cu[n]} tokens exceed the cache capacity "
                                  f"{cache.max_len}; create the cache with a larger max_len")
    if batch.decode and cache is not None:
        slots_t = torch.tensor(slots, dtype=torch.int64)
        return mla_decode_rows(x, w, layer, cfg, ops, cache.kv[layer], slots_t.to(dev, torch.int32),
                               torch.tensor(starts, dtype=torch.int64, device=dev),
                               cache.block_table[slots_t].to(dev))
    q, latent, k_rope = mla_project(x, w, layer, cfg)
    return mla_output(mla_prefill_core(q, latent, k_rope, w, layer, cfg, ops, batch), x, w, layer, cfg)


def mla_prefill_core(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, w: WeightView, layer: int,
                     cfg: K3Config, ops: Mapping[str, Callable], batch: Batch) -> torch.Tensor:
    """The sequence-dependent part of :func:`mla_mixer` on chunks, on :func:`mla_project`'s outputs of the
    batch's T rows: the cache write (with a cache), then ``mla_prefill`` (fresh sequences) or absorbed
    ``mla_decode`` per sequence (a chunk continuing a cached context). Returns the attention output
    ``[T, H, Dv]``, the gate's input."""
    H, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    T = q.shape[0]
    cache = batch.cache
    starts = batch.starts()
    slots = batch.slot_list()
    dev = q.device
    scale = (Dn + Dr) ** -0.5
    if cache is not None:
        def slot_mapping_of_batch() -> torch.Tensor:
            cu = batch.cu_list()
            bs = cache.block_size
            pos = []
            for n in range(batch.num_seqs):  # on the block table's device (CPU for K3Cache, the engine's GPU)
                tpos = torch.arange(starts[n], starts[n] + cu[n + 1] - cu[n], device=cache.block_table.device)
                blocks = cache.block_table[slots[n]].to(torch.int64)[tpos // bs]
                pos.append(blocks * bs + tpos % bs)
            return (torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)).to(dev)
        # the same slots in every MLA layer of the batch (one paged cache layout): made once, not per layer
        ops["mla_cache_write"](cache.kv[layer], batch.memo("mla_slot_mapping", slot_mapping_of_batch), latent, k_rope)

    if cache is None or all(s == 0 for s in starts):
        kvb = linear(latent, w(f"layers.{layer}.self_attn.kv_b_proj.weight")).view(T, H, Dn + Dv)
        cu_t = batch.cu_seqlens.to(dev)
        extra = {}
        if batch.cu_host is not None and _takes(ops["mla_prefill"], "max_seqlen_q"):
            extra["max_seqlen_q"] = max(batch.seqlens, default=0)  # else read from the device offsets
        o = ops["mla_prefill"](q, kvb[..., :Dn].contiguous(), k_rope, kvb[..., Dn:].contiguous(), cu_t, cu_t, scale,
                               **extra)
    else:
        w_kc, w_vc = mla_kv_split(w, layer, cfg)
        outs = []
        cu = batch.cu_list()
        for n in range(batch.num_seqs):
            a, b = cu[n], cu[n + 1]
            if b == a:
                continue
            ctx = batch.device_ints(f"context{n}", [starts[n] + b - a], torch.int32, dev)
            o_n = ops["mla_decode"](q[a:b, :, :Dn].unsqueeze(0).contiguous(), q[a:b, :, Dn:].unsqueeze(0).contiguous(),
                                    cache.kv[layer], cache.block_table[slots[n]:slots[n] + 1].to(dev), ctx,
                                    w_kc, w_vc, scale)
            outs.append(o_n[0])
        o = torch.cat(outs, 0)
    return o


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


def dense_mlp(x: torch.Tensor, w: WeightView, prefix: str, cfg: K3Config,
              ops: Mapping[str, Callable] | None = None) -> torch.Tensor:
    """GLU MLP ``down(act(gate(x), up(x)))`` in fp32: x ``[T, hidden]`` -> ``[T, hidden]``.

    ``prefix`` is e.g. ``layers.0.mlp.`` (dense layer 0) or ``layers.i.block_sparse_moe.shared_experts.``
    (the shared experts, stored merged). act = SiTU-GLU (K3_FACTS §5) or SiLU-GLU (kimi_linear), through the
    ``glu`` op of ``ops`` (default the oracle's); on the low-precision path (the down weight in the scope's
    matmul dtype) the op writes its output in that dtype, which the down projection would round to anyway.
    Under TP the weights are a rank's intermediate slice and the result its partial sum.
    """
    g, u = linears(x, w, (prefix + "gate_proj.weight", prefix + "up_proj.weight"))
    down = w(prefix + "down_proj.weight")
    dt = current_matmul_dtype()
    out_dtype = dt if dt is not None and down.dtype == dt else torch.float32
    fn = (ops or {}).get("glu")
    if fn is None:
        h = _glu(cfg, g, u)
    else:
        if cfg.hidden_act not in ("situ", "silu"):
            _glu(cfg, g, u)  # raises the unsupported-activation error
        h = fn(g, u, cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta, out_dtype=out_dtype)
    return linear(h, down)


@functools.lru_cache(maxsize=512)
def _takes(fn: Callable, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (an op implementation's optional capability). Remembered per
    function: the eager mixers ask it every layer of every step, and ``inspect.signature`` is not cheap."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


#: route on a second stream of the device while the main stream runs the MoE block's projections that do not
#: need the routing (the latent down projection, the shared experts): ``[on]``. The router is a latency-bound
#: chain (two launches of ~12 us each at any batch size on an H100, 2026-12-07) beside bandwidth-bound GEMMs; the
#: same kernels run either way, so the results are bit-identical. Only on CUDA / HIP devices; captured graphs
#: record the fork and join. Set to ``[False]`` for an A/B (``gpu-runs/prof_steps.py``: ``ROUTER_OVERLAP=0``).
ROUTER_OVERLAP: list = [True]
#: with :data:`ROUTER_OVERLAP`: the shared experts run on the side stream after the routing (the main stream runs the
#: down projection, waits for the routing only, runs the routed experts, then joins) ``[True]``, or on the main stream
#: before the join ``[False]`` (A/B: ``gpu-runs/prof_steps.py`` ``SHARED_ON_SIDE=0``). Bit-identical either way.
SHARED_ON_SIDE: list = [True]
_SIDE_STREAMS: dict = {}


def _side_stream(x: torch.Tensor):
    """The routing stream of ``x``'s device (made once, outside any capture: the first call is an eager warm-up
    step), or None on the CPU / with :data:`ROUTER_OVERLAP` off."""
    if not (ROUTER_OVERLAP[0] and x.is_cuda):
        return None
    s = _SIDE_STREAMS.get(x.device)
    if s is None:
        s = _SIDE_STREAMS[x.device] = torch.cuda.Stream(device=x.device)
    return s


def moe_block(x: torch.Tensor, w: WeightView, layer: int, cfg: K3Config, ops: Mapping[str, Callable],
              mode: str = "a16w4", reduce: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> torch.Tensor:
    """MoE channel mixer: Stable LatentMoE (K3) or plain MoE (kimi_linear). x ``[T, hidden]`` -> ``[T, hidden]`` fp32.

    K3_FACTS §5: FP32 router (``moe_router``: sigmoid, biased top-k, unbiased renormalised weights ×
    ``routed_scaling_factor``); K3 only: x_lat = ``routed_expert_down_proj(x)``; ``moe_experts`` (weighted sum
    over the experts these weights hold, SiTU-GLU / SiLU-GLU; ``mode`` "a16w4" or "a8w4" for MXFP4 experts); K3
    only: ``routed_expert_norm`` on the sum then ``routed_expert_up_proj``; + shared experts on the original x,
    unweighted.

    ``reduce(t, name)``: the tensor-parallel sum (None: one rank). The routed partial sum (a rank's experts) and
    the shared-expert partial sum (a rank's intermediate slice) travel in one collective, reduced **before**
    ``routed_expert_norm`` (K3_FACTS §5 step 3: norm(sum) != sum(norm)).

    Fused routing: when the ``moe_router`` implementation takes ``experts`` and the ``moe_experts`` one takes
    ``dispatch`` (the Triton pair), the router also groups the pairs by this rank's experts on the device and
    the experts reuse that grouping (same tensors as grouping them inside ``moe_experts``, so the same result).

    On a GPU the routing, then the shared experts, run on a second stream beside the down projection and the
    routed experts (:data:`ROUTER_OVERLAP`, :data:`SHARED_ON_SIDE`; bit-identical results).
    """
    p = f"layers.{layer}.block_sparse_moe."
    experts = w.experts(layer)
    route = (x, w(p + "gate.weight"), w(p + "gate.e_score_correction_bias"), cfg.num_experts_per_token,
             cfg.moe_renormalize, cfg.routed_scaling_factor)

    def routing() -> tuple:
        if _takes(ops["moe_router"], "experts") and _takes(ops["moe_experts"], "dispatch"):
            ids, wts, dispatch = ops["moe_router"](*route, experts=experts)
            return ids, wts, {"dispatch": dispatch}
        return (*ops["moe_router"](*route), {})

    # Overlap (ROUTER_OVERLAP): the routing (then, SHARED_ON_SIDE, the shared experts) on the side stream, forked
    # after everything queued so far (x and its bf16 copy xl are written); the main stream waits for the routing
    # before the experts read it, and for the whole side stream before the shared output is read. No
    # record_stream is needed: what the side stream allocates goes back to its pool when this block returns, and
    # it allocates again only after the next fork, which orders it after the main stream's reads; x, xl and the
    # weights are the main stream's, freed only after the join.
    latent = cfg.routed_expert_hidden_size is not None
    mode = mode if cfg.experts_quantized else "a16w4"
    # x feeds the latent down projection and the shared experts' gate|up: rounded to the matmul dtype once for
    # both (the router keeps the fp32 x: K3_FACTS §5 step 1)
    sh = p + "shared_experts."
    readers = ([w(p + "routed_expert_down_proj.weight")] if latent else []) + (
        [w(sh + "gate_proj.weight"), w(sh + "up_proj.weight")] if cfg.num_shared_experts else [])
    xl = matmul_input(x, *readers) if readers else x  # before any fork: the side stream may read it
    side = _side_stream(x)
    shared = None
    routed = None
    if side is not None:
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ids, wts, given = routing()
            if SHARED_ON_SIDE[0] and cfg.num_shared_experts:
                # the shared experts after the routing on the side stream; the main stream waits for the routing
                # only (this event), then for the side stream as a whole before the shared output is read
                routed = torch.cuda.Event()
                routed.record(side)
                shared = dense_mlp(xl, w, sh, cfg, ops)
    else:
        ids, wts, given = routing()
    if latent:
        # A16W4 experts take bf16 activations: the down projection writes them so (one rounding, as the op's own
        # cast of an fp32 input would make); A8W4 quantises the fp32 product itself
        down = w(p + "routed_expert_down_proj.weight")
        xin = linear_lp(xl, down) if mode == "a16w4" else linear(xl, down)
    else:
        xin = x
    act = "situ" if cfg.hidden_act == "situ" else "silu"
    if side is not None:
        if routed is not None:
            main.wait_event(routed)
        else:  # the shared experts on the main stream while the routing runs, then the join
            shared = dense_mlp(xl, w, sh, cfg, ops) if cfg.num_shared_experts else None
            main.wait_stream(side)
    y = f32(ops["moe_experts"](xin, ids, wts, experts, act=act, mode=mode,
                               beta=cfg.activation_situ_beta, beta_lin=cfg.activation_situ_linear_beta, **given))
    if side is None:
        shared = dense_mlp(xl, w, sh, cfg, ops) if cfg.num_shared_experts else None
    elif routed is not None:
        main.wait_stream(side)  # the shared experts' output (and everything the side stream read) is done
    if reduce is not None:
        if shared is not None:
            width = y.shape[1]
            both = reduce(torch.cat([y, shared], dim=1), "moe")
            y, shared = both[:, :width], both[:, width:]
        else:
            y = reduce(y, "moe")
    if latent:
        y = linear(rms_norm(y, w.f32(p + "routed_expert_norm.weight"), cfg.rms_norm_eps),
                   w(p + "routed_expert_up_proj.weight"))
    return y if shared is None else y + shared


# ---------------------------------------------------------------------------------------------------------
# Block Attention Residuals bookkeeping (K3_FACTS §5)
# ---------------------------------------------------------------------------------------------------------


class AttnResState:
    """Per-forward Block AttnRes state on flat tokens.

    Attributes:
        bank: completed-block rows (embedding first), each its own ``[T, D]`` fp32 tensor (never a view of
            another row or of the prefix).
        prefix: ``[T, D]`` fp32 running sum of the current block (the embedding before layer 0). Reading it adds
            any ``pending`` output first (:meth:`settle`); setting it drops ``pending``.
        pending: a sublayer output ``[T, D]`` not yet added to the prefix (None: none). The decoder defers its
            ``prefix += out`` so the next aggregation adds it in its own launch (``attn_res_norm``'s ``addend``);
            the aggregation reads :attr:`base` and ``pending`` apart.
        base: the prefix without ``pending``.
    """

    def __init__(self, bank: list[torch.Tensor], prefix: torch.Tensor, pending: torch.Tensor | None = None):
        self.bank = bank
        self.base = prefix
        self.pending = pending

    @property
    def prefix(self) -> torch.Tensor:
        return self.settle()

    @prefix.setter
    def prefix(self, value: torch.Tensor) -> None:
        self.base, self.pending = value, None

    def settle(self) -> torch.Tensor:
        """Add ``pending`` into the prefix (a new tensor, as the decoder's ``prefix + out``) and return it."""
        if self.pending is not None:
            self.base, self.pending = self.base + self.pending, None
        return self.base

    def __repr__(self) -> str:
        return f"AttnResState(bank={len(self.bank)} rows, prefix={tuple(self.base.shape)}, pending={self.pending is not None})"


def _slots(state: AttnResState) -> torch.Tensor | None:
    """The ``[R + 1, T, D]`` storage whose leading slots are the bank rows (set up by :func:`attn_side` on
    layer 0), or None when the rows are separate tensors (a cloned or row-selected state)."""
    if not state.bank:
        return None
    buf = state.bank[0]._base
    if buf is None or buf.dim() != 3 or buf.shape[0] <= len(state.bank) or buf.shape[1:] != state.base.shape:
        return None
    if any(r.data_ptr() != buf[i].data_ptr() or r.shape != buf.shape[1:] for i, r in enumerate(state.bank)):
        return None
    return buf


def takes_addend(ops: Mapping[str, Callable]) -> bool:
    """Whether the ops table's ``attn_res_norm`` takes ``addend`` / ``prefix_out`` (the pending prefix add in the
    step: :class:`AttnResState`'s ``pending``)."""
    return _takes(ops["attn_res_norm"], "addend")


def _pending_kw(state: AttnResState, ops: Mapping[str, Callable]) -> tuple[dict, torch.Tensor | None]:
    """``attn_res_norm`` keywords that add ``state.pending`` in the step (none without one), and the new prefix
    buffer they fill (None without one). An op that does not take ``addend`` gets the pending output added first
    (:meth:`AttnResState.settle`) and no keywords."""
    if state.pending is None:
        return {}, None
    if not takes_addend(ops):
        state.settle()
        return {}, None
    new = torch.empty(state.base.shape, dtype=torch.float32, device=state.base.device)
    return {"addend": state.pending, "prefix_out": new}, new


def _normed(ops: Mapping[str, Callable], out_dtype: torch.dtype | None, *args: Any, **kw: Any) -> torch.Tensor:
    """The normed output of ``attn_res_norm(*args, **kw)``: fp32 (``out_dtype`` None), else in ``out_dtype`` —
    written so by the op itself where it takes ``out_dtype`` (the Triton kernel stores its fp32 result rounded to
    nearest even, as ``.to`` rounds), else rounded from its fp32 result. The aggregation ``h`` itself is never
    used here: an op that takes ``store_h`` (the Triton kernel) is asked not to store it (``T * D * 4`` bytes
    less written per call)."""
    fn = ops["attn_res_norm"]
    if _takes(fn, "store_h"):
        kw = dict(kw, store_h=False)
    if out_dtype is not None and _takes(fn, "out_dtype"):
        x = fn(*args, out_dtype=out_dtype, **kw)[1]
    else:
        x = f32(fn(*args, **kw)[1])
    return x if out_dtype is None else x.to(out_dtype)


def _aggregate_norm(ops: Mapping[str, Callable], state: AttnResState, weight: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, write: bool = False,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``attn_res_norm`` over ``[bank rows..., prefix]`` followed by the RMSNorm of ``norm_weight``; returns the
    normed ``[T, D]`` fp32 (or in ``out_dtype``, see :func:`attn_side`). On a write layer the prefix also becomes
    the next bank row.

    When the rows are slots of one storage (:func:`_slots`) the op reads them in place and, on a write layer,
    stores the prefix into the next slot itself (one launch in all); otherwise the sources are stacked and the
    prefix tensor is appended as the row. Same values either way."""
    buf = _slots(state)
    k = len(state.bank)
    if buf is not None and (not write or k < buf.shape[0] - 1):
        # a pending sublayer output is added in the same launch, into a new prefix (the op's prefix_out)
        kw, new = _pending_kw(state, ops)
        x = _normed(ops, out_dtype, buf, k, state.base, weight, norm_weight, eps, append=write, **kw)
        if new is not None:
            state.prefix = new
        if write:
            state.bank.append(buf[k])
        return x
    state.settle()
    x = _normed(ops, out_dtype, torch.stack(state.bank + [state.prefix]), k, state.prefix, weight, norm_weight, eps)
    if write:
        state.bank.append(state.prefix)
    return x


def _mixer_readers(w: WeightView, layer: int, cfg: K3Config, side: str) -> list[str] | None:
    """Model-relative names of the weights that read layer ``layer``'s mixer input on ``side`` (``"attn"``:
    the token mixer's projections; ``"mlp"``: the dense MLP's gate|up), or None where something reads it in
    fp32 (the MoE router, K3_FACTS §5 step 1)."""
    p = f"layers.{layer}."
    if side == "mlp":
        return None if cfg.is_moe_layer(layer) else [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    a = p + "self_attn."
    if cfg.layer_type(layer) == "kda":
        g = "g_proj" if cfg.family == "k3" else "g_a_proj"
        return [a + f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", g, "b_proj", "f_a_proj")]
    names = [a + ("q_a_proj.weight" if cfg.q_lora_rank else "q_proj.weight"), a + "kv_a_proj_with_mqa.weight"]
    return names + ([a + "g_proj.weight"] if mla_has_output_gate(cfg) else [])


def mixer_input_dtype(w: WeightView, layer: int, cfg: K3Config, side: str) -> torch.dtype | None:
    """The dtype the AttnRes side of layer ``layer`` writes its normed output in (``side`` ``"attn"`` or
    ``"mlp"``): the :func:`~k3rocm.model.common.matmul_dtype` scope's dtype when every weight reading that
    mixer input is stored in it (each such :func:`~k3rocm.model.common.linear` rounds its input to that dtype
    anyway, so rounding once where it is made gives the same products); None (fp32) outside a scope (the
    oracle), for a MoE layer's MLP side (its router reads the fp32 input) or when a reader is stored in another
    dtype. ``cfg`` is the config the mixers see.

    Raises:
        ConfigError: ``side`` is neither ``"attn"`` nor ``"mlp"``.
        CheckpointError: a reader weight is missing.
    """
    if side not in ("attn", "mlp"):
        raise ConfigError(f"mixer_input_dtype: side {side!r} is not 'attn' or 'mlp'")
    dt = current_matmul_dtype()
    if dt is None:
        return None

    def decide() -> bool:
        names = _mixer_readers(w, layer, cfg, side)
        return names is not None and all(w(n).dtype == dt for n in names)
    return dt if w.derived(f"in_dtype:{side}:{layer}:{dt}", decide) else None


def attn_side(state: AttnResState, layer: int, weight: torch.Tensor, norm_weight: torch.Tensor, cfg: K3Config,
              ops: Mapping[str, Callable], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention side of layer ``layer``: aggregation, then ``input_layernorm`` (``norm_weight``); returns the
    token-mixer input ``[T, D]`` fp32, or in ``out_dtype`` (:func:`mixer_input_dtype`: the low-precision path,
    where every projection reading it rounds it to that dtype anyway; the bank and prefix stay fp32).

    Layer 0 aggregates its one source (the embedding passes through: softmax over one source is 1). On a write
    layer (``i % attn_res_block_size == 0``) the pre-attention prefix becomes a new bank row and the prefix
    restarts at zero (a fresh tensor). The bank rows of a forward are slots of one ``[R + 1, T, D]`` storage,
    allocated at the first write layer, so the aggregations read them in place; a row, once written, is never
    written again.
    """
    write = cfg.is_write_layer(layer)
    if write and not state.bank and cfg.num_attn_res_bank_rows > 0:
        # the first write layer: one storage for every bank row of this forward (+ one spare slot)
        buf = state.base.new_empty(cfg.num_attn_res_bank_rows + 1, *state.base.shape)
        kw, new = _pending_kw(state, ops)
        x = _normed(ops, out_dtype, buf, 0, state.base, weight, norm_weight, cfg.rms_norm_eps, append=True, **kw)
        if new is not None:
            state.prefix = new
        state.bank.append(buf[0])
    else:
        x = _aggregate_norm(ops, state, weight, norm_weight, cfg.rms_norm_eps, write, out_dtype)
    if write:
        state.prefix = torch.zeros_like(state.base)
    return x


def mlp_side(state: AttnResState, weight: torch.Tensor, norm_weight: torch.Tensor, cfg: K3Config,
             ops: Mapping[str, Callable], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """MLP side: aggregation over bank rows + prefix (which now holds this layer's attention output), then
    ``post_attention_layernorm`` (``norm_weight``); returns the channel-mixer input ``[T, D]`` fp32, or in
    ``out_dtype`` (:func:`mixer_input_dtype`)."""
    return _aggregate_norm(ops, state, weight, norm_weight, cfg.rms_norm_eps, out_dtype=out_dtype)


def final_aggregate(state: AttnResState, weight: torch.Tensor, norm_weight: torch.Tensor, cfg: K3Config,
                    ops: Mapping[str, Callable]) -> torch.Tensor:
    """``output_attn_res_*`` aggregation over all bank rows + prefix, then the final ``norm`` (``norm_weight``);
    returns ``[T, D]`` fp32."""
    return _aggregate_norm(ops, state, weight, norm_weight, cfg.rms_norm_eps)
