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
    backend's targets (the decode-path MoE tiles with CUDA's inline PTX are not compiled for gfx); every other case
    is compiled for every target asked."""
    from k3rocm.kernels import isa

    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    cases = [("f.cuda_only", _axpy, sig, {"BLOCK": 256}, False, {"hip": None, "cuda": {"num_warps": 4}}),
             ("f.amd_only", _axpy, sig, {"BLOCK": 256}, False, {"hip": {"num_warps": 4}, "cuda": None}),
             ("f.everywhere", _axpy, sig, {"BLOCK": 256}, False, {})]
    monkeypatch.setattr(isa, "family_cases", lambda families=None: cases)
    got = sorted((r.name, r.target) for r in isa.run_isa(("gfx950", "sm_90")))
    assert got == [("f.amd_only", "gfx950"), ("f.cuda_only", "sm_90"), ("f.everywhere", "gfx950"),
                   ("f.everywhere", "sm_90")]


@triton.jit
def _rows(x, y, stride, BLOCK: tl.constexpr):
    """Row ``program_id`` of a row-major matrix with row stride ``stride`` (elements), doubled."""
    offs = tl.program_id(0).to(tl.int64) * stride + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs) * 2.0)


@pytest.mark.parametrize("target,vector_load", [("gfx950", "global_load_dwordx4"), ("sm_90", "ld.global.v4.b32")])
def test_an_aligned_integer_in_the_signature_vectorises_what_it_addresses(target, vector_load):
    """A row stride the launcher specialises (a multiple of 16, ``"i32:16"``) lets the row loads vectorise; the
    same stride unmarked (a value the launcher does not specialise) cannot."""
    import re

    from k3rocm.kernels.isa import specialize

    loads = r"(?:global_load_\w+|buffer_load_\w+|ld\.global[\w.]*)"
    sig = {"x": "*fp32", "y": "*fp32", "stride": "i32", "BLOCK": "constexpr"}
    marked = compile_kernel(_rows, specialize(sig, {"stride": 7168}), {"BLOCK": 1024}, target)
    odd = compile_kernel(_rows, specialize(sig, {"stride": 7165}), {"BLOCK": 1024}, target)
    assert marked.error is None and odd.error is None
    assert vector_load in set(re.findall(loads, marked.asm))
    assert vector_load not in set(re.findall(loads, odd.asm))


def test_specialize_marks_multiples_of_16_and_refuses_what_the_launcher_never_specialises():
    from functools import partial

    from triton.runtime.jit import JITFunction

    from k3rocm.kernels.isa import ALIGNED_INT, specialize

    sig = {"x": "*fp32", "y": "*fp32", "stride": "i32", "BLOCK": "constexpr"}
    assert specialize(sig, {"stride": 0})["stride"] == "i32" + ALIGNED_INT  # the launcher specialises 0 too
    assert specialize(sig, {"stride": 48})["stride"] == "i32" + ALIGNED_INT
    assert specialize(sig, {"stride": 12})["stride"] == "i32"
    assert sig["stride"] == "i32"  # a copy
    with pytest.raises(HardwareError, match="'x' is not an i32 / i64"):
        specialize(sig, {"x": 16})
    with pytest.raises(HardwareError, match="'n' is not"):
        specialize(sig, {"n": 16})
    # a kernel that never specialises `stride` cannot be compiled as if it did
    rows_dns = partial(JITFunction, do_not_specialize=("stride",))(_rows.fn)
    r = compile_kernel(rows_dns, specialize(sig, {"stride": 64}), {"BLOCK": 256}, "gfx950")
    assert r.error and "do_not_specialize" in r.error and not r.ok
    assert compile_kernel(rows_dns, sig, {"BLOCK": 256}, "gfx950").error is None


@pytest.mark.parametrize("target,tile,fits", [("gfx942", (128, 128, 128), True), ("gfx942", (128, 256, 128), False),
                                              ("gfx950", (128, 128, 128), True), ("gfx950", (128, 256, 128), False),
                                              ("sm_90", (128, 256, 128), True)])
def test_shared_memory_above_the_target_limit_is_a_problem(target, tile, fits):
    """A kernel that compiles with more LDS / shared memory than one program may use would not launch: the report
    says so. A bf16 matmul of ``tile`` (BM, BN, BK), two stages of operands staged in shared memory (gfx942 at
    64 KiB and 96 KiB, gfx950 at 132 KiB and 200 KiB, sm_90 at 160 KiB)."""
    from k3rocm.kernels.isa import LDS_LIMIT

    r = compile_kernel(_mm, MM_SIG, dict(zip(("BM", "BN", "BK"), tile)), target, expects_matrix=True,
                       options={"num_warps": 8, "num_stages": 2})
    assert r.error is None, r.error
    assert (r.lds_bytes <= LDS_LIMIT[target]) == fits, r.lds_bytes
    assert r.ok == fits, r.problems()
    assert any("would not launch" in p for p in r.problems()) != fits
