"""k3rocm.mx: E2M1 / E8M0 / MXFP4 / MXFP8 against known values, a brute-force oracle and compressed-tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3rocm import mx
from k3rocm.errors import CheckpointError

E2M1_MAG = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_blocks(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values with per-row magnitudes spread over ~2^-20 .. 2^20 (fresh, seeded)."""
    g = _gen(seed)
    x = torch.randn(rows, cols, generator=g)
    return x * torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).float())


def _oracle_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Brute force in float64: nearest magnitude, ties to the even code, saturate at 6; sign bit from y."""
    a = y.double().abs().clamp(max=6.0).unsqueeze(-1)
    mags = torch.tensor(E2M1_MAG, dtype=torch.float64)
    d = (a - mags).abs()
    best = d.min(dim=-1, keepdim=True).values
    cand = (d == best)
    # among tied candidates prefer the even code
    even = cand & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), cand.float().argmax(-1)).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _oracle_exponent(amax: float, rule: str, fmt: str = "e2m1") -> int:
    """Shared exponent from the rule definitions, in exact rational arithmetic on float64."""
    max_elem, emax, mbits = {"e2m1": (6.0, 2, 1), "e4m3": (448.0, 8, 3), "e5m2": (57344.0, 15, 2)}[fmt]
    if amax == 0.0 or amax < 2.0 ** -126:
        return -127
    k = math.floor(math.log2(amax))
    if 2.0 ** k > amax:
        k -= 1
    if 2.0 ** (k + 1) <= amax:
        k += 1
    if rule == "floor":
        e = k - emax
    elif rule == "even":
        m = amax / 2.0 ** k  # [1, 2)
        # round the mantissa to mbits bits, ties up (the add-half-ulp-and-truncate rule)
        step = 2.0 ** -mbits
        m_r = math.floor(m / step + 0.5) * step
        e = k + (1 if m_r >= 2.0 else 0) - emax
    else:
        e = k - emax
        while amax / 2.0 ** e > max_elem:
            e += 1
    return max(-127, min(127, e))


# --------------------------------------------------------------------------------------- E2M1
def test_all_16_e2m1_codes():
    v = mx.e2m1_to_float(torch.arange(16, dtype=torch.uint8))
    assert v.dtype == torch.float32
    assert v.tolist() == E2M1_MAG + [-m for m in E2M1_MAG]
    assert torch.signbit(v[8]) and not torch.signbit(v[0])  # code 8 is -0


def test_pack_unpack_every_byte_low_nibble_first():
    b = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = mx.unpack_fp4(b)
    assert codes.shape == (4, 128)
    assert torch.equal(codes[:, 0::2], b & 0xF) and torch.equal(codes[:, 1::2], b >> 4)
    assert torch.equal(mx.pack_fp4(codes), b)
    # a known byte: 0x72 = low nibble 2 (1.0, element 0), high nibble 7 (6.0, element 1)
    p = torch.full((1, 16), 0x72, dtype=torch.uint8)
    d = mx.dequantize_mxfp4(p, torch.full((1, 1), 127, dtype=torch.uint8))
    assert d[0, :4].tolist() == [1.0, 6.0, 1.0, 6.0]
    with pytest.raises(mx.MXFormatError):
        mx.pack_fp4(torch.tensor([[16, 0]]))
    with pytest.raises(mx.MXFormatError):
        mx.pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))


# --------------------------------------------------------------------------------------- E8M0
def test_e8m0_bytes():
    s = torch.arange(255, dtype=torch.uint8)
    v = mx.e8m0_to_float(s)
    assert v.dtype == torch.float32
    assert v.double().tolist() == [math.ldexp(1.0, i - 127) for i in range(255)]
    assert v[0].item() == math.ldexp(1.0, -127) and v[127].item() == 1.0 and v[254].item() == math.ldexp(1.0, 127)
    with pytest.raises(mx.MXFormatError) as ei:
        mx.e8m0_to_float(torch.tensor([[3, 255]], dtype=torch.uint8), where="layers.1.w2.weight_scale")
    assert isinstance(ei.value, CheckpointError) and isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "0xFF" in msg and "layers.1.w2.weight_scale" in msg and "(0, 1)" in msg and "\n" not in msg
    with pytest.raises(mx.MXFormatError):
        mx.dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))


# --------------------------------------------------------------------------------------- rounding
def test_ties_round_to_nearest_even():
    # amax 5.0 -> every rule picks scale 2^0 here, so y = x
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.25, -2.5, -5.0, 0.2500001, 2.5000002, 4.9999995]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -2.0, -4.0, 0.5, 3.0, 4.0]
    x = torch.zeros(1, 32)
    x[0, :len(vals)] = torch.tensor(vals)
    for rule in mx.SCALE_RULES:
        p, s = mx.quantize_mxfp4(x, rule)
        assert s.item() == 127, rule
        d = mx.dequantize_mxfp4(p, s)[0, :len(vals)]
        assert d.tolist() == want, rule
        assert torch.signbit(d[7])  # -0.25 -> -0 keeps its sign (compressed-tensors does the same)


@pytest.mark.parametrize("amax,rule,exp,top", [
    (6.5, "floor", 0, 6.0), (7.0, "floor", 0, 6.0),
    (6.5, "even", 0, 6.0), (7.0, "even", 1, 8.0),
    (6.5, "round-up", 1, 6.0), (7.0, "round-up", 1, 8.0),
])
def test_scale_rules_at_amax_6_5_and_7(amax, rule, exp, top):
    x = torch.zeros(2, 32)
    x[:, 5] = torch.tensor([amax, -amax])
    p, s = mx.quantize_mxfp4(x, rule)
    assert (s.int() - 127).tolist() == [[exp], [exp]]
    d = mx.dequantize_mxfp4(p, s)
    assert d[:, 5].tolist() == [top, -top]
    assert (d[:, :5] == 0).all() and (d[:, 6:] == 0).all()


def test_all_zero_blocks():
    x = torch.zeros(3, 96)
    x[1, 40] = 3.0  # row 1, block 1 non-zero
    for rule in mx.SCALE_RULES:
        p, s = mx.quantize_mxfp4(x, rule)
        assert s[0].tolist() == [0, 0, 0] and s[2].tolist() == [0, 0, 0] and s[1, 0] == 0 and s[1, 2] == 0
        assert (p[0] == 0).all()
        assert torch.equal(mx.dequantize_mxfp4(p, s), x)
        v, s8 = mx.quantize_mxfp8(x, "e4m3", rule)
        assert torch.equal(mx.dequantize_mxfp8(v, s8), x)


@pytest.mark.parametrize("rule", mx.SCALE_RULES)
def test_quantize_mxfp4_matches_bruteforce_oracle(rule):
    x = _random_blocks(48, 256, seed=hash(rule) % 1000)
    x[3, :32] = 0.0
    x[4, 32:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # ties at scale 1
    p, s = mx.quantize_mxfp4(x, rule)
    assert p.shape == (48, 128) and s.shape == (48, 8) and p.dtype == s.dtype == torch.uint8
    xb = x.reshape(48, 8, 32)
    amax = xb.abs().amax(-1)
    want_e = torch.tensor([[_oracle_exponent(float(a), rule) for a in row] for row in amax])
    assert torch.equal(s.int() - 127, want_e.int())
    y = xb.double() / torch.exp2(want_e.double()).unsqueeze(-1)
    assert torch.equal(mx.unpack_fp4(p), _oracle_e2m1(y).reshape(48, 256))
    d = mx.dequantize_mxfp4(p, s)
    # rule properties: round-up never saturates, floor keeps amax/scale in [4, 8)
    sc = torch.exp2(want_e.double())
    nz = amax > 0
    if rule == "round-up":
        assert (amax.double()[nz] / sc[nz] <= 6).all() and (amax.double()[nz] / sc[nz] > 3).all()
    if rule == "floor":
        r = amax.double()[nz] / sc[nz]
        assert ((r >= 4) & (r < 8)).all()
    # error bound: half a step of the largest gap (2 * scale / 2) per element, saturation aside
    err = (d.double() - x.double()).abs().reshape(48, 8, 32)
    bound = torch.where(xb.abs().double() <= 6 * sc.unsqueeze(-1), sc.unsqueeze(-1),
                        xb.abs().double() - 6 * sc.unsqueeze(-1))
    assert (err <= bound + 1e-30).all()


def test_quantize_errors():
    with pytest.raises(mx.MXFormatError):
        mx.quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(mx.MXFormatError):
        mx.quantize_mxfp4(torch.full((1, 32), float("nan")))
    with pytest.raises(mx.MXFormatError):
        mx.quantize_mxfp4(torch.zeros(1, 32), "nearest")
    with pytest.raises(mx.MXFormatError):
        mx.quantize_mxfp8(torch.zeros(1, 32), "e3m4")
    with pytest.raises(mx.MXFormatError):
        mx.dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_3d_and_bf16_inputs():
    x = _random_blocks(6, 64, seed=7).reshape(2, 3, 64).to(torch.bfloat16)
    p, s = mx.quantize_mxfp4(x)
    p2, s2 = mx.quantize_mxfp4(x.float().reshape(6, 64))
    assert p.shape == (2, 3, 32) and s.shape == (2, 3, 2)
    assert torch.equal(p.reshape(6, 32), p2) and torch.equal(s.reshape(6, 2), s2)


# --------------------------------------------------------------------------------------- MXFP8
@pytest.mark.parametrize("fmt,dtype,maxv,mbits", [("e4m3", torch.float8_e4m3fn, 448.0, 3),
                                                  ("e5m2", torch.float8_e5m2, 57344.0, 2)])
@pytest.mark.parametrize("rule", mx.SCALE_RULES)
def test_mxfp8(fmt, dtype, maxv, mbits, rule):
    x = _random_blocks(32, 128, seed=11)
    v, s = mx.quantize_mxfp8(x, fmt, rule)
    assert v.dtype == dtype and v.shape == x.shape and s.shape == (32, 4)
    amax = x.reshape(32, 4, 32).abs().amax(-1)
    want_e = torch.tensor([[_oracle_exponent(float(a), rule, fmt) for a in row] for row in amax])
    assert torch.equal(s.int() - 127, want_e.int())
    sc = torch.exp2(want_e.double()).repeat_interleave(32, dim=-1)
    y = x.double() / sc
    # element = torch's RNE fp8 cast of the saturated y (its own oracle for fp8 rounding)
    assert torch.equal(v.float(), y.clamp(-maxv, maxv).float().to(dtype).float())
    d = mx.dequantize_mxfp8(v, s)
    big = y.abs() >= 2.0 ** (-6 if fmt == "e4m3" else -14)  # normal range of the element
    unsat = y.abs() <= maxv
    rel = ((d.double() - x.double()).abs() / x.double().abs())[big & unsat]
    assert rel.max() <= 2.0 ** -(mbits + 1) + 1e-12
    if rule == "round-up":
        assert unsat.all()


# --------------------------------------------------------------------------------------- compressed-tensors
def _ct():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    mxu = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    return helpers, mxu


@pytest.mark.parametrize("rule", mx.SCALE_RULES)
def test_byte_exact_with_compressed_tensors(rule):
    helpers, mxu = _ct()
    x = _random_blocks(64, 512, seed=1234 + len(rule))
    x[0, :32] = -1e-30  # tiny negatives -> -0 codes
    p, s = mx.quantize_mxfp4(x, rule)
    ct_packed = helpers.quantize_and_pack_fp4(x, mx.e8m0_to_float(s), group_size=32)
    assert torch.equal(ct_packed, p)
    ct_vals = helpers.unpack_fp4_from_uint8(p, 64, 512, dtype=torch.float32)
    assert torch.equal(ct_vals, mx.e2m1_to_float(mx.unpack_fp4(p)))
    # codes -> bytes with compressed-tensors' own packer
    assert torch.equal(helpers.pack_fp4_to_uint8(mx.e2m1_to_float(mx.unpack_fp4(p))), p)
    if rule == "even":  # compressed-tensors' scale choice is our "even" rule
        amax = x.reshape(64, 16, 32).abs().amax(-1)
        assert torch.equal(mxu.generate_mx_scales(amax).to(torch.uint8), s)


def test_golden_experts_dequantize_like_compressed_tensors(golden_ckpt):
    _ct()
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors import safe_open

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", group_size=32, strategy="group", symmetric=True, scale_dtype=torch.uint8))
    packed, scales, names = [], [], []
    for shard in sorted(golden_ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                if k.endswith(".weight_packed"):
                    base = k[: -len(".weight_packed")]
                    packed.append(f.get_tensor(k))
                    scales.append(f.get_tensor(base + ".weight_scale"))
                    names.append(base)
    assert len(names) == 12 * 16 * 3
    # the decode is row-wise: one compressed-tensors call over all expert rows (per row width)
    for width in sorted({p.shape[1] for p in packed}):
        sel = [i for i, p in enumerate(packed) if p.shape[1] == width]
        P = torch.cat([packed[i] for i in sel])
        S = torch.cat([scales[i] for i in sel])
        ct = MXFP4PackedCompressor.decompress({"weight_packed": P, "weight_scale": S}, scheme)["weight"].float()
        ours = torch.cat([mx.dequantize_mxfp4(packed[i], scales[i], where=names[i]) for i in sel])
        assert torch.equal(ct, ours)
        assert ours.abs().max() > 0


def test_nibble_swap_is_caught(golden_ckpt):
    """A swapped-nibble decode differs from the correct one on real data (why the layout test matters)."""
    from safetensors import safe_open

    shard = sorted(golden_ckpt.glob("*.safetensors"))[0]
    with safe_open(str(shard), "pt") as f:
        k = next(k for k in f.keys() if k.endswith("w1.weight_packed"))
        p = f.get_tensor(k)
    swapped = (p >> 4) | (p << 4)
    s = torch.full((p.shape[0], p.shape[1] * 2 // 32), 127, dtype=torch.uint8)
    a, b = mx.dequantize_mxfp4(p, s), mx.dequantize_mxfp4(swapped, s)
    assert not torch.equal(a, b)
    assert np.isclose(a.abs().mean().item(), b.abs().mean().item())  # same statistics, different values


# --------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_mx_on_gpu_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm GPU")
    x = _random_blocks(256, 1024, seed=99)
    for rule in mx.SCALE_RULES:
        p, s = mx.quantize_mxfp4(x, rule)
        pg, sg = mx.quantize_mxfp4(x.cuda(), rule)
        assert pg.is_cuda and torch.equal(pg.cpu(), p) and torch.equal(sg.cpu(), s)
        assert torch.equal(mx.dequantize_mxfp4(pg, sg).cpu(), mx.dequantize_mxfp4(p, s))
        for fmt in ("e4m3", "e5m2"):
            v, s8 = mx.quantize_mxfp8(x, fmt, rule)
            vg, s8g = mx.quantize_mxfp8(x.cuda(), fmt, rule)
            assert torch.equal(vg.cpu().view(torch.uint8), v.view(torch.uint8)) and torch.equal(s8g.cpu(), s8)
            assert torch.equal(mx.dequantize_mxfp8(vg, s8g).cpu(), mx.dequantize_mxfp8(v, s8))
    bad = torch.full((2, 1), 0xFF, dtype=torch.uint8, device="cuda")
    with pytest.raises(mx.MXFormatError):
        mx.e8m0_to_float(bad)
