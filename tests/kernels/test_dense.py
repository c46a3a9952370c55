"""The skinny GEMM (``k3rocm.kernels.dense``): every config against a float64 oracle at the edge shapes (one row, a
row count past a tile, N and K off every tile), the split-K sum deterministic and its counters left at zero, the
refusals, and the ahead-of-time compile for gfx950, gfx942 and sm_90 (matrix instructions, no AMD spills, the
loads staged by ``cp.async`` on sm_90 once the launcher's alignment hints are given).

Without a GPU the kernel runs in the Triton interpreter (fp32 products of the exact bf16 / fp16 values); the
module fixture sets ``TRITON_INTERPRET=1`` for this module only."""

from __future__ import annotations

import importlib

import pytest
import torch
# Triton's compiler imported in compiled mode, before the D fixture sets TRITON_INTERPRET: the ahead-of-time test
# below needs the jitted (not interpreted) standard library that its first compile imports
import triton.compiler.code_generator  # noqa: F401

from k3rocm.errors import ConfigError
from tests.helpers import interpreter_without_gpu

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 70, 300), (5, 64, 256), (16, 130, 513), (17, 200, 1000), (53, 96, 384), (64, 64, 64), (65, 33, 160)]


@pytest.fixture(scope="module")
def D():
    with interpreter_without_gpu():
        yield importlib.import_module("k3rocm.kernels.dense.gemm")


def _configs(D):
    return D.SKINNY_CONFIGS["cuda" if DEV == "cuda" else "interpreter"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_config_matches_the_oracle(D, dtype):
    """Every config whose row band fits (candidates included) within 1e-5 of the float64 product of the same 16-bit
    values (fp32 accumulation), fresh random inputs per shape; bit-identical on a second run (split-K partials
    summed in split order by whichever program arrives last) and the counter buffer back at zero."""
    g = torch.Generator().manual_seed(11)
    ran = 0
    for M, N, K in SHAPES:
        x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
        w = (torch.randn(N, K, generator=g) * 0.05).to(dtype).to(DEV)
        ref = x.double() @ w.double().T
        scale = ref.abs().max().item()
        for c in _configs(D):
            if M > c.get("max_rows", M):
                continue
            y = D.skinny_gemm(x, w, config=c)
            assert y.dtype == torch.float32 and y.shape == (M, N)
            err = (y.double() - ref).abs().max().item() / scale
            assert err < 1e-5, (M, N, K, c, err)
            assert torch.equal(y, D.skinny_gemm(x, w, config=c)), (M, N, K, c)
            ran += 1
    assert ran >= 2 * len(SHAPES)
    for buf in D.COUNTERS.values():
        assert int(buf.abs().sum()) == 0


def test_auto_split_fills_the_gpu():
    """``SPLIT_K`` 0 takes the smallest power of two giving two programs a multiprocessor, within the K steps and
    16: many for a 768-row slice, one for a 10,240-row one, never more splits than K steps."""
    from k3rocm.kernels.dense.gemm import auto_split
    meta = dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=256)
    assert auto_split(53, 768, 7168, dict(meta, BLOCK_M=64), 132) == 16
    assert auto_split(1, 10240, 7168, meta, 132) == 2
    assert auto_split(1, 20480, 7168, meta, 132) == 1
    assert auto_split(16, 64, 256, meta, 132) == 1  # one K step
    assert auto_split(16, 64, 1024, meta, 132) == 4


def test_tuned_pick_and_strided_rows(D):
    """Without a config the pick for the shape runs (its row band); x may be a row-strided view (a column slice of a
    wider activation) and the weight a row slice of a concatenated matrix."""
    g = torch.Generator().manual_seed(12)
    big = torch.randn(7, 400, generator=g).bfloat16().to(DEV)
    x = big[:, 50:306]
    wall = torch.randn(90, 256, generator=g).bfloat16().to(DEV)
    w = wall[10:80]
    y = D.skinny_gemm(x, w)
    ref = x.double() @ w.double().T
    assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


def test_empty_and_refusals(D):
    x = torch.randn(3, 32).bfloat16().to(DEV)
    w = torch.randn(8, 32).bfloat16().to(DEV)
    assert D.skinny_gemm(x[:0], w).shape == (0, 8)
    assert torch.equal(D.skinny_gemm(x[:, :0], w[:, :0]), torch.zeros(3, 8, device=DEV))
    for a, b, what in ((x, w[:, :16], "same K"), (x.float(), w.float(), "bf16"), (x, w.half(), "bf16"),
                       (x.t().contiguous().t(), w, "contiguous"), (x[0], w, "same K")):
        with pytest.raises(ConfigError, match=what):
            D.skinny_gemm(a, b)


@pytest.mark.parametrize("target", ["gfx950", "gfx942", "sm_90"])
def test_compiles_for_each_target(D, target, monkeypatch):
    """Each ISA case compiles with matrix instructions (bf16 MFMA on AMD, wgmma on sm_90), no AMD spills, and on
    sm_90 with the launcher's alignment hints (the case marks K, N and the strides divisible by 16, as at K3's
    widths: ``isa.specialize``) the loop's tiles are staged by the pipeliner's ``cp.async``, within the shared
    memory of a block."""
    isa = pytest.importorskip("k3rocm.kernels.isa")
    from k3rocm.kernels.dense import isa_cases
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    be = "hip" if target.startswith("gfx") else "cuda"
    for name, fn, sig, consts, expects, opts in isa_cases():
        assert {n for n, t in sig.items() if t.endswith(isa.ALIGNED_INT)} == {"K", "N", "stride_xm", "stride_wn",
                                                                              "stride_ym"}
        o = dict(opts[be])
        rep = isa.compile_kernel(fn, sig, {**consts, **o.pop("constexprs", {})}, target, name=name, options=o,
                                 expects_matrix=expects)
        assert rep.error is None, rep.error
        assert rep.ok, (name, target, rep.problems())
        if be == "hip":
            assert rep.matrix_ops and all("bf16" in op for op in rep.matrix_ops), rep.matrix_ops
            assert rep.vgpr_spill == 0 and rep.sgpr_spill == 0, (name, target, rep.vgpr_spill, rep.sgpr_spill)
            assert rep.lds_bytes <= (64 if target == "gfx942" else 160) * 1024, (name, rep.lds_bytes)
        else:
            assert any(op.startswith("wgmma") for op in rep.matrix_ops), rep.matrix_ops
            assert "cp.async" in rep.asm, name
            assert rep.lds_bytes <= 227 * 1024, (name, rep.lds_bytes)


def test_fastest_gemm_picks_between_vendor_and_skinny(D):
    """``fastest_gemm``: off the GPU it is the caller's vendor GEMM itself; on a GPU the timed pick's result (vendor or
    a skinny config, whichever was faster at this shape) equals the fp32 product within accumulation-order noise,
    at 1 / 16 / 53 rows and a K3 projection's width, and the vendor GEMM is the first (untimed) candidate."""
    from k3rocm.kernels import tune

    calls = []

    def vendor(a, w):
        calls.append(a.shape[0])
        return a.float() @ w.float().T
    g = torch.Generator().manual_seed(3)
    for M in (1, 16, 53):
        x = torch.randn(M, 7168, generator=g).to(torch.bfloat16).to(DEV)
        w = (torch.randn(3846, 7168, generator=g) * 0.02).to(torch.bfloat16).to(DEV)
        y = D.fastest_gemm(x, w, vendor)
        ref = x.double() @ w.double().T
        assert y.dtype == torch.float32 and y.shape == (M, 3846)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        if DEV == "cpu":
            assert calls[-1] == M  # the vendor GEMM ran
    assert D.fastest_gemm.__globals__["VENDOR"] == dict(VENDOR=1)
    with tune.mode("first"):
        key_before = len(tune.TIMINGS)
        D.fastest_gemm(torch.ones(3, 64, dtype=torch.bfloat16, device=DEV),
                       torch.ones(64, 64, dtype=torch.bfloat16, device=DEV), vendor)
        assert calls[-1] == 3 and len(tune.TIMINGS) == key_before  # untimed: the vendor GEMM, nothing timed
