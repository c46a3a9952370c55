"""Every KDA kernel compiles ahead of time for gfx950, gfx942 and sm_90 (no GPU needed).

Asserts matrix instructions where the kernel does matrix work (the prefill kernels: bf16 MFMA,
``v_mfma_f32_*_bf16``, on AMD, but for the UT solve's fp32 MFMA; wgmma / mma on sm_90), zero VGPR and SGPR spills on gfx950 and gfx942, and records VGPR counts and LDS bytes
(printed, and written as JSON lines to ``$KDA_ISA_LOG`` when set).
"""

from __future__ import annotations

import json
import os

import pytest

from k3rocm.kernels.isa import TARGETS, compile_kernel
from k3rocm.kernels import kda, tune

CASES = {c[0]: c for c in kda.isa_cases()}
#: the one prefill kernel whose matrix work stays fp32 on AMD: the UT solve's 16 x 16 block products (fp32 MFMA;
#: its diagonal-block inverses are IEEE fp32), where a bf16 operand would cost the solve's accuracy
FP32_MATRIX = {"prefill_solve", "prefill_solve_f16"}
#: the kernels of prefill.PRODUCTS "fp16" whose products are all one fp16 product (fp16 MFMA, no bf16 and no fp32)
#: fp16 products with the UT solve's fp32 ones in the same kernel (the w / u kernel's SV entries)
F16_F32_MATRIX = {"prefill_wu_sv_f16"}
#: the one-program chunk phases (the intra table's LC entries): the CS gate's bf16 products, fp16 ones, the solve's
#: fp32 ones
MIXED_MATRIX = {"prefill_local_f16"}
F16_MATRIX = {"prefill_wu_f16", "prefill_state_f16", "prefill_state_f16_fo", "prefill_out_f16", "prefill_seg_f16"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_kda_kernel_isa(name, target, monkeypatch):
    # an interpreter test module in the same process may have set TRITON_INTERPRET; compiling needs it off
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, fn, sig, consts, expects, opts = CASES[name]
    be = "hip" if target.startswith("gfx") else "cuda"
    rep = compile_kernel(fn, sig, consts, target, name=f"kda.{name}", options=opts.get(be, {}),
                         expects_matrix=expects)
    rec = dict(kernel=rep.name, target=target, matrix_ops=rep.matrix_ops, vgpr=rep.vgpr, agpr=rep.agpr,
               vgpr_spill=rep.vgpr_spill, sgpr_spill=rep.sgpr_spill, lds_bytes=rep.lds_bytes,
               num_warps=rep.num_warps)
    print(json.dumps(rec))
    if os.environ.get("KDA_ISA_LOG"):
        with open(os.environ["KDA_ISA_LOG"], "a") as f:
            f.write(json.dumps(rec) + "\n")
    assert rep.error is None, rep.error
    if expects:
        assert rep.matrix_ops, f"{name} on {target}: no matrix instructions"
        if be == "hip" and name in FP32_MATRIX:
            assert all(op.startswith("v_mfma_f32_") and op.endswith("_f32") for op in rep.matrix_ops), \
                f"{name} on {target}: {rep.matrix_ops}"
        elif be == "hip" and name in F16_F32_MATRIX:
            assert any(op.startswith("v_mfma_f32_") and op.endswith("_f16") for op in rep.matrix_ops), rep.matrix_ops
            assert all(op.startswith("v_mfma_f32_") and op.endswith(("_f16", "_f32")) for op in rep.matrix_ops), \
                f"{name} on {target}: {rep.matrix_ops}"
        elif be == "hip" and name in MIXED_MATRIX:
            assert {"bf16", "f16", "f32"} <= {op.rsplit("_", 1)[-1] for op in rep.matrix_ops}, rep.matrix_ops
            assert all(op.startswith("v_mfma_f32_") for op in rep.matrix_ops), f"{name} on {target}: {rep.matrix_ops}"
        elif be == "hip" and name in F16_MATRIX:
            assert rep.matrix_ops and all(op.startswith("v_mfma_f32_") and "f16" in op and "bf16" not in op
                                          for op in rep.matrix_ops), f"{name} on {target}: {rep.matrix_ops}"
        elif be == "hip":
            assert any(op.startswith("v_mfma_f32_") and "bf16" in op for op in rep.matrix_ops), \
                f"{name} on {target}: no bf16 MFMA in {rep.matrix_ops}"
        else:
            assert any(op.startswith(("wgmma", "mma")) for op in rep.matrix_ops)
    if be == "hip":
        assert rep.vgpr_spill == 0, f"{name} on {target}: {rep.vgpr_spill} VGPR spills"
        assert rep.sgpr_spill == 0, f"{name} on {target}: {rep.sgpr_spill} SGPR spills"
        assert rep.vgpr is not None and rep.vgpr > 0
    assert rep.lds_bytes is not None and rep.lds_bytes <= (160 * 1024 if target == "gfx950" else 64 * 1024
                                                            if target == "gfx942" else 228 * 1024)


@pytest.mark.parametrize("target", [t for t in TARGETS if t.startswith("gfx")])
@pytest.mark.parametrize("ci", range(len(kda.configs.DECODE["hip"])))
def test_kda_decode_vgpr_budget(ci, target, monkeypatch):
    """Every HIP decode config (whole-row, V-tiled and three-launch) fits 128 VGPRs (two waves per SIMD or more), no spills."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    meta, opts = tune.split(kda.configs.DECODE["hip"][ci], interp=False)
    if meta.get("SPLIT"):  # the three-launch form: its per-config launch is the state grid
        _, fn, sig, consts, _, _ = CASES["decode_split_state"]
        rep = compile_kernel(fn, sig, {**consts, "BV": meta["BV"]}, target, name="kda.decode_split_state",
                             options=opts)
        assert rep.error is None, rep.error
        assert rep.vgpr_spill == 0 and rep.vgpr is not None and rep.vgpr + (rep.agpr or 0) <= 128, \
            f"decode config {ci} on {target}: {rep.vgpr} VGPRs + {rep.agpr} AGPRs, {rep.vgpr_spill} spills"
        return
    _, fn, sig, consts, _, _ = CASES["decode"]
    bv = meta["BV"]
    rep = compile_kernel(fn, sig, {**consts, "BV": bv, "PRE": int(meta.get("PRE", 0)), "WIN": int(meta.get("WIN", 0))},
                         target, name="kda.decode", options=opts)
    assert rep.error is None, rep.error
    assert rep.vgpr_spill == 0 and rep.vgpr is not None and rep.vgpr + (rep.agpr or 0) <= 128, \
        f"decode config {ci} on {target}: {rep.vgpr} VGPRs + {rep.agpr} AGPRs, {rep.vgpr_spill} spills"


PREFILL_TABLES = {"prefill_intra": kda.configs.INTRA, "prefill_wu": kda.configs.WU, "prefill_state": kda.configs.STATE,
                  "prefill_out": kda.configs.OUT, "prefill_wu_f16": kda.configs.WU,
                  "prefill_state_f16": kda.configs.STATE, "prefill_out_f16": kda.configs.OUT}


@pytest.mark.parametrize("target", [t for t in TARGETS if t.startswith("gfx")])
@pytest.mark.parametrize("name,ci", [(n, i) for n, t in PREFILL_TABLES.items() for i in range(len(t["hip"]))])
def test_kda_prefill_every_hip_config_bf16_mfma_no_spills(name, ci, target, monkeypatch):
    """Every HIP config of the prefill kernels runs 16-bit MFMA (bf16 for "split", fp16 for the ``_f16`` cases of
    prefill.PRODUCTS "fp16") and spills nothing (the tuner may pick any)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, fn, sig, consts, _, _ = CASES[name]
    meta, opts = tune.split(PREFILL_TABLES[name]["hip"][ci], interp=False)
    if name == "prefill_state" and meta.get("FO"):
        pytest.skip("the output in the loop does not run on split products in the plain loop (prefill.fo_ok)")
    # a SEG entry's loop is the state kernel at the entry's other keys (its runs' maps: the prefill_seg_f16 case)
    meta.pop("SEG", None)
    if meta.pop("LC", 0):  # the one-program chunk phases: their own kernel (the prefill_local_f16 case)
        _, fn, sig, consts, _, _ = CASES["prefill_local_f16"]
        name = "prefill_local_f16"
    rep = compile_kernel(fn, sig, {**consts, **meta}, target, name=f"kda.{name}", options=opts, expects_matrix=True)
    assert rep.error is None, rep.error
    if name in F16_MATRIX:
        assert any(op.startswith("v_mfma_f32_") and "f16" in op and "bf16" not in op for op in rep.matrix_ops), \
            rep.matrix_ops
    else:
        assert any(op.startswith("v_mfma_f32_") and "bf16" in op for op in rep.matrix_ops), rep.matrix_ops
    assert rep.vgpr_spill == 0 and rep.sgpr_spill == 0, f"{name} config {ci} on {target}: {rep.vgpr_spill} spills"


@pytest.mark.parametrize("target", [t for t in TARGETS if t.startswith("gfx")])
@pytest.mark.parametrize("name", ["decode_split_prep", "decode_split_norm"])
def test_kda_split_decode_side_launches_vgpr_budget(name, target, monkeypatch):
    """The SPLIT decode's prologue and norm launches (fixed warps, not in the config table) fit 128 VGPRs with no
    spills on CDNA, as every decode config's state launch does (test_kda_decode_vgpr_budget)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, fn, sig, consts, _, opts = CASES[name]
    rep = compile_kernel(fn, sig, consts, target, name=f"kda.{name}", options=opts["hip"])
    assert rep.error is None, rep.error
    assert rep.vgpr_spill == 0 and rep.vgpr is not None and rep.vgpr + (rep.agpr or 0) <= 128, \
        f"{name} on {target}: {rep.vgpr} VGPRs + {rep.agpr} AGPRs, {rep.vgpr_spill} spills"
