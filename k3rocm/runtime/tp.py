"""Tensor- and expert-parallel pieces: one rank's weights and the TP/EP oracle's worker.

Each rank holds the slices :mod:`k3rocm.runtime.plan` assigns it, as a :class:`~k3rocm.model.weights.Weights`
(its ``expert_range`` = the rank's routed experts), and runs the one decoder skeleton
(:class:`~k3rocm.model.decoder.Decoder`) with a :class:`~k3rocm.runtime.dist.TPGroup` parallel context:

* KDA / MLA mixer: heads split (q/k/v/g/b/f_b/conv/A_log/dt_bias rows, ``q_b``/``kv_b``/``g_proj`` rows);
  ``o_proj`` is split by input columns, so each rank's output is a partial sum -> ``all_reduce``.
* dense MLP (layer 0) and shared experts: split by intermediate (gate/up rows, down columns) -> partial sums.
* routed experts: each rank holds ``num_experts / ep`` experts (global ids ``first .. first + n - 1``; the
  ``moe_experts`` op maps global -> local ids with ``first_expert``), split by intermediate inside an EP
  group when ``tp > ep``. The router, latent down/up projections and ``routed_expert_norm`` are replicated.
  The routed latent partial sum is reduced **before** ``routed_expert_norm`` (K3_FACTS §5 step 3:
  norm(sum) != sum(norm)); it travels in the same ``all_reduce`` as the shared-expert partial sum.
* embedding: vocab-parallel rows, each rank looks up the ids in its range (zeros elsewhere) -> ``all_reduce``;
  lm_head: vocab-parallel rows -> local logits -> ``all_gather`` along the vocabulary, or the distributed
  greedy pick (one ``[N, 2]`` exchange).
* Block AttnRes, norms and everything else run replicated on every rank (identical inputs, identical results).

Collectives per layer: 2 all_reduces of ``[T, hidden]`` (+ ``[T, latent]`` on MoE layers).
"""

from __future__ import annotations

from typing import Any

import torch

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.errors import CheckpointError
from k3rocm.profiles import load_profile
from k3rocm.model.model import K3Model
from k3rocm.model.weights import Weights
from k3rocm.runtime.dist import DistContext, TPGroup
from k3rocm.runtime.load import load
from k3rocm.runtime.plan import Placement, RankPlan, plan

__all__ = ["shard_weights", "rank_weights", "tp_model", "tp_forward_worker"]


def _get(src: Any, name: str) -> torch.Tensor:
    try:
        t = src.get(name) if hasattr(src, "get") else src[name]
    except KeyError:
        t = None
    if t is None:
        raise CheckpointError(f"tensor {name} is missing from the weights given to the TP model")
    return t


def shard_weights(full: Any, cfg: Any, rank: RankPlan) -> Weights:
    """Cut rank ``rank``'s slices out of full (single-device) weights.

    Args:
        full: mapping / ``Weights`` / ``CheckpointIndex`` (anything with ``get(name)``, ``[name]`` or ``read(name)``)
            keyed by full checkpoint names.
        cfg: the full model config.
        rank: ``placement.ranks[r]``.
    Returns:
        :class:`Weights` of exactly the names in ``rank.tensors`` (contiguous local copies), expert range = the
        rank's experts.
    Raises:
        CheckpointError: a tensor is missing or its shape differs from the plan.
    """
    out = {}
    reader = getattr(full, "read", None)
    for name, sl in rank.tensors.items():
        t = reader(name) if callable(reader) else _get(full, name)
        if tuple(t.shape) != sl.shape:
            raise CheckpointError(f"{name}: shape {tuple(t.shape)} != planned {sl.shape}")
        out[name] = t[sl.index()].contiguous().clone()
    return rank_weights(cfg, rank, out)


def rank_weights(cfg: Any, rank: RankPlan, tensors: Any) -> Weights:
    """One rank's local slices as :class:`Weights` (expert range = the rank's experts); a Weights passes as is."""
    if isinstance(tensors, Weights):
        return tensors
    return Weights.from_tensors(cfg, dict(tensors), (rank.expert_first, rank.expert_stop))


def tp_model(cfg: Any, placement: Placement, rank: int, weights: Any, ctx: DistContext | None, **kw: Any) -> K3Model:
    """The TP/EP oracle on one rank: :class:`K3Model` over the rank's slices with a :class:`TPGroup`
    (``ctx`` None only for a one-rank placement). ``kw`` as :class:`K3Model` (``ops``, ``moe_mode``)."""
    par = TPGroup(ctx, placement, rank) if placement.world > 1 or ctx is not None else None
    return K3Model(cfg, rank_weights(cfg, placement.ranks[rank], weights), par=par, **kw)


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
    if ctx.device.type == "cuda":  # an fp32 oracle: no TF32 in matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    index = open_checkpoint(checkpoint)
    cfg = index.config
    pl = plan(cfg, load_profile("cpu"), tp=tp, ep=ep)
    if via_loader:
        res = load(index, pl, ranks=[ctx.rank], device=ctx.device)
        tensors = res.rank_weights[ctx.rank]
    else:
        tensors = shard_weights(index, cfg, pl.ranks[ctx.rank])
    model = tp_model(cfg, pl, ctx.rank, tensors, ctx)
    logits = model.forward(torch.as_tensor(input_ids))
    out = {"rank": ctx.rank, "logits": logits.cpu(),
           "bytes_loaded": rank_weights(cfg, pl.ranks[ctx.rank], tensors).nbytes()}
    if decode_steps:
        out["greedy"] = model.generate_greedy(torch.as_tensor(input_ids)[0], decode_steps).cpu()
    return out
