"""Triton Block AttnRes kernel (aggregation + following RMSNorm, optional bank append).

Importing this package registers the ``triton`` implementation of ``attn_res`` in
:mod:`k3rocm.kernels.registry`. Oracle: :mod:`k3rocm.model.attnres`.
"""

from __future__ import annotations

from k3rocm.kernels.registry import register

from .attnres import ATTNRES_CONFIGS, MAX_SOURCES, _attn_res_kernel, attn_res, attn_res_norm

__all__ = ["attn_res", "attn_res_norm", "ATTNRES_CONFIGS", "isa_cases"]

register("attn_res", "triton", attn_res, supports=lambda num_sources=1, **_: num_sources <= MAX_SOURCES,
         note="Triton one-pass-per-token AttnRes (scores, fp32 softmax, mix; fused RMSNorm/append variant)")


def isa_cases() -> list[tuple]:
    """The AttnRes kernel (write-layer variant, bf16 bank) for ``kernels isa``; no matrix instructions expected."""
    from .attnres import isa_signature

    sig, consts, opts = isa_signature("bf16", append=True)
    sig2, consts2, opts2 = isa_signature("fp32", append=False)
    return [("attn_res_norm_append_bf16", _attn_res_kernel, sig, consts, False, opts),
            ("attn_res_norm_fp32", _attn_res_kernel, sig2, consts2, False, opts2)]
