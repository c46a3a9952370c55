"""OCP Microscaling (MX) formats in torch: E2M1 (MXFP4), E4M3 / E5M2 (MXFP8), E8M0 scales.

Source: OCP Microscaling Formats (MX) v1.0 specification; the stored layout follows the
``compressed-tensors`` ``mxfp4-pack-quantized`` format that wrote the Kimi K3 checkpoint (K3_FACTS §4).

* A block is 32 consecutive elements along the LAST dimension, sharing one E8M0 scale byte
  ``s``: multiplier ``2**(s - 127)``; ``s = 0xFF`` is NaN in the spec and is treated as corrupt data
  (:class:`MXFormatError`).
* E2M1 codes 0..7 are magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``; bit 3 is the sign (8 is -0).
* Packing: two E2M1 codes per byte, element ``2i`` in the LOW nibble, ``2i+1`` in the high nibble.
* Quantization rounds to nearest, ties to even, and saturates to the largest finite magnitude
  (6 for E2M1, 448 for E4M3, 57344 for E5M2).

Scale rules (``scale_rule``), each giving the shared exponent ``e`` (scale ``2**e``, clamped to
``-127..127``, stored as ``e + 127``):

* ``"floor"`` — OCP spec: ``e = floor(log2(amax)) - emax_elem`` (emax_elem = 2 for E2M1, 8 for E4M3,
  15 for E5M2); the block maximum may saturate.
* ``"even"`` — round ``amax`` to the element's mantissa width first (add half an element ulp to the
  fp32 bit pattern and drop the mantissa; the rule of ``compressed-tensors``' ``generate_mx_scales``),
  then as ``floor``.
* ``"round-up"`` — the smallest ``e`` with ``amax / 2**e <= max_elem`` (nothing saturates).

An all-zero block (and any block whose exponent falls below the E8M0 range) gets scale byte 0
(``2**-127``): the clamp-limit of every rule.
"""

from __future__ import annotations

import torch

from k3rocm.errors import CheckpointError

GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_RULES = ("floor", "even", "round-up")

# E2M1 code -> value (bit 3 = sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# element formats: (max finite magnitude, emax_elem = floor(log2(max)), mantissa bits)
_ELEM = {
    "e2m1": (6.0, 2, 1),
    "e4m3": (448.0, 8, 3),
    "e5m2": (57344.0, 15, 2),
}
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class MXFormatError(CheckpointError, ValueError):
    """Malformed MX data or arguments: a 0xFF (NaN) E8M0 scale byte, a code out of range, a width that
    is not a multiple of the group, a non-finite value to quantize, an unknown scale rule."""


def _check_u8(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise MXFormatError(f"{what} must be a torch.uint8 tensor, got {getattr(t, 'dtype', type(t))}")


# ---------------------------------------------------------------------------------------- E2M1
def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Split packed E2M1 bytes into codes.

    Args:
        packed: ``[..., n/2]`` uint8, element ``2i`` in the low nibble.
    Returns:
        ``[..., n]`` uint8 codes 0..15.
    Raises:
        MXFormatError: ``packed`` is not uint8.
    """
    _check_u8(packed, "packed FP4 data")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte (element ``2i`` in the low nibble).

    Args:
        codes: ``[..., n]`` integer codes 0..15, ``n`` even.
    Returns:
        ``[..., n/2]`` uint8.
    Raises:
        MXFormatError: odd ``n`` or a code outside 0..15.
    """
    if codes.shape[-1] % 2:
        raise MXFormatError(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes per row")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise MXFormatError("FP4 codes must be in 0..15")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, bit 3 = sign) -> fp32 values (OCP MX §5.3.3, K3_FACTS §4)."""
    _check_u8(codes, "E2M1 codes")
    if codes.numel() and int(codes.max()) > 15:
        raise MXFormatError("E2M1 codes must be in 0..15 (unpack bytes with unpack_fp4 first)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


# ---------------------------------------------------------------------------------------- E8M0
def e8m0_to_float(scale: torch.Tensor, where: str = "E8M0 scale") -> torch.Tensor:
    """E8M0 scale bytes -> fp32 multipliers ``2**(s - 127)`` (exact; s = 0 gives the denormal 2**-127).

    Args:
        scale: uint8 tensor of biased exponents.
        where: what the bytes are (file / tensor name), used in the error message.
    Raises:
        MXFormatError: a byte is 0xFF (NaN in the OCP spec).
    """
    _check_u8(scale, where)
    bad = scale == E8M0_NAN
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        raise MXFormatError(f"{where}: E8M0 scale byte 0xFF (NaN) at index {idx} ({int(bad.sum())} in all); "
                            "the data is corrupt - re-download or re-quantize it")
    s = scale.to(torch.int32)
    # normal: exponent field = s (s >= 1); s == 0 -> 2**-127 = fp32 denormal with bit 22 set
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22))
    return bits.view(torch.float32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for int32 ``e`` in -127..127 (bit construction, no libm)."""
    return e8m0_to_float((e + E8M0_BIAS).to(torch.uint8))


def _shared_exponent(amax: torch.Tensor, fmt: str, scale_rule: str) -> torch.Tensor:
    """int32 shared exponent per block from fp32 ``amax`` (>= 0, finite), clamped to -127..127."""
    if scale_rule not in SCALE_RULES:
        raise MXFormatError(f"unknown scale_rule {scale_rule!r}; choose one of {', '.join(SCALE_RULES)}")
    max_elem, emax, mbits = _ELEM[fmt]
    bits = amax.contiguous().view(torch.int32)
    if scale_rule == "even":
        bits = bits + (1 << (22 - mbits))  # half an element ulp; a carry bumps the exponent field
    field = (bits >> 23) & 0xFF
    # field 0 = zero or denormal: below any representable shared exponent -> clamps to -127
    e = field - 127 - emax
    if scale_rule == "round-up":
        max_mant = torch.tensor(max_elem, dtype=torch.float32).view(torch.int32).item() & 0x7FFFFF
        e = e + ((bits & 0x7FFFFF) > max_mant).to(torch.int32)
    e = torch.where(field == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127).to(torch.int32)


def _blocks(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.shape[-1] % GROUP:
        raise MXFormatError(f"{what}: last dimension {x.shape[-1]} is not a multiple of the MX group {GROUP}")
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise MXFormatError(f"{what}: input holds NaN or Inf; MX quantization needs finite values")
    return x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` (already divided by the scale) to E2M1 codes: RNE, saturating at 6."""
    a = y.abs()
    # thresholds between neighbours 0|.5|1|1.5|2|3|4|6; '>' where the tie goes down (to the even
    # code), '>=' where it goes up: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return mag.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)


# ---------------------------------------------------------------------------------------- MXFP4
def quantize_mxfp4(x: torch.Tensor, scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP4 (E2M1 elements, E8M0 scale per 32 along the last dim).

    Args:
        x: ``[..., n]`` float tensor, ``n % 32 == 0``, finite.
        scale_rule: ``"floor"`` (OCP), ``"even"`` (compressed-tensors), ``"round-up"``; see module doc.
    Returns:
        ``(packed [..., n/2] uint8, scale [..., n/32] uint8)``. Negative inputs that round to zero keep
        the sign bit (code 8), as compressed-tensors writes them.
    Raises:
        MXFormatError: bad width, non-finite input, unknown rule.
    """
    xb = _blocks(x, "quantize_mxfp4")
    e = _shared_exponent(xb.abs().amax(dim=-1), "e2m1", scale_rule)
    y = xb * _pow2(-e).unsqueeze(-1)
    codes = _e2m1_codes(y).reshape(x.shape)
    return pack_fp4(codes), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, where: str = "MXFP4 tensor") -> torch.Tensor:
    """MXFP4 -> fp32, exactly (every product of an E2M1 value and a power of two is an fp32 number
    unless it underflows).

    Args:
        packed: ``[..., n/2]`` uint8 (element ``2i`` low nibble).
        scale: ``[..., n/32]`` uint8 E8M0.
        where: name used in error messages.
    Returns:
        ``[..., n]`` fp32.
    Raises:
        MXFormatError: shapes disagree or a scale byte is 0xFF.
    """
    _check_u8(packed, where)
    n = packed.shape[-1] * 2
    if n % GROUP or tuple(scale.shape) != (*packed.shape[:-1], n // GROUP):
        raise MXFormatError(f"{where}: scale shape {tuple(scale.shape)} does not match packed shape "
                            f"{tuple(packed.shape)} (expected {(*packed.shape[:-1], n // GROUP)})")
    s = e8m0_to_float(scale, where)
    v = e2m1_to_float(unpack_fp4(packed)).reshape(*packed.shape[:-1], n // GROUP, GROUP)
    return (v * s.unsqueeze(-1)).reshape(*packed.shape[:-1], n)


# ---------------------------------------------------------------------------------------- MXFP8
def quantize_mxfp8(x: torch.Tensor, fmt: str = "e4m3", scale_rule: str = "floor"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP8 (E4M3 or E5M2 elements, E8M0 scale per 32 along the last dim).

    Args:
        x: ``[..., n]`` float tensor, ``n % 32 == 0``, finite.
        fmt: ``"e4m3"`` (``torch.float8_e4m3fn``, max 448) or ``"e5m2"`` (``torch.float8_e5m2``, max 57344).
        scale_rule: see module doc.
    Returns:
        ``(values [..., n] float8, scale [..., n/32] uint8)``; values are x/scale saturated to ±max and
        rounded to nearest even by torch's fp8 cast.
    Raises:
        MXFormatError: bad format / width / rule, non-finite input.
    """
    if fmt not in _FP8_DTYPES:
        raise MXFormatError(f"unknown MXFP8 element format {fmt!r}; choose 'e4m3' or 'e5m2'")
    xb = _blocks(x, "quantize_mxfp8")
    e = _shared_exponent(xb.abs().amax(dim=-1), fmt, scale_rule)
    mx = _ELEM[fmt][0]
    y = (xb * _pow2(-e).unsqueeze(-1)).clamp(-mx, mx)
    return y.reshape(x.shape).to(_FP8_DTYPES[fmt]), (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(values: torch.Tensor, scale: torch.Tensor, where: str = "MXFP8 tensor") -> torch.Tensor:
    """MXFP8 -> fp32: ``values [..., n]`` (float8) times ``2**(scale-127)`` per 32 elements.

    Raises:
        MXFormatError: shapes disagree or a scale byte is 0xFF.
    """
    n = values.shape[-1]
    if n % GROUP or tuple(scale.shape) != (*values.shape[:-1], n // GROUP):
        raise MXFormatError(f"{where}: scale shape {tuple(scale.shape)} does not match values shape "
                            f"{tuple(values.shape)}")
    s = e8m0_to_float(scale, where)
    v = values.to(torch.float32).reshape(*values.shape[:-1], n // GROUP, GROUP)
    return (v * s.unsqueeze(-1)).reshape(values.shape)


__all__ = [
    "GROUP", "E2M1_VALUES", "SCALE_RULES", "MXFormatError", "unpack_fp4", "pack_fp4", "e2m1_to_float",
    "e8m0_to_float", "quantize_mxfp4", "dequantize_mxfp4", "quantize_mxfp8", "dequantize_mxfp8",
]
