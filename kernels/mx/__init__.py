"""Triton MX-format helpers: MXFP8 (E4M3 + E8M0 per 32) quantization of activations and of kernel tiles.

Used by the A8W4 path of :mod:`k3rocm.kernels.moe`; the torch reference is
``k3rocm.model.moe.quantize_mxfp8_e4m3`` (bit-identical).
"""

from __future__ import annotations

from k3rocm.kernels.isa import specialize

from .quant import _mxfp8_rows_kernel, mxfp8_quantize_tile, quantize_mxfp8_rows

__all__ = ["quantize_mxfp8_rows", "mxfp8_quantize_tile", "isa_cases", "TRITON_IMPLS"]

#: no op of the registry: these kernels serve the MoE family's A8W4 path
TRITON_IMPLS = ()


def isa_cases() -> list[tuple]:
    """The row quantization kernel (bf16 in): no matrix instructions expected."""
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*u8", "T": "i32", "D": "i32", "stride_x": "i32",
           "stride_q": "i32", "stride_s": "i32", "BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
    # K3's latent rows (3584 wide, 112 scales); the token count is not specialised on
    sig = specialize(sig, dict(D=3584, stride_x=3584, stride_q=3584, stride_s=112))
    return [("mxfp8_rows_bf16", _mxfp8_rows_kernel, sig, {"BLOCK_T": 4, "BLOCK_D": 512}, False,
             {"hip": {"num_warps": 4}, "cuda": {"num_warps": 4}})]
