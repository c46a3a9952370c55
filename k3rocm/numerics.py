"""Numeric formats and cache reads shared by the fp32 oracle (:mod:`k3rocm.model`) and the kernels
(:mod:`k3rocm.kernels`), so that neither imports the other for them.

* :data:`FP8_MAX` — the largest finite value of each FP8 format the latent cache may use.
* :func:`gather_cache` — one sequence's rows of the paged MLA latent cache, dequantised to fp32.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "gather_cache"]

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
