"""Launch wrappers of the MoE kernels, with the oracle's signatures (``k3rocm.model.moe``).

* :func:`moe_router` — Triton router (``router.py``); :func:`moe_route` — the router and the dispatch below in
  two launches (the top-k kernel's last program groups the pairs); ``moe_router(..., experts=...)`` routes
  for the GEMM config :func:`moe_experts` will pick (:func:`gemm_pick`), whose ``dispatch=`` takes the result.
* :func:`dispatch_gpu` — (token, expert) pairs sorted by local expert on the device (no host synchronisation),
  plus the M-block table of the grouped GEMM for a given ``block_m``: one Triton program (counting sort) for
  decode-sized batches, torch ops (stable radix sort, scatter-add counts, cumsum, searchsorted) above that.
* :func:`moe_experts` — w1|w3 grouped GEMM + SiTU-GLU, w2 grouped GEMM x router weight, per-token reduction;
  ``mode`` is explicit (``"a16w4"`` / ``"a8w4"``); nothing in the environment changes it.
* :func:`latent_moe` — the whole Stable LatentMoE layer: router, latent down projection, experts, reduction
  fused with the latent RMSNorm, up projection and shared experts (dense bf16 GEMMs through torch).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from k3rocm.errors import ConfigError, HardwareError
from k3rocm.kernels import tune
from k3rocm.kernels.moe.configs import (DQ_KINDS, GEMM_CONFIGS, LAYOUT_BITS, LAYOUT_ORDER, LAYOUT_TILES,
                                        REDUCE_LAUNCH,
                                        ROUTER_BUCKET_TOKENS, ROUTER_CONFIGS, ROUTER_GROUPING, ROUTER_LOGIT_PROGRAMS,
                                        ROUTER_SMALL_TOKENS, ROUTER_TOPK_SORT,
                                        ROUTER_TOPK_WARPS,
                                        SCALE_PF_KINDS, SWAP_KINDS, stage_config)
from k3rocm.kernels.moe.gemm import (moe_dispatch_kernel, moe_gemm_dq_kernel, moe_gemm_kernel, moe_glu_finish_kernel,
                                     moe_reduce_kernel)
from k3rocm.kernels.moe.router import (group_block_p, group_pairs_kernel, pair_tokens, router_logits_kernel,
                                      router_topk_kernel, router_topk_small_kernel)
from k3rocm.kernels.mx.layout import TiledMxfp4, check_repack, fit_tile_k, repack_mxfp4, unpack_mxfp4
from k3rocm.kernels.mx.quant import quantize_mxfp8_rows
from k3rocm.kernels.target import current_target, interpreting, multiprocessors

MODES = ("a16w4", "a8w4")


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


# ----------------------------------------------------------------------------------------------------------


def _logit_splits(D: int, block_k: int, want: int) -> tuple[int, int]:
    """``(K_PER_SPLIT, splits)`` of the router logits over ``D`` hidden columns: at most ``want`` (>= 1) ranges of
    whole ``block_k`` steps, as even as that allows."""
    splits = max(1, min(want, triton.cdiv(D, block_k)))
    k_per = triton.cdiv(triton.cdiv(D, splits), block_k) * block_k
    return k_per, triton.cdiv(D, k_per)


def _router_logits(x, gate_weight, top_k, config):
    """Checks, then the split-K logits launch: ``(x, part [S, T, E] fp32, splits)`` (x possibly widened)."""
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ConfigError(f"moe_router: x {tuple(x.shape)} and gate.weight {tuple(gate_weight.shape)} do not match")
    T, D = x.shape
    E = gate_weight.shape[0]
    if not 0 < top_k <= E:
        raise ConfigError(f"moe_router: top_k {top_k} must be in 1..{E} (num_experts_per_token)")
    split = 0
    if x.dtype == torch.float32 and gate_weight.dtype == torch.bfloat16:
        split = 2 if interpreting() else 1  # fp32 x as three exact bf16 parts times the bf16 gate (router.py)
    elif gate_weight.dtype != x.dtype:  # never narrow one side to the other's format: widen both (FP32 router)
        x, gate_weight = x.float(), gate_weight.float()
    x = x.contiguous()
    gate_weight = gate_weight.contiguous()
    if T == 0:
        return x, None, 0
    # keyed on the power of two above T (bounded set: no new compile per batch size while serving)
    cfg = config or tune.pick("moe_router", (tune.pow2(T),), tune.configs(ROUTER_CONFIGS), rows=T)
    tiles = triton.cdiv(T, cfg["BLOCK_T"]) * triton.cdiv(E, cfg["BLOCK_E"])
    want = ROUTER_LOGIT_PROGRAMS[current_target().backend] // tiles  # ~2 programs per SM of an H100
    k_per, splits = _logit_splits(D, cfg["BLOCK_K"], max(1, min(32, want)))
    part = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    router_logits_kernel[(triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(E, cfg["BLOCK_E"]), splits)](
        x, gate_weight, part, T, E, D, k_per, x.stride(0), gate_weight.stride(0), part.stride(0), part.stride(1),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_E=cfg["BLOCK_E"], BLOCK_K=cfg["BLOCK_K"],
        IEEE=x.dtype == torch.float32 and not split, SPLIT_X=split,
        **tune.split(cfg)[1])
    return x, part, splits


def moe_router(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
               renormalize: bool = True, scaling: float = 1.0, config=None, experts: Any = None) -> tuple:
    """Triton router; same contract as ``k3rocm.model.moe.moe_router`` (FP32 logits, lowest-id ties).

    x ``[T, D]`` and gate_weight ``[E, D]``: both bf16 (exact products, fp32 accumulation); fp32 x with the bf16
    gate (the engine: x split into three exact bf16 parts on the matrix unit, fp32 math up to summation order,
    the gate never widened; emulated in fp32 under the interpreter, whose bf16 ``tl.dot`` is not trustworthy);
    both fp32 (the validation path: IEEE products, never TF32); other mixes widen both to fp32.
    Returns ``(ids [T, k] int32, weights [T, k] fp32)``. Two launches (logits, top-k). ``config``: one
    ``ROUTER_CONFIGS`` tile; default: the tile picked for the token count.

    ``experts`` (the layer's packed ``ExpertWeights``, as :func:`moe_experts` takes them): fused routing —
    returns ``(ids, weights, GpuDispatch)`` from :func:`moe_route`, the pairs grouped for these local experts
    with the ``BLOCK_M`` of the GEMM config :func:`moe_experts` picks for them (:func:`gemm_pick`); pass the
    dispatch on as ``moe_experts(..., dispatch=...)``. Still two launches, no host synchronisation.
    Raises ConfigError on bad shapes / top_k, or ``experts`` without packed MXFP4 stacks.
    """
    if experts is None:
        return _route(x, gate_weight, bias, top_k, renormalize, scaling, config, None)[:2]
    first, num_local = _local_experts(experts)
    block_m = gemm_pick(x.shape[0] * top_k, num_local, num_experts=gate_weight.shape[0])["BLOCK_M"]
    return moe_route(x, gate_weight, bias, top_k, first, num_local, block_m, renormalize, scaling, config)


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              first_expert: int, num_local: int, block_m: int, renormalize: bool = True, scaling: float = 1.0,
              config=None, bucket_tokens: int | None = None,
              topk_warps: int | None = None,
              small_tokens: int | None = None,
              grouping: str | None = None,
              topk_sort: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, GpuDispatch]:
    """Fused routing: :func:`moe_router` and :func:`dispatch_gpu` of its ids in two launches, no host sync.

    x ``[T, D]``, gate_weight ``[E, D]``, bias ``[E]`` fp32 or None; the pairs of local experts
    ``first_expert .. first_expert + num_local - 1`` are grouped for M blocks of ``block_m`` rows (the grouped
    GEMM's ``BLOCK_M``). Returns ``(ids [T, k] int32, weights [T, k] fp32, GpuDispatch)``, each tensor equal to
    what ``moe_router`` then ``dispatch_gpu(ids, first_expert, num_local, block_m)`` return (K3_FACTS §5 step 1;
    grouping stable in the pair index, so deterministic). ``bucket_tokens``: tokens per group of the
    two-level grouping (default ``configs.ROUTER_BUCKET_TOKENS`` of the backend, capped at 16384 lanes / the
    expert count; a power of two; tests set small groups to cover many). ``topk_warps``: warps of the top-k +
    grouping launch (default ``configs.ROUTER_TOPK_WARPS`` of the backend; benchmarks sweep it; the same
    results at any count). ``small_tokens``: up to this many tokens the whole routing runs in one program
    (``router.router_topk_small_kernel``, 8 warps unless ``topk_warps``; default ``configs.ROUTER_SMALL_TOKENS`` of
    the backend; at most 8; the same tensors). ``grouping``: ``"fused"`` (the top-k launch groups the pairs, its
    last programs in turn) or ``"experts"`` (a third launch, ``router.group_pairs_kernel``: one program per local
    expert, none waiting on another); default ``"experts"`` up to ``configs.ROUTER_GROUPING`` local experts of the
    backend, else ``"fused"``; the same tensors.
    ``topk_sort``: with ``"experts"`` grouping, the picks by one ``tl.topk`` instead of 16 max rounds (default
    ``configs.ROUTER_TOPK_SORT`` of the backend; off where this Triton has no ``tl.topk``; the same tensors).
    Raises ConfigError on bad shapes / top_k / experts / bucket_tokens / topk_warps / small_tokens / grouping.
    """
    if grouping is not None and grouping not in ("fused", "experts"):
        raise ConfigError(f"moe_route: grouping {grouping!r} must be 'fused' or 'experts'")
    if small_tokens is not None and not 0 <= small_tokens <= 8:
        raise ConfigError(f"moe_route: small_tokens {small_tokens} must be in 0..8")
    if topk_warps is not None and (topk_warps < 1 or topk_warps > 16 or topk_warps & (topk_warps - 1)):
        raise ConfigError(f"moe_route: topk_warps {topk_warps} must be a power of two in 1..16")
    if not (0 < num_local and 0 <= first_expert and first_expert + num_local <= gate_weight.shape[0]):
        raise ConfigError(f"moe_route: local experts {first_expert}+{num_local} outside 0..{gate_weight.shape[0]}")
    if bucket_tokens is not None and (bucket_tokens < 1 or bucket_tokens & (bucket_tokens - 1)):
        raise ConfigError(f"moe_route: bucket_tokens {bucket_tokens} must be a power of two")
    return _route(x, gate_weight, bias, top_k, renormalize, scaling, config,
                  (first_expert, num_local, block_m, bucket_tokens, topk_warps, small_tokens, grouping, topk_sort))


# scratch counters per device for the handshakes of the fused dispatch ([0]: groups done, [1 + g]: tokens of
# group g done); the program that completes a counter resets it, so all are zero before every launch (and
# inside a captured graph). A larger batch gets a larger buffer; the smaller ones stay alive for the graphs
# captured with them.
_DONE: dict[torch.device, list[torch.Tensor]] = {}


def _counters(dev: torch.device, groups: int) -> torch.Tensor:
    held = _DONE.setdefault(dev, [])
    if not held or held[-1].numel() < 1 + groups:
        held.append(torch.zeros(max(4096, triton.next_power_of_2(1 + groups)), dtype=torch.int32, device=dev))
    return held[-1]


def _topk_sort(flag: bool | None, backend: str) -> bool:
    """Whether the top-k launch picks by ``tl.topk``: ``flag`` (default ``ROUTER_TOPK_SORT`` of the backend), and
    only where this Triton has ``tl.topk``."""
    return bool(ROUTER_TOPK_SORT[backend] if flag is None else flag) and hasattr(tl, "topk")


def _topk_only(part, b, ids, wts, E, scaling, meta, warps: int, sort: bool = False) -> None:
    """The top-k launch without grouping (``router_topk_kernel``, one program per token; the dispatch arguments
    unused), as ``moe_router`` and the ``"experts"`` grouping run it."""
    router_topk_kernel[(ids.shape[0],)](part, b, ids, wts, E, part.stride(0), part.stride(1), float(scaling),
                                        ids, ids, ids, ids, ids.shape[0], 0, 1, ids, ids, ids, ids, ids, ids, 1, **meta,
                                        SORT=sort, num_warps=warps)


def _route(x, gate_weight, bias, top_k, renormalize, scaling, config, group):
    x, part, splits = _router_logits(x, gate_weight, top_k, config)
    T = x.shape[0]
    E = gate_weight.shape[0]
    dev = x.device
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    wts = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    if group is not None and T == 0:
        return ids, wts, replace(dispatch_gpu(ids, group[0], group[1], group[2]), num_experts=E)
    if T == 0:
        return ids, wts, None
    b = bias.float().contiguous() if bias is not None else part
    meta = dict(SPLITS=splits, TOPK=top_k, HAS_BIAS=bias is not None, RENORM=bool(renormalize),
                BLOCK_E=triton.next_power_of_2(E), BLOCK_KOUT=triton.next_power_of_2(top_k))
    if group is None:
        _topk_only(part, b, ids, wts, E, scaling, meta, 4)
        return ids, wts, None
    first, num_local, block_m, bucket_tokens, topk_warps, small_tokens, grouping, topk_sort = group
    d = _empty_dispatch(T * top_k, num_local, block_m, dev, E)
    ub = d.block_expert.numel()
    backend = current_target().backend
    if T <= (ROUTER_SMALL_TOKENS[backend] if small_tokens is None else small_tokens):
        router_topk_small_kernel[(1,)](part, b, ids, wts, E, part.stride(0), part.stride(1), float(scaling), T,
                                       int(first), num_local, d.sorted_pair, d.pos, d.counts, d.offsets,
                                       d.block_expert, d.block_start, ub, **meta, BLOCK_TT=triton.next_power_of_2(T),
                                       BLOCK_M=block_m, BLOCK_UB=triton.next_power_of_2(ub),
                                       num_warps=topk_warps or 8)
        return ids, wts, d
    if (grouping or ("experts" if num_local <= ROUTER_GROUPING[backend] else "fused")) == "experts":
        _topk_only(part, b, ids, wts, E, scaling, meta, topk_warps or 4, _topk_sort(topk_sort, backend))
        _group_pairs(ids, first, num_local, d)
        return ids, wts, d
    block_l = triton.next_power_of_2(num_local + 1)
    bt = bucket_tokens or max(1, min(ROUTER_BUCKET_TOKENS[backend], 16384 // block_l))
    groups = triton.cdiv(T, bt)
    member = torch.empty(T, num_local, dtype=torch.int32, device=dev)
    rowpos = torch.empty(T, num_local, dtype=torch.int32, device=dev)
    gcount = torch.empty(groups, num_local, dtype=torch.int32, device=dev)
    router_topk_kernel[(T,)](part, b, ids, wts, E, part.stride(0), part.stride(1), float(scaling),
                             member, rowpos, gcount, _counters(dev, groups), T, int(first), num_local, d.sorted_pair,
                             d.pos, d.counts, d.offsets, d.block_expert, d.block_start, ub, **meta, DISPATCH=True,
                             BLOCK_M=block_m, BLOCK_T=bt, BLOCK_L=block_l, BLOCK_UB=triton.next_power_of_2(ub),
                             BLOCK_PT=pair_tokens(bt),
                             num_warps=topk_warps or ROUTER_TOPK_WARPS[backend])
    return ids, wts, d


# ----------------------------------------------------------------------------------------------------------


@dataclass
class GpuDispatch:
    """Device-side dispatch of (token, slot) pairs (P = T*k, all pairs; only the first ``offsets[-1]`` sorted
    rows belong to this rank).

    sorted_pair ``[P]`` int32 (flat pair index t*k+j, grouped by local expert); pos ``[P]`` int32 (sorted row
    of each pair, -1 when its expert is on another rank); counts ``[E_loc]`` int64; offsets ``[E_loc+1]``
    int64; block_expert / block_start ``[UB]`` int32 (local expert and first sorted row of each M block of
    ``block_m`` rows; -1 = empty block).
    """

    sorted_pair: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_m: int
    num_experts: int | None = None  # global experts the pairs were routed over (None: all local)


def _block_slots(P: int, block_m: int, num_local: int) -> int:
    """Rows of the block table for ``P`` pairs over ``num_local`` experts: every block any routing of them could
    need (``ceil(P / block_m)`` full blocks plus one partial block per expert), at most one per pair."""
    return max(1, min(P, triton.cdiv(P, block_m) + num_local))


def _empty_dispatch(P: int, num_local: int, block_m: int, dev: torch.device,
                    num_experts: int | None = None) -> GpuDispatch:
    """An unfilled :class:`GpuDispatch` of ``P`` pairs over ``num_local`` local experts (the kernels fill it)."""
    ub = _block_slots(P, block_m, num_local)
    i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
    return GpuDispatch(torch.empty(P, **i32), torch.empty(P, **i32), torch.empty(num_local, **i64),
                       torch.empty(num_local + 1, **i64), torch.empty(ub, **i32), torch.empty(ub, **i32), block_m,
                       num_experts)


def _group_pairs(ids: torch.Tensor, first: int, num_local: int, d: GpuDispatch) -> None:
    """``router.group_pairs_kernel`` of the int32 ids ``[T, k]`` (or ``[P]``) into the allocated dispatch ``d``."""
    P = ids.numel()
    ub = d.block_expert.numel()
    group_pairs_kernel[(num_local + 1,)](ids, int(first), num_local, P, d.sorted_pair, d.pos, d.counts, d.offsets,
                                         d.block_expert, d.block_start, ub, BLOCK_M=d.block_m,
                                         BLOCK_P=group_block_p(P), BLOCK_E=triton.next_power_of_2(num_local + 2),
                                         BLOCK_J=16, num_warps=4)


# decode-sized dispatch runs as one Triton program (one launch instead of ~35 small torch ops, whose launch
# overhead, not their work, made the 0.85 ms measured at 64 tokens on the H200); larger P uses torch's sort
ONE_PROGRAM_MAX_PAIRS = 8192
ONE_PROGRAM_MAX_EXPERTS = 4094


def dispatch_gpu(topk_ids: torch.Tensor, first_expert: int, num_local: int, block_m: int,
                 one_program: bool | None = None, per_expert: bool = False) -> GpuDispatch:
    """Group pairs by local expert (ids ``first_expert .. first_expert+num_local-1``; others dropped).

    Same grouping as ``k3rocm.model.moe.dispatch`` (stable: ascending pair index within a group).
    ``one_program``: None = ``moe_dispatch_kernel`` (one launch) when P <= ``ONE_PROGRAM_MAX_PAIRS`` and
    num_local <= ``ONE_PROGRAM_MAX_EXPERTS``, else the torch path (radix sort); True / False force one (tests).
    ``per_expert``: ``router.group_pairs_kernel`` instead (one program per local expert; what ``moe_route`` runs
    with ``grouping="experts"``). All give identical tensors.
    """
    dev = topk_ids.device
    P = topk_ids.numel()
    if per_expert and P > 0:
        d = _empty_dispatch(P, num_local, block_m, dev)
        _group_pairs(topk_ids.reshape(-1).to(torch.int32).contiguous(), first_expert, num_local, d)
        return d
    if one_program is None:
        one_program = 0 < P <= ONE_PROGRAM_MAX_PAIRS and num_local <= ONE_PROGRAM_MAX_EXPERTS
    if one_program and P > 0:
        d = _empty_dispatch(P, num_local, block_m, dev)
        ub = d.block_expert.numel()
        ids32 = topk_ids.reshape(-1).to(torch.int32).contiguous()
        be = triton.next_power_of_2(num_local + 2)
        run = torch.empty(be, dtype=torch.int32, device=dev)
        moe_dispatch_kernel[(1,)](ids32, int(first_expert), num_local, P, d.sorted_pair, d.pos, d.counts, d.offsets,
                                  d.block_expert, d.block_start, run, ub, BLOCK_M=block_m, BLOCK_P=64, BLOCK_E=be,
                                  BLOCK_UB=triton.next_power_of_2(ub), num_warps=8)  # spill-free on gfx942/950
        return d
    flat = topk_ids.reshape(-1).to(torch.int64)
    local = flat - int(first_expert)
    valid = (local >= 0) & (local < num_local)
    key = torch.where(valid, local, torch.full_like(local, num_local))
    _, order = torch.sort(key, stable=True)
    # scatter_add instead of bincount: bincount sizes its output from the data (a host sync), which breaks
    # CUDA/HIP graph capture of decode
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key.long(), torch.ones_like(key, dtype=torch.int64))[:num_local]
    offsets = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(counts, 0)
    pos = torch.empty(P, dtype=torch.int64, device=dev)
    pos[order] = torch.arange(P, device=dev)
    pos = torch.where(valid, pos, torch.full_like(pos, -1)).to(torch.int32)
    blocks = (counts + block_m - 1) // block_m
    bcum = torch.cumsum(blocks, 0)
    ub = _block_slots(P, block_m, num_local)
    b = torch.arange(ub, device=dev)
    e = torch.searchsorted(bcum, b, right=True)
    ok = e < num_local
    ec = torch.clamp(e, max=num_local - 1)
    first_block = bcum[ec] - blocks[ec]
    block_start = offsets[ec] + (b - first_block) * block_m
    block_expert = torch.where(ok, ec, torch.full_like(ec, -1)).to(torch.int32)
    return GpuDispatch(order.to(torch.int32), pos, counts, offsets, block_expert, block_start.to(torch.int32), block_m)


# ----------------------------------------------------------------------------------------------------------


def _act_format(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    raise ConfigError(f"moe_experts: activation dtype {dtype} unsupported by the A16W4 kernel; pass bf16 or fp16")


def _dq_grid(ub: int, n_tiles: int, splits: int, persist: int, dev: torch.device) -> tuple[int, ...]:
    """Grid of ``gemm.moe_gemm_dq_kernel``: ``(ub, n_tiles, splits)``, one program per work item, when ``persist`` is
    0; else ``(programs,)`` for its persistent form, ``persist`` programs per SM / CU of ``dev`` (per "SM" of one
    under the interpreter, so the tests walk many items per program) and never more than the items."""
    if not persist:
        return (ub, n_tiles, splits)
    sms = 1 if interpreting() else multiprocessors(dev)
    return (max(1, min(persist * sms, ub * n_tiles * splits)),)


def _split_k(K: int, block_k: int, split_k: int, tile_k: int = 0) -> tuple[int, int]:
    """``(K_PER, splits)`` of a split-K GEMM over ``K`` elements in k-steps of ``block_k``: at most ``split_k``
    ranges of whole k-steps (of whole ``tile_k`` chunks of the tiled layout when ``tile_k``; ``block_k`` divides
    it), ``K_PER`` elements each (the last one shorter when the steps do not divide evenly), none empty;
    ``(K, 1)`` when unsplit."""
    if split_k <= 1:
        return K, 1
    unit = max(block_k, tile_k)
    steps = triton.cdiv(K, unit)
    k_per = triton.cdiv(steps, min(split_k, steps)) * unit
    return k_per, triton.cdiv(K, k_per)


def _fit_block_k(cfg_k: int, K: int) -> int:
    bk = cfg_k
    while bk > 32 and K % bk:
        bk //= 2
    if K % bk:
        raise ConfigError(f"moe_experts: width {K} is not a multiple of 32 (MXFP4 group size)")
    return bk


@dataclass
class ExpertLayout:
    """The routed experts of one layer in the tiled kernel layout (``k3rocm.kernels.mx.layout``): ``w13``
    (gate and up rows interleaved per n-tile, G = 2) and ``w2`` (G = 1). Made by :func:`kernel_layout`."""

    w13: TiledMxfp4
    w2: TiledMxfp4

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    @property
    def repack_s(self) -> float:
        return self.w13.repack_s + self.w2.repack_s

    def experts(self, first: int, end: int) -> "ExpertLayout":
        """Local experts ``first .. end-1`` (views of the same bytes)."""
        return ExpertLayout(self.w13.experts(first, end), self.w2.experts(first, end))

    def to(self, device: str | torch.device) -> "ExpertLayout":
        """The same layout on ``device`` (shared when already there)."""
        return ExpertLayout(self.w13.to(device), self.w2.to(device))

    def checkpoint_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local expert ``e`` read back in the checkpoint layout (``mx.layout.unpack_mxfp4``, bit for bit):
        ``(w13_packed [2I, D/2], w13_scale [2I, D/32], w2_packed [D, I/2], w2_scale [D, I/32])`` u8, new tensors
        on the layout's device (for the fp32 oracle once the checkpoint-layout stacks were released)."""
        p13, s13 = unpack_mxfp4(self.w13.experts(e, e + 1))
        p2, s2 = unpack_mxfp4(self.w2.experts(e, e + 1))
        return p13[0], s13[0], p2[0], s2[0]


def kernel_layout(experts: Any, tiles: tuple[int, int] | None = None, check: bool = False,
                  bits: int | None = None, order: int | None = None) -> ExpertLayout:
    """Repack one layer's checkpoint-layout experts (``w13_packed/w13_scale/w2_packed/w2_scale``) into the tiled
    layout on their device, once (at load / engine build). ``tiles``: (tile_n, tile_k), default
    ``configs.LAYOUT_TILES`` of the current backend; ``bits``: value bits (0 checkpoint nibbles, 1 planar lanes,
    which only the decode-path GEMMs read), default ``configs.LAYOUT_BITS`` of the current backend; ``order``: the
    element order within a block (0 the checkpoint's, 1 the mma order, which only the decode-path GEMMs read),
    default ``configs.LAYOUT_ORDER`` of the current backend. ``check``:
    also prove with ``mx.layout.check_repack`` that both tensors read back to the checkpoint's bytes (raises
    ConfigError if not).

    Pass the result to :func:`moe_experts` as ``experts["kernel_layout"]`` (or the attribute of the same name);
    the checkpoint tensors are then only read for their shapes."""
    backend = "interpreter" if interpreting() else current_target().backend
    tn, tk = tiles or LAYOUT_TILES[backend]
    bits = LAYOUT_BITS[backend] if bits is None else bits
    order = LAYOUT_ORDER[backend] if order is None else order
    srcs = [(_get(experts, f"{w}_packed"), _get(experts, f"{w}_scale")) for w in ("w13", "w2")]
    lay = ExpertLayout(repack_mxfp4(*srcs[0], 2, tn, tk, bits, order), repack_mxfp4(*srcs[1], 1, tn, tk, bits, order))
    if check:
        check_repack(lay.w13, *srcs[0])
        check_repack(lay.w2, *srcs[1])
    return lay


#: id(scale tensor) -> (weak reference to it, its version counter, whether every byte is <= FUSED_SCALE_MAX).
#: The weak reference proves the entry is for this very tensor (a new tensor may reuse a freed one's id) and
#: drops the entry when the tensor goes. (A WeakKeyDictionary would compare tensors with ``==``: elementwise.)
_FUSED_OK: dict[int, tuple[Any, int, bool]] = {}

#: largest E8M0 byte for which the decode path folds its 2^126 into the scale: 2^(s-1) <= 2^127 (bf16's largest
#: power of two). A scale above 2 (s > 128) means a 32-weight block whose largest |value| is >= 8.
FUSED_SCALE_MAX = 128


def fused_scale_ok(scale: torch.Tensor) -> bool:
    """Whether the decode-path GEMM may run its one-multiply decode (``FUSED_SCALE``) on weights with these
    E8M0 ``scale`` bytes (any shape, uint8): every byte <= :data:`FUSED_SCALE_MAX`. Checked once per tensor
    (one device reduction and one host read; remembered until the tensor changes in place or is freed). During
    CUDA graph capture an unchecked tensor is not read (that would synchronise): the answer is then False, the
    general decode, which is exact for every scale. An inference-mode tensor has no version counter: it is
    checked once and then taken as unchanged (weights loaded under ``torch.inference_mode`` are not written
    again). A tiled ``kernel_layout`` carries its own flag (``TiledMxfp4.max_scale``, read at repack)."""
    key = id(scale)
    version = -1 if scale.is_inference() else scale._version
    hit = _FUSED_OK.get(key)
    if hit is not None and hit[0]() is scale and hit[1] == version:
        return hit[2]
    if scale.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    ok = scale.numel() == 0 or int(scale.max()) <= FUSED_SCALE_MAX
    _FUSED_OK[key] = (weakref.ref(scale, lambda _r, k=key: _FUSED_OK.pop(k, None)), version, ok)
    return ok


def _local_experts(experts: Any) -> tuple[int, int]:
    """``(first_expert, local expert count)`` of packed experts; ConfigError when they are not packed MXFP4."""
    if _get(experts, "w13_packed") is None or _get(experts, "w2_packed") is None:
        raise ConfigError("moe_experts (triton): needs packed MXFP4 experts (w13_packed/w2_packed); "
                          "use the torch implementation for unquantized experts")
    return int(_get(experts, "first_expert") or 0), _get(experts, "w13_packed").shape[0]


def gemm_pick(pairs: int, num_local: int, config: tune.Config | None = None,
              num_experts: int | None = None) -> tune.Config:
    """The grouped-GEMM config :func:`moe_experts` runs for ``pairs`` (token, expert) pairs (all ranks' pairs,
    ``T * top_k``) over ``num_local`` local experts of ``num_experts`` (the global count; None: all local):
    ``config`` if given, else the first of ``GEMM_CONFIGS`` whose ``max_rows`` covers the mean pairs per active
    local expert, keyed on its power of two (never a raw length: no specialisation per batch). Under expert
    parallelism a rank expects ``pairs * num_local / num_experts`` of the pairs (uniform routing), so a rank of
    EP16 at 256 tokens (4096 pairs, 256 local over 56 experts: ~5 rows each) takes the narrow-M tile, not the
    64-row one the all-local estimate (73 rows) would. Configs with ``max_pairs`` (a K split, more warps) serve
    while that expected local pair count is at most theirs: a decode step of a few tokens keeps few experts busy.
    The fused routing groups its pairs for this config's ``BLOCK_M``."""
    if num_experts and num_experts > num_local:
        pairs = math.ceil(pairs * num_local / num_experts)
    rows = pairs / max(1, min(num_local, pairs))  # mean pairs per active expert
    # keyed on powers of two of both (bounded: the few-pairs configs stop at a handful of pairs)
    key = (tune.pow2(math.ceil(rows)), min(tune.pow2(max(1, pairs)), 64))
    return config or tune.pick("moe_gemm", key, tune.configs(GEMM_CONFIGS), rows=rows, pairs=pairs)


def _experts_impl(x, topk_ids, topk_weights, experts, act, mode, beta, beta_lin, config: tune.Config | None,
                  norm_weight=None, eps=1e-5, normed_dtype=torch.bfloat16, poison=False,
                  stages: dict | None = None, dispatch: GpuDispatch | None = None):
    if mode not in MODES:
        raise ConfigError(f"moe_experts: mode {mode!r} is not one of {', '.join(MODES)}; pass it explicitly")
    if act not in ("situ", "silu"):
        raise ConfigError(f"moe_experts: act {act!r} is not one of situ, silu")
    first, E_loc = _local_experts(experts)
    w13p, w13s = _get(experts, "w13_packed"), _get(experts, "w13_scale")
    w2p, w2s = _get(experts, "w2_packed"), _get(experts, "w2_scale")
    T, D = x.shape
    k = topk_ids.shape[1]
    N13 = w13p.shape[1]
    inter = N13 // 2
    if w13p.shape[2] * 2 != D or w2p.shape[1] != D or w2p.shape[2] * 2 != inter:
        raise ConfigError(f"moe_experts: x {tuple(x.shape)} does not fit w13_packed {tuple(w13p.shape)} / "
                          f"w2_packed {tuple(w2p.shape)}")
    dev = x.device
    out = torch.empty(T, D, dtype=torch.float32, device=dev)
    normed = torch.empty(T, D, dtype=normed_dtype, device=dev) if norm_weight is not None else None
    P = T * k
    if P == 0:
        out.zero_()
        return out, (normed.zero_() if normed is not None else None)
    lay = _get(experts, "kernel_layout")
    if lay is None:
        w13p, w13s, w2p, w2s = (t.contiguous() for t in (w13p, w13s, w2p, w2s))
        # (weights, scales, strides expert/row of each, layout tile) per GEMM; tile 0 = checkpoint layout
        g13 = (w13p, w13s, w13p.stride(0), w13p.stride(1), w13s.stride(0), w13s.stride(1), 0, 0)
        g2 = (w2p, w2s, w2p.stride(0), w2p.stride(1), w2s.stride(0), w2s.stride(1), 0, 0)
    else:  # one tiled buffer per GEMM (values and scales in it): expert strides = its bytes per expert, row strides unused
        if lay.w13.rows != inter or lay.w13.k != D or lay.w2.rows != D or lay.w2.k != inter:
            raise ConfigError("moe_experts: kernel_layout does not match the experts' shapes; rebuild it")
        g13 = (lay.w13.data, lay.w13.data, lay.w13.stride_expert, 0, lay.w13.stride_expert, 0, lay.w13.tile_n, lay.w13.tile_k)
        g2 = (lay.w2.data, lay.w2.data, lay.w2.stride_expert, 0, lay.w2.stride_expert, 0, lay.w2.tile_n, lay.w2.tile_k)
    a8 = mode == "a8w4"
    if a8:
        a, a_s = quantize_mxfp8_rows(x)
    else:
        a = x if x.dtype in (torch.bfloat16, torch.float16) else x.to(torch.bfloat16)
        a = a.contiguous()
        a_s = a  # unused placeholder pointer
    fmt = "e4m3" if a8 else _act_format(a.dtype)
    cfg = gemm_pick(P, E_loc, config, num_experts=dispatch.num_experts if dispatch is not None else None)
    if dispatch is None:
        d = dispatch_gpu(topk_ids, first, E_loc, cfg["BLOCK_M"])
    elif (dispatch.block_m != cfg["BLOCK_M"] or dispatch.sorted_pair.numel() != P
          or dispatch.counts.numel() != E_loc):
        raise ConfigError(f"moe_experts: the given dispatch ({dispatch.sorted_pair.numel()} pairs, "
                          f"{dispatch.counts.numel()} experts, block_m {dispatch.block_m}) does not fit {P} pairs, "
                          f"{E_loc} experts, BLOCK_M {cfg['BLOCK_M']}; route with moe_router(..., experts=...)")
    else:
        d = dispatch
    ub = d.block_expert.numel()
    wflat = topk_weights.reshape(-1).to(torch.float32).contiguous()
    # h: [P, I] per sorted pair (bf16, or fp8 + scales)
    if a8:
        h = torch.empty(P, inter, dtype=torch.float8_e4m3fn, device=dev)
        hs = torch.empty(P, inter // 32, dtype=torch.uint8, device=dev)
    else:
        h = torch.empty(P, inter, dtype=torch.bfloat16, device=dev)
        hs = h
    opts = tune.split(stage_config(cfg, True))[1]
    if poison:  # testing aid: NaN (0xFF for fp8) wherever a kernel should write, so an unwritten element shows
        if a8:
            h.view(torch.uint8).fill_(0xFF)
            hs.fill_(0xFF)
        else:
            h.fill_(float("nan"))
        out.fill_(float("nan"))
        if normed is not None:
            normed.fill_(float("nan"))
    bk1 = _fit_block_k(cfg["BLOCK_K"], g13[7] or D)

    # decode path (Hopper A16W4): bf16 activations only; A8W4 and fp16 activations take the scaled kernel
    dq = cfg["kind"] in DQ_KINDS and not a8 and a.dtype == torch.bfloat16
    bits13, bits2 = (lay.w13.bits, lay.w2.bits) if lay is not None else (0, 0)
    order13, order2 = (lay.w13.order, lay.w2.order) if lay is not None else (0, 0)
    held = [(what, fix) for what, fix, on in (("planar value bits", "bits=0", bits13 or bits2),
                                              ("the mma element order", "order=0", order13 or order2)) if on]
    if held and not dq:
        raise ConfigError(f"moe_experts: the experts' kernel layout holds {' and '.join(w for w, _ in held)}, which "
                          f"only the A16W4 decode path reads, but this call runs the scaled kernel ({mode}, {a.dtype}, "
                          f"config kind {cfg['kind']!r}); make the layout with "
                          f"kernel_layout(..., {', '.join(f for _, f in held)})")
    swap = cfg["kind"] in SWAP_KINDS
    spf = SCALE_PF_KINDS.get(cfg["kind"], 0)
    interp = interpreting()
    # the decode's one-multiply variant where the scales allow it (every K3 layer: s <= 128), and its packed
    # bf16x2 multiplies in PTX on CUDA (the interpreter decodes in fp32, HIP in Triton's own bf16 ops)
    ptx = dq and not interp and current_target().backend == "cuda"
    # (a tiled layout carries its own scales: the flag is the one read at repack, never the checkpoint tensors')
    if lay is None:
        fs13 = dq and fused_scale_ok(_get(experts, "w13_scale"))
        fs2 = dq and fused_scale_ok(_get(experts, "w2_scale"))
    else:
        fs13 = dq and lay.w13.max_scale <= FUSED_SCALE_MAX
        fs2 = dq and lay.w2.max_scale <= FUSED_SCALE_MAX

    # split-K (decode kinds): up to split_k ranges of whole k-steps per GEMM; fp32 partials [S, ..] summed after
    sk = cfg.get("split_k", 1) if dq else 1
    persist = cfg.get("persist", 0) if dq else 0  # programs per SM of the persistent grid (0: one per item)
    # split boundaries at whole chunks of the backend's layout tile in both layouts (the tiled layout needs them
    # there for its full-width loads; the checkpoint layout takes the same ones so both give the same bits)
    backend = "interpreter" if interp else current_target().backend
    tile_k = LAYOUT_TILES[backend][1]
    kp1, s1 = _split_k(D, bk1, sk, g13[7] or fit_tile_k(tile_k, D))
    part13 = torch.empty(s1, 2, P, inter, dtype=torch.float32, device=dev) if s1 > 1 else h
    if poison and s1 > 1:
        part13.fill_(float("nan"))

    def run_w13():
        if dq:
            moe_gemm_dq_kernel[_dq_grid(ub, triton.cdiv(inter, cfg["BLOCK_N"]), s1, persist, dev)](
                a, g13[0], g13[1], part13, d.sorted_pair, wflat, d.block_expert, d.block_start, d.offsets,
                inter, D, inter, a.stride(0), *g13[2:6], inter if s1 > 1 else h.stride(0), kp1, 2 * P * inter, ub,
                TOPK=k, GATED=True, ACT=act, BETA=float(beta), BETA_LIN=float(beta_lin),
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk1, SWAP=swap, F32=interp,
                TILE_N=g13[6], TILE_K=g13[7], FUSED_SCALE=fs13, PTX=ptx, SCALE_PF=spf, SPLIT_K=s1, BITS=bits13,
                KORDER=order13, PERSIST=int(persist > 0), **opts)
            if s1 > 1:
                moe_glu_finish_kernel[(triton.cdiv(P, 16), triton.cdiv(inter, 256))](
                    part13, h, d.offsets, E_loc, inter, 2 * P * inter, h.stride(0), SPLITS=s1, ACT=act,
                    BETA=float(beta), BETA_LIN=float(beta_lin), BLOCK_R=16, BLOCK_I=256, num_warps=4)
            return
        moe_gemm_kernel[(ub, triton.cdiv(inter, cfg["BLOCK_N"]))](
            a, a_s, g13[0], g13[1], h, hs, d.sorted_pair, wflat, d.block_expert, d.block_start, d.offsets,
            inter, D, inter, a.stride(0), a_s.stride(0), *g13[2:6], h.stride(0), hs.stride(0),
            TOPK=k, GATED=True, A8=a8, ACT_FMT=fmt, ACT=act, BETA=float(beta), BETA_LIN=float(beta_lin),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk1, TILE_N=g13[6], TILE_K=g13[7], **opts)
    # w2's own n-tile and launch options where the config overrides them (configs.stage_config); BLOCK_M, BLOCK_K,
    # kind and split are shared
    cfg2 = stage_config(cfg, False)
    opts2 = tune.split(cfg2)[1]
    bk2 = _fit_block_k(cfg["BLOCK_K"], g2[7] or inter)
    kp2, s2 = _split_k(inter, bk2, sk, g2[7] or fit_tile_k(tile_k, inter))
    y = torch.empty(s2, P, D, dtype=torch.float32, device=dev)  # w2 rows per sorted pair, per split
    if poison:
        y.fill_(float("nan"))

    def run_w2():
        if dq:
            moe_gemm_dq_kernel[_dq_grid(ub, triton.cdiv(D, cfg2["BLOCK_N"]), s2, persist, dev)](
                h, g2[0], g2[1], y, d.sorted_pair, wflat, d.block_expert, d.block_start, d.offsets,
                D, inter, 0, h.stride(0), *g2[2:6], y.stride(1), kp2, y.stride(0), ub,
                TOPK=k, GATED=False, ACT=act, BETA=float(beta), BETA_LIN=float(beta_lin),
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg2["BLOCK_N"], BLOCK_K=bk2, SWAP=swap, F32=interp,
                TILE_N=g2[6], TILE_K=g2[7], FUSED_SCALE=fs2, PTX=ptx, SCALE_PF=spf, SPLIT_K=s2, BITS=bits2,
                KORDER=order2, PERSIST=int(persist > 0), **opts2)
            return
        moe_gemm_kernel[(ub, triton.cdiv(D, cfg2["BLOCK_N"]))](
            h, hs, g2[0], g2[1], y, y, d.sorted_pair, wflat, d.block_expert, d.block_start, d.offsets,
            D, inter, 0, h.stride(0), hs.stride(0), *g2[2:6], y.stride(1), y.stride(1),
            TOPK=k, GATED=False, A8=a8, ACT_FMT="e4m3" if a8 else "bf16", ACT=act, BETA=float(beta),
            BETA_LIN=float(beta_lin), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg2["BLOCK_N"], BLOCK_K=bk2,
            TILE_N=g2[6], TILE_K=g2[7], **opts2)
    nw = norm_weight.contiguous() if norm_weight is not None else out
    nd = normed if normed is not None else out

    # the unrolled reduction on unsplit output only (split partials keep the 4-warp loop: configs.REDUCE_LAUNCH)
    ilp = REDUCE_LAUNCH[backend]["ILP"] and s2 == 1
    reduce_warps = REDUCE_LAUNCH[backend]["num_warps"] if ilp else 4

    def run_reduce():
        moe_reduce_kernel[(T,)](y, d.pos, out, nw, nd, D, y.stride(1), out.stride(0), D, float(eps), TOPK=k,
                                NORM=norm_weight is not None, BLOCK_D=triton.next_power_of_2(D), SPLITS=s2,
                                stride_ys=y.stride(0), ILP=ilp, num_warps=reduce_warps)

    run_w13()
    run_w2()
    run_reduce()
    if stages is not None:  # benchmarking aid: each launch alone, on the same buffers
        stages.update(w13=run_w13, w2=run_w2, reduce=run_reduce,
                      dispatch=lambda: dispatch_gpu(topk_ids, first, E_loc, cfg["BLOCK_M"]),
                      quantize=(lambda: quantize_mxfp8_rows(x)) if a8 else None, config=cfg,
                      kernel=cfg["kind"] if dq else "scaled")
    return out, normed


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Any,
                act: str = "situ", mode: str = "a16w4", beta: float = 4.0, beta_lin: float = 25.0,
                config: tune.Config | None = None, poison: bool = False,
                dispatch: GpuDispatch | None = None) -> torch.Tensor:
    """Routed experts on packed MXFP4 in Triton; contract of ``k3rocm.model.moe.moe_experts``.

    Args:
        x: ``[T, D]`` bf16 (fp16 accepted; fp32 is rounded to bf16 for A16W4 — the kernel's activation type).
        topk_ids, topk_weights: ``[T, k]`` global ids / fp32 weights from the router.
        experts: ``ExpertWeights`` with ``w13_packed/w13_scale/w2_packed/w2_scale`` (checkpoint layout,
            unconverted), ``first_expert`` for expert parallelism (pairs of other ranks' experts add nothing);
            optionally ``kernel_layout`` (an :class:`ExpertLayout` from :func:`kernel_layout`): both GEMMs then
            read the tiled layout (bit-identical results; the checkpoint tensors give only the shapes).
        mode: ``"a16w4"`` (bf16 x decoded MXFP4: the integer decode + bf16 ``tl.dot`` for configs of kind
            ``"dq"``/``"dqn"``, ``tl.dot_scaled`` for kind ``"scaled"``) or ``"a8w4"`` (MXFP8 E4M3 activations,
            quantized on the fly, x MXFP4 through ``tl.dot_scaled`` whatever the kind); explicit, no global
            switch.
        config: one entry of ``GEMM_CONFIGS`` (default: :func:`k3rocm.kernels.tune.pick` by mean rows per expert).
        poison: testing aid — fill every intermediate and the output with NaN before the kernels run.
        dispatch: the grouping of ``topk_ids`` already made on the device (``moe_router(..., experts=experts)``,
            fused routing); None: ``dispatch_gpu`` here. Either gives the same tensors, so the same result.
    Returns:
        ``[T, D]`` fp32. Raises ConfigError on bad mode / act / shapes / unquantized experts, or a dispatch
        made for other pairs, experts or another ``BLOCK_M`` than this call's GEMM config.
    """
    return _experts_impl(x, topk_ids, topk_weights, experts, act, mode, beta, beta_lin, config, poison=poison,
                         dispatch=dispatch)[0]


def latent_moe(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, experts: Any, top_k: int,
               down_proj: torch.Tensor, norm_weight: torch.Tensor, up_proj: torch.Tensor,
               shared_gate: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
               shared_down: torch.Tensor | None = None, eps: float = 1e-5, renormalize: bool = True,
               scaling: float = 1.0, act: str = "situ", mode: str = "a16w4", beta: float = 4.0,
               beta_lin: float = 25.0) -> torch.Tensor:
    """Whole Stable LatentMoE layer on the GPU (oracle: ``k3rocm.model.moe.latent_moe``); x ``[T, H]`` bf16.

    Fusions: the per-token expert reduction and the latent RMSNorm run in one kernel (the normed latent is
    written in bf16 for the up projection); the dense projections (down 7168->3584, up 3584->7168, shared
    experts 6144 wide) are bf16 GEMMs with fp32 accumulation through torch, SiTU of the shared experts in fp32.
    Returns ``[T, H]`` fp32.
    """
    if not x.is_cuda and not interpreting():
        raise HardwareError("latent_moe (triton) needs a GPU tensor; use k3rocm.model.moe.latent_moe on CPU")
    def mm(a, b):  # bf16 GEMM with fp32 accumulation (cuBLAS); fp32 on the CPU (interpreter tests)
        return (a @ b.t()).float() if a.is_cuda else a.float() @ b.float().t()

    # the interpreter's bf16 tl.dot is not trustworthy: its router runs on the (exact) fp32 widening
    ids, w, d = moe_router(x if x.is_cuda else x.float(), gate_weight, bias, top_k, renormalize, scaling,
                           experts=experts)
    xl = mm(x, down_proj).to(torch.bfloat16)
    _, normed = _experts_impl(xl, ids, w, experts, act, mode, beta, beta_lin, None, norm_weight, eps, dispatch=d)
    out = mm(normed, up_proj)
    if shared_gate is not None:
        g = mm(x, shared_gate)
        u = mm(x, shared_up)
        if act == "situ":
            hsh = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))
        else:
            hsh = torch.nn.functional.silu(g) * u
        out += mm(hsh.to(torch.bfloat16), shared_down)
    return out
