"""The op table of the fp32 oracle: op name -> reference function. The one list of op names.

A layer calls its heavy ops through a table of this shape (:func:`k3rocm.model.layer.resolve_ops`); the
kernel registry (:mod:`k3rocm.runtime.registry`) offers other implementations of the same ops, each with the
signature of the reference function here (documented at the function).
"""

from __future__ import annotations

from typing import Callable

from k3rocm.model.attnres import attn_res_norm
from k3rocm.model.common import glu
from k3rocm.model.kda import kda_decode, kda_prefill, short_conv
from k3rocm.model.mla import mla_cache_write, mla_decode, mla_prefill
from k3rocm.model.moe import moe_experts, moe_router

__all__ = ["ORACLE_OPS"]

#: op name -> fp32 reference function (K3_FACTS §5; formulas at each function)
ORACLE_OPS: dict[str, Callable] = {
    "short_conv": short_conv,
    "kda_prefill": kda_prefill,
    "kda_decode": kda_decode,
    "mla_prefill": mla_prefill,
    "mla_decode": mla_decode,
    "mla_cache_write": mla_cache_write,
    "attn_res_norm": attn_res_norm,
    "moe_router": moe_router,
    "moe_experts": moe_experts,
    "glu": glu,
}
