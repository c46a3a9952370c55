"""Triton Block AttnRes kernel (aggregation + following RMSNorm, optional bank append).

``TRITON_IMPLS`` lists the ``triton`` implementation of ``attn_res_norm`` (the fused step the decoder calls:
aggregation + following RMSNorm + bank append, one launch) for :mod:`k3rocm.runtime.registry`.
Oracle: :mod:`k3rocm.model.attnres`.
"""

from __future__ import annotations

from .attnres import ATTNRES_CONFIGS, _attn_res_kernel, attn_res, attn_res_norm, isa_signature

__all__ = ["attn_res", "attn_res_norm", "ATTNRES_CONFIGS", "isa_cases", "TRITON_IMPLS"]


#: the ``triton`` implementations of this family: ``(op, fn, supports or None, note)``
TRITON_IMPLS = (
    ("attn_res_norm", attn_res_norm, None,
     "Triton AttnRes + following RMSNorm + bank append in one launch; one pass over the sources, row tiles"),
)


def isa_cases() -> list[tuple]:
    """The AttnRes kernel (write-layer variant, bf16 bank) for ``kernels isa``; no matrix instructions expected."""
    sig, consts, opts = isa_signature("bf16", append=True)
    sig2, consts2, opts2 = isa_signature("fp32", append=False)
    # the single-pass path at K3's hidden size (7168 in one 8192 block, 2-row tiles, 16 warps as the HIP config)
    sig3, consts3, _ = isa_signature("bf16", append=True, block_d=8192, one_block=True, rows=2)
    opts3 = {"cuda": {"num_warps": 16, "num_stages": 1}, "hip": {"num_warps": 16, "num_stages": 1}}
    # the decoder's pending prefix add in the step (ADD), fp32 bank and prefix as the engine keeps them: the
    # single-pass path at K3's width and the phased path (the PIPE stream, a CUDA-only candidate, with ADD:
    # tests/kernels/test_attnres.py compiles every CUDA PIPE config for sm_90 with and without it)
    sig4, consts4, _ = isa_signature("fp32", append=True, block_d=8192, one_block=True, rows=2, add=True)
    sig6, consts6, opts6 = isa_signature("fp32", append=True, add=True)
    # the EARLY candidate (prefix / addend loads before the bank tiles) as the decoder calls it
    sig7, consts7, _ = isa_signature("fp32", append=True, block_d=8192, one_block=True, rows=4, add=True,
                                     store_h=False, early=1)
    return [("attn_res_norm_append_bf16", _attn_res_kernel, sig, consts, False, opts),
            ("attn_res_norm_fp32", _attn_res_kernel, sig2, consts2, False, opts2),
            ("attn_res_norm_append_bf16_one_block", _attn_res_kernel, sig3, consts3, False, opts3),
            ("attn_res_norm_add_fp32_one_block", _attn_res_kernel, sig4, consts4, False, opts3),
            ("attn_res_norm_add_fp32", _attn_res_kernel, sig6, consts6, False, opts6),
            ("attn_res_norm_add_fp32_one_block_early", _attn_res_kernel, sig7, consts7, False, opts3)]
