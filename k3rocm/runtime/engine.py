"""Serving engine: continuous batching over the paged MLA cache and the KDA slot pool, greedy sampling.

Per :meth:`Engine.step` the :class:`~k3rocm.runtime.scheduler.Scheduler` plans one mixed batch — decode
rows (one token per running sequence) first, then prefill chunks — and the engine runs it through the
decoder layer by layer on flat tokens (``B = 1``, ``cu_seqlens``):

* Block Attention Residuals, norms and channel mixers (dense SiTU-GLU, Stable LatentMoE through the
  ``moe_router`` / ``moe_experts`` ops) are the model's layer functions (:mod:`k3rocm.model.layer`) on all
  tokens of the step at once;
* token mixers on the **decode rows** run the engine's own device-side decode path: ``kda_decode`` on
  the slot pool and ``mla_cache_write`` + absorbed ``mla_decode`` on the paged cache, with slot ids,
  slot mapping and context lengths computed as tensors (padding rows: slot id −1, context 0, which the
  ops skip) so the step can be captured as a CUDA/HIP graph;
* token mixers on the **prefill chunks** run the model's ``kda_mixer`` / ``mla_mixer`` (``short_conv`` +
  ``kda_prefill`` from the slot's saved state; ``mla_prefill`` for fresh sequences, or ``mla_cache_write``
  + per-sequence ``mla_decode`` when a chunk continues a cached context).

Ops come from :func:`k3rocm.kernels.registry.select` (``torch`` oracle on CPU, ``triton`` on a GPU when
registered, ``--kernels`` override). Weights: bf16 on a GPU, fp32 on CPU by default (FP32 checkpoint
tensors and packed MXFP4 experts are kept as stored). Dense projections (attention projections, dense and
shared MLPs, the LatentMoE down/up projections, lm_head) multiply in the weight dtype with fp32
accumulation (``matmul_dtype``, default on a GPU with bf16/fp16 weights; see
:func:`k3rocm.model.common.linear`) instead of widening every weight to fp32 per step. Sampling is
greedy (argmax, lowest id on ties). Decode-only steps on a GPU replay CUDA/HIP graphs captured per batch
size of a ladder; if capture fails (an op that syncs with the host) the engine stays eager and
:meth:`Engine.describe` says why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from k3rocm.config import K3Config
from k3rocm.errors import ConfigError, PlanError
from k3rocm.runtime import registry
from k3rocm.model.common import MATMUL_DTYPES, f32, fp32_out_supported, linear, matmul_dtype, rms_norm
from k3rocm.model.layer import (AttnResState, Batch, WeightView, attn_side, dense_mlp, final_aggregate,
                                fold_res_weight, kda_mixer, mla_has_output_gate, mlp_side, moe_block)
from k3rocm.runtime.cache import KDAStatePool, MLACache, size_caches
from k3rocm.runtime.scheduler import Scheduler, SchedulerOutput, Sequence

GRAPH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
AUTO = "auto"  # default of Engine(matmul_dtype=...): the weight dtype on a GPU when it is bf16/fp16, else None


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token: ``request_id`` got ``token``; ``finished`` with ``finish_reason`` when it was the last."""

    request_id: int
    token: int
    finished: bool
    finish_reason: str | None
    time: float


@dataclass(frozen=True)
class StepStats:
    """What one step computed: decode rows (with their context lengths after the step), prefill tokens, seconds."""

    num_decode: int
    num_prefill_tokens: int
    decode_contexts: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    seconds: float
    graph: bool
    prefill_sizes: tuple[int, ...] = ()


class _DeviceWeights:
    """Weights moved to the engine device: float tensors cast to ``dtype`` except FP32-stored ones
    (conv, ``A_log``, ``dt_bias``, ``o_norm``, router bias); uint8 (MXFP4) kept. Routed experts of a layer are
    stacked once into the op contract's ``ExpertWeights`` layout and cached."""

    def __init__(self, source: Any, cfg: K3Config, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.t: dict[str, torch.Tensor] = {}
        for name, v in source.items():
            if not isinstance(v, torch.Tensor):
                continue
            if v.is_floating_point() and v.dtype != torch.float32:
                v = v.to(dtype)
            elif v.dtype == torch.float32 and dtype != torch.float32 and not _keep_fp32(name):
                v = v.to(dtype)
            self.t[name] = v.to(device)
        self._experts: dict[int, Any] = {}
        fn = getattr(source, "experts", None)
        self._src_experts = fn if callable(fn) and not isinstance(source, dict) else None
        self.device = device

    def get(self, name: str) -> torch.Tensor | None:
        return self.t.get(name)

    def experts(self, layer: int) -> Any:
        if layer not in self._experts:
            if self._src_experts is not None:  # a Weights object stacks its own experts
                ew = self._src_experts(layer)
                self._experts[layer] = ew.to(self.device) if hasattr(ew, "to") else ew
            else:
                self._experts[layer] = WeightView(self.t).experts(layer, self.cfg)
        return self._experts[layer]


def _keep_fp32(name: str) -> bool:
    return any(s in name for s in ("conv1d", "A_log", "dt_bias", "o_norm", "e_score_correction_bias"))


class _PagedCacheView:
    """The attributes the model's token mixers read from a cache (``conv``, ``ssm``, ``kv``, ``block_table``
    indexed by slot id, ``block_size``, ``max_len``), backed by the engine's pool and paged cache."""

    def __init__(self, mla: MLACache, kda: KDAStatePool, block_table: torch.Tensor):
        self.conv = kda.conv
        self.ssm = kda.state
        self.kv = mla.kv_cache
        self.block_table = block_table
        self.block_size = mla.block_size
        self.max_len = block_table.shape[1] * mla.block_size
        self.batch = kda.num_slots


class Engine:
    """Continuous-batching inference engine on one device.

    Args:
        cfg: model config (K3 family; ``kimi_linear`` runs the eager paths).
        weights: ``Mapping[str, Tensor]`` by full checkpoint name (moved/cast to ``device``), or a ``Weights``
            object offering ``get(name)`` (and optionally ``experts(layer)``) already on the device.
        kernels: registry override (``"torch"``, ``"triton"``, ``"op=impl,..."`` or a dict); None = auto.
        device: ``"cuda"`` when a GPU is visible, else ``"cpu"``.
        max_batch: running sequences at most (= KDA slots unless the budget gives fewer).
        max_num_batched_tokens: tokens per step (decode + prefill chunks).
        block_size: tokens per MLA cache block.
        max_model_len: longest prompt + output a request may have (sizes the cache when no budget is given).
        cache_budget_bytes: cache bytes for this device (the plan's cache capacity); splits into slots/blocks.
        dtype: weight/compute dtype (bf16 on GPU, fp32 on CPU).
        kv_dtype: MLA cache dtype (fp32 on CPU, bf16 on GPU; ``torch.float8_e4m3fn`` stores with scale 1).
        moe_mode: ``"a16w4"`` or ``"a8w4"``.
        cuda_graphs: capture decode steps (default: on a GPU).
        graph_batch_sizes: the ladder of captured decode batch sizes.
        num_blocks: MLA cache blocks, overriding the sizing from the budget / ``max_model_len``.
        matmul_dtype: operand dtype of the dense projections (:func:`k3rocm.model.common.matmul_dtype`):
            ``"auto"`` (default) = ``dtype`` on a GPU when it is bf16/fp16, else None; None = widen to fp32
            (the oracle's math); ``torch.bfloat16`` / ``torch.float16`` also on the CPU. Only weights stored in
            that dtype take the low-precision path (FP32-stored tensors stay fp32).

    Raises:
        ConfigError / HardwareError: a bad override (e.g. ``triton`` without a GPU), or a ``matmul_dtype`` other
            than ``"auto"``, None, bf16 or fp16.
        PlanError: the cache does not hold one sequence.
    """

    def __init__(self, cfg: K3Config, weights: Any, kernels: str | dict | None = None, device: str | None = None,
                 max_batch: int = 8, max_num_batched_tokens: int = 256, block_size: int = 16,
                 max_model_len: int = 2048, cache_budget_bytes: int | None = None, dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None, moe_mode: str = "a16w4", cuda_graphs: bool | None = None,
                 graph_batch_sizes: Iterable[int] = GRAPH_LADDER, num_blocks: int | None = None,
                 matmul_dtype: torch.dtype | str | None = AUTO):
        self.cfg = cfg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        on_gpu = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        if isinstance(matmul_dtype, str) and matmul_dtype == AUTO:
            matmul_dtype = self.dtype if on_gpu and self.dtype in MATMUL_DTYPES else None
        if matmul_dtype is not None and matmul_dtype not in MATMUL_DTYPES:
            raise ConfigError(f"Engine matmul_dtype {matmul_dtype!r} is not 'auto', None, torch.bfloat16 or "
                              "torch.float16; pass one of those")
        self.matmul_dtype: torch.dtype | None = matmul_dtype
        # probe torch.mm(out_dtype=fp32) here, never first inside a graph capture (the probe reads back)
        self.fp32_out = bool(matmul_dtype is not None and fp32_out_supported(self.device))
        self.kv_dtype = kv_dtype or (torch.bfloat16 if on_gpu else torch.float32)
        if moe_mode not in ("a16w4", "a8w4"):
            raise ConfigError(f"moe_mode {moe_mode!r} is not 'a16w4' or 'a8w4'")
        self.moe_mode = moe_mode
        self.max_model_len = max_model_len
        # ---- ops
        override = registry.parse_override(kernels) if isinstance(kernels, str) or kernels is None else dict(kernels)
        if not on_gpu and "*" not in override:
            override["*"] = "torch"  # a CPU engine never takes GPU kernels, even where a GPU is visible
        self.ops: dict[str, Any] = {}
        self.op_impls: dict[str, str] = {}
        # what the kernels' supports() checks look at: the model's shapes, not their defaults
        shape = dict(quantized=cfg.experts_quantized, kv_lora_rank=cfg.kv_lora_rank,
                     gate_form="k3" if cfg.family == "k3" else "kimi_linear", lower_bound=cfg.gate_lower_bound,
                     num_sources=cfg.num_attn_res_bank_rows + 1)
        for op in registry.ORACLE_OPS:
            name, impl = registry.select(op, override, **shape)
            self.ops[op] = impl.fn
            self.op_impls[op] = name
        # ---- weights
        if isinstance(weights, Mapping) or hasattr(weights, "items"):
            self.weights = _DeviceWeights(weights, cfg, self.device, self.dtype)
        else:
            self.weights = weights
        self.w = WeightView(self.weights)
        self.attn_res = cfg.attn_res_block_size is not None
        self._res_attn, self._res_mlp, self._res_out = {}, {}, None
        if self.attn_res:
            for i in range(cfg.num_hidden_layers):
                p = f"layers.{i}."
                self._res_attn[i] = fold_res_weight(self.w(p + "self_attention_res_norm.weight"),
                                                    self.w(p + "self_attention_res_proj.weight"))
                self._res_mlp[i] = fold_res_weight(self.w(p + "mlp_res_norm.weight"), self.w(p + "mlp_res_proj.weight"))
            self._res_out = fold_res_weight(self.w("output_attn_res_norm.weight"), self.w("output_attn_res_proj.weight"))
        self._wkv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # ---- caches
        if cache_budget_bytes is not None:
            sz = size_caches(cfg, cache_budget_bytes, max_batch, block_size, self.kv_dtype)
            num_slots, num_blocks = sz.num_slots, num_blocks or max(1, sz.num_blocks)
        else:
            num_slots = max_batch
            num_blocks = num_blocks or max_batch * -(-max_model_len // block_size)
        self.mla = MLACache(cfg, num_blocks, block_size, self.kv_dtype, self.device)
        self.kda = KDAStatePool(cfg, num_slots, self.device)
        self.scheduler = Scheduler(self.mla, self.kda, max_num_seqs=min(max_batch, num_slots),
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._next_id = 0
        self.seqs: dict[int, Sequence] = {}
        self.step_log: list[StepStats] = []
        # ---- graphs
        self.cuda_graphs = on_gpu if cuda_graphs is None else bool(cuda_graphs and on_gpu)
        self.graph_sizes = sorted(set(int(b) for b in graph_batch_sizes if 0 < int(b) <= max_batch)) or [max_batch]
        if self.graph_sizes[-1] < min(max_batch, num_slots):
            self.graph_sizes.append(min(max_batch, num_slots))
        self._graphs: dict[int, Any] = {}
        self.graph_error = ""
        self._graph_mode = False
        # a captured mla_decode must not size its work from the live context lengths (a host sync): kernels
        # that accept a static bound get max_model_len and one fixed split count
        import inspect
        try:
            params = inspect.signature(self.ops["mla_decode"]).parameters
        except (TypeError, ValueError):
            params = {}
        self._graph_kw = {k: v for k, v in (("max_context_len", max_model_len),
                                             ("num_splits", max(1, min(8, max_model_len // 512))))
                          if k in params}
        self.graph_note = "off (CPU)" if not on_gpu else ("on" if self.cuda_graphs else "off (disabled)")

    # ------------------------------------------------------------------ description
    def describe(self) -> dict:
        """What runs: device, dtypes, per-op implementation, cache sizes, paths, graph state."""
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_dtype": str(self.kv_dtype).replace("torch.", ""),
            # the mode that runs: bf16 (unquantized) experts have no A8W4 path
            "moe_mode": self.moe_mode if self.cfg.experts_quantized else "a16w4 (bf16 experts)",
            "ops": dict(self.op_impls),
            "fallbacks": [f"{op}: torch oracle (no GPU kernel registered or supported)" for op, impl in
                          self.op_impls.items() if impl == "torch" and self.device.type == "cuda"],
            "kda_slots": self.kda.num_slots,
            "mla_blocks": self.mla.num_blocks,
            "block_size": self.mla.block_size,
            "cache_bytes": self.mla.nbytes() + self.kda.nbytes(),
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "decode_path": ("kda_decode + mla_cache_write + mla_decode (paged, slot pools)"
                            if self.cfg.family == "k3" else
                            "model per-sequence path (kda_prefill on one token; kimi_linear has no fused decode)"),
            "prefill_path": "short_conv + kda_prefill (slot state); mla_prefill (fresh) or mla_decode (continuation)",
            "matmul_dtype": None if self.matmul_dtype is None else str(self.matmul_dtype).replace("torch.", ""),
            "matmul": ("fp32 (weights widened per use)" if self.matmul_dtype is None else
                       f"{str(self.matmul_dtype).replace('torch.', '')} operands, fp32 accumulation, "
                       + ("fp32 output (torch.mm out_dtype)" if self.fp32_out else
                          f"{str(self.matmul_dtype).replace('torch.', '')} output widened to fp32")),
            "cuda_graphs": self.graph_note,
            "graph_batch_sizes": list(self._graphs) if self._graphs else [],
        }

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: Iterable[int], max_tokens: int, ignore_eos: bool = False,
                    request_id: int | None = None) -> int:
        """Queue a request; returns its id. Raises ConfigError (bad ids / lengths) or PlanError (never fits)."""
        prompt = [int(t) for t in prompt_ids]
        if prompt and (min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size):
            raise ConfigError(f"prompt token ids must lie in 0..{self.cfg.vocab_size - 1}")
        if len(prompt) + max_tokens > self.max_model_len:
            raise PlanError(f"request of {len(prompt)} + {max_tokens} tokens exceeds max_model_len "
                            f"{self.max_model_len}; raise max_model_len")
        rid = self._next_id if request_id is None else int(request_id)
        self._next_id = max(self._next_id, rid) + 1
        seq = Sequence(rid, prompt, int(max_tokens), self.cfg.eos_token_id, ignore_eos)
        self.scheduler.add(seq)
        self.seqs[rid] = seq
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)

    def where(self, request_id: int) -> dict:
        """Where a request is: status, prompt length, tokens computed, outputs produced, preemptions."""
        s = self.seqs.get(request_id)
        if s is None:
            return {"status": "unknown"}
        phase = s.status.value
        if s.status.value == "running":
            phase = "decode" if s.num_computed >= len(s.prompt) else "prefill"
        return {"status": phase, "prompt_len": len(s.prompt), "num_computed": s.num_computed,
                "output_tokens": len(s.output), "preemptions": s.num_preemptions}

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int], ignore_eos: bool = True) -> list[list[int]]:
        """Run ``prompts`` to completion through the scheduler; returns each one's output ids."""
        mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        ids = [self.add_request(p, m, ignore_eos) for p, m in zip(prompts, mts)]
        while self.has_unfinished():
            self.step()
        return [list(self.seqs[i].output) for i in ids]

    # ------------------------------------------------------------------ forward pieces
    def _kv_split(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._wkv:
            H, Dn, Dv, R = self.cfg.num_attention_heads, self.cfg.qk_nope_head_dim, self.cfg.v_head_dim, \
                self.cfg.kv_lora_rank
            kvb = f32(self.w(f"layers.{layer}.self_attn.kv_b_proj.weight")).view(H, Dn + Dv, R)
            self._wkv[layer] = (kvb[:, :Dn, :].contiguous(), kvb[:, Dn:, :].transpose(1, 2).contiguous())
        return self._wkv[layer]

    def _kda_decode_rows(self, x: torch.Tensor, layer: int, slot_ids: torch.Tensor) -> torch.Tensor:
        """KDA token mixer for one token per row via ``kda_decode`` on the slot pool (K3_FACTS §5)."""
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}.self_attn."
        q_raw, k_raw, v_raw = (linear(x, w(p + f"{n}_proj.weight")) for n in "qkv")
        decay_raw = linear(linear(x, w(p + "f_a_proj.weight")), w(p + "f_b_proj.weight"))
        beta_raw = linear(x, w(p + "b_proj.weight"))
        gate_raw = linear(x, w(p + "g_proj.weight"))
        convw = tuple(f32(w(p + f"{n}_conv1d.weight")) for n in "qkv")
        o = self.ops["kda_decode"](q_raw, k_raw, v_raw, decay_raw, beta_raw, gate_raw, convw,
                                   f32(w(p + "A_log")).reshape(-1), f32(w(p + "dt_bias")).reshape(-1),
                                   f32(w(p + "o_norm.weight")), self.kda.conv[layer], self.kda.state[layer],
                                   slot_ids, cfg.rms_norm_eps, None, cfg.gate_lower_bound)
        return linear(o, w(p + "o_proj.weight"))

    def _mla_decode_rows(self, x: torch.Tensor, layer: int, slot_ids: torch.Tensor, pos: torch.Tensor,
                         block_rows: torch.Tensor) -> torch.Tensor:
        """Gated MLA token mixer for one token per row: write the token's latent + k_rope into its paged
        slot (``mla_cache_write``), then absorbed ``mla_decode`` (K3_FACTS §5). Rows with slot id −1 write
        nothing (slot mapping −1) and attend to nothing (context length 0)."""
        cfg = self.cfg
        Dn, Dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q, latent, k_rope = self._mla_qkv(x, layer)
        bs = self.mla.block_size
        valid = slot_ids >= 0
        col = torch.clamp(pos // bs, max=block_rows.shape[1] - 1).unsqueeze(1)
        blk = block_rows.to(torch.int64).gather(1, col).squeeze(1)
        slot_mapping = torch.where(valid, blk * bs + pos % bs, torch.full_like(pos, -1))
        self.ops["mla_cache_write"](self.mla.kv_cache[layer], slot_mapping, latent, k_rope)
        ctx = torch.where(valid, pos + 1, torch.zeros_like(pos)).to(torch.int32)
        w_kc, w_vc = self._kv_split(layer)
        o = self.ops["mla_decode"](q[..., :Dn].unsqueeze(1).contiguous(), q[..., Dn:].unsqueeze(1).contiguous(),
                                   self.mla.kv_cache[layer], block_rows, ctx, w_kc, w_vc, (Dn + Dr) ** -0.5,
                                   **(self._graph_kw if self._graph_mode else {}))
        return self._mla_out(o, x, layer)

    def _mla_qkv(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H, Dn+Dr]``, normed latent ``[T, R]``, k_rope ``[T, Dr]`` of a gated MLA layer (K3_FACTS §5)."""
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}.self_attn."
        H, Dn, Dr, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        if cfg.q_lora_rank:
            q = linear(rms_norm(linear(x, w(p + "q_a_proj.weight")), w(p + "q_a_layernorm.weight"), eps),
                       w(p + "q_b_proj.weight"))
        else:
            q = linear(x, w(p + "q_proj.weight"))
        ckv = linear(x, w(p + "kv_a_proj_with_mqa.weight"))
        latent = rms_norm(ckv[:, :R], w(p + "kv_a_layernorm.weight"), eps)
        return q.view(x.shape[0], H, Dn + Dr), latent, ckv[:, R:].contiguous()

    def _mla_out(self, o: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Output gate ``sigmoid(g_proj(x))`` (when the layer has one) and ``o_proj``."""
        p = f"layers.{layer}.self_attn."
        o = f32(o).reshape(x.shape[0], -1)
        if mla_has_output_gate(self.cfg):
            o = o * torch.sigmoid(linear(x, self.w(p + "g_proj.weight")))
        return linear(o, self.w(p + "o_proj.weight"))

    def _mla_chunks(self, x: torch.Tensor, layer: int, info: dict) -> torch.Tensor:
        """Gated MLA on prefill chunks: write every chunk token into its paged slot, then ``mla_prefill``
        when every chunk starts a sequence (keys/values expanded by ``kv_b_proj``), else absorbed
        ``mla_decode`` per chunk with its queries as the last positions of the cached context."""
        cfg, w = self.cfg, self.w
        H, Dn, Dr, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        dev = x.device
        q, latent, k_rope = self._mla_qkv(x, layer)
        starts, sizes, rows = info["starts"], info["sizes"], info["block_rows"]
        bs = self.mla.block_size
        pos = torch.cat([torch.arange(a, a + n, device=dev) for a, n in zip(starts, sizes)])
        which = torch.repeat_interleave(torch.arange(len(sizes), device=dev), torch.tensor(sizes, device=dev))
        slot_mapping = rows.to(torch.int64)[which, pos // bs] * bs + pos % bs
        self.ops["mla_cache_write"](self.mla.kv_cache[layer], slot_mapping, latent, k_rope)
        scale = (Dn + Dr) ** -0.5
        if all(a == 0 for a in starts):
            cu = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0).tolist()), dtype=torch.int32, device=dev)
            kvb = linear(latent, w(f"layers.{layer}.self_attn.kv_b_proj.weight")).view(-1, H, Dn + Dv)
            o = self.ops["mla_prefill"](q, kvb[..., :Dn].contiguous(), k_rope, kvb[..., Dn:].contiguous(), cu, cu,
                                        scale)
        else:
            w_kc, w_vc = self._kv_split(layer)
            outs, off = [], 0
            for j, (a, n) in enumerate(zip(starts, sizes)):
                ctx = torch.tensor([a + n], dtype=torch.int32, device=dev)
                qj = q[off:off + n]
                outs.append(self.ops["mla_decode"](qj[..., :Dn].unsqueeze(0).contiguous(),
                                                   qj[..., Dn:].unsqueeze(0).contiguous(), self.mla.kv_cache[layer],
                                                   rows[j:j + 1], ctx, w_kc, w_vc, scale)[0])
                off += n
            o = torch.cat(outs, 0)
        return self._mla_out(o, x, layer)

    def _channel(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_moe_layer(i):
            return moe_block(x, self.w, i, self.cfg, self.ops, self.moe_mode)
        return dense_mlp(x, self.w, f"layers.{i}.mlp.", self.cfg)

    def _forward(self, ids: torch.Tensor, nd: int, dec: dict | None, pre: Batch | None, pre_info: dict | None,
                 sample_rows: torch.Tensor) -> torch.Tensor:
        """Run all layers on flat ``ids [T]`` (first ``nd`` = decode rows) and return logits of ``sample_rows``.

        ``dec``: ``slot_ids [nd] int32``, ``pos [nd] int64`` (tokens cached before), ``block_rows [nd, nb]``.
        ``pre``: the prefill chunks' :class:`Batch` (for the KDA mixer), or None; ``pre_info``: their
        ``block_rows [P, nb]``, ``starts`` and ``sizes`` (for the MLA chunk path).
        Runs inside ``matmul_dtype(self.matmul_dtype)`` (eager steps, graph warm-up and capture alike).
        """
        with matmul_dtype(self.matmul_dtype):
            return self._forward_layers(ids, nd, dec, pre, pre_info, sample_rows)

    def _forward_layers(self, ids: torch.Tensor, nd: int, dec: dict | None, pre: Batch | None,
                        pre_info: dict | None, sample_rows: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        x = f32(w("embed_tokens.weight")[ids])
        res = AttnResState([], x) if self.attn_res else None
        hidden = None if self.attn_res else x
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            h = attn_side(res, i, self._res_attn[i], cfg, self.ops) if self.attn_res else hidden
            xn = rms_norm(h, w(p + "input_layernorm.weight"), eps)
            parts = []
            if nd:
                xd = xn[:nd]
                if cfg.layer_type(i) == "kda":
                    if cfg.family == "k3":
                        parts.append(self._kda_decode_rows(xd, i, dec["slot_ids"]))
                    else:
                        parts.append(kda_mixer(xd, w, i, cfg, self.ops, dec["batch"]))
                else:
                    parts.append(self._mla_decode_rows(xd, i, dec["slot_ids"], dec["pos"], dec["block_rows"]))
            if pre is not None:
                if cfg.layer_type(i) == "kda":
                    parts.append(kda_mixer(xn[nd:], w, i, cfg, self.ops, pre))
                else:
                    parts.append(self._mla_chunks(xn[nd:], i, pre_info))
            a = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            if self.attn_res:
                res.prefix = res.prefix + a
                h = mlp_side(res, self._res_mlp[i], cfg, self.ops)
            else:
                hidden = hidden + a
                h = hidden
            m = self._channel(i, rms_norm(h, w(p + "post_attention_layernorm.weight"), eps))
            if self.attn_res:
                res.prefix = res.prefix + m
            else:
                hidden = hidden + m
        if self.attn_res:
            sub = AttnResState([b[sample_rows] for b in res.bank], res.prefix[sample_rows])
            h = final_aggregate(sub, self._res_out, cfg, self.ops)
        else:
            h = hidden[sample_rows]
        h = rms_norm(h, w("norm.weight"), eps)
        head = w("embed_tokens.weight") if cfg.tie_word_embeddings else w.head()
        return linear(h, head)

    def _slot_block_table(self) -> torch.Tensor:
        """``[num_slots, max_blocks_per_seq]`` int32: row = block table of the sequence in that slot."""
        t = torch.zeros(self.kda.num_slots, self.max_blocks_per_seq, dtype=torch.int32)
        for sid, slot in self.kda.slots.items():
            blocks = self.mla.block_tables.get(sid, [])
            t[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return t.to(self.device)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Plan and run one step; returns the tokens sampled in it (greedy)."""
        plan: SchedulerOutput = self.scheduler.schedule()
        if plan.empty:
            return []
        t0 = time.perf_counter()
        dev = self.device
        sched = plan.scheduled
        decs = [s for s in sched if s.is_decode]
        pres = [s for s in sched if not s.is_decode]
        nd = len(decs)
        table = self._slot_block_table()
        ids, sample_rows, sample_seqs = [], [], []
        off = 0
        for s in sched:
            ids.extend(s.seq.tokens[s.start:s.start + s.num_tokens])
            off += s.num_tokens
            if s.sample:
                sample_rows.append(off - 1)
                sample_seqs.append(s.seq)
        dec = None
        if nd:
            slots = torch.tensor([self.kda.slot_of(s.seq.seq_id) for s in decs], dtype=torch.int64)
            dec = {"slot_ids": slots.to(torch.int32).to(dev),
                   "pos": torch.tensor([s.start for s in decs], dtype=torch.int64, device=dev),
                   "block_rows": table[slots.to(dev)]}
            if self.cfg.family != "k3":
                dec["batch"] = Batch(torch.arange(nd + 1, dtype=torch.int32, device=dev),
                                     _PagedCacheView(self.mla, self.kda, table),
                                     slots, torch.tensor([s.start for s in decs]), decode=False)
        pre = pre_info = None
        view = _PagedCacheView(self.mla, self.kda, table)
        if pres:
            pslots = torch.tensor([self.kda.slot_of(s.seq.seq_id) for s in pres], dtype=torch.int64, device=dev)
            pre_info = {"block_rows": table[pslots], "starts": [s.start for s in pres],
                        "sizes": [s.num_tokens for s in pres]}
            cu = [0]
            for s in pres:
                cu.append(cu[-1] + s.num_tokens)
            pre = Batch(torch.tensor(cu, dtype=torch.int32, device=dev), view,
                        torch.tensor([self.kda.slot_of(s.seq.seq_id) for s in pres], dtype=torch.int64),
                        torch.tensor([s.start for s in pres], dtype=torch.int64), decode=False)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        rows_t = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
        used_graph = False
        if nd and not pres and self.cuda_graphs:
            logits = self._graph_decode(ids_t, dec)
            used_graph = logits is not None
        if not used_graph:
            logits = self._forward(ids_t, nd, dec, pre, pre_info, rows_t)
        toks = logits.argmax(-1).tolist() if sample_rows else []
        now = time.perf_counter()
        sampled = {s.seq_id: int(t) for s, t in zip(sample_seqs, toks)}
        done = {s.seq_id for s in self.scheduler.update(plan, sampled)}
        self.step_log.append(StepStats(nd, sum(s.num_tokens for s in pres),
                                       tuple(s.start + 1 for s in decs),
                                       tuple(s.start + s.num_tokens for s in pres), now - t0, used_graph,
                                       tuple(s.num_tokens for s in pres)))
        return [TokenEvent(s.seq_id, sampled[s.seq_id], s.seq_id in done, s.finish_reason, now) for s in sample_seqs]

    # ------------------------------------------------------------------ CUDA/HIP graphs
    def _graph_decode(self, ids: torch.Tensor, dec: dict) -> torch.Tensor | None:
        """Replay (capturing on first use) the decode graph of the smallest ladder size >= N; padding rows get
        token 0 (a valid id: finite activations, in-range expert ids), slot −1 and context 0. Returns logits
        ``[N, vocab]`` or None when graphs are unavailable (then the engine stays eager and says why)."""
        n = ids.numel()
        size = next((b for b in self.graph_sizes if b >= n), None)
        if size is None:
            return None
        g = self._graphs.get(size)
        if g is None:
            g = self._capture(size)
            if g is None:
                return None
        g["ids"].zero_()
        g["ids"][:n] = ids
        g["slot_ids"].fill_(-1)
        g["slot_ids"][:n] = dec["slot_ids"]
        g["pos"].zero_()
        g["pos"][:n] = dec["pos"]
        g["block_rows"].zero_()
        g["block_rows"][:n] = dec["block_rows"]
        g["graph"].replay()  # the graph-mode kwargs were baked in at capture
        return g["logits"][:n].clone()

    def _capture(self, size: int) -> dict | None:
        dev = self.device
        st = {"ids": torch.zeros(size, dtype=torch.int64, device=dev),
              "slot_ids": torch.full((size,), -1, dtype=torch.int32, device=dev),
              "pos": torch.zeros(size, dtype=torch.int64, device=dev),
              "block_rows": torch.zeros(size, self.max_blocks_per_seq, dtype=torch.int32, device=dev)}
        # every tensor the graph reads but did not allocate during capture must live as long as the graph: a
        # buffer freed after capture goes back to the caching allocator, and replays read whatever reuses it
        # (here: the sampled-row indices of the final AttnRes gather)
        st["rows"] = rows = torch.arange(size, device=dev)
        try:
            s = torch.cuda.Stream(device=dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            self._graph_mode = True
            with torch.cuda.stream(s):  # warm-up on padding only (writes nothing)
                self._forward(st["ids"], size, st, None, None, rows)
            torch.cuda.current_stream(dev).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                st["logits"] = self._forward(st["ids"], size, st, None, None, rows)
            self._graph_mode = False
        except Exception as e:  # an op synchronises with the host: stay eager and say so
            self._graph_mode = False
            import traceback
            self.graph_error = traceback.format_exc(limit=-6)
            self.cuda_graphs = False
            self.graph_note = f"off (capture failed at batch {size}: {type(e).__name__}: {str(e).splitlines()[0][:160]})"
            return None
        st["graph"] = graph
        self._graphs[size] = st
        self.graph_note = "on"
        return st
