"""Ahead-of-time compilation of the fused-routing top-k kernel with the bucket tile of each backend (no GPU
needed): spill-free on gfx950 / gfx942 with the HIP tile, compiles for sm_90 with the CUDA tile."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":  # pragma: no cover - AOT compile needs compiled kernels
    pytest.skip("TRITON_INTERPRET=1: ahead-of-time compilation needs compiled kernels", allow_module_level=True)

from k3rocm.kernels.isa import compile_kernel  # noqa: E402
from k3rocm.kernels.moe.configs import ROUTER_BUCKET_TOKENS  # noqa: E402
from k3rocm.kernels.moe.router import group_isa_case, topk_isa_case, topk_small_isa_case  # noqa: E402


@pytest.mark.parametrize("target", ["gfx950", "gfx942", "sm_90"])
def test_fused_route_topk_compiles(target):
    backend = "hip" if target.startswith("gfx") else "cuda"
    name, fn, sig, consts, expects, opts = topk_isa_case(True, ROUTER_BUCKET_TOKENS[backend])
    rep = compile_kernel(fn, sig, consts, target, name=name, options=opts[backend], expects_matrix=expects)
    assert rep.ok, f"{name} on {target}: {rep.problems()}"


@pytest.mark.parametrize("target,tokens", [("gfx950", 4), ("gfx942", 4), ("sm_90", 8)])
def test_one_program_route_compiles(target, tokens):
    # the one-program routing of decode-sized batches: spill-free on AMD at up to 4 tokens (8 warps), compiles for
    # sm_90 at 8
    backend = "hip" if target.startswith("gfx") else "cuda"
    name, fn, sig, consts, expects, opts = topk_small_isa_case(tokens, 8)
    rep = compile_kernel(fn, sig, consts, target, name=name, options=opts[backend], expects_matrix=expects)
    assert rep.ok, f"{name} on {target}: {rep.problems()}"


@pytest.mark.parametrize("target", ["gfx950", "gfx942", "sm_90"])
@pytest.mark.parametrize("num_local", [56, 896])
def test_per_expert_grouping_compiles(target, num_local):
    # the per-expert grouping launch (ROUTER_GROUPING "experts") for a K3 rank of EP16 and for all 896 experts
    backend = "hip" if target.startswith("gfx") else "cuda"
    name, fn, sig, consts, expects, opts = group_isa_case(num_local)
    rep = compile_kernel(fn, sig, consts, target, name=name, options=opts[backend], expects_matrix=expects)
    assert rep.ok, f"{name} on {target}: {rep.problems()}"


@pytest.mark.parametrize("target", ["gfx950", "gfx942", "sm_90"])
def test_topk_by_sort_compiles(target):
    # the top-k launch picking by tl.topk (configs.ROUTER_TOPK_SORT), where this Triton has it
    import triton.language as tl

    if not hasattr(tl, "topk"):
        pytest.skip("this Triton has no tl.topk")
    backend = "hip" if target.startswith("gfx") else "cuda"
    name, fn, sig, consts, expects, opts = topk_isa_case(False, sort=True)
    rep = compile_kernel(fn, sig, consts, target, name=name, options=opts[backend], expects_matrix=expects)
    assert rep.ok, f"{name} on {target}: {rep.problems()}"
