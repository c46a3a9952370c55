"""Numeric formats and cache reads shared by the fp32 oracle (:mod:`k3rocm.model`) and the kernels
(:mod:`k3rocm.kernels`), so that neither imports the other for them.

* :data:`FP8_MAX` — the largest finite value of each FP8 format the latent cache may use.
* :func:`gather_cache` — one sequence's rows of the paged MLA latent cache, dequantised to fp32.
* :func:`overlaps`, :func:`check_addend` — the memory-overlap test and the ``addend`` / ``prefix_out`` checks of
  the AttnRes step (``attn_res_norm``'s pending prefix add), the same for the oracle and the kernel.
"""

from __future__ import annotations

import torch

from k3rocm.errors import ConfigError

__all__ = ["FP8_MAX", "gather_cache", "overlaps", "check_addend"]

#: largest finite value of each FP8 cache format (e4m3fn: OCP FP8 spec, 448; e4m3fnuz: AMD CDNA3, 240)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


def gather_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, seq: int,
                 kv_scale: float | None = None) -> torch.Tensor:
    """The first ``context_len`` cached rows of sequence ``seq`` of a paged cache, as fp32.

    Args:
        kv_cache: ``[num_blocks, block_size, W]`` (``W = R + Dr`` = 576 for K3), any float dtype or FP8.
        block_table: int ``[N, max_blocks]``; row ``seq`` lists the sequence's blocks in order.
        context_len: rows to read (token ``p`` lives in block ``block_table[seq, p // block_size]``, row
            ``p % block_size``).
        seq: the sequence's row of ``block_table``.
        kv_scale: FP8 dequantisation multiplier (ignored for non-FP8 caches; None = 1).
    Returns:
        fp32 ``[context_len, W]``; FP8 rows are multiplied by ``kv_scale``.
    """
    bs = kv_cache.shape[1]
    pos = torch.arange(context_len, device=kv_cache.device)
    blocks = block_table[seq].to(torch.int64)[pos // bs]
    if kv_cache.element_size() == 1:  # FP8: gather the bytes, then reinterpret
        rows = kv_cache.view(torch.uint8)[blocks, pos % bs].view(kv_cache.dtype).float()
    else:
        rows = kv_cache[blocks, pos % bs]
        rows = rows if rows.dtype == torch.float32 else rows.float()
    if kv_cache.dtype in FP8_MAX and kv_scale is not None:
        rows = rows * float(kv_scale)
    return rows


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` (first to last byte) intersect on one device."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (sum((n - 1) * st for n, st in zip(a.shape, a.stride())) + 1) * a.element_size()
    b1 = b0 + (sum((n - 1) * st for n, st in zip(b.shape, b.stride())) + 1) * b.element_size()
    return a0 < b1 and b0 < a1


def check_addend(prefix: torch.Tensor, addend: torch.Tensor, prefix_out: torch.Tensor | None,
                 bank: torch.Tensor | None = None) -> None:
    """The ``addend`` / ``prefix_out`` pair of :func:`attn_res_norm`: both of ``prefix``'s shape, ``prefix_out``
    fp32, sharing no memory with ``prefix``, ``addend`` or ``bank`` (a prefix updated in place would be added to
    twice when a step is run again, e.g. by the tuner). Raises ConfigError otherwise."""
    if prefix_out is None:
        raise ConfigError("attn_res_norm: addend given without prefix_out (the fp32 [T, D] buffer that receives "
                          "prefix + addend)")
    if addend.shape != prefix.shape or prefix_out.shape != prefix.shape or prefix_out.dtype != torch.float32:
        raise ConfigError(f"attn_res_norm: addend {tuple(addend.shape)} / prefix_out {tuple(prefix_out.shape)} "
                          f"{prefix_out.dtype} must be the prefix's shape {tuple(prefix.shape)}, prefix_out fp32")
    if any(overlaps(prefix_out, t) for t in (prefix, addend) + ((bank,) if bank is not None else ())):
        raise ConfigError("attn_res_norm: prefix_out overlaps prefix, addend or the bank; give it its own buffer")
