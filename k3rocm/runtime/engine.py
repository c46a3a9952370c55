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

Ops come from :func:`k3rocm.runtime.registry.select` (``torch`` oracle on CPU, ``triton`` on a GPU when
registered, ``--kernels`` override). Weights: bf16 on a GPU, fp32 on CPU by default (FP32 checkpoint
tensors and packed MXFP4 experts are kept as stored). Dense projections (attention projections, dense and
shared MLPs, the LatentMoE down/up projections, lm_head) multiply in the weight dtype with fp32
accumulation (``matmul_dtype``, default on a GPU with bf16/fp16 weights; see
:func:`k3rocm.model.common.linear`) instead of widening every weight to fp32 per step. Sampling is
greedy (argmax, lowest id on ties). Decode-only steps on a GPU replay CUDA/HIP graphs captured per batch
size of a ladder; steps carrying prefill chunks replay piecewise graphs per token bucket, with only the
chunks' sequence-dependent mixer work (``kda_prefill``, ``mla_prefill`` and their cache work) eager between
the pieces (:meth:`Engine._graph_mixed`). If capture fails (an op that syncs with the host) the engine stays
eager and :meth:`Engine.describe` says why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from k3rocm.config import K3Config
from k3rocm.kernels import tune
from k3rocm.kernels.compile_watch import CompileWatch
from k3rocm.errors import ConfigError, PlanError
from k3rocm.hw import tune_env
from k3rocm.runtime import registry
from k3rocm.model.common import MATMUL_DTYPES, fp32_out_supported, matmul_dtype
from k3rocm.model.decoder import Decoder, Parallel
from k3rocm.model.layer import (Batch, WeightView, _kda_inputs, kda_decode_core, kda_decode_rows, kda_input_rows,
                                kda_mixer, kda_output, kda_prefill_core, mla_decode_core, mla_decode_rows, mla_mixer,
                                mla_output, mla_prefill_core, mla_project, mla_row_slots)
from k3rocm.model.weights import as_weights
from k3rocm.runtime.cache import KDAStatePool, MLACache, size_caches
from k3rocm.runtime.scheduler import Scheduler, SchedulerOutput, Sequence

GRAPH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: the default tokens per step (decode rows + prefill chunk tokens; ``bench --max-num-batched-tokens``). 512: on one
#: H200 (2026-12-04, input 256 / output 64 at concurrency 64) k3-prefix-4 served 2,328 output tok/s vs 1,793 at 256,
#: with ITL p99 / p50 2.1 and 0.50 of the roofline over all steps (1024: 2,544 tok/s but ITL p99 / p50 3.1, 0.46),
#: and the K3 rank of TP16/EP16 653 tok/s vs 484 (its chunk steps are host-bound: fewer of them, same cost each)
MAX_NUM_BATCHED_TOKENS = 512
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
    """What one step computed: decode rows (with their context lengths after the step), prefill tokens, seconds,
    and on a rank of a TP/EP layout the collectives it issued (bytes each rank put in; seconds where measured)."""

    num_decode: int
    num_prefill_tokens: int
    decode_contexts: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    seconds: float
    graph: bool
    prefill_sizes: tuple[int, ...] = ()
    comm: tuple[tuple[str, int, int, float], ...] = ()  # (collective, calls, bytes, host seconds) this step
    # host seconds from the step's start to its one synchronisation (planning, launches, the eager chunk halves);
    # ``seconds - issue_seconds`` is what the host then waited for the device. Near ``seconds``: the host bounds the
    # step (the device idles between launches); well below: the device does
    issue_seconds: float | None = None


@dataclass(frozen=True)
class StepBatch:
    """What one step computes, the same on every rank (rank 0 plans it; see :mod:`k3rocm.runtime.serve`).

    Attributes:
        num_decode: the first ``num_decode`` sequences are decode rows (one token each), the rest prefill chunks.
        ids: ``[T]`` int64 token ids, packed in sequence order.
        rows: ``[N, 4]`` int64 per sequence: KDA slot id, tokens cached before this step, tokens in this step,
            1 when the step samples a token for it (its last row).
        block_rows: ``[N, max_blocks_per_seq]`` int32 MLA block table row of each sequence.
    """

    num_decode: int
    ids: torch.Tensor
    rows: torch.Tensor
    block_rows: torch.Tensor


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
        par: the parallel context of this rank (default one rank; a :class:`k3rocm.runtime.dist.TPGroup` for a
            rank of a TP/EP layout: ``weights`` are then the rank's slices, the caches hold its KDA heads, and
            every rank runs each step's :class:`StepBatch`, see :mod:`k3rocm.runtime.serve`).
        record_logits: keep the whole-vocabulary logits ``[N, V]`` fp32 (CPU) of each step's sampled rows in
            :attr:`last_logits` (gathered over the ranks' vocabulary slices; for validation — serving never
            gathers logits whole).
        autotune: time the kernels' configs during :meth:`warm_up` (tune mode ``"time"``, then ``"frozen"``
            while serving); default False (``K3ROCM_TUNE=1`` makes it True): every kernel takes its table's first
            fitting config (tune mode ``"first"``), so serving compiles one config per kernel specialisation and
            warm-up is mostly compile time (:mod:`k3rocm.kernels.tune`).
        kernel_layout: on a GPU with the Triton ``moe_experts``, move every MoE layer's MXFP4 experts into the
            grouped GEMM's tiled layout once here (``k3rocm.kernels.mx.layout``; each layer read back byte for byte
            against the checkpoint layout before that is released), layer by layer while the device has room
            (:meth:`k3rocm.model.weights.Weights.use_kernel_layout`). A ``Weights`` passed in whose experts already
            lie on the engine device is converted **in place** (its values do not change: a released expert tensor
            is read back from the tiled bytes by ``get`` and by the fp32 oracle), so the experts are held once.
            False: the GEMMs read the checkpoint layout (bit-identical results). :meth:`describe` says which.

    Raises:
        ConfigError / HardwareError: a bad override (e.g. ``triton`` without a GPU), or a ``matmul_dtype`` other
            than ``"auto"``, None, bf16 or fp16.
        PlanError: the cache does not hold one sequence.
    """

    def __init__(self, cfg: K3Config, weights: Any, kernels: str | dict | None = None, device: str | None = None,
                 max_batch: int = 8, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS, block_size: int = 16,
                 max_model_len: int = 2048, cache_budget_bytes: int | None = None, dtype: torch.dtype | None = None,
                 kv_dtype: torch.dtype | None = None, moe_mode: str = "a16w4", cuda_graphs: bool | None = None,
                 graph_batch_sizes: Iterable[int] = GRAPH_LADDER, num_blocks: int | None = None,
                 matmul_dtype: torch.dtype | str | None = AUTO, par: Parallel | None = None,
                 record_logits: bool = False, autotune: bool | None = None, kernel_layout: bool = True):
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
        self.ops["mla_decode"] = self._static_split_plan(self.ops["mla_decode"])
        # ---- tuning: serving never times a kernel (module docstring of k3rocm.kernels.tune)
        if autotune is None:
            autotune = tune_env() == "1"
        self.autotune = bool(autotune)
        self._tune_mode = "frozen" if self.autotune else "first"
        # ---- weights: this rank's, on the engine device in the engine dtype (the one Weights protocol); the MoE
        # experts in the grouped GEMM's tiled layout (converted where they lie when that is the engine device, so
        # the experts are held once; else after the move)
        src = as_weights(cfg, weights)
        self.layout_note = self._layout_plan(kernel_layout, cfg, on_gpu, cache_budget_bytes)
        if not self.layout_note and hasattr(src, "stack_experts"):
            src.stack_experts()  # (the cast would) — so the stacks are found where they lie and converted there
        stats: list[dict] = []
        if not self.layout_note and self._experts_on(src, self.device):
            stats.append(self._to_kernel_layout(src, cache_budget_bytes))
        self.weights = src.cast(self.device, self.dtype)
        if not self.layout_note:
            stats.append(self._to_kernel_layout(self.weights, cache_budget_bytes))
            self.layout_note = self._layout_summary(self.weights, stats)
        self.w = WeightView(self.weights, memo=True)
        self.dec = Decoder(cfg, self.w, self.ops, par=par, moe_mode=moe_mode)
        self.par = self.dec.par
        self.attn_res = self.dec.attn_res
        # ---- caches: sized from this rank's budget (its KDA heads), then the smallest over the ranks, since
        # rank 0's scheduler hands out slots and blocks that every rank must hold
        mcfg = self.dec.mixer_cfg
        if cache_budget_bytes is not None:
            sz = size_caches(mcfg, cache_budget_bytes, max_batch, block_size, self.kv_dtype)
            num_slots, num_blocks = sz.num_slots, num_blocks or max(1, sz.num_blocks)
        else:
            num_slots = max_batch
            num_blocks = num_blocks or max_batch * -(-max_model_len // block_size)
        num_slots, num_blocks = self.par.agree_min([num_slots, num_blocks])
        self.mla = MLACache(mcfg, num_blocks, block_size, self.kv_dtype, self.device)
        self.kda = KDAStatePool(mcfg, num_slots, self.device)
        self.scheduler = Scheduler(self.mla, self.kda, max_num_seqs=min(max_batch, num_slots),
                                   max_num_batched_tokens=max_num_batched_tokens)
        # block-table rows padded to 4 int32 (16 bytes): a row handed to a kernel on its own (a chunk continuing
        # a cached context) starts 16-byte aligned at every slot, so no kernel specialises on the slot's parity
        blocks = -(-max_model_len // block_size)
        self.max_blocks_per_seq = -(-blocks // 4) * 4
        # host block table by slot, kept across steps (see _block_rows): row owner = (seq id, block count)
        self._table = torch.zeros(num_slots, self.max_blocks_per_seq, dtype=torch.int32)
        self._table_owner: list[tuple[int, int] | None] = [None] * num_slots
        self._next_id = 0
        self.seqs: dict[int, Sequence] = {}
        self.channel: Any = None  # rank 0 of a layout: sends each StepBatch to the other ranks
        self.record_logits = bool(record_logits)
        self.last_comm: tuple = ()
        self._issued: float | None = None  # perf_counter when the step reached its synchronisation (StepStats)
        self.last_logits: torch.Tensor | None = None
        self.step_log: list[StepStats] = []
        self.profiler: Any = None  # a k3rocm.runtime.breakdown.StepProfiler while a profiled step runs (eager)
        # ---- graphs
        self.cuda_graphs = on_gpu if cuda_graphs is None else bool(cuda_graphs and on_gpu)
        self.graph_sizes = sorted(set(int(b) for b in graph_batch_sizes if 0 < int(b) <= max_batch)) or [max_batch]
        if self.graph_sizes[-1] < min(max_batch, num_slots):
            self.graph_sizes.append(min(max_batch, num_slots))
        self._graphs: dict[int, Any] = {}
        # steps carrying prefill chunks: piecewise graphs per token bucket (the token mixers run eager between)
        self.mixed_graphs = self.cuda_graphs
        self.mixed_sizes = tune.pow2_ladder(max(1, max_num_batched_tokens))
        self._mixed: dict[int, Any] = {}
        self._mixed_pool: Any = None
        self.mixed_error = ""
        self.graph_error = ""
        self.graph_note = "off (CPU)" if not on_gpu else ("on" if self.cuda_graphs else "off (disabled)")
        self.mixed_note = self.graph_note

    def _layout_plan(self, want: bool, cfg: K3Config, on_gpu: bool, budget: int | None) -> str:
        """Why the experts stay in the checkpoint layout ("" when they move to the tiled one)."""
        if not want:
            return "checkpoint layout (kernel_layout=False)"
        if not cfg.experts_quantized:
            return "bf16 experts (no MXFP4 layout)"
        if not on_gpu:
            return "checkpoint layout (CPU: the torch oracle reads it)"
        if self.op_impls.get("moe_experts") != "triton":
            return f"checkpoint layout (moe_experts={self.op_impls.get('moe_experts')})"
        return ""

    @staticmethod
    def _experts_on(w: Any, device: torch.device) -> bool:
        """Whether ``w`` holds expert stacks already on ``device`` (then converting it in place frees them)."""
        for ew in getattr(w, "_experts", {}).values():
            t = ew.w13_packed
            if t is not None and not t.is_meta:
                return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
        return False

    def _to_kernel_layout(self, w: Any, budget: int | None) -> dict:
        """Convert ``w``'s MoE experts to the tiled layout (checked read-back), while the device keeps room for
        the cache budget (or 1 GiB) beyond the repack's temporaries."""
        from k3rocm.kernels.moe.ops import kernel_layout  # the Triton family (imported only on this path)

        if not hasattr(w, "use_kernel_layout"):
            return {"layers": 0, "already": 0, "total": 0, "bytes": 0, "seconds": 0.0, "stopped": ""}
        dev = self.device
        reserve = (budget or 0) + (1 << 30)

        def room(nbytes: int) -> bool:
            free, _ = torch.cuda.mem_get_info(dev)
            free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)  # the allocator's own free
            return free - nbytes >= reserve

        # planar value bits and the mma element order (the backend's defaults) only for A16W4: A8W4 runs the scaled
        # kernel, which reads nibbles in the checkpoint's order
        keep = None if self.moe_mode == "a16w4" else 0
        return w.use_kernel_layout(lambda ew: kernel_layout(ew, check=True, bits=keep, order=keep), room=room)

    @staticmethod
    def _layout_summary(w: Any, stats: list[dict]) -> str:
        """One line for :meth:`describe`: how many of the held MoE layers the GEMMs read in the tiled layout (made
        here or by an earlier engine on the same weights), their bytes and repack seconds, and why any did not."""
        first, end = getattr(w, "expert_range", (0, 0))
        held = [ew for (i, a, b), ew in getattr(w, "_experts", {}).items() if (a, b) == (first, end) and ew.quantized]
        lays = [ew.kernel_layout for ew in held if ew.kernel_layout is not None]
        done, total = len(lays), len(held)
        stopped = next((s["stopped"] for s in stats if s["stopped"]), "")
        gb = sum(x.nbytes for x in lays) / 1e9
        sec = sum(x.repack_s for x in lays)
        if not total:
            return "checkpoint layout (no MXFP4 MoE layer held)"
        line = (f"tiled MXFP4 layout (kernels/mx/layout.py) for {done} of {total} MoE layers, {gb:.2f} GB, "
                f"repacked in {sec:.2f} s and read back byte for byte")
        return line + (f"; {stopped}" if stopped else "")

    def _static_split_plan(self, fn: Any) -> Any:
        """``fn`` (an ``mla_decode`` op) with a split plan fixed by the engine's limits where ``fn`` takes one
        (``num_splits`` / ``max_context_len``; the oracle's does not and is returned as is): one token per row
        (decode rows, eager or captured) -> ``min(8, max(1, max_model_len // 512))`` splits of a
        ``max_model_len`` context; several (a prefill chunk continuing a cached context) -> one split. Each
        sequence still reads only its own context (the kernel takes the lengths on the device), so a captured
        graph never sizes its work from live lengths (a host sync), and no split count derived from them reaches
        a kernel: the eager and the captured decode run the same shapes, and a kernel specialises only on the
        counts of rows and sequences (:func:`k3rocm.kernels.tune.spec_cover`). A caller's own plan wins."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "num_splits" not in params or "max_context_len" not in params:
            return fn
        rows_plan = {"num_splits": max(1, min(8, self.max_model_len // 512)), "max_context_len": self.max_model_len}
        chunk_plan = {"num_splits": 1, "max_context_len": self.max_model_len}

        @functools.wraps(fn)
        def mla_decode(q_nope, *args, **kw):
            for k, v in (rows_plan if q_nope.shape[1] == 1 else chunk_plan).items():
                kw.setdefault(k, v)
            return fn(q_nope, *args, **kw)
        return mla_decode

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
            "moe_weight_layout": self.layout_note,
            "matmul_dtype": None if self.matmul_dtype is None else str(self.matmul_dtype).replace("torch.", ""),
            "matmul": ("fp32 (weights widened per use)" if self.matmul_dtype is None else
                       f"{str(self.matmul_dtype).replace('torch.', '')} operands, fp32 accumulation, "
                       + ("fp32 output (torch.mm out_dtype)" if self.fp32_out else
                          f"{str(self.matmul_dtype).replace('torch.', '')} output widened to fp32")),
            "cuda_graphs": self.graph_note,
            "graph_batch_sizes": list(self._graphs) if self._graphs else [],
            "mixed_graphs": self.mixed_note,
            "mixed_graph_token_buckets": sorted(self._mixed),
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

    @contextlib.contextmanager
    def recording(self):
        """Within: every step keeps the whole-vocabulary logits of its sampled rows in :attr:`last_logits`
        (``[N, V]`` fp32, CPU), on every rank of a layout (the logits are gathered only here)."""
        prev = self.record_logits
        self._set_recording(True)
        try:
            yield self
        finally:
            self._set_recording(prev)

    def _set_recording(self, flag: bool) -> None:
        if self.channel is not None:
            self.channel.set_recording(flag)  # every rank's engine, this one included
        else:
            self.record_logits = bool(flag)

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

    # ------------------------------------------------------------------ forward
    def _mix(self, nd: int, dec: dict | None, pre: Batch | None):
        """The engine's batch form of the token mixers: the first ``nd`` rows are decode rows on the device-side
        path (``kda_decode`` on the slot pool; ``mla_cache_write`` + absorbed ``mla_decode`` on the paged cache;
        padding rows have slot −1 and context 0, so the step can be captured), the rest prefill chunks through the
        model's mixers on the paged view (``short_conv`` + ``kda_prefill`` from the slot's state; ``mla_prefill``
        for fresh sequences, per-chunk absorbed ``mla_decode`` when a chunk continues a cached context)."""
        cfg, mcfg, w, ops = self.cfg, self.dec.mixer_cfg, self.w, self.ops
        made: dict = {}  # the decode rows' cache slots, made in the first MLA layer for every MLA layer of the step

        def mix(i: int, x: torch.Tensor) -> torch.Tensor:
            parts = []
            if nd:
                xd = x[:nd]
                if cfg.layer_type(i) != "kda":
                    if "slots" not in made:
                        made["slots"] = mla_row_slots(dec["slot_ids"], dec["pos"], dec["block_rows"],
                                                      self.mla.kv_cache[i].shape[1])
                    parts.append(mla_decode_rows(xd, w, i, mcfg, ops, self.mla.kv_cache[i], dec["slot_ids"], dec["pos"],
                                                 dec["block_rows"], row_slots=made["slots"]))
                elif cfg.family == "k3":
                    parts.append(kda_decode_rows(xd, w, i, mcfg, ops, self.kda.conv[i], self.kda.state[i],
                                                 dec["slot_ids"]))
                else:  # kimi_linear has no fused decode: one-token chunks through the prefill path
                    parts.append(kda_mixer(xd, w, i, mcfg, ops, dec["batch"]))
            if pre is not None:
                fn = kda_mixer if cfg.layer_type(i) == "kda" else mla_mixer
                parts.append(fn(x[nd:], w, i, mcfg, ops, pre))
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)
        return mix

    def _forward(self, ids: torch.Tensor, nd: int, dec: dict | None, pre: Batch | None,
                 sample_rows: torch.Tensor, mix: Any = None) -> torch.Tensor:
        """Run all layers on flat ``ids [T]`` (first ``nd`` = decode rows) and return this rank's logits slice
        ``[len(sample_rows), V_local]`` fp32 of the sampled rows (the whole vocabulary on one rank); ``sample_rows``
        None: every row, ``[T, V_local]``.

        ``dec``: ``slot_ids [nd] int32``, ``pos [nd] int64`` (tokens cached before), ``block_rows [nd, nb]``.
        ``pre``: the prefill chunks' :class:`Batch` over the paged view, or None.
        ``mix``: the token mixer callable ``mix(i, x)`` (default :meth:`_mix` of the step; piecewise capture passes
        its own). Runs inside ``matmul_dtype(self.matmul_dtype)`` (eager steps, graph warm-up and capture alike).
        """
        with matmul_dtype(self.matmul_dtype):
            st = self.dec.embed(ids, None)
            self.dec.layers(st, mix or self._mix(nd, dec, pre))
            return self.dec.local_logits(self.dec.hidden_out(st, sample_rows))

    # ------------------------------------------------------------------ step
    def _block_rows(self, seq_ids: list[int]) -> torch.Tensor:
        """``[len(seq_ids), max_blocks_per_seq]`` int32: each sequence's MLA block table row (zero-padded).

        The rows live in one persistent host table indexed by KDA slot; a slot's row is rewritten only when its
        sequence or its block count changed since the last step (blocks are only appended while a sequence
        holds its slot), so a step's host work is O(sequences), not O(slots x blocks)."""
        out = []
        for sid in seq_ids:
            slot = self.kda.slot_of(sid)
            blocks = self.mla.block_tables.get(sid, [])
            if self._table_owner[slot] != (sid, len(blocks)):
                row = self._table[slot]
                row.zero_()
                if blocks:
                    row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
                self._table_owner[slot] = (sid, len(blocks))
            out.append(slot)
        return self._table[torch.tensor(out, dtype=torch.int64)]

    def plan_step(self) -> tuple[SchedulerOutput, "StepBatch | None"]:
        """Ask the scheduler for the next mixed batch and describe it for every rank (None when idle)."""
        plan: SchedulerOutput = self.scheduler.schedule()
        if plan.empty:
            return plan, None
        ids: list[int] = []
        rows = []
        for s in plan.scheduled:
            ids.extend(s.seq.tokens[s.start:s.start + s.num_tokens])
            slot = self.kda.slot_of(s.seq.seq_id)
            rows.append((slot, s.start, s.num_tokens, int(bool(s.sample))))
        nd = sum(1 for s in plan.scheduled if s.is_decode)
        return plan, StepBatch(nd, torch.tensor(ids, dtype=torch.int64), torch.tensor(rows, dtype=torch.int64),
                               self._block_rows([s.seq.seq_id for s in plan.scheduled]))

    def _paged_view(self, slots: torch.Tensor, block_rows: torch.Tensor) -> "_PagedCacheView":
        """The model mixers' view of the pools for a step's sequences: a block table indexed by slot id holding
        ``block_rows`` (on the device) at ``slots``; the other rows are unused by the step."""
        table = torch.zeros(self.kda.num_slots, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
        table[self._to_dev(slots)] = block_rows  # pinned, non-blocking: no host wait at the step's start
        return _PagedCacheView(self.mla, self.kda, table)

    def _to_dev(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the engine device; on a GPU through pinned host memory with a non-blocking copy (the host
        goes on preparing the step while the copy is queued)."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def execute(self, sb: "StepBatch") -> tuple[list[int], bool]:
        """Run one described step on this rank's shard (every rank of a layout runs the same step): returns the
        greedy tokens of the sampled rows (same on every rank) and whether a captured graph ran.

        Sampling runs on the device (:meth:`Parallel.greedy`: argmax, lowest id on ties; on a TP rank one
        small all-gather of each rank's (max, id)), inside the graph where one ran; the host reads back only
        the sampled token ids (the step's one synchronisation)."""
        with tune.mode(self._tune_mode):
            return self._execute(sb)

    def _execute(self, sb: "StepBatch") -> tuple[list[int], bool]:
        dev = self.device
        nd, rows = sb.num_decode, sb.rows.tolist()
        for slot, start, _, _ in rows[nd:]:
            if start == 0:  # a fresh sequence's slot starts from zero state on every rank
                for i in self.kda.layers:
                    self.kda.state[i][slot].zero_()
                    self.kda.conv[i][slot].zero_()
        sample_rows, off = [], 0
        for _, _, n, sample in rows:
            off += n
            if sample:
                sample_rows.append(off - 1)
        stats = self.par.stats
        before = stats.snapshot() if stats is not None else None
        ids = self._to_dev(sb.ids)
        block_rows = self._to_dev(sb.block_rows)
        dec = pre = None
        if nd:
            slots = sb.rows[:nd, 0]
            dec = {"slot_ids": self._to_dev(slots.to(torch.int32)), "pos": self._to_dev(sb.rows[:nd, 1]),
                   "block_rows": block_rows[:nd]}
            if self.cfg.family != "k3":
                dec["batch"] = Batch(torch.arange(nd + 1, dtype=torch.int32, device=dev),
                                     self._paged_view(slots, block_rows[:nd]), slots, sb.rows[:nd, 1].clone())
        if len(rows) > nd:
            p = sb.rows[nd:]
            cu = torch.zeros(p.shape[0] + 1, dtype=torch.int32)
            cu[1:] = p[:, 2].cumsum(0)
            pre = Batch(self._to_dev(cu), self._paged_view(p[:, 0], block_rows[nd:]), p[:, 0].clone(),
                        p[:, 1].clone(), cu_host=cu.tolist())
        out = None
        if self.cuda_graphs and self.profiler is None:
            if nd and pre is None:
                out = self._graph_decode(ids, dec)
            elif self.mixed_graphs and self.cfg.family == "k3":
                out = self._graph_mixed(ids, nd, dec, pre, sample_rows)
        used_graph = out is not None
        if out is None:
            # a decode-only step samples every row: no row selection (the final AttnRes then reads the bank rows in
            # place instead of gathering each of them)
            every = pre is None and sample_rows == list(range(nd))
            logits = self._forward(ids, nd, dec, pre,
                                   None if every else self._to_dev(torch.tensor(sample_rows, dtype=torch.int64)))
            tokens = self.par.greedy(logits) if sample_rows else None
        else:
            tokens, logits = out
        if self.profiler is not None:
            self.profiler.sync()
        self._issued = time.perf_counter()
        toks = tokens.tolist() if tokens is not None else []  # the step's one host synchronisation
        if self.record_logits:
            self.last_logits = self.par.gather_vocab(logits).float().cpu()
        if stats is not None:
            self.last_comm = tuple((k, int(v["calls"]), int(v["bytes"]), float(v["seconds"]))
                                   for k, v in stats.delta(stats.snapshot(), before).items())
        return toks, used_graph

    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Plan and run one step; returns the tokens sampled in it (greedy). On rank 0 of a layout the step's
        description is first sent to the other ranks (``self.channel``, see :mod:`k3rocm.runtime.serve`)."""
        t0 = time.perf_counter()
        self._issued = None
        plan, sb = self.plan_step()
        if sb is None:
            return []
        if self.channel is None:
            toks, used_graph = self.execute(sb)
        else:  # rank 0 of a layout: every rank runs the step; a rank's failure becomes one WorkerFailed line
            with self.channel.guard():
                self.channel.send_step(sb)
                toks, used_graph = self.execute(sb)
        now = time.perf_counter()
        sched = plan.scheduled
        decs = [s for s in sched if s.is_decode]
        pres = [s for s in sched if not s.is_decode]
        sample_seqs = [s.seq for s in sched if s.sample]
        sampled = {s.seq_id: int(t) for s, t in zip(sample_seqs, toks)}
        done = {s.seq_id for s in self.scheduler.update(plan, sampled)}
        self.step_log.append(StepStats(len(decs), sum(s.num_tokens for s in pres),
                                       tuple(s.start + 1 for s in decs),
                                       tuple(s.start + s.num_tokens for s in pres), now - t0, used_graph,
                                       tuple(s.num_tokens for s in pres), self.last_comm,
                                       None if self._issued is None else self._issued - t0))
        return [TokenEvent(s.seq_id, sampled[s.seq_id], s.seq_id in done, s.finish_reason, now) for s in sample_seqs]

    # ------------------------------------------------------------------ warm-up
    def prefill_buckets(self) -> list[int]:
        """The :func:`~k3rocm.kernels.tune.pow2` buckets of a step's prefill tokens: the powers of two up to the
        step's token budget (and below ``max_model_len``), the buckets kernels key their shapes on."""
        top = max(1, min(self.scheduler.max_num_batched_tokens, self.max_model_len - 2))
        return [b for b in tune.pow2_ladder(top) if b <= top]

    def warm_up_plan(self) -> dict[str, list[int]]:
        """The counts :meth:`warm_up` runs, enumerated from the engine's limits with
        :func:`k3rocm.kernels.tune.spec_cover` (every specialisation and every pow2 bucket of the counts a step
        can carry, ``O(log)`` of each limit):

        * ``prefill_lengths``: one fresh prompt chunk of each length of the cover of the step budget (tokens of a
          step's chunks; the longest chunk sizes ``mla_prefill``'s blocks);
        * ``continued_lengths``: a chunk of each length >= 2 of that cover continuing a cached context of one
          full first chunk (``mla_decode`` on a chunk's queries), where prompt and output fit ``max_model_len``
          (one query meets the decode rows' shapes, below);
        * ``decode_rows``: a step of each decode-row count of the cover of ``min(max_num_seqs, budget) - 1``
          beside a one-token prefill chunk (the eager decode mixers of a mixed step).
        """
        budget = self.scheduler.max_num_batched_tokens
        first = min(budget, self.scheduler.long_prefill_threshold)
        lengths = tune.spec_cover(max(1, min(budget, self.max_model_len - 2)))
        most = min(self.scheduler.max_num_seqs, budget) - 1  # decode rows a step can carry beside a chunk
        rows = tune.spec_cover(most) if most >= 1 else []
        return {"prefill_lengths": lengths,
                "continued_lengths": [q for q in lengths
                                      if 2 <= q <= first and first + q + 1 <= self.max_model_len],
                "decode_rows": rows}

    @torch.no_grad()
    def warm_up(self, force: bool = False) -> dict:
        """Compile, tune and capture everything serving can meet, before anything is measured.

        1. Every decode graph of the ladder and every piecewise graph of a mixed-step token bucket (captured
           now, not on first use): every row-wise op of a step then runs at a bucket size only.
        2. The steps of :meth:`warm_up_plan`: the eager token mixers of steps carrying prefill chunks meet every
           specialisation of their token, chunk and decode-row counts (``mla_decode``'s split plan is fixed by
           the engine's limits, :meth:`_static_split_plan`, so no context length reaches a kernel).

        Kernels take their tables' first fitting configs (tune mode ``"first"``), or with ``autotune`` are timed
        here (``"time"``) and frozen for serving. The engine must be idle; the warm-up requests run to completion
        or are aborted (caches left free). On a rank of a TP/EP layout the graphs are captured on first use
        (every rank at the same step), which the warm-up steps reach: a decode-only step at each decode-row
        count of the plan (every ladder size up to ``pow2(max_num_seqs - 1)``) and a chunk of every token bucket.
        On the CPU nothing compiles, so this is a no-op unless ``force``.

        Returns:
            ``{"graphs": [decode batch sizes], "mixed_graphs": [token buckets], "prefill_buckets": [pow2],
            **warm_up_plan(), "seconds": wall s, "compiles": n, "autotune_runs": n, "tune_mode": mode}``
            (compiles as :class:`~k3rocm.kernels.compile_watch.CompileWatch` counts them; 0 on the CPU).
        """
        if self.device.type != "cuda" and not force:
            return {"graphs": [], "mixed_graphs": [], "prefill_buckets": []}
        t0 = time.perf_counter()
        serve_mode = self._tune_mode
        self._tune_mode = "time" if self.autotune else "first"
        try:
            with CompileWatch() as watch, tune.mode(self._tune_mode):
                plan = self._warm_up(self.warm_up_plan())
        finally:
            self._tune_mode = serve_mode
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        c = watch.summary()
        return {"graphs": sorted(self._graphs), "mixed_graphs": sorted(self._mixed),
                "prefill_buckets": self.prefill_buckets(), **plan, "seconds": round(time.perf_counter() - t0, 3),
                "compiles": c["compiles"] if c["available"] else None, "autotune_runs": c["autotune_runs"],
                "tune_mode": "time, then frozen" if self.autotune else "first"}

    def _warm_up(self, plan: dict[str, list[int]]) -> dict[str, list[int]]:
        alone = self.par.world == 1
        if self.cuda_graphs and alone:
            for size in self.graph_sizes:
                if size not in self._graphs and self._capture(size) is None:
                    break  # capture failed: the engine stays eager and says why
        if self.cuda_graphs and self.mixed_graphs and self.cfg.family == "k3" and alone:
            for size in reversed(self.mixed_sizes):  # largest first: the smaller fit in its pool
                if size not in self._mixed and self._capture_mixed(size) is None:
                    break  # mixed steps stay eager and say why
        vocab = max(1, self.cfg.vocab_size - 3)

        def prompt(n: int, salt: int = 0) -> list[int]:
            return [3 + (5 * j + salt) % vocab for j in range(n)]

        # a fresh chunk of n tokens, then one decode row; longest first, so that a rank of a layout (capturing on
        # first use) captures the mixed-step graphs largest first into their shared pool
        for n in reversed(plan["prefill_lengths"]):
            self.generate([prompt(n)], 2)
        first = min(self.scheduler.max_num_batched_tokens, self.scheduler.long_prefill_threshold)
        for q in plan["continued_lengths"]:  # a first chunk, then q tokens continuing its context
            self.generate([prompt(first + q, 1)], 1)
        pool: list[int] = []
        for nd in plan["decode_rows"]:  # nd decode rows beside a one-token chunk
            while len(pool) < nd:
                pool.append(self.add_request(prompt(1, len(pool)), self.max_model_len - 1, ignore_eos=True))
            while any(self.where(r)["status"] in ("waiting", "prefill") for r in pool):
                self.step()
            self.step()  # nd decode rows alone: on a rank of a layout this captures the decode graph of pow2(nd)
            self.add_request(prompt(1, nd), 1, ignore_eos=True)
            self.step()
        for r in pool:
            self.abort(r)
        while self.has_unfinished():
            self.step()
        return plan

    # ------------------------------------------------------------------ CUDA/HIP graphs
    @staticmethod
    def _bucket_graph(sizes: list[int], graphs: dict[int, Any], capture: Any, n: int) -> dict | None:
        """The graph of the smallest bucket of ``sizes`` holding ``n`` rows, captured by ``capture(size)`` on
        first use; None when no bucket holds ``n`` or the capture failed."""
        size = next((b for b in sizes if b >= n), None)
        if size is None:
            return None
        g = graphs.get(size)
        return g if g is not None else capture(size)

    def _graph_decode(self, ids: torch.Tensor, dec: dict) -> torch.Tensor | None:
        """Replay (capturing on first use) the decode graph of the smallest ladder size >= N; padding rows get
        token 0 (a valid id: finite activations, in-range expert ids), slot −1 and context 0. Returns the greedy
        ids ``[N]`` int64 and the logits ``[N, V_local]`` (views of the graph's output buffers, valid until the
        next replay: never cloned), or None when graphs are unavailable (then the engine stays eager and says
        why)."""
        n = ids.numel()
        g = self._bucket_graph(self.graph_sizes, self._graphs, self._capture, n)
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
        if self.par.stats is not None:
            for name, v in g["comm"].items():
                self.par.stats.add(name, v["bytes"], 0.0, calls=v["calls"])
        return g["tokens"][:n], g["logits"][:n]

    def _capture(self, size: int) -> dict | None:
        dev = self.device
        st = {"ids": torch.zeros(size, dtype=torch.int64, device=dev),
              "slot_ids": torch.full((size,), -1, dtype=torch.int32, device=dev),
              "pos": torch.zeros(size, dtype=torch.int64, device=dev),
              "block_rows": torch.zeros(size, self.max_blocks_per_seq, dtype=torch.int32, device=dev)}
        # every tensor the graph reads but did not allocate during capture must live as long as the graph: a
        # buffer freed after capture goes back to the caching allocator, and replays read whatever reuses it
        # (the step samples every row: no sampled-row indices, the final AttnRes reads the bank rows in place)
        try:
            s = torch.cuda.Stream(device=dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):  # warm-up on padding only (writes nothing)
                self._forward(st["ids"], size, st, None, None)
            torch.cuda.current_stream(dev).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            stats = self.par.stats
            before = stats.snapshot() if stats is not None else {}
            with torch.cuda.graph(graph):
                st["logits"] = self._forward(st["ids"], size, st, None, None)
                st["tokens"] = self.par.greedy(st["logits"])  # sampling on the device, inside the graph
            # the collectives captured into the graph: what every replay issues
            st["comm"] = stats.delta(stats.snapshot(), before) if stats is not None else {}
        except Exception as e:  # an op synchronises with the host: stay eager and say so
            import traceback
            self.graph_error = traceback.format_exc(limit=-6)
            self.cuda_graphs = False
            self.graph_note = f"off (capture failed at batch {size}: {type(e).__name__}: {str(e).splitlines()[0][:160]})"
            return None
        st["graph"] = graph
        self._graphs[size] = st
        self.graph_note = "on"
        return st

    # ------------------------------------------------------------------ piecewise graphs of mixed steps
    def _padded_meta(self, dec: dict | None, nd: int, size: int, into: dict | None = None) -> dict:
        """The decode-row tensors of a ``size``-row padded step: ``slot_ids [size]`` int32 (the ``nd`` decode rows'
        slots, −1 after them), ``pos [size]`` int64 and ``block_rows [size, max_blocks_per_seq]`` int32 (zeros
        after the decode rows). ``into``: a graph's static buffers, filled in place (else new tensors)."""
        dev = self.device
        m = into if into is not None else {
            "slot_ids": torch.empty(size, dtype=torch.int32, device=dev),
            "pos": torch.empty(size, dtype=torch.int64, device=dev),
            "block_rows": torch.empty(size, self.max_blocks_per_seq, dtype=torch.int32, device=dev)}
        m["slot_ids"].fill_(-1)
        m["pos"].zero_()
        m["block_rows"].zero_()
        if nd:
            m["slot_ids"][:nd] = dec["slot_ids"]
            m["pos"][:nd] = dec["pos"]
            m["block_rows"][:nd] = dec["block_rows"]
        return m

    def _mixer_rows(self, i: int, x: torch.Tensor, meta: dict) -> tuple[tuple, torch.Tensor]:
        """The row-wise half of layer ``i``'s token mixer on every row of a padded step, with the decode rows'
        cache work: the projections (:func:`~k3rocm.model.layer._kda_inputs` / ``mla_project``) of all rows, then
        the decode op on all rows (``kda_decode``; ``mla_cache_write`` + absorbed ``mla_decode``) with ``meta``'s
        slots — rows after the decode rows have slot −1 and come out zero. Returns ``(inputs, o)``: the
        projections, for :meth:`_mixer_chunks`, and the ``o_proj`` / gate input ``o [rows, heads * head_dim]``,
        whose chunk rows :meth:`_mixer_chunks` overwrites. Every shape is the step's row count: capturable."""
        cfg, mcfg, w, ops = self.cfg, self.dec.mixer_cfg, self.w, self.ops
        if cfg.layer_type(i) == "kda":
            a = _kda_inputs(x, w, i, mcfg)
            return a, kda_decode_core(a, mcfg, ops, self.kda.conv[i], self.kda.state[i], meta["slot_ids"])
        q, latent, k_rope = mla_project(x, w, i, mcfg)
        o = mla_decode_core(q, latent, k_rope, w, i, mcfg, ops, self.mla.kv_cache[i], meta["slot_ids"], meta["pos"],
                            meta["block_rows"], row_slots=meta.get("row_slots"))
        return (q, latent, k_rope), o

    def _mixer_chunks(self, i: int, inputs: Any, nd: int, t: int, pre: Batch) -> torch.Tensor:
        """The sequence-dependent half of layer ``i``'s token mixer on the prefill chunks (rows ``nd:t`` of
        :meth:`_mixer_rows`' projections): ``kda_prefill_core`` (conv, ``kda_prefill``, norm and gate) or
        ``mla_prefill_core`` (cache write, ``mla_prefill`` / per-chunk ``mla_decode``). Returns ``[t - nd, ...]``,
        the chunk rows of ``o``."""
        mcfg, w, ops = self.dec.mixer_cfg, self.w, self.ops
        if self.cfg.layer_type(i) == "kda":
            return kda_prefill_core(kda_input_rows(inputs, nd, t), w, i, mcfg, ops, pre)
        q, latent, k_rope = inputs
        return mla_prefill_core(q[nd:t], latent[nd:t], k_rope[nd:t], w, i, mcfg, ops, pre)

    def _fill_chunks(self, i: int, inputs: Any, o: torch.Tensor, nd: int, t: int, pre: Batch) -> None:
        """Write the chunk rows ``nd:t`` of layer ``i``'s ``o`` with :meth:`_mixer_chunks` (eager, between pieces)."""
        o[nd:t].copy_(self._mixer_chunks(i, inputs, nd, t, pre).reshape(t - nd, -1))

    def _mixer_out(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The row-wise output of layer ``i``'s token mixer: ``o_proj`` (KDA) or gate and ``o_proj`` (MLA)."""
        if self.cfg.layer_type(i) == "kda":
            return kda_output(o, self.w, i)
        return mla_output(o, x, self.w, i, self.dec.mixer_cfg)

    def _padded_mix(self, nd: int, dec: dict | None, pre: Batch | None, t: int, meta: dict | None = None,
                    cut: Any = None):
        """The token mixer of a step padded to a bucket of rows (``x [T_bucket, hidden]``, the first ``t`` real:
        ``nd`` decode rows, then the prefill chunks ``pre``), as its piecewise graph runs it: per layer
        :meth:`_mixer_rows` on every row (projections, and the decode rows' cache work with slot −1 after them),
        then the chunk rows of ``o`` replaced by :meth:`_mixer_chunks`, then :meth:`_mixer_out` on every row. Only
        the chunk half depends on the chunks' layout; every other op is row-wise or skips slot −1, so padding rows
        never reach a real row. ``meta``: the decode-row tensors (default :meth:`_padded_meta` of ``dec``).
        ``cut(i, inputs, o)``: called between the two halves instead of running the chunk half (graph capture:
        the piece ends there and each replay runs the chunk half eagerly)."""
        made: dict = {}  # the decode-row tensors of each row count, made once for every layer

        def mix(i: int, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            m = made.get(n)
            if m is None:
                m = made[n] = dict(meta if meta is not None else self._padded_meta(dec, nd, n))
            if self.cfg.layer_type(i) != "kda" and "row_slots" not in m:
                # the rows' MLA cache slots: the same in every MLA layer, made once per forward from the (static)
                # decode-row tensors, so a captured piece recomputes them at each replay
                m["row_slots"] = mla_row_slots(m["slot_ids"], m["pos"], m["block_rows"], self.mla.kv_cache[i].shape[1])
            inputs, o = self._mixer_rows(i, x, m)
            if cut is not None:
                cut(i, inputs, o)
            elif pre is not None:
                self._fill_chunks(i, inputs, o, nd, t, pre)
            return self._mixer_out(i, x, o)
        return mix

    def _graph_mixed(self, ids: torch.Tensor, nd: int, dec: dict | None, pre: Batch | None,
                     sample_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run a step carrying prefill chunks through the piecewise graphs of its token bucket (the smallest of
        :attr:`mixed_sizes` >= its tokens; captured on first use), as :meth:`_padded_mix` describes: graph piece
        ``k`` runs everything from the chunk half of layer ``k - 1``'s token mixer to the chunk half of layer
        ``k``'s (embedding first; final AttnRes, norm, lm_head and greedy sampling last) on the padded tokens —
        the projections of every row, the decode rows' ``kda_decode`` / ``mla_decode`` and the output projections
        included; only the chunk halves (``kda_prefill``, ``mla_prefill``, their conv and cache work) run eager
        between the pieces, writing the chunk rows of the static buffer the next piece reads. Returns
        ``(tokens [N], logits [N, V_local])`` (views into the graph's buffers) or None (no bucket fits, or capture
        failed: then mixed steps stay eager and :meth:`describe` says why)."""
        t, n = ids.numel(), len(sample_rows)
        g = None if n > self._mixed_rows() else self._bucket_graph(self.mixed_sizes, self._mixed,
                                                                    self._capture_mixed, t)
        if g is None:
            return None
        g["ids"].zero_()
        g["ids"][:t] = ids
        g["rows"].zero_()
        g["rows"][:n] = self._to_dev(torch.tensor(sample_rows, dtype=torch.int64))
        self._padded_meta(dec, nd, g["ids"].numel(), into=g["meta"])
        with matmul_dtype(self.matmul_dtype):
            for k, piece in enumerate(g["pieces"]):
                piece.replay()
                if k < len(g["mixers"]) and pre is not None:
                    self._fill_chunks(*g["mixers"][k], nd, t, pre)
        if self.par.stats is not None:
            for name, v in g["comm"].items():
                self.par.stats.add(name, v["bytes"], 0.0, calls=v["calls"])
        return g["tokens"][:n], g["logits"][:n]

    def _mixed_rows(self) -> int:
        """Sampled rows a mixed graph holds: one per sequence a step can carry."""
        return self.scheduler.max_num_seqs

    def _capture_mixed(self, size: int) -> dict | None:
        """Capture the pieces of the mixed-step graph of ``size`` tokens (see :meth:`_graph_mixed`): a warm-up
        pass on padding first (compiles and tunes outside capture), then one capture per piece into one memory
        pool, the mixers' static output buffers allocated between the pieces."""
        dev = self.device
        st = {"ids": torch.zeros(size, dtype=torch.int64, device=dev),
              "rows": torch.zeros(self._mixed_rows(), dtype=torch.int64, device=dev)}
        st["meta"] = self._padded_meta(None, 0, size)  # the decode rows' slots etc., refilled before each replay
        pieces: list = []
        mixers: list = []
        # one memory pool for every bucket (graphs replay one at a time and read their outputs before the next
        # replay, so a later capture may reuse an earlier one's temporaries): memory of the largest, not the sum
        if self._mixed_pool is None:
            self._mixed_pool = torch.cuda.graph_pool_handle()
        pool = self._mixed_pool
        stats = self.par.stats
        s = torch.cuda.Stream(device=dev)
        cur: list = []

        def cut(i: int, inputs: Any, o: torch.Tensor) -> None:
            """End the piece after the mixer's row-wise half and start the next; the chunk half writes ``o``'s
            chunk rows eagerly at each replay (``inputs`` and ``o`` stay alive with the graph)."""
            cur[0].capture_end()
            pieces.append(cur[0])
            mixers.append((i, inputs, o))
            cur[0] = torch.cuda.CUDAGraph()
            cur[0].capture_begin(pool=pool)

        try:
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                # warm-up on padding only (every row slot -1, no chunks: writes nothing), so the row-wise ops and
                # the decode ops compile and tune at this size outside capture
                self._forward(st["ids"], 0, None, None, st["rows"],
                              mix=self._padded_mix(0, None, None, 0, meta=st["meta"]))
                torch.cuda.synchronize(dev)
                before = stats.snapshot() if stats is not None else {}
                with matmul_dtype(self.matmul_dtype):
                    cur.append(torch.cuda.CUDAGraph())
                    cur[0].capture_begin(pool=pool)
                    try:
                        logits = self._forward(st["ids"], 0, None, None, st["rows"],
                                               mix=self._padded_mix(0, None, None, 0, meta=st["meta"], cut=cut))
                        st["tokens"] = self.par.greedy(logits)
                    finally:
                        cur[0].capture_end()
                    pieces.append(cur[0])
                st["logits"] = logits
                st["comm"] = stats.delta(stats.snapshot(), before) if stats is not None else {}
            torch.cuda.current_stream(dev).wait_stream(s)
        except Exception as e:  # an op synchronises with the host: mixed steps stay eager and say so
            import traceback
            self.mixed_error = traceback.format_exc(limit=-6)
            self.mixed_graphs = False
            self.mixed_note = (f"off (capture failed at {size} tokens: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160]})")
            return None
        st["pieces"], st["mixers"] = pieces, mixers
        self._mixed[size] = st
        self.mixed_note = "on"
        return st
