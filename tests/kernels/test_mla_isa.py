"""Ahead-of-time compile of every MLA / AttnRes kernel for gfx950, gfx942 and sm_90 (no GPU needed).

Two views:
* ``kernels isa`` as the toolkit runs it (``k3rocm.kernels.isa.run_isa``): compiles everywhere, matrix
  instructions (v_mfma / wgmma / mma) wherever the kernel has a dot, no VGPR spills on AMD.
* the launch-time view: the JIT marks pointer and integer arguments divisible by 16 (``tt.divisibility``),
  which is what lets it vectorise loads; the cases carry those hints (the strides as K3 constants, the integer
  arguments a launch specialises as ``"i32:16"``, ``isa.specialize``), so compiled as a real launch is, every
  kernel must have **zero VGPR and zero SGPR spills** on gfx950 and gfx942 and use 128-bit loads.
"""

from __future__ import annotations

import os

import pytest

isa = pytest.importorskip("k3rocm.kernels.isa")


@pytest.fixture(autouse=True, scope="module")
def _compiled_mode():
    """Ahead-of-time compiles need ``TRITON_INTERPRET`` off (an interpreter test module may have set it)."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    yield
    if old is not None:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="module")
def reports():
    return isa.run_isa(families=("mla", "attnres"))


def test_every_case_compiled_for_every_target(reports):
    names = {r.name for r in reports}
    assert {"mla.mla_prefill_bf16_gate", "mla.mla_decode_merge_bf16", "mla.mla_cache_write_bf16",
            "attnres.attn_res_norm_append_bf16"} <= names
    assert any(n.startswith("mla.mla_decode_split") for n in names)
    assert {r.target for r in reports} == set(isa.TARGETS)
    bad = [(r.name, r.target, r.error) for r in reports if r.error]
    assert not bad, bad


def test_matrix_instructions(reports):
    for r in reports:
        if r.expects_matrix:
            assert r.matrix_ops, f"{r.name} on {r.target}: no matrix instructions"
            if r.target == "gfx950":
                assert any("v_mfma" in op and "bf16" in op for op in r.matrix_ops), r.matrix_ops
            if r.target == "sm_90":
                assert any(op.startswith(("wgmma", "mma")) for op in r.matrix_ops), r.matrix_ops


def test_amd_no_vgpr_spills(reports):
    for r in reports:
        if r.target.startswith("gfx"):
            assert r.vgpr_spill == 0, f"{r.name} on {r.target}: {r.vgpr_spill} VGPR spills"
            assert r.lds_bytes <= (160 if r.target == "gfx950" else 64) * 1024


@pytest.mark.parametrize("target", ["gfx950", "gfx942"])
def test_amd_zero_spills_at_launch(target):
    cases = isa.family_cases(("mla", "attnres"))
    assert len(cases) >= 6
    for name, fn, sig, consts, _expects, opts in cases:
        o = dict(opts.get("hip", {}))
        rep = isa.compile_kernel(fn, sig, {**consts, **o.pop("constexprs", {})}, target, name=name, options=o)
        assert rep.error is None, rep.error
        assert rep.vgpr_spill == 0 and rep.sgpr_spill == 0, f"{name} on {target}: {rep.to_dict()}"
        asm = rep.asm
        if "cache_write" not in name:
            assert "global_load_dwordx4" in asm or "buffer_load_dwordx4" in asm, f"{name}: no 128-bit loads"
