"""MXFP8 (E4M3, one E8M0 scale per 32 values) quantization in Triton: a jit helper for kernel epilogues and a
standalone row-quantization kernel for activations (the A8W4 path of the MoE experts).

Rule ("no saturation", bit-identical to ``k3rocm.model.moe.quantize_mxfp8_e4m3``): per block of 32,
``amax = 1.m * 2^E``; shared exponent ``e = E - 8`` if ``1.m <= 1.75`` else ``E - 7`` (the smallest e with
``amax * 2^-e <= 448``), clamped to -127..127; element ``RNE_e4m3(clamp(x * 2^-e, -448, 448))``; scale byte
``e + 127``. Formats: OCP Microscaling v1.0 (E4M3 max 448, E8M0 bias 127).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rocm.errors import ConfigError


@triton.jit
def round_to_e4m3_grid(s):
    """Round fp32 values with |s| <= 448 to the nearest E4M3 value, ties to even, staying in fp32.

    The step is 2^(E-3) for exponent E >= -6 (normals) and 2^-9 below (subnormals); ``y = s / step`` is exact
    and |y| < 16, so adding and removing 1.5 * 2^23 rounds it to an integer in the default RNE mode. Doing
    this before the fp8 cast makes the cast exact on every backend (the Triton interpreter's own cast does
    not round correctly).
    """
    bits = s.to(tl.int32, bitcast=True)
    E = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    up = ((130 - E) << 23).to(tl.float32, bitcast=True)  # 2^(3-E)
    down = ((124 + E) << 23).to(tl.float32, bitcast=True)  # 2^(E-3)
    y = s * up
    r = (y + 12582912.0) - 12582912.0
    return r * down


@triton.jit
def mxfp8_quantize_tile(v, R: tl.constexpr, C: tl.constexpr):
    """Quantize an fp32 tile ``[R, C]`` (C a multiple of 32) along its columns; returns (fp8e4nv [R, C], u8 [R, C/32])."""
    v3 = tl.reshape(v, (R, C // 32, 32))
    amax = tl.max(tl.abs(v3), axis=2)
    bits = amax.to(tl.int32, bitcast=True)
    eb = (bits >> 23) & 0xFF
    bump = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(eb - 135 + bump, -127), 127)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact (127 - e in 1..254 for finite input)
    s = tl.minimum(tl.maximum(v3 * inv[:, :, None], -448.0), 448.0)
    s = round_to_e4m3_grid(s)
    q = tl.reshape(s.to(tl.float8e4nv, fp_downcast_rounding="rtne"), (R, C))
    return q, (e + 127).to(tl.uint8)


@triton.jit
def _mxfp8_rows_kernel(x_ptr, q_ptr, s_ptr, T, D, stride_x, stride_q, stride_s,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rs = pid_d * (BLOCK_D // 32) + tl.arange(0, BLOCK_D // 32)
    mask = (rt[:, None] < T) & (rd[None, :] < D)
    x = tl.load(x_ptr + rt[:, None] * stride_x + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = mxfp8_quantize_tile(x, BLOCK_T, BLOCK_D)
    tl.store(q_ptr + rt[:, None] * stride_q + rd[None, :], q, mask=mask)
    tl.store(s_ptr + rt[:, None] * stride_s + rs[None, :], s, mask=(rt[:, None] < T) & (rs[None, :] < D // 32))


def quantize_mxfp8_rows(x: torch.Tensor, block_t: int = 4, block_d: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x [T, D]`` (bf16/fp16/fp32, D a multiple of 32) to MXFP8 E4M3.

    Returns:
        ``(q [T, D] torch.float8_e4m3fn, scale [T, D/32] uint8 E8M0)``, equal bit for bit to
        ``k3rocm.model.moe.quantize_mxfp8_e4m3(x)[:2]``.
    Raises:
        ConfigError: x is not 2-D or D is not a multiple of 32.
    """
    if x.dim() != 2 or x.shape[1] % 32:
        raise ConfigError(f"quantize_mxfp8_rows: x must be [T, D] with D a multiple of 32, got {tuple(x.shape)}")
    x = x.contiguous()
    T, D = x.shape
    q = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, D // 32, dtype=torch.uint8, device=x.device)
    if T == 0:
        return q, s
    block_d = min(block_d, triton.next_power_of_2(D))
    block_d = max(block_d, 32)
    grid = (triton.cdiv(T, block_t), triton.cdiv(D, block_d))
    _mxfp8_rows_kernel[grid](x, q, s, T, D, x.stride(0), q.stride(0), s.stride(0), BLOCK_T=block_t, BLOCK_D=block_d)
    return q, s
