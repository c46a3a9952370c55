"""Triton Block AttnRes kernel (aggregation + following RMSNorm, optional bank append).

``TRITON_IMPLS`` lists the ``triton`` implementation of ``attn_res`` for :mod:`k3rocm.runtime.registry`.
Oracle: :mod:`k3rocm.model.attnres`.
"""

from __future__ import annotations

from .attnres import ATTNRES_CONFIGS, MAX_SOURCES, _attn_res_kernel, attn_res, attn_res_norm, isa_signature

__all__ = ["attn_res", "attn_res_norm", "ATTNRES_CONFIGS", "isa_cases", "TRITON_IMPLS"]


def _fits_sources(num_sources: int = 1, **_) -> bool:
    return num_sources <= MAX_SOURCES


#: the ``triton`` implementations of this family: ``(op, fn, supports or None, note)``
TRITON_IMPLS = (
    ("attn_res", attn_res, _fits_sources,
     "Triton one-pass-per-token AttnRes (scores, fp32 softmax, mix; fused RMSNorm/append variant)"),
)


def isa_cases() -> list[tuple]:
    """The AttnRes kernel (write-layer variant, bf16 bank) for ``kernels isa``; no matrix instructions expected."""
    sig, consts, opts = isa_signature("bf16", append=True)
    sig2, consts2, opts2 = isa_signature("fp32", append=False)
    return [("attn_res_norm_append_bf16", _attn_res_kernel, sig, consts, False, opts),
            ("attn_res_norm_fp32", _attn_res_kernel, sig2, consts2, False, opts2)]
