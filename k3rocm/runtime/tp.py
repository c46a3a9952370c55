"""Tensor- and expert-parallel forward of the fp32 oracle (one process per rank).

Each rank holds the slices :mod:`k3rocm.runtime.plan` assigns it and runs the oracle's own layer functions
(:mod:`k3rocm.model.layer`) on a *local* view of the config (``kda_num_heads`` and ``num_attention_heads``
divided by ``tp``), then reduces:

* KDA / MLA mixer: heads split (q/k/v/g/b/f_b/conv/A_log/dt_bias rows, ``q_b``/``kv_b``/``g_proj`` rows);
  ``o_proj`` is split by input columns, so each rank's output is a partial sum -> ``all_reduce``.
* dense MLP (layer 0) and shared experts: split by intermediate (gate/up rows, down columns) -> partial sums.
* routed experts: each rank holds ``num_experts / ep`` experts (global ids ``first .. first + n - 1``; the
  oracle's ``moe_experts`` maps global -> local ids with ``first_expert``), split by intermediate inside an EP
  group when ``tp > ep``. The router, latent down/up projections and ``routed_expert_norm`` are replicated.
  The routed latent partial sum is reduced **before** ``routed_expert_norm`` (K3_FACTS §5 step 3:
  norm(sum) != sum(norm)); it travels in the same ``all_reduce`` as the shared-expert partial sum.
* embedding: vocab-parallel rows, each rank looks up the ids in its range (zeros elsewhere) -> ``all_reduce``;
  lm_head: vocab-parallel rows -> local logits -> ``all_gather`` along the vocabulary.
* Block AttnRes, norms and everything else run replicated on every rank (identical inputs, identical results).

Collectives per layer: 2 all_reduces of ``[T, hidden]`` (+ ``[T, latent]`` on MoE layers).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

import torch

from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.model.common import f32, linear, rms_norm
from k3rocm.model.layer import Batch, K3Cache, dense_mlp, kda_mixer, mla_mixer
from k3rocm.model.model import K3Model, LayerState, _cu
from k3rocm.model.layer import AttnResState
from k3rocm.runtime.dist import DistContext, all_gather_cat, all_reduce
from k3rocm.runtime.plan import Placement, RankPlan

__all__ = ["local_config", "shard_weights", "LocalWeights", "TPModel", "tp_forward_worker"]


def local_config(cfg: K3Config, tp: int) -> K3Config:
    """The per-rank view of ``cfg``: KDA and MLA head counts divided by ``tp`` (everything else unchanged)."""
    if cfg.kda_num_heads % tp or cfg.num_attention_heads % tp:
        raise ConfigError(f"heads ({cfg.kda_num_heads} KDA, {cfg.num_attention_heads} MLA) not divisible by tp={tp}")
    return replace(cfg, kda_num_heads=cfg.kda_num_heads // tp, num_attention_heads=cfg.num_attention_heads // tp)


def _get(src: Any, name: str) -> torch.Tensor:
    try:
        t = src.get(name) if hasattr(src, "get") else src[name]
    except KeyError:
        t = None
    if t is None:
        raise CheckpointError(f"tensor {name} is missing from the weights given to the TP model")
    return t


def shard_weights(full: Any, rank: RankPlan) -> dict[str, torch.Tensor]:
    """Cut rank ``rank``'s slices out of full (single-device) weights.

    Args:
        full: mapping / ``Weights`` / ``CheckpointIndex`` (anything with ``get(name)``, ``[name]`` or ``read(name)``)
            keyed by full checkpoint names.
        rank: ``placement.ranks[r]``.
    Returns:
        ``{name: contiguous local tensor}`` — exactly the names in ``rank.tensors``.
    """
    out = {}
    reader = getattr(full, "read", None)
    for name, sl in rank.tensors.items():
        t = reader(name) if callable(reader) else _get(full, name)
        if tuple(t.shape) != sl.shape:
            raise CheckpointError(f"{name}: shape {tuple(t.shape)} != planned {sl.shape}")
        out[name] = t[sl.index()].contiguous().clone()
    return out


class LocalWeights:
    """One rank's tensors by full checkpoint name plus ``experts(layer)`` for its EP range.

    Args:
        cfg: the full config. rank: the rank's :class:`RankPlan`.
        tensors: anything with ``get(name)`` / ``[name]`` holding the rank's LOCAL slices (from
            :func:`shard_weights` or :func:`k3rocm.runtime.load.load`).
    """

    def __init__(self, cfg: K3Config, rank: RankPlan, tensors: Any):
        self.cfg = cfg
        self.rank = rank
        self.tensors = tensors
        self._experts: dict[int, dict] = {}

    def get(self, name: str) -> torch.Tensor | None:
        try:
            return self.tensors.get(name) if hasattr(self.tensors, "get") else self.tensors[name]
        except KeyError:
            return None

    def experts(self, layer: int) -> dict:
        """``ExpertWeights`` fields (op contract) of this rank's experts of MoE layer ``layer``.

        ``w13_packed [E_local, 2*I_local, D/2]`` (w1 rows then w3 rows), ``w13_scale``, ``w2_packed
        [E_local, D, I_local/2]``, ``w2_scale``, ``num_experts`` = E_local, ``first_expert`` = global id of local 0.
        """
        if layer in self._experts:
            return self._experts[layer]
        r = self.rank
        base = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
        ids = range(r.expert_first, r.expert_stop)

        def stack(w: str, kind: str) -> torch.Tensor:
            return torch.stack([_get(self, f"{base}{e}.{w}.{kind}") for e in ids])

        if self.cfg.experts_quantized:
            ew = {"w13_packed": torch.cat([stack("w1", "weight_packed"), stack("w3", "weight_packed")], 1),
                  "w13_scale": torch.cat([stack("w1", "weight_scale"), stack("w3", "weight_scale")], 1),
                  "w2_packed": stack("w2", "weight_packed"), "w2_scale": stack("w2", "weight_scale")}
        else:
            ew = {"w13": torch.cat([stack("w1", "weight"), stack("w3", "weight")], 1), "w2": stack("w2", "weight")}
        ew.update(num_experts=len(ids), first_expert=r.expert_first)
        self._experts[layer] = ew
        return ew


class TPModel(K3Model):
    """The oracle model on one rank of a TP/EP layout (K3 family).

    Args:
        cfg: full config. placement: the :class:`Placement`. rank: this rank's index.
        weights: the rank's local slices (see :class:`LocalWeights`).
        ctx: :class:`DistContext` (``None`` only when ``placement.world == 1``).
        ops, moe_mode: as :class:`K3Model`.
    All outputs (logits ``[T, vocab]`` fp32) are identical on every rank.
    """

    def __init__(self, cfg: K3Config, placement: Placement, rank: int, weights: Any, ctx: DistContext | None,
                 ops: Mapping[str, Callable] | None = None, moe_mode: str = "a16w4"):
        if cfg.family != "k3":
            raise ConfigError("the TP/EP forward supports the K3 family (AttnRes + LatentMoE) only")
        if placement.world > 1 and (ctx is None or ctx.world_size != placement.world):
            raise ConfigError(f"placement has {placement.world} ranks but the process group has "
                              f"{getattr(ctx, 'world_size', 1)}")
        self.placement = placement
        self.rank_plan = placement.ranks[rank]
        self.ctx = ctx
        self.local_cfg = local_config(cfg, placement.tp)
        src = weights if isinstance(weights, LocalWeights) else LocalWeights(cfg, self.rank_plan, weights)
        super().__init__(cfg, src, ops=ops, moe_mode=moe_mode)
        emb = self.rank_plan.tensors["language_model.model.embed_tokens.weight"]
        self.vocab_range = (emb.start, emb.stop) if emb.dim is not None else (0, cfg.vocab_size)

    # -- collectives
    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce(t.contiguous(), self.ctx)

    # -- embedding (vocab-parallel)
    def embed(self, token_ids: torch.Tensor, batch: Batch | None = None, record: bool = False) -> LayerState:
        ids = torch.as_tensor(token_ids).reshape(-1).to(torch.int64)
        V = self.cfg.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ConfigError(f"token ids must lie in 0..{V - 1} (got {int(ids.min())}..{int(ids.max())})")
        if batch is None:
            batch = Batch(_cu([ids.numel()]))
        v0, v1 = self.vocab_range
        table = self.w("embed_tokens.weight")
        ids = ids.to(table.device)
        mine = (ids >= v0) & (ids < v1)
        x = torch.zeros(ids.numel(), self.cfg.hidden_size, dtype=torch.float32, device=table.device)
        x[mine] = f32(table[ids[mine] - v0])
        x = self._reduce(x)
        return LayerState(batch, res=AttnResState([], x), record=record)

    # -- token mixer: heads split, o_proj partial sums
    def _mixer(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        fn = kda_mixer if self.cfg.layer_type(i) == "kda" else mla_mixer
        return self._reduce(fn(x, self.w, i, self.local_cfg, self.ops, batch))

    # -- channel mixer
    def _channel(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if not cfg.is_moe_layer(i):
            return self._reduce(dense_mlp(x, self.w, f"layers.{i}.mlp.", cfg))
        p = f"layers.{i}.block_sparse_moe."
        ids, wts = self.ops["moe_router"](x, self.w(p + "gate.weight"), self.w(p + "gate.e_score_correction_bias"),
                                          cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor)
        latent = cfg.routed_expert_hidden_size is not None
        xin = linear(x, self.w(p + "routed_expert_down_proj.weight")) if latent else x
        routed = f32(self.ops["moe_experts"](xin, ids, wts, self.w.experts(i, cfg), act="situ",
                                             mode=self.moe_mode if cfg.experts_quantized else "a16w4",
                                             beta=cfg.activation_situ_beta,
                                             beta_lin=cfg.activation_situ_linear_beta))
        Lw = routed.shape[1]
        if cfg.num_shared_experts:
            shared = dense_mlp(x, self.w, p + "shared_experts.", cfg)
            buf = self._reduce(torch.cat([routed, shared], dim=1))  # one collective, reduced BEFORE the norm
            routed, shared = buf[:, :Lw], buf[:, Lw:]
        else:
            routed, shared = self._reduce(routed), None
        y = routed
        if latent:
            y = linear(rms_norm(y, self.w(p + "routed_expert_norm.weight"), cfg.rms_norm_eps),
                       self.w(p + "routed_expert_up_proj.weight"))
        return y + shared if shared is not None else y

    # -- head (vocab-parallel)
    def final(self, state: LayerState) -> torch.Tensor:
        local = linear(self.final_hidden(state), self.w.head())
        return all_gather_cat(local.contiguous(), self.ctx, dim=-1)

    def new_cache(self, batch: int, max_len: int = 1024, block_size: int = 16) -> K3Cache:
        """Decode cache sized for this rank's heads (KDA state and conv state of H/tp heads; MLA latent whole)."""
        return K3Cache.empty(self.local_cfg, batch, max_len, block_size)


def tp_forward_worker(ctx: DistContext, checkpoint: str, input_ids: torch.Tensor, tp: int, ep: int,
                      via_loader: bool = True, decode_steps: int = 0) -> dict:
    """Worker body for :func:`k3rocm.runtime.dist.launch`: load this rank's slices and run a forward.

    Args:
        checkpoint: checkpoint directory. input_ids: ``[B, T]`` int64.
        tp, ep: layout (``tp`` must equal the world size).
        via_loader: load with :func:`k3rocm.runtime.load.load` (streamed byte ranges); else cut from full tensors.
        decode_steps: when > 0, also run greedy prefill + decode and return the tokens.
    Returns:
        ``{"rank", "logits" [B, T, V] fp32, "bytes_loaded", "greedy" (optional)}``.
    """
    from k3rocm.checkpoint.reader import open_checkpoint
    from k3rocm.profiles import load_profile
    from k3rocm.runtime.plan import plan

    if ctx.device.type == "cuda":  # an fp32 oracle: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    index = open_checkpoint(checkpoint)
    cfg = index.config
    pl = plan(cfg, load_profile("cpu"), tp=tp, ep=ep)
    if via_loader:
        from k3rocm.runtime.load import load
        res = load(index, pl, ranks=[ctx.rank], device=ctx.device)
        tensors = res.rank_weights[ctx.rank]
    else:
        tensors = shard_weights(index, pl.ranks[ctx.rank])
    model = TPModel(cfg, pl, ctx.rank, tensors, ctx)
    logits = model.forward(torch.as_tensor(input_ids))
    out = {"rank": ctx.rank, "logits": logits.cpu(),
           "bytes_loaded": sum(t.numel() * t.element_size() for t in _values(tensors))}
    if decode_steps:
        out["greedy"] = model.generate_greedy(torch.as_tensor(input_ids)[0], decode_steps).cpu()
    return out


def _values(tensors: Any):
    if isinstance(tensors, Mapping):
        return tensors.values()
    if hasattr(tensors, "tensors") and isinstance(tensors.tensors, Mapping):
        return tensors.tensors.values()
    return []
