"""The ahead-of-time ISA tool itself: it must see matrix instructions where they are and not where they aren't."""

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from k3rocm.errors import HardwareError  # noqa: E402
from k3rocm.kernels.isa import TARGETS, compile_kernel, gpu_target  # noqa: E402


@triton.jit
def _mm(a, b, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k0 + rk)[None, :])
        y = tl.load(b + (k0 + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * BN + rn[None, :], acc)


@triton.jit
def _axpy(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=m) * 2.0 + tl.load(y + offs, mask=m), mask=m)


MM_SIG = {"a": "*bf16", "b": "*bf16", "c": "*fp32", "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}


@pytest.mark.parametrize("target", TARGETS)
def test_matmul_has_matrix_instructions(target):
    r = compile_kernel(_mm, MM_SIG, {"BM": 64, "BN": 64, "BK": 32}, target, expects_matrix=True,
                       options={"num_warps": 4})
    assert r.error is None
    assert r.matrix_ops, r
    if target.startswith("gfx"):
        assert all(op.startswith("v_mfma") for op in r.matrix_ops)
        assert r.vgpr and r.vgpr > 0 and r.vgpr_spill == 0 and r.sgpr_spill == 0
    else:
        assert any(op.startswith("wgmma") for op in r.matrix_ops)
    assert r.ok


@pytest.mark.parametrize("target", ["gfx950", "sm_90"])
def test_elementwise_has_none_and_expectation_is_enforced(target):
    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    r = compile_kernel(_axpy, sig, {"BLOCK": 256}, target, expects_matrix=True)
    assert r.error is None and r.matrix_ops == []
    assert not r.ok and "no matrix instructions" in r.problems()[0]


def test_unknown_target_and_bad_signature():
    with pytest.raises(HardwareError):
        gpu_target("gfx95z0")
    r = compile_kernel(_axpy, {"x": "*fp32"}, {}, "gfx950")
    assert r.error and not r.ok


@pytest.mark.parametrize("target,vector_load,scalar_load", [("gfx950", "global_load_dwordx4", "global_load_dword"),
                                                            ("sm_90", "ld.global.v4.b32", "ld.global.b32")])
def test_alignment_hints_reach_the_compiler(target, vector_load, scalar_load):
    """With 16-byte divisibility (what the launcher specialises at run time) loads vectorise; without, they can't."""
    import re

    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    loads = r"(?:global_load_\w+|buffer_load_\w+|ld\.global[\w.]*)"
    hinted = compile_kernel(_axpy, sig, {"BLOCK": 1024}, target, aligned=("x", "y", "n"))
    plain = compile_kernel(_axpy, sig, {"BLOCK": 1024}, target, aligned=False)
    assert vector_load in set(re.findall(loads, hinted.asm))
    assert set(re.findall(loads, plain.asm)) == {scalar_load}


def test_a_case_without_options_for_a_backend_is_not_compiled_there(monkeypatch):
    """``None`` options for a backend: the case does not run there and ``run_isa`` does not compile it for that
    backend's targets (the CUDA-only decode-path MoE tiles spilled SGPRs when compiled for gfx and failed the check);
    every other case is compiled for every target asked."""
    from k3rocm.kernels import isa

    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    cases = [("f.cuda_only", _axpy, sig, {"BLOCK": 256}, False, {"hip": None, "cuda": {"num_warps": 4}}),
             ("f.amd_only", _axpy, sig, {"BLOCK": 256}, False, {"hip": {"num_warps": 4}, "cuda": None}),
             ("f.everywhere", _axpy, sig, {"BLOCK": 256}, False, {})]
    monkeypatch.setattr(isa, "family_cases", lambda families=None: cases)
    got = sorted((r.name, r.target) for r in isa.run_isa(("gfx950", "sm_90")))
    assert got == [("f.amd_only", "gfx950"), ("f.cuda_only", "sm_90"), ("f.everywhere", "gfx950"),
                   ("f.everywhere", "sm_90")]
