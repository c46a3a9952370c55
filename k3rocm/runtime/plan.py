"""Placement plan: which rank holds which bytes of which tensor, whether it fits, and what is left for caches.

One process per GPU (DESIGN.md §6, K3_FACTS §7). ``world = tp``; experts are split by ``ep`` (a divisor of
``tp``) and, inside an EP group of ``etp = tp // ep`` ranks, by expert intermediate (w1/w3 rows, w2
input columns). Rank ``r`` has ``ep_rank = r // etp`` and ``etp_rank = r % etp``.

Split rules (by tensor name, after the released layout, ``k3rocm.checkpoint.layout``):

==========================  ===========================================  ==============================
part                        tensors                                      split
==========================  ===========================================  ==============================
attention (TP, by head)     KDA q/k/v/g_proj, q/k/v_conv1d, f_b_proj,     dim 0 (rows of whole heads)
                            b_proj, A_log[:H], dt_bias; MLA q_b_proj,
                            kv_b_proj, g_proj; ``o_proj``                dim 1 (input columns)
dense (TP)                  layer-0 ``mlp.gate/up_proj``; ``down_proj``  dim 0; dim 1
shared (TP)                 ``shared_experts.gate/up_proj``; ``down``    dim 0; dim 1
experts (EP x etp)          ``experts.{e}.*`` for e in the rank's range  whole tensors (etp = 1) or
                                                                         intermediate rows / columns
embed_head (vocab-parallel) ``embed_tokens``, ``lm_head``                dim 0 (vocab rows)
replicated                  router gate + bias, latent down/up + norm,   none
                            AttnRes norms/projections, layer norms,
                            q_a_proj, kv_a_proj_with_mqa, f_a_proj,
                            o_norm, final norm
==========================  ===========================================  ==============================

Memory model (per GPU, bytes): ``usable = memory_bytes * usable_fraction`` (profile; assumption, sourced);
``budget = usable - weights - workspace_reserve - activation_reserve``; the cache capacity is what the budget
holds of the MLA latent cache per token (replicated on every TP rank) and the KDA state per sequence (heads
split by TP), both from :mod:`k3rocm.runtime.sizing` (K3 bf16: 27,648 B/token; 58.1 MB/sequence at tp=8). The decode
floor is :class:`k3rocm.runtime.sizing.StepRoofline` for one rank.

The per-rank tensor map (:attr:`RankPlan.tensors`) is lazy — built per layer on demand — so the official
497k-tensor plan is computed in well under a second; byte totals come from one expert's specs times the
expert count.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from math import prod
from typing import Iterator

from k3rocm.checkpoint import layout
from k3rocm.checkpoint.layout import DTYPE_BYTES, TensorSpec
from k3rocm.config import K3Config
from k3rocm.errors import PlanError
from k3rocm.profiles import Profile
from k3rocm.runtime.sizing import StepRoofline, kda_state_bytes_per_seq, kv_dtype_bytes, mla_cache_bytes_per_token

PARTS = ("experts", "attention", "shared", "dense", "embed_head", "replicated")
GB = 1e9
DEFAULT_CONTEXT = 9216  # 8k input + 1k output: the public SGLang 8k/1k scenario (K3_FACTS §7)
DEFAULT_MAX_TOKENS = 8192  # tokens per forward step (prefill chunk budget) for the activation reserve

_LAYER_RE = re.compile(r"layers\.(\d+)\.")
EXPERT_RE = re.compile(r"experts\.(\d+)\.(w[123])\.")  # routed expert tensor names: (expert id, w1|w2|w3)

# suffix (after "self_attn."/"mlp."/"block_sparse_moe.") -> (dim, group) ; group "tp" | "etp" | None
_ATTN_ROW = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
             "v_conv1d.weight", "f_b_proj.weight", "b_proj.weight", "A_log", "dt_bias", "g_proj.weight",
             "q_b_proj.weight", "kv_b_proj.weight")
_ATTN_COL = ("o_proj.weight",)


@dataclass(frozen=True)
class ShardSlice:
    """The piece of one checkpoint tensor a rank holds.

    Attributes:
        name: checkpoint tensor name.
        shape: stored (full) shape; for MXFP4 ``weight_packed`` the packed ``[out, in/2]`` shape.
        dtype: safetensors dtype (``BF16``, ``F32``, ``U8``).
        part: one of :data:`PARTS`.
        dim: split dimension of the stored shape, or ``None`` for the whole tensor.
        start, stop: the rank's index range along ``dim`` (``0, shape[0]`` when whole).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    part: str
    dim: int | None
    start: int
    stop: int

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] = self.stop - self.start
        return tuple(s)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds (local shape x item size)."""
        return prod(self.local_shape) * self.itemsize

    @property
    def whole(self) -> bool:
        return self.dim is None or (self.start == 0 and self.stop == self.shape[self.dim])

    def runs(self) -> tuple[int, int, int, int]:
        """The slice as strided byte runs relative to the tensor's first data byte (row-major storage).

        Returns:
            ``(first, count, length, stride)``: ``count`` runs of ``length`` bytes, the i-th starting at
            ``first + i * stride``. A dim-0 (or whole) slice is one run.
        """
        if self.whole:
            return 0, 1, prod(self.shape) * self.itemsize, 0
        inner = prod(self.shape[self.dim + 1:]) * self.itemsize
        outer = prod(self.shape[:self.dim])
        stride = self.shape[self.dim] * inner
        return self.start * inner, outer, (self.stop - self.start) * inner, stride

    def byte_ranges(self, base: int = 0) -> list[tuple[int, int]]:
        """Absolute ``[start, end)`` byte ranges of this slice in a file whose tensor data begins at ``base``."""
        first, count, length, stride = self.runs()
        return [(base + first + i * stride, base + first + i * stride + length) for i in range(count)]

    def index(self) -> tuple[slice, ...]:
        """The torch/numpy index that cuts this slice out of the full tensor."""
        if self.dim is None:
            return (slice(None),)
        return tuple([slice(None)] * self.dim + [slice(self.start, self.stop)])


@dataclass(frozen=True)
class _Layout:
    tp: int
    ep: int

    @property
    def etp(self) -> int:
        return self.tp // self.ep


def classify(name: str) -> tuple[str, int | None, str | None]:
    """Split rule of a checkpoint tensor: ``(part, dim, group)``; group ``"tp"``, ``"etp"`` or ``None``.

    ``"etp"`` marks expert tensors (split by intermediate inside an EP group); the expert *range* is chosen
    separately. Unknown names are replicated (safe: every rank gets the whole tensor).
    """
    if name.endswith("embed_tokens.weight") or name == layout.LM_HEAD:
        return "embed_head", 0, "tp"
    m = EXPERT_RE.search(name)
    if m:
        w = m.group(2)
        return "experts", (0 if w in ("w1", "w3") else 1), "etp"
    if ".self_attn." in name:
        tail = name.split(".self_attn.", 1)[1]
        if tail in _ATTN_ROW:
            return "attention", 0, "tp"
        if tail in _ATTN_COL:
            return "attention", 1, "tp"
        return "replicated", None, None
    if ".block_sparse_moe.shared_experts." in name:
        return "shared", (1 if "down_proj" in name else 0), "tp"
    if ".mlp." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        return "dense", (1 if "down_proj" in name else 0), "tp"
    return "replicated", None, None


def _slice(spec: TensorSpec, cfg: K3Config, lay: _Layout, rank: int) -> ShardSlice:
    part, dim, group = classify(spec.name)
    if group is None or dim is None:
        return ShardSlice(spec.name, spec.shape, spec.dtype, part, None, 0, spec.shape[0])
    n = lay.tp if group == "tp" else lay.etp
    idx = rank if group == "tp" else rank % lay.etp
    size = spec.shape[dim]
    if spec.name.endswith("self_attn.A_log"):
        # A_log is stored [head_dim] but only the first num_heads entries are used, one per head (K3_FACTS §3)
        size = cfg.kda_num_heads
    if n == 1:
        return ShardSlice(spec.name, spec.shape, spec.dtype, part, None, 0, spec.shape[0])
    if size % n:
        raise PlanError(f"{spec.name}: dim {dim} of size {size} does not split into {n} equal parts; "
                        f"choose a TP/EP layout that divides it")
    step = size // n
    return ShardSlice(spec.name, spec.shape, spec.dtype, part, dim, idx * step, (idx + 1) * step)


class RankTensors(Mapping):
    """Lazy ``name -> ShardSlice`` map of everything one rank needs (built per layer on first use)."""

    def __init__(self, rank: "RankPlan"):
        self._r = rank

    def layer(self, i: int) -> dict[str, ShardSlice]:
        """The rank's slices of decoder layer ``i`` (experts restricted to its EP range)."""
        return self._r.layer(i)

    def model_level(self) -> dict[str, ShardSlice]:
        return self._r.model_level()

    def __getitem__(self, name: str) -> ShardSlice:
        m = _LAYER_RE.search(name)
        d = self._r.layer(int(m.group(1))) if m else self._r.model_level()
        return d[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._r.model_level()
        for i in range(self._r.cfg.num_hidden_layers):
            yield from self._r.layer(i)

    def __len__(self) -> int:
        return self._r.num_tensors


@dataclass
class RankPlan:
    """What one rank (one GPU) holds.

    Attributes:
        rank, ep_rank, etp_rank: position in the layout.
        expert_first, expert_stop: global routed-expert id range ``[first, stop)`` held by this rank.
        bytes_by_part: bytes per :data:`PARTS` entry.
        tensors: lazy ``name -> ShardSlice`` mapping (``.layer(i)`` for one layer).
    """

    rank: int
    ep_rank: int
    etp_rank: int
    expert_first: int
    expert_stop: int
    bytes_by_part: dict[str, int]
    num_tensors: int
    cfg: K3Config = field(repr=False)
    _lay: _Layout = field(repr=False)

    @property
    def weights_bytes(self) -> int:
        return sum(self.bytes_by_part.values())

    @property
    def tensors(self) -> RankTensors:
        return RankTensors(self)

    def model_level(self) -> dict[str, ShardSlice]:
        return {s.name: _slice(s, self.cfg, self._lay, self.rank) for s in layout.model_specs(self.cfg)}

    def layer(self, i: int) -> dict[str, ShardSlice]:
        return _layer_slices(self.cfg, self._lay, self.rank, i)

    def expert_slices(self, i: int, e: int) -> list[ShardSlice]:
        """Slices of global expert ``e`` of layer ``i`` (must be in this rank's range)."""
        if not self.expert_first <= e < self.expert_stop:
            raise PlanError(f"expert {e} of layer {i} is not on rank {self.rank} "
                            f"(holds {self.expert_first}..{self.expert_stop - 1})")
        return [_slice(s, self.cfg, self._lay, self.rank) for s in layout.expert_specs(self.cfg, i, e)]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "ep_rank": self.ep_rank, "etp_rank": self.etp_rank,
                "experts": [self.expert_first, self.expert_stop], "bytes_by_part": dict(self.bytes_by_part),
                "weights_bytes": self.weights_bytes, "num_tensors": self.num_tensors}


@lru_cache(maxsize=64)
def _layer_slices(cfg: K3Config, lay: _Layout, rank: int, i: int) -> dict[str, ShardSlice]:
    out = {s.name: _slice(s, cfg, lay, rank) for s in layout.layer_specs(cfg, i, with_experts=False)}
    if cfg.is_moe_layer(i):
        per = cfg.num_experts // lay.ep
        first = (rank // lay.etp) * per
        for e in range(first, first + per):
            for s in layout.expert_specs(cfg, i, e):
                out[s.name] = _slice(s, cfg, lay, rank)
    return out


#: what the plan says of the token capacity of a config without MLA layers (``CacheCapacity.max_tokens`` None)
NO_MLA_BOUND = "no MLA layers: not bounded by the MLA cache"


@dataclass
class CacheCapacity:
    """What the per-GPU budget holds after weights and reserves.

    Attributes:
        budget_bytes: per GPU, for MLA cache + KDA states.
        kv_dtype: MLA latent cache dtype.
        mla_bytes_per_token: per rank, all MLA layers (replicated across TP ranks).
        kda_state_bytes_per_seq: per rank, all KDA layers (recurrent fp32 state + fp32 conv state).
        max_tokens: cached tokens if the whole budget held MLA cache (no KDA state counted); ``None`` when the
            config has no MLA layer (``mla_bytes_per_token == 0``): the tokens are then not bounded by the MLA
            cache, only ``max_sequences`` (KDA states) bounds the budget.
        context_len: tokens per sequence assumed for ``max_sequences``.
        max_sequences: concurrent sequences of ``context_len`` tokens the budget holds.
    """

    budget_bytes: int
    kv_dtype: str
    mla_bytes_per_token: int
    kda_state_bytes_per_seq: int
    max_tokens: int | None
    context_len: int
    max_sequences: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Placement:
    """The plan for one config on one profile (see the module docstring for rules and memory model).

    Attributes:
        config_name, profile_name, tp, ep, etp, world, kv_dtype.
        ranks: one :class:`RankPlan` per rank (``ranks[r].tensors`` is the lazy name -> slice map).
        usable_bytes, workspace_reserve_bytes, activation_reserve_bytes: per GPU.
        weights_bytes: per GPU (the largest rank).
        cache: :class:`CacheCapacity`.
        fits: whether weights + reserves fit with room for at least one sequence of ``context_len``.
        problem: one line when it does not fit (the :class:`PlanError` message), else ``None``.
        roofline: :class:`k3rocm.runtime.sizing.StepRoofline` of one rank (``roofline.decode(batch, context)``).
        host_shares: on the cpu backend, the rank processes sharing the host (its memory, bandwidth and compute
            each get this share); 1 on GPUs.
    """

    config_name: str
    profile_name: str
    tp: int
    ep: int
    world: int
    kv_dtype: str
    max_tokens: int
    ranks: list[RankPlan]
    usable_bytes: int
    memory_bytes: int
    usable_fraction: float
    workspace_reserve_bytes: int
    activation_reserve_bytes: int
    cache: CacheCapacity
    fits: bool
    problem: str | None
    roofline: StepRoofline
    experts_per_rank: int
    heads_per_rank: dict
    notes: list = field(default_factory=list)
    host_shares: int = 1

    @property
    def etp(self) -> int:
        return self.tp // self.ep

    @property
    def weights_bytes(self) -> int:
        return max(r.weights_bytes for r in self.ranks)

    @property
    def bytes_by_part(self) -> dict[str, int]:
        """Per-part bytes of the largest rank."""
        return max(self.ranks, key=lambda r: r.weights_bytes).bytes_by_part

    @property
    def needed_bytes(self) -> int:
        """Weights + workspace + activation reserve + one sequence of cache, per GPU."""
        c = self.cache
        return (self.weights_bytes + self.workspace_reserve_bytes + self.activation_reserve_bytes
                + c.context_len * c.mla_bytes_per_token + c.kda_state_bytes_per_seq)

    def summary(self) -> list[dict]:
        """Rows for a table: ``{"item", "bytes", "GB", "detail"}`` — per-GPU parts, reserves, budget, cache.

        A row whose figure is a count also has ``"count"``; ``"count": None`` is a count that does not apply (the
        token capacity of a config without MLA layers, :data:`NO_MLA_BOUND`)."""
        def row(item, b, detail="", count=None):
            r = {"item": item, "bytes": int(b), "GB": round(b / GB, 3), "detail": detail}
            if count is not None:
                r["count"] = int(count)  # a row whose figure is a count (tokens, sequences); bytes = what it uses
            return r

        parts = self.bytes_by_part
        split = {
            "experts": f"EP {self.ep} x intermediate {self.etp}: {self.experts_per_rank} experts/rank",
            "attention": (f"TP {self.tp}: {self.heads_per_rank['kda']} KDA / "
                          f"{self.heads_per_rank['mla']} MLA heads per rank"),
            "shared": f"TP {self.tp} by intermediate", "dense": f"TP {self.tp} by intermediate",
            "embed_head": f"vocab-parallel over {self.tp}",
            "replicated": "router, latent down/up + norm, AttnRes, norms, low-rank A projections",
        }
        rows = [row(f"weights: {p}", parts.get(p, 0), split[p]) for p in PARTS]
        rows.append(row("weights per GPU", self.weights_bytes, "largest rank"))
        shared = (f" / {self.host_shares} processes sharing this host" if self.host_shares > 1 else "")
        rows.append(row("usable memory per GPU", self.usable_bytes,
                        f"{self.memory_bytes / GB:.1f} GB x {self.usable_fraction}{shared} ({self.profile_name})"))
        rows.append(row("workspace reserve", self.workspace_reserve_bytes, "runtime, collectives, kernels"))
        rows.append(row("activation reserve", self.activation_reserve_bytes, f"{self.max_tokens} tokens per step"))
        c = self.cache
        rows.append(row("cache budget per GPU", c.budget_bytes, "fits" if self.fits else f"DOES NOT FIT: {self.problem}"))
        rows.append(row("MLA cache per token", c.mla_bytes_per_token,
                        f"{c.kv_dtype}, replicated per TP rank" if c.mla_bytes_per_token else "no MLA layers"))
        rows.append(row("KDA state per sequence", c.kda_state_bytes_per_seq, "fp32 recurrent + conv state, this rank"))
        if c.max_tokens is None:  # no MLA layer: no token bound from the cache ("count" None: shown as n/a)
            rows.append({**row("cache capacity (tokens)", 0, NO_MLA_BOUND), "count": None})
        else:
            rows.append(row("cache capacity (tokens)", c.max_tokens * c.mla_bytes_per_token,
                            f"{c.max_tokens:,} tokens if all budget were MLA cache", count=c.max_tokens))
        rows.append(row("concurrent sequences", c.max_sequences * (c.context_len * c.mla_bytes_per_token
                                                                    + c.kda_state_bytes_per_seq),
                        f"{c.max_sequences:,} sequences of {c.context_len:,} tokens", count=c.max_sequences))
        return rows

    def to_dict(self) -> dict:
        return {
            "config": self.config_name, "profile": self.profile_name, "tp": self.tp, "ep": self.ep,
            "etp": self.etp, "world": self.world, "kv_dtype": self.kv_dtype, "max_tokens": self.max_tokens,
            "experts_per_rank": self.experts_per_rank, "heads_per_rank": dict(self.heads_per_rank),
            "weights_bytes_per_gpu": self.weights_bytes, "bytes_by_part": dict(self.bytes_by_part),
            "memory_bytes": self.memory_bytes, "usable_fraction": self.usable_fraction,
            "usable_bytes": self.usable_bytes, "workspace_reserve_bytes": self.workspace_reserve_bytes,
            "activation_reserve_bytes": self.activation_reserve_bytes, "needed_bytes": self.needed_bytes,
            "cache": self.cache.to_dict(), "fits": self.fits, "problem": self.problem,
            "ranks": [r.to_dict() for r in self.ranks],
            "roofline": {**self.roofline.to_dict(), "step_b1_ctx1k": self.roofline.decode(1, 1024)},
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------------------ planning
def default_ep(profile: Profile, tp: int) -> int:
    """The expert-parallel degree of a ``tp``-rank layout when none is given: the profile's where it divides
    ``tp``, else ``tp`` (every rank its own expert slice)."""
    return profile.ep if profile.ep and tp % profile.ep == 0 else tp


def _check_layout(cfg: K3Config, profile: Profile, tp: int, ep: int, hint: bool = True) -> None:
    where = f"{cfg.name} on {profile.name}"
    if tp < 1:
        raise PlanError(f"{where}: tp={tp} must be >= 1 (tensor-parallel ranks, one process per GPU)"
                        + (f"; {_valid_hint(cfg, profile)}" if hint else ""))
    if ep < 1:
        raise PlanError(f"{where}: ep={ep} must be >= 1 and divide tp={tp} (experts split by EP)"
                        + (f"; {_valid_hint(cfg, profile)}" if hint else ""))
    if profile.backend != "cpu" and tp > profile.device_count:
        raise PlanError(f"{where}: tp={tp} needs {tp} GPUs but the profile has {profile.device_count}; "
                        f"use tp <= {profile.device_count} (one process per GPU)")
    if tp % ep:
        fix = ""
        if hint:  # only layouts that pass every check: a suggestion must never lead to the next error
            good = [e for t, e in valid_layouts(cfg, profile) if t == tp]
            fix = ("; with tp=" + str(tp) + " try ep=" + " or ep=".join(map(str, good)) if good
                   else "; " + _valid_hint(cfg, profile))
        raise PlanError(f"{where}: ep={ep} must divide tp={tp} (experts split by EP, then by intermediate "
                        f"inside each EP group){fix}")
    if cfg.num_kda_layers and cfg.kda_num_heads % tp:
        raise PlanError(f"{where}: {cfg.kda_num_heads} KDA heads are not divisible by tp={tp}; "
                        f"{_valid_hint(cfg, profile) if hint else ''}")
    if cfg.num_mla_layers and cfg.num_attention_heads % tp:
        raise PlanError(f"{where}: {cfg.num_attention_heads} MLA heads are not divisible by tp={tp}; "
                        f"{_valid_hint(cfg, profile) if hint else ''}")
    if cfg.num_moe_layers:
        if cfg.num_experts % ep:
            fix = f"choose ep from {_divisors(cfg.num_experts)}"
            if hint:  # a suggestion must never lead to the next error: only layouts that pass every check
                good = [e for t, e in valid_layouts(cfg, profile) if t == tp]
                fix = (f"with tp={tp} try ep=" + " or ep=".join(map(str, good)) if good
                       else f"and no ep works with tp={tp} (the model splits no valid way into tp={tp} ranks); "
                            f"{_valid_hint(cfg, profile)}")
            raise PlanError(f"{where}: {cfg.num_experts} routed experts are not divisible by ep={ep}; {fix}")
        etp = tp // ep
        I = cfg.moe_intermediate_size
        if I % etp:
            raise PlanError(f"{where}: expert intermediate {I} does not split into {etp} parts (tp/ep); raise ep")
        if cfg.experts_quantized and (I // etp) % 32:
            raise PlanError(f"{where}: splitting expert intermediate {I} into {etp} parts of {I // etp} cuts "
                            f"MXFP4 scale groups of 32 in w2 (weight_scale [out, in/32]); use ep={tp} or a "
                            f"split whose part is a multiple of 32")
        if cfg.shared_intermediate_size % tp:
            raise PlanError(f"{where}: shared-expert width {cfg.shared_intermediate_size} is not divisible by tp={tp}")
    if cfg.first_k_dense_replace and cfg.intermediate_size % tp:
        raise PlanError(f"{where}: dense intermediate {cfg.intermediate_size} is not divisible by tp={tp}")
    if cfg.vocab_size % tp:
        raise PlanError(f"{where}: vocab {cfg.vocab_size} is not divisible by tp={tp} (vocab-parallel embedding/head)")


def _layout_ok(cfg: K3Config, profile: Profile, tp: int, ep: int) -> bool:
    """True when ``(tp, ep)`` passes every layout check on ``profile`` (memory aside). Raises nothing."""
    try:
        _check_layout(cfg, profile, tp, ep, hint=False)
    except PlanError:
        return False
    return True


def valid_layouts(cfg: K3Config, profile: Profile) -> list[tuple[int, int]]:
    """Every ``(tp, ep)`` that passes the layout checks on ``profile`` (tp up to its device count, or 64 on
    the CPU profile), smallest tp first; memory is not considered."""
    top = profile.device_count if profile.backend != "cpu" else 64
    out = []
    for tp in range(1, top + 1):
        for ep in range(1, tp + 1):
            if tp % ep:
                continue
            try:
                _check_layout(cfg, profile, tp, ep, hint=False)
            except PlanError:
                continue
            out.append((tp, ep))
    return out


def _valid_hint(cfg: K3Config, profile: Profile) -> str:
    """The layouts to suggest: those of :func:`valid_layouts` that also hold the model in memory at the default
    cache settings (the official K3 at tp=1 on mi355x-8 splits evenly but needs 1.58 TB a GPU), else the ones that
    split it evenly, said so."""
    lay = valid_layouts(cfg, profile)
    if not lay:
        return f"no tp/ep layout works on {profile.name}"

    def fits(tp: int, ep: int) -> bool:
        try:
            return plan(cfg, profile, tp=tp, ep=ep, strict=False, _probe=True).fits
        except PlanError:
            return False

    fit = [(t, e) for t, e in lay if fits(t, e)]

    def shown(ls: list[tuple[int, int]]) -> str:
        return ", ".join(f"tp={t}/ep={e}" for t, e in ls[:12]) + (", ..." if len(ls) > 12 else "")
    if fit:
        return f"layouts that work on {profile.name}: {shown(fit)}"
    return (f"no layout of {profile.name} holds {cfg.name} in memory at the default cache settings; the ones that "
            f"split it evenly: {shown(lay)}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


@lru_cache(maxsize=32)
def _rank_bytes(cfg: K3Config, lay: _Layout, rank: int) -> tuple[dict[str, int], int]:
    by = {p: 0 for p in PARTS}
    n = 0
    for s in layout.model_specs(cfg):
        sl = _slice(s, cfg, lay, rank)
        by[sl.part] += sl.nbytes
        n += 1
    per = cfg.num_experts // lay.ep if cfg.num_experts else 0
    for i in range(cfg.num_hidden_layers):
        for s in layout.layer_specs(cfg, i, with_experts=False):
            sl = _slice(s, cfg, lay, rank)
            by[sl.part] += sl.nbytes
            n += 1
        if cfg.is_moe_layer(i):
            one = [_slice(s, cfg, lay, rank) for s in layout.expert_specs(cfg, i, 0)]
            by["experts"] += per * sum(sl.nbytes for sl in one)
            n += per * len(one)
    return by, n


def activation_reserve(cfg: K3Config, tp: int, max_tokens: int) -> int:
    """Estimated activation/workspace bytes per GPU for a forward step of ``max_tokens`` tokens.

    Per token: the AttnRes bank + prefix in fp32 (``(bank_rows + 1) * hidden * 4``), one layer's KDA
    projections q/k/v/g/decay in fp32 on this rank (``5 * H*K/tp * 4``), the routed-expert intermediates of
    ``top_k`` experts in bf16 (``top_k * 2 * I * 2``, worst case all on this rank), the latent (fp32) and
    vocab-parallel logits (``vocab/tp * 4``). An estimate, not a measurement: the load tier reports the
    measured peak.
    """
    H = cfg.hidden_size
    per_tok = (cfg.num_attn_res_bank_rows + 2) * H * 4
    per_tok += 5 * (cfg.kda_proj_size // tp) * 4
    per_tok += cfg.num_experts_per_token * 2 * cfg.moe_intermediate_size * 2 + cfg.expert_in_size * 4
    per_tok += (cfg.vocab_size // tp) * 4
    return int(per_tok * max_tokens)


def _roofline(cfg: K3Config, profile: Profile, lay: _Layout, shares: int = 1) -> StepRoofline:
    """Rank 0's step roofline: its non-expert bytes and parameters (embedding excluded) from the split rules;
    ``shares`` processes on one host (cpu backend) split its bandwidth and compute, as they split its memory."""
    return StepRoofline.from_config(cfg, profile.hbm_bandwidth / shares, profile.peak("bf16") / shares, tp=lay.tp,
                                    ep=lay.ep, rank_trunk=_rank_trunk(cfg, lay, 0))


@lru_cache(maxsize=32)
def _rank_trunk(cfg: K3Config, lay: _Layout, rank: int) -> tuple[int, int]:
    """``(bytes, params)`` of the non-expert slices ``rank`` holds, input embedding excluded."""
    by = params = 0
    specs = [s for s in layout.model_specs(cfg) if not s.name.endswith("embed_tokens.weight")]
    specs += [s for i in range(cfg.num_hidden_layers) for s in layout.layer_specs(cfg, i, with_experts=False)]
    for s in specs:
        sl = _slice(s, cfg, lay, rank)
        by += sl.nbytes
        params += prod(sl.local_shape)
    return by, params


def plan(cfg: K3Config, profile: Profile, tp: int | None = None, ep: int | None = None, kv_dtype: str = "bf16",
         max_tokens: int | None = None, context_len: int | None = None, strict: bool = True,
         host_ranks: int | None = None, *, _probe: bool = False) -> Placement:
    """Place ``cfg`` on ``profile``: per-rank tensor slices, bytes, memory budget, cache capacity, roofline.

    Args:
        cfg: model config. profile: hardware profile (:func:`k3rocm.profiles.load_profile`).
        tp: ranks (one process per GPU). Default ``profile.tp``, or — when the config's heads / experts / widths
            do not split that way (e.g. k3-tiny's 4 heads on an 8-GPU profile) — the largest divisor of it that
            works, with a note in ``Placement.notes``. An explicit ``tp`` is never changed.
        ep: expert-parallel degree, a divisor of ``tp`` (default ``profile.ep`` when it divides tp, else tp).
        kv_dtype: MLA latent cache dtype (``bf16``, ``fp8``, ``fp16``, ``fp32``).
        max_tokens: tokens per forward step (prefill chunk budget) for the activation reserve (default 8192).
        context_len: tokens per sequence for the concurrent-sequence figure (default 9216 = 8k + 1k).
        strict: raise :class:`PlanError` when it does not fit (default); ``False`` returns the Placement with
            ``fits=False`` and ``problem`` set, so a caller can still print the numbers.
        host_ranks: on the cpu backend, the rank processes that share the host's memory (default ``tp``: every
            rank runs here; 1 for a ``--synthetic`` run, which builds one rank alone). Ignored on GPU profiles.
        _probe: internal (the hints' own trial plans): errors carry no layout hint or suggestion, which would plan
            again — on a profile that holds the model in no layout, without end.

    Raises:
        PlanError: heads / experts / widths not divisible by the layout, MXFP4 scale groups split by an
            expert-intermediate split, more ranks than GPUs, or (strict) memory short — one line with needed
            vs available bytes per GPU and what to try.
    """
    notes: list[str] = []
    if tp is None:
        # the profile's layout, or the largest divisor of it that the config can be split by
        want = profile.tp  # cpu profiles too: [parallel] tp gloo processes on the host
        first_err = None
        for cand in range(want, 0, -1):  # the largest layout the config splits by, at most the profile's
            cand_ep = ep if ep is not None else default_ep(profile, cand)
            try:
                _check_layout(cfg, profile, cand, cand_ep, hint=not _probe)
            except PlanError as e:
                first_err = first_err or e
                continue
            if cand != want:
                notes.append(f"tp reduced from the profile's {want} to {cand}: {first_err}")
            tp, ep = cand, cand_ep
            break
        if tp is None:
            raise first_err  # type: ignore[misc]
    if ep is None:
        ep = default_ep(profile, tp)
        try:
            _check_layout(cfg, profile, tp, ep, hint=not _probe)
        except PlanError as e:
            # the user gave no --ep: say where the value came from, but only when another ep makes this tp work;
            # when none does, tp itself is what is wrong and the message (about tp) stands alone
            top = min(tp, cfg.num_experts if cfg.num_moe_layers else 1)  # an ep above that never passes
            if any(_layout_ok(cfg, profile, tp, e2) for e2 in range(1, top + 1) if tp % e2 == 0):
                raise PlanError(f"{e} (ep was not given and defaults to {ep}; pass --ep)") from None
            raise
    else:
        _check_layout(cfg, profile, tp, ep, hint=not _probe)
    lay = _Layout(tp, ep)
    max_tokens = int(max_tokens or DEFAULT_MAX_TOKENS)
    context_len = int(context_len or DEFAULT_CONTEXT)
    mla_tok = mla_cache_bytes_per_token(cfg, kv_dtype_bytes(kv_dtype))
    kda_seq = kda_state_bytes_per_seq(cfg, cfg.kda_num_heads // tp)

    ranks = []
    per = cfg.num_experts // ep if cfg.num_moe_layers else 0
    for r in range(tp):
        by, n = _rank_bytes(cfg, lay, r)
        e0 = (r // lay.etp) * per
        ranks.append(RankPlan(rank=r, ep_rank=r // lay.etp, etp_rank=r % lay.etp, expert_first=e0,
                              expert_stop=e0 + per, bytes_by_part=dict(by), num_tensors=n, cfg=cfg, _lay=lay))
    weights = max(r.weights_bytes for r in ranks)
    # on the cpu backend the ranks are processes sharing the host's memory: each gets its share
    if host_ranks is not None and not 1 <= host_ranks <= tp:
        raise PlanError(f"host_ranks {host_ranks} must be in 1..tp={tp}")
    shares = (host_ranks or tp) if profile.backend == "cpu" else 1
    usable = profile.usable_bytes // shares
    act = activation_reserve(cfg, tp, max_tokens)
    budget = usable - weights - profile.workspace_reserve_bytes - act
    per_seq = context_len * mla_tok + kda_seq
    cache = CacheCapacity(budget_bytes=int(budget), kv_dtype=kv_dtype, mla_bytes_per_token=mla_tok,
                          kda_state_bytes_per_seq=kda_seq,
                          max_tokens=max(0, budget // mla_tok) if mla_tok else None, context_len=context_len,
                          max_sequences=max(0, budget // per_seq) if per_seq else 0)
    fits = budget >= per_seq
    pl = Placement(config_name=cfg.name, profile_name=profile.name, tp=tp, ep=ep, world=tp, kv_dtype=kv_dtype,
                   max_tokens=max_tokens, ranks=ranks, usable_bytes=usable, memory_bytes=profile.memory_bytes,
                   usable_fraction=profile.usable_fraction, workspace_reserve_bytes=profile.workspace_reserve_bytes,
                   activation_reserve_bytes=act, cache=cache, fits=fits, problem=None,
                   roofline=_roofline(cfg, profile, lay, shares), host_shares=shares,
                   experts_per_rank=per,
                   heads_per_rank={"kda": cfg.kda_num_heads // tp, "mla": cfg.num_attention_heads // tp},
                   notes=notes)
    if cfg.experts_quantized and cfg.num_moe_layers and not profile.has_fp4 and profile.backend != "cpu":
        pl.notes.append(f"{profile.arch} has no MXFP4 hardware: experts stay packed in memory and the A16W4 "
                        "kernel decodes them to bf16 in registers, so the byte plan holds but expert GEMMs run "
                        "at the bf16 rate (A8W4 is emulated there)")
    if not fits:
        pl.problem = _not_fit_message(cfg, profile, pl, suggest=not _probe)
        if strict:
            raise PlanError(pl.problem)
    return pl


def _not_fit_message(cfg: K3Config, profile: Profile, pl: Placement, suggest: bool = True) -> str:
    need = pl.needed_bytes
    msg = (f"{cfg.name} does not fit {profile.name} at tp={pl.tp}/ep={pl.ep}: needs {need / GB:.1f} GB per GPU "
           f"(weights {pl.weights_bytes / GB:.1f} GB + reserves "
           f"{(pl.workspace_reserve_bytes + pl.activation_reserve_bytes) / GB:.1f} GB + one "
           f"{pl.cache.context_len}-token sequence of cache), {pl.usable_bytes / GB:.1f} GB usable "
           f"({profile.memory_bytes / GB:.1f} GB x {profile.usable_fraction})")
    return msg + "; " + _suggest(cfg, profile, pl) if suggest else msg


def _suggest(cfg: K3Config, profile: Profile, pl: Placement) -> str:
    """What to try: the smallest power-of-two GPU count of this kind that would hold the model."""
    if profile.backend != "cpu":
        # a bigger layout on the same profile first
        for n in (2, 4, 8, 16, 32, 64):
            if n <= pl.tp:
                continue
            fake = scaled_profile(profile, n)
            try:
                p = plan(cfg, fake, tp=n, ep=n, kv_dtype=pl.kv_dtype, max_tokens=pl.max_tokens,
                         context_len=pl.cache.context_len, strict=True, _probe=True)
            except PlanError:
                continue
            # one node of the profile as written (a synthetic rank stretches device_count to its layout)
            node = int((profile.raw.get("device") or {}).get("count") or profile.device_count)
            src = (profile.name if profile.name.endswith(".toml") else f"hwprofiles/{profile.name}.toml")
            where = ("this node" if n <= node else
                     f"{-(-n // node)} nodes under torchrun; `plan` covers one node of "
                     f"{node}, so plan it with --profile FILE.toml, a copy of "
                     f"{src} with count = {n}, and --tp {n} --ep {n}")
            # a smaller cache dtype helps only when the weights alone fit and the cache is not fp8 already
            kv = (", fp8 kv cache" if pl.kv_dtype != "fp8" and pl.weights_bytes < pl.usable_bytes else "")
            return (f"try tp={n}/ep={n} ({n} x {profile.device_name}, {p.weights_bytes / GB:.1f} GB/GPU of "
                    f"weights, on {where}){kv}, or a GPU with more memory")
    return "try more GPUs, a GPU with more memory, or a smaller checkpoint (k3-tiny, k3-prefix-N)"


def scaled_profile(profile: Profile, n: int, ep: int | None = None) -> Profile:
    """``profile`` with at least ``n`` devices of its kind and a ``tp = n`` / ``ep`` (default ``n``) layout: the
    same GPU, memory and links per device, more of them (several nodes of it under torchrun)."""
    return replace(profile, device_count=max(n, profile.device_count), tp=n, ep=n if ep is None else ep)
