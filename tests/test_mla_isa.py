"""Ahead-of-time compile of every MLA / AttnRes kernel for gfx950, gfx942 and sm_90 (no GPU needed).

Asserts: compiles everywhere, matrix instructions (v_mfma / wgmma / mma) wherever the kernel has a dot,
no VGPR spills on the AMD targets. SGPR spills are bounded, not zero yet (see SGPR_SPILL_BOUND).
"""

from __future__ import annotations

import pytest

isa = pytest.importorskip("k3rocm.kernels.isa")

#: SGPR spills (to VGPR lanes, not memory) still seen on AMD with triton 3.9 in the attention kernels;
#: the bound stops regressions until they are removed.
SGPR_SPILL_BOUND = 64


@pytest.fixture(scope="module")
def reports():
    import importlib
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, nothing to compile")
    for m in ("k3rocm.kernels.mla.prefill", "k3rocm.kernels.mla.decode", "k3rocm.kernels.mla",
              "k3rocm.kernels.attnres.attnres", "k3rocm.kernels.attnres"):
        mod = importlib.import_module(m)
        if any(type(getattr(mod, n, None)).__name__ == "InterpretedFunction" for n in dir(mod)):
            importlib.reload(mod)  # imported under the interpreter by an earlier test module
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


def test_amd_resources(reports):
    for r in reports:
        if r.target.startswith("gfx"):
            assert r.vgpr_spill == 0, f"{r.name} on {r.target}: {r.vgpr_spill} VGPR spills"
            assert (r.sgpr_spill or 0) <= SGPR_SPILL_BOUND, f"{r.name} on {r.target}: {r.sgpr_spill} SGPR spills"
            assert r.lds_bytes <= 160 * 1024 if r.target == "gfx950" else r.lds_bytes <= 64 * 1024
