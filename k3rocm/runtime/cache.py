"""Decode caches: a paged MLA latent cache and a KDA state-slot pool, sized from a memory budget.

* **MLA** (K3_FACTS §5, §7): per MLA layer and cached token, ``kv_lora_rank + qk_rope_head_dim`` values
  (512 normed latent + 64 k_rope = 576 for K3). Stored paged: ``kv_cache [num_blocks, block_size, R+Dr]``
  per layer; a sequence owns a list of blocks (its block table); token ``t`` of a sequence lives in slot
  ``block_table[t // block_size] * block_size + t % block_size`` (the ``slot_mapping`` of the
  ``mla_cache_write`` op). Storage dtype bf16 / fp32, or fp8 E4M3 with one static fp32 scale per layer
  (``stored = value / kv_scale``), as vLLM's fp8 KV cache.
* **KDA** (K3_FACTS §5): per KDA layer and sequence, the recurrent state ``[H, K, V]`` fp32 and the
  short-conv state of q, k, v ``[3, C, W-1]`` fp32 (``C = H*K``, ``W = short_conv_kernel_size``), independent
  of length. Kept in pools ``state [S, H, K, V]`` and ``conv [S, 3, C, W-1]`` indexed by a slot id; a slot
  is zeroed when it is handed out, so a reused slot never carries a previous sequence's state.

The block free list is FIFO (freed blocks are reused last), so allocation order is deterministic. Bytes
per token and per sequence come from :mod:`k3rocm.runtime.sizing`; :func:`size_caches` splits a budget with them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from k3rocm.config import K3Config
from k3rocm.errors import PlanError
from k3rocm.numerics import FP8_MAX
from k3rocm.runtime.sizing import kda_state_bytes_per_seq, kv_dtype_bytes, mla_cache_bytes_per_token


class CacheExhausted(PlanError):
    """No free MLA block or KDA slot is left for a request (the scheduler preempts or waits on it)."""


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mla_bytes_per_block(cfg: K3Config, block_size: int, dtype: torch.dtype = torch.bfloat16,
                        num_layers: int | None = None) -> int:
    """Bytes of one cache block over all MLA layers: ``block_size`` tokens of
    :func:`k3rocm.runtime.sizing.mla_cache_bytes_per_token` at the element size of ``dtype``."""
    return block_size * mla_cache_bytes_per_token(cfg, _elem_bytes(dtype), num_layers)


@dataclass(frozen=True)
class CacheSizing:
    """How a cache budget splits: ``num_slots`` KDA slots and ``num_blocks`` MLA blocks of ``block_size``."""

    num_slots: int
    num_blocks: int
    block_size: int
    slot_bytes: int
    block_bytes: int
    budget_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.num_slots * self.slot_bytes + self.num_blocks * self.block_bytes

    @property
    def max_cached_tokens(self) -> int:
        return self.num_blocks * self.block_size


def size_caches(cfg: K3Config, budget_bytes: int, max_seqs: int, block_size: int = 16,
                kv_dtype: torch.dtype = torch.bfloat16, num_heads: int | None = None) -> CacheSizing:
    """Split a cache budget (bytes; the plan's cache capacity per device) between KDA slots and MLA blocks.

    Slots: as many as ``max_seqs`` allows while each slot also keeps at least one block,
    ``min(max_seqs, budget // (slot_bytes + block_bytes))``; blocks take the rest. A slot is one sequence's KDA
    state (:func:`k3rocm.runtime.sizing.kda_state_bytes_per_seq` of ``num_heads`` heads, default all).

    Raises:
        PlanError: the budget does not hold one slot plus one block.
    """
    return _split_budget(cfg, budget_bytes, max_seqs, block_size, _elem_bytes(kv_dtype), num_heads)


def _split_budget(cfg: K3Config, budget_bytes: int, max_seqs: int, block_size: int, kv_bytes: int,
                  num_heads: int | None) -> CacheSizing:
    """:func:`size_caches` with the cache dtype given by its bytes per value."""
    sb = kda_state_bytes_per_seq(cfg, num_heads)
    bb = block_size * mla_cache_bytes_per_token(cfg, kv_bytes)
    if max_seqs < 1 or block_size < 1:
        raise PlanError(f"max_seqs {max_seqs} and block_size {block_size} must be >= 1")
    slots = min(max_seqs, budget_bytes // max(1, sb + bb))
    if slots < 1:
        raise PlanError(f"cache budget {budget_bytes} B holds no sequence (one KDA slot {sb} B + one MLA block "
                        f"{bb} B); lower the weight share, add devices or shorten max context")
    blocks = (budget_bytes - slots * sb) // bb if bb else 0
    return CacheSizing(int(slots), int(blocks), block_size, sb, bb, int(budget_bytes))


class MLACache:
    """Paged latent cache of every MLA layer plus the block manager.

    Args:
        cfg: model config (``kv_lora_rank`` R, ``qk_rope_head_dim`` Dr, MLA layer indices).
        num_blocks: blocks per layer (>= 1).
        block_size: tokens per block.
        dtype: ``torch.bfloat16``, ``torch.float16``, ``torch.float32``, or ``torch.float8_e4m3fn`` /
            ``torch.float8_e4m3fnuz`` (then ``kv_scale`` applies).
        device: where the cache tensors live.
        kv_scale: fp8 only: stored = value / kv_scale (static, per layer; same value for all layers).
        layers: 0-based MLA layer indices to hold (default: all MLA layers of ``cfg``).

    Attributes:
        kv_cache: ``{layer: [num_blocks, block_size, R+Dr]}``.
        block_tables: ``{seq_id: [block ids]}``.
    """

    def __init__(self, cfg: K3Config, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", kv_scale: float = 1.0, layers: list[int] | None = None):
        if num_blocks < 1 or block_size < 1:
            raise PlanError(f"MLA cache needs num_blocks >= 1 and block_size >= 1 (got {num_blocks}, {block_size})")
        # FP8: e4m3fn on gfx950 / CUDA, e4m3fnuz on gfx942 (k3rocm.model.mla.fp8_cache_dtype picks by arch)
        if dtype not in (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise PlanError(f"MLA cache dtype {dtype} is not supported; use bfloat16, float32, float8_e4m3fn "
                            "(gfx950/CUDA) or float8_e4m3fnuz (gfx942)")
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.width = cfg.mla_cache_width
        self.layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == "mla"] if layers is None \
            else list(layers)
        self.kv_scale = {i: float(kv_scale) for i in self.layers}
        self.kv_cache = {i: torch.zeros(num_blocks, block_size, self.width, dtype=dtype, device=self.device)
                         for i in self.layers}
        self._free: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ block manager
    @property
    def is_fp8(self) -> bool:
        """An FP8 cache (e4m3fn or e4m3fnuz): stored scaled by ``kv_scale`` and saturated to the format."""
        return self.dtype in FP8_MAX

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """More blocks ``seq_id`` needs so that its first ``num_tokens`` tokens have slots (0 if none)."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s block table to hold ``num_tokens`` tokens; returns the new block ids.

        Raises:
            CacheExhausted: not enough free blocks (nothing is allocated then).
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise CacheExhausted(f"MLA cache: sequence {seq_id} needs {need} more blocks, {len(self._free)} free; "
                                 "raise the cache budget or lower concurrency")
        new = [self._free.popleft() for _ in range(need)]
        self.block_tables.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: int) -> int:
        """Return ``seq_id``'s blocks to the free list (no-op when it has none); returns how many."""
        blocks = self.block_tables.pop(seq_id, [])
        self._free.extend(blocks)
        return len(blocks)

    def slot_mapping(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slots (int64, ``block * block_size + offset``) of tokens ``start .. end-1`` of ``seq_id``.

        Raises:
            CacheExhausted: a token beyond the allocated blocks.
        """
        table = self.block_tables.get(seq_id, [])
        if end > len(table) * self.block_size:
            raise CacheExhausted(f"MLA cache: sequence {seq_id} token {end - 1} has no block (allocated "
                                 f"{len(table)} blocks); allocate before writing")
        t = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.int64)[t // self.block_size] if end > start else t
        return (blocks * self.block_size + t % self.block_size).to(torch.int64)

    def block_table(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """``[N, width]`` int32 block table (rows padded with block 0, which ``context_lens`` never reaches)."""
        rows = [self.block_tables.get(s, []) for s in seq_ids]
        width = max([len(r) for r in rows] + [1]) if width is None else width
        out = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.device)

    # ------------------------------------------------------------------ data
    def write(self, layer: int, slot_mapping: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Store tokens' ``latent [T, R]`` and ``k_rope [T, Dr]`` at ``slot_mapping [T]`` (−1 = skip), in place.

        fp8 caches store ``clamp(value / kv_scale, ±max)`` as E4M3, ``max`` the format's largest finite value
        (:data:`k3rocm.numerics.FP8_MAX`: 448 for e4m3fn, 240 for e4m3fnuz).
        """
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(self.device)
        vals = torch.cat([latent.float(), k_rope.float()], dim=-1)[keep.to(latent.device)].to(self.device)
        if self.is_fp8:
            lim = FP8_MAX[self.dtype]
            vals = (vals / self.kv_scale[layer]).clamp(-lim, lim)
        flat = self.kv_cache[layer].view(-1, self.width)
        flat[slots] = vals.to(self.dtype)

    def read(self, layer: int) -> torch.Tensor:
        """The layer's cache for the decode op: the tensor itself, or for fp8 a dequantized fp32 copy."""
        kv = self.kv_cache[layer]
        if self.is_fp8:
            return kv.float() * self.kv_scale[layer]
        return kv

    def gather(self, layer: int, seq_id: int, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` cached rows of ``seq_id`` as fp32 ``[num_tokens, R+Dr]`` (dequantized)."""
        slots = self.slot_mapping(seq_id, 0, num_tokens).to(self.device)
        out = self.kv_cache[layer].view(-1, self.width)[slots].float()
        return out * self.kv_scale[layer] if self.is_fp8 else out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_cache.values())


class KDAStatePool:
    """Slot pool of KDA recurrent + conv states, one pair of tensors per KDA layer.

    Args:
        cfg: model config (``kda_num_heads`` H, ``kda_head_dim`` K = V, ``short_conv_kernel_size`` W).
        num_slots: S (>= 1): sequences that can be live at once.
        device: where the pools live.
        num_heads: heads on this rank (default all).
        layers: 0-based KDA layer indices (default all KDA layers of ``cfg``).

    Attributes:
        state: ``{layer: [S, H, K, V] fp32}``; conv: ``{layer: [S, 3, H*K, W-1] fp32}``.
    """

    def __init__(self, cfg: K3Config, num_slots: int, device: str | torch.device = "cpu",
                 num_heads: int | None = None, layers: list[int] | None = None):
        if num_slots < 1:
            raise PlanError(f"KDA state pool needs num_slots >= 1 (got {num_slots})")
        self.cfg = cfg
        self.num_slots = num_slots
        self.device = torch.device(device)
        H = cfg.kda_num_heads if num_heads is None else num_heads
        K = cfg.kda_head_dim
        W = cfg.short_conv_kernel_size
        self.layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_type(i) == "kda"] if layers is None \
            else list(layers)
        self.state = {i: torch.zeros(num_slots, H, K, K, dtype=torch.float32, device=self.device)
                      for i in self.layers}
        self.conv = {i: torch.zeros(num_slots, 3, H * K, W - 1, dtype=torch.float32, device=self.device)
                     for i in self.layers}
        self._free: deque[int] = deque(range(num_slots))
        self.slots: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, seq_id: int) -> int:
        """Give ``seq_id`` a slot (its existing one if it has one), zeroing that slot's states.

        Raises:
            CacheExhausted: every slot is taken.
        """
        if seq_id in self.slots:
            return self.slots[seq_id]
        if not self._free:
            raise CacheExhausted(f"KDA state pool: all {self.num_slots} slots are in use; raise the cache "
                                 "budget or lower concurrency")
        s = self._free.popleft()
        for i in self.layers:
            self.state[i][s].zero_()
            self.conv[i][s].zero_()
        self.slots[seq_id] = s
        return s

    def free(self, seq_id: int) -> int | None:
        """Release ``seq_id``'s slot (no-op without one); returns the slot id or None."""
        s = self.slots.pop(seq_id, None)
        if s is not None:
            self._free.append(s)
        return s

    def slot_of(self, seq_id: int) -> int:
        return self.slots[seq_id]

    def nbytes(self) -> int:
        return sum(t.numel() * 4 for t in self.state.values()) + sum(t.numel() * 4 for t in self.conv.values())


def size_from_capacity(cfg: K3Config, capacity, block_size: int = 16, max_seqs: int | None = None,
                       num_heads: int | None = None) -> CacheSizing:
    """:func:`size_caches` from the plan's cache capacity (``Placement.cache``: ``budget_bytes``, ``kv_dtype``,
    ``max_sequences``). ``max_seqs`` defaults to the plan's ``max_sequences`` (at least 1).

    Raises:
        PlanError: unknown ``kv_dtype`` (:func:`k3rocm.runtime.sizing.kv_dtype_bytes`) or a budget that holds no
            sequence.
    """
    kv_bytes = kv_dtype_bytes(capacity.kv_dtype)
    n = max_seqs if max_seqs is not None else max(1, int(capacity.max_sequences))
    return _split_budget(cfg, int(capacity.budget_bytes), n, block_size, kv_bytes, num_heads)
