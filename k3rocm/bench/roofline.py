"""Roofline of one engine step: the time floor from bytes moved and FLOPs done, and a step's fraction of it.

For a step with decode rows at context lengths ``c_n`` and prefill chunks (``n_j`` new tokens ending at
context ``e_j``), on one device (HARDWARE.md "Measuring"; DeepSeek/vLLM decode roofline practice):

* **bytes** = trunk weights read once (every non-expert tensor except the input embedding, of which only
  the step's rows are read) + routed experts touched (expected distinct experts per MoE layer for T routed
  tokens under uniform routing, ``E * (1 - (1 - k/E)^T)``, times one expert's bytes, times MoE layers)
  + MLA cache read (``sum_n c_n + sum_j e_j`` tokens x ``layers x (R+Dr) x kv bytes``) and written (T tokens)
  + KDA state read and written once per sequence in the step (``2 x`` slot bytes);
* **FLOPs** = ``2 x activated parameters`` per token (K3_FACTS §2 definition: lm_head counted, embedding not)
  + absorbed-MLA attention ``2 x H x (2R + Dr)`` per (query, context position) per MLA layer
  + KDA ``8 x H x K x V`` per token per KDA layer (decay, ``S^T k``, rank-1 update, ``S^T q``);
* **floor** = ``max(bytes / bandwidth, FLOPs / peak)``; ``fraction = floor / measured`` (1.0 = at the roofline).

Ceilings come from the hardware profile (datasheet, ``projected``) or from measured copy bandwidth and
GEMM rate (HARDWARE.md: H200 ~4.2 TB/s, ~682 TFLOP/s bf16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from k3rocm.checkpoint.layout import counts, expert_specs, model_specs
from k3rocm.config import K3Config
from k3rocm.errors import ConfigError


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
    """Per-device roofline parameters (bytes, FLOPs, ceilings) of a model for engine steps.

    Attributes:
        trunk_bytes: non-expert weight bytes read per step (embedding excluded).
        embed_row_bytes: bytes of one input-embedding row.
        expert_bytes: bytes of one routed expert (w1, w2, w3; packed MXFP4 + scales as stored).
        num_moe_layers, num_experts, top_k: routing shape.
        mla_bytes_per_token: cache bytes of one token over all MLA layers.
        kda_slot_bytes: KDA state + conv bytes of one sequence over all KDA layers.
        flops_per_token: 2 x activated parameters.
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

    @classmethod
    def from_config(cls, cfg: K3Config, bandwidth: float, peak_flops: float, kv_bytes: int = 2,
                    trunk_dtype_bytes: int | None = None) -> "StepRoofline":
        """Single-device roofline from the checkpoint layout of ``cfg``.

        Args:
            bandwidth: memory bandwidth, bytes/s (> 0). peak_flops: FLOP/s (> 0).
            kv_bytes: bytes per MLA cache value (2 bf16, 1 fp8, 4 fp32).
            trunk_dtype_bytes: bytes per trunk weight as held in memory (None = as stored: 2 for BF16; 4 for an
                fp32 engine on CPU).
        Raises:
            ConfigError: non-positive ceilings.
        """
        if bandwidth <= 0 or peak_flops <= 0:
            raise ConfigError(f"roofline needs bandwidth > 0 and peak FLOP/s > 0 (got {bandwidth}, {peak_flops})")
        c = counts(cfg)
        embed = next(s for s in model_specs(cfg) if s.name.endswith("embed_tokens.weight"))
        trunk_params = c["params"] - c["params_expert"]
        if trunk_dtype_bytes is None:
            trunk = c["bytes_trunk"] - embed.nbytes
            row = embed.nbytes / embed.shape[0]
        else:
            trunk = (trunk_params - embed.params) * trunk_dtype_bytes
            row = embed.shape[1] * trunk_dtype_bytes
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        eb = sum(s.nbytes for s in expert_specs(cfg, moe[0], 0)) if moe else 0
        H, R, Dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        Hk, K = cfg.kda_num_heads, cfg.kda_head_dim
        kda_slot = cfg.num_kda_layers * (Hk * K * K + 3 * Hk * K * (cfg.short_conv_kernel_size - 1)) * 4
        return cls(trunk_bytes=float(trunk), embed_row_bytes=float(row), expert_bytes=float(eb),
                   num_moe_layers=len(moe), num_experts=cfg.num_experts, top_k=cfg.num_experts_per_token,
                   mla_bytes_per_token=float(cfg.num_mla_layers * (R + Dr) * kv_bytes),
                   kda_slot_bytes=float(kda_slot), flops_per_token=2.0 * c["params_activated"],
                   mla_flops_per_pair=float(cfg.num_mla_layers * 2 * H * (2 * R + Dr)),
                   kda_flops_per_token=float(cfg.num_kda_layers * 8 * Hk * K * K),
                   bandwidth=float(bandwidth), peak_flops=float(peak_flops))

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts per MoE layer for ``tokens`` routed tokens (uniform routing)."""
        E, k = self.num_experts, self.top_k
        return E * (1.0 - (1.0 - k / E) ** tokens) if E and tokens > 0 else 0.0

    def step(self, decode_contexts: Sequence[int] = (), prefill_chunks: Sequence[tuple[int, int]] = ()) -> StepCost:
        """Floor of one step.

        Args:
            decode_contexts: context length (tokens incl. the new one) of each decode row.
            prefill_chunks: ``(new_tokens, context_end)`` per prefill chunk.
        """
        T = len(decode_contexts) + sum(n for n, _ in prefill_chunks)
        nseq = len(decode_contexts) + len(prefill_chunks)
        ctx_read = sum(decode_contexts) + sum(e for _, e in prefill_chunks)
        by = (self.trunk_bytes + T * self.embed_row_bytes
              + self.num_moe_layers * self.experts_touched(T) * self.expert_bytes
              + (ctx_read + T) * self.mla_bytes_per_token + 2 * nseq * self.kda_slot_bytes)
        pairs = sum(decode_contexts) + sum(n * (e - n) + n * (n + 1) / 2 for n, e in prefill_chunks)
        fl = T * (self.flops_per_token + self.kda_flops_per_token) + pairs * self.mla_flops_per_pair
        tm, tc = by / self.bandwidth, fl / self.peak_flops
        return StepCost(by, fl, tm, tc, max(tm, tc), "memory" if tm >= tc else "compute")

    def to_dict(self) -> dict:
        return asdict(self)


def fraction_of_roofline(roof: StepRoofline, steps: Sequence) -> dict:
    """Fraction of roofline per step and in total for engine :class:`~k3rocm.runtime.engine.StepStats`.

    Returns ``{"per_step": [{"floor_s", "measured_s", "fraction", "bound", "decode", "prefill_tokens"}...],
    "total_floor_s", "total_measured_s", "fraction", "decode_only": {"steps", "floor_s", "measured_s",
    "fraction", "median_fraction"}, "with_prefill": {...the same}}`` (fraction = floor / measured; 0 when nothing
    ran). ``decode_only`` covers the steps that carried no prefill tokens: the decode step the serving goals
    speak of, without the prefill chunks a continuous-batching engine mixes into other steps; ``with_prefill``
    the others.
    """
    rows = []
    for s in steps:
        pre = list(zip(_prefill_sizes(s), s.prefill_contexts))
        c = roof.step(s.decode_contexts, pre)
        rows.append({"floor_s": c.floor_s, "measured_s": s.seconds, "fraction": c.floor_s / s.seconds if s.seconds else 0.0,
                     "bound": c.bound, "decode": s.num_decode, "prefill_tokens": s.num_prefill_tokens})
    tf = sum(r["floor_s"] for r in rows)
    tmeas = sum(r["measured_s"] for r in rows)
    return {"per_step": rows, "total_floor_s": tf, "total_measured_s": tmeas,
            "fraction": tf / tmeas if tmeas else 0.0,
            "decode_only": _summary([r for r in rows if r["decode"] and not r["prefill_tokens"]]),
            "with_prefill": _summary([r for r in rows if r["prefill_tokens"]])}


def _summary(rows: list[dict]) -> dict:
    """``{"steps", "floor_s", "measured_s", "fraction" (sum floor / sum measured), "median_fraction"}`` of
    per-step rows; zeros when there are none."""
    f, m = sum(r["floor_s"] for r in rows), sum(r["measured_s"] for r in rows)
    fr = sorted(r["fraction"] for r in rows)
    med = (fr[len(fr) // 2] if len(fr) % 2 else (fr[len(fr) // 2 - 1] + fr[len(fr) // 2]) / 2) if fr else 0.0
    return {"steps": len(rows), "floor_s": f, "measured_s": m, "fraction": f / m if m else 0.0,
            "median_fraction": med}


def _prefill_sizes(s) -> list[int]:
    """Per-chunk token counts of a step (the engine logs them as ``prefill_sizes`` or only their sum)."""
    sizes = getattr(s, "prefill_sizes", None)
    if sizes is not None:
        return list(sizes)
    n = len(s.prefill_contexts)
    if n == 0:
        return []
    base, extra = divmod(s.num_prefill_tokens, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
