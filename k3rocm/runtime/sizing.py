"""Decode-cache sizes and the engine-step roofline: the one place these figures are computed.

Used by the placement plan (:mod:`k3rocm.runtime.plan`: cache capacity and the decode floor it prints), the
engine's cache pools (:mod:`k3rocm.runtime.cache`: how a budget splits into KDA slots and MLA blocks) and the
serving benchmark (:mod:`k3rocm.bench.roofline`: fraction of roofline of measured steps).

Cache sizes (K3_FACTS §5, §7):

* **MLA latent cache**, per token per MLA layer: ``kv_lora_rank + qk_rope_head_dim`` values (512 normed latent
  + 64 k_rope = 576 for K3) of the cache dtype; K3 in bf16: ``24 * 576 * 2 = 27,648`` B per token. Replicated
  on every TP rank (the latent is shared by all heads).
* **KDA state**, per sequence per KDA layer, independent of length: the fp32 recurrent state ``H * K * V``
  plus the fp32 short-conv state of q, k, v ``3 * (H * K) * (W - 1)`` (``W = short_conv_kernel_size``);
  K3 on one rank: ``69 * (96*128*128 + 3*12288*3) * 4 B`` = 434.1 MB + 30.5 MB = 464.6 MB per sequence.
  Heads split by TP.

Step roofline (:class:`StepRoofline`; the usual decode roofline, e.g. DeepSeek / vLLM practice, HARDWARE.md
"Measuring"), for a step of decode rows at context lengths ``c_n`` and prefill chunks (``n_j`` new tokens
ending at context ``e_j``), ``T`` tokens in all, on one device or rank:

* **bytes** = trunk weights read once (every non-expert tensor except the input embedding, of which only the
  step's rows are read) + routed experts touched: the expected number of distinct experts per MoE layer for
  ``T`` tokens each choosing ``k`` of ``E`` under uniform routing, :func:`experts_touched`
  ``= E * (1 - (1 - k/E)^T)``, of which a rank holds ``1/ep``, times one expert's bytes on the rank, times the
  MoE layers + MLA cache read (``sum c_n + sum e_j`` tokens) and written (``T`` tokens) + KDA state read and
  written once per sequence in the step (``2 x`` state bytes);
* **FLOPs** = ``2 x`` parameters multiplied per token (K3_FACTS §2 definition of activated parameters:
  lm_head counted, embedding not; a rank: its trunk share plus ``k/tp`` experts' worth)
  + absorbed-MLA attention ``2 x H x (2R + Dr)`` per (query, context position) per MLA layer
  + KDA ``8 x H x K x V`` per token per KDA layer (decay, ``S^T k``, rank-1 update, ``S^T q``);
* **floor** = ``max(bytes / bandwidth, FLOPs / peak)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from k3rocm.checkpoint.layout import counts, expert_specs, model_specs
from k3rocm.config import K3Config
from k3rocm.errors import ConfigError, PlanError

#: bytes per MLA cache value by cache dtype name
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
#: bytes per KDA state / conv-state value (both kept in fp32)
KDA_STATE_BYTES = 4


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes per MLA cache value of the dtype named ``kv_dtype`` (``bf16``, ``fp16``, ``fp8``, ``fp32``).

    Raises:
        PlanError: an unknown dtype name.
    """
    if kv_dtype not in KV_DTYPE_BYTES:
        raise PlanError(f"kv_dtype {kv_dtype!r} is not supported; use one of {', '.join(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[kv_dtype]


def mla_cache_bytes_per_token(cfg: K3Config, kv_bytes: int, num_layers: int | None = None) -> int:
    """MLA latent-cache bytes of one token over ``num_layers`` MLA layers (default all):
    ``layers * (kv_lora_rank + qk_rope_head_dim) * kv_bytes`` (K3 bf16: 24 * 576 * 2 = 27,648 B).

    Args:
        kv_bytes: bytes per cached value (2 bf16/fp16, 1 fp8, 4 fp32).
    """
    L = cfg.num_mla_layers if num_layers is None else num_layers
    return L * cfg.mla_cache_width * kv_bytes


def kda_state_bytes_per_seq(cfg: K3Config, num_heads: int | None = None, num_layers: int | None = None) -> int:
    """KDA state bytes of one sequence over ``num_layers`` KDA layers (default all): fp32 recurrent state
    ``H * K * V`` plus fp32 conv state ``3 * (H * K) * (W - 1)`` per layer.

    Official K3, all 96 heads: 69 * (96*128*128 + 3*12288*3) * 4 B = 464,633,856 B (K3_FACTS §5, §7).

    Args:
        num_heads: KDA heads held (on one TP rank: ``kda_num_heads // tp``); default all.
    """
    H = cfg.kda_num_heads if num_heads is None else num_heads
    K = V = cfg.kda_head_dim
    L = cfg.num_kda_layers if num_layers is None else num_layers
    conv = 3 * H * K * (cfg.short_conv_kernel_size - 1)
    return L * (H * K * V + conv) * KDA_STATE_BYTES


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts one MoE layer reads for ``tokens`` tokens, each routed to ``top_k``
    distinct experts of ``num_experts``, uniformly: ``E * (1 - (1 - k/E)^T)`` (each expert is missed by one
    token with probability ``1 - k/E``). 0 for no tokens or no experts; ``k`` for one token; tends to ``E``."""
    E, k = num_experts, top_k
    return E * (1.0 - (1.0 - k / E) ** tokens) if E and tokens > 0 else 0.0


@dataclass(frozen=True)
class StepCost:
    """Floor of one step. ``bytes`` B, ``flops`` FLOP, times in seconds, ``bound`` "memory" / "compute"."""

    bytes: float
    flops: float
    t_memory_s: float
    t_compute_s: float
    floor_s: float
    bound: str


@dataclass(frozen=True)
class StepRoofline:
    """Roofline parameters (bytes, FLOPs, ceilings) of a model for engine steps, on one device or one rank.

    Attributes (per device / rank):
        trunk_bytes: non-expert weight bytes read per step (input embedding excluded).
        embed_row_bytes: input-embedding bytes read per token (one row; on a rank, its expected share of a
            vocab-parallel row: ``row / tp``).
        expert_bytes: bytes of one routed expert held here (w1, w2, w3, packed MXFP4 + scales as stored;
            ``1/etp`` of it on a rank of an EP group of ``etp = tp // ep`` ranks).
        num_moe_layers, num_experts, top_k: routing shape.
        ep: expert-parallel degree; a rank holds ``1/ep`` of the experts a step touches (1: all).
        mla_bytes_per_token: cache bytes of one token over all MLA layers.
        kda_slot_bytes: KDA state + conv bytes of one sequence over all KDA layers (heads held here).
        flops_per_token: 2 x parameters multiplied per token.
        mla_flops_per_pair: FLOPs per (query, context position) over all MLA layers.
        kda_flops_per_token: FLOPs of the KDA recurrences per token over all KDA layers.
        bandwidth: bytes/s; peak_flops: FLOP/s.
    """

    trunk_bytes: float
    embed_row_bytes: float
    expert_bytes: float
    num_moe_layers: int
    num_experts: int
    top_k: int
    mla_bytes_per_token: float
    kda_slot_bytes: float
    flops_per_token: float
    mla_flops_per_pair: float
    kda_flops_per_token: float
    bandwidth: float
    peak_flops: float
    ep: int = 1

    @classmethod
    def from_config(cls, cfg: K3Config, bandwidth: float, peak_flops: float, kv_bytes: int = 2,
                    trunk_dtype_bytes: int | None = None, *, tp: int = 1, ep: int = 1,
                    rank_trunk: tuple[int, int] | None = None) -> "StepRoofline":
        """Roofline of ``cfg`` on one device (``tp = 1``) or on one rank of a ``tp``-rank layout.

        Args:
            bandwidth: memory bandwidth, bytes/s (> 0). peak_flops: FLOP/s (> 0).
            kv_bytes: bytes per MLA cache value (2 bf16, 1 fp8, 4 fp32).
            trunk_dtype_bytes: bytes per trunk weight as held in memory (None = as stored: 2 for BF16; 4 for an
                fp32 engine on CPU). Ignored with ``rank_trunk``.
            tp, ep: ranks and expert-parallel degree (``ep`` divides ``tp``); heads split by ``tp``, experts by
                ``ep`` and inside an EP group by intermediate (``tp // ep``).
            rank_trunk: ``(bytes, params)`` of the non-expert tensors one rank holds, input embedding excluded
                (which are split and which replicated is the plan's rule); required when ``tp > 1``.
        Raises:
            ConfigError: non-positive ceilings, ``ep`` not dividing ``tp``, or ``tp > 1`` without ``rank_trunk``.
        """
        if bandwidth <= 0 or peak_flops <= 0:
            raise ConfigError(f"roofline needs bandwidth > 0 and peak FLOP/s > 0 (got {bandwidth}, {peak_flops})")
        if tp < 1 or ep < 1 or tp % ep:
            raise ConfigError(f"roofline needs tp >= 1 and ep dividing it (got tp={tp}, ep={ep})")
        if tp > 1 and rank_trunk is None:
            raise ConfigError(f"roofline at tp={tp} needs the rank's trunk (bytes, params) from the plan")
        c = counts(cfg)
        embed = next(s for s in model_specs(cfg) if s.name.endswith("embed_tokens.weight"))
        if rank_trunk is not None:
            trunk, trunk_params = rank_trunk
            row = embed.nbytes / embed.shape[0] / tp
        elif trunk_dtype_bytes is None:
            trunk_params = c["params"] - c["params_expert"] - embed.params
            trunk = c["bytes_trunk"] - embed.nbytes
            row = embed.nbytes / embed.shape[0]
        else:
            trunk_params = c["params"] - c["params_expert"] - embed.params
            trunk = trunk_params * trunk_dtype_bytes
            row = embed.shape[1] * trunk_dtype_bytes
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        one = expert_specs(cfg, moe[0], 0) if moe else []
        k = cfg.num_experts_per_token
        # uniform routing: k/ep experts per token on a rank, 1/etp of each -> k/tp experts' parameters
        expert_params = len(moe) * k * sum(s.params for s in one) / tp
        H, R, Dr = cfg.num_attention_heads // tp, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        Hk, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
        return cls(trunk_bytes=float(trunk), embed_row_bytes=float(row),
                   expert_bytes=float(sum(s.nbytes for s in one) // (tp // ep)),
                   num_moe_layers=len(moe), num_experts=cfg.num_experts, top_k=k,
                   mla_bytes_per_token=float(mla_cache_bytes_per_token(cfg, kv_bytes)),
                   kda_slot_bytes=float(kda_state_bytes_per_seq(cfg, Hk)),
                   flops_per_token=2.0 * (trunk_params + expert_params),
                   mla_flops_per_pair=float(cfg.num_mla_layers * 2 * H * (2 * R + Dr)),
                   kda_flops_per_token=float(cfg.num_kda_layers * 8 * Hk * K * K),
                   bandwidth=float(bandwidth), peak_flops=float(peak_flops), ep=ep)

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per MoE layer for ``tokens`` routed tokens, node-wide (:func:`experts_touched`)."""
        return experts_touched(self.num_experts, self.top_k, tokens)

    def step(self, decode_contexts: Sequence[int] = (), prefill_chunks: Sequence[tuple[int, int]] = ()) -> StepCost:
        """Floor of one step (formulas in the module docstring).

        Args:
            decode_contexts: context length (tokens incl. the new one) of each decode row.
            prefill_chunks: ``(new_tokens, context_end)`` per prefill chunk.
        """
        T = len(decode_contexts) + sum(n for n, _ in prefill_chunks)
        nseq = len(decode_contexts) + len(prefill_chunks)
        ctx_read = sum(decode_contexts) + sum(e for _, e in prefill_chunks)
        by = (self.trunk_bytes + T * self.embed_row_bytes
              + self.num_moe_layers * self.experts_touched(T) / self.ep * self.expert_bytes
              + (ctx_read + T) * self.mla_bytes_per_token + 2 * nseq * self.kda_slot_bytes)
        pairs = sum(decode_contexts) + sum(n * (e - n) + n * (n + 1) / 2 for n, e in prefill_chunks)
        fl = T * (self.flops_per_token + self.kda_flops_per_token) + pairs * self.mla_flops_per_pair
        tm, tc = by / self.bandwidth, fl / self.peak_flops
        return StepCost(by, fl, tm, tc, max(tm, tc), "memory" if tm >= tc else "compute")

    def decode(self, batch: int, context: int) -> dict:
        """Floor of a pure decode step of ``batch`` sequences at ``context`` tokens each (``step([context] *
        batch)``), as ``{"batch", "context", "bytes" (int), "flops", "t_memory_s", "t_compute_s", "floor_s",
        "bound"}``."""
        c = self.step([context] * batch)
        return {"batch": batch, "context": context, "bytes": int(c.bytes), "flops": c.flops,
                "t_memory_s": c.t_memory_s, "t_compute_s": c.t_compute_s, "floor_s": c.floor_s, "bound": c.bound}

    def to_dict(self) -> dict:
        return asdict(self)
