"""gpu-runs/peer_ogs.py without a GPU: the EP slice's pairs per token, the one-line ImportError, the table, and,
where the peer package is given (``K3ROCM_TRITON_KERNELS`` or ``PYTHONPATH``, with ``TRITON_INTERPRET=1``), the
routing and weight packing it hands to the peer, checked against plain torch on tiny shapes (the peer's grouped
GEMM and combine need a GPU)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

from tests.helpers import script_module

peer_ogs = script_module("peer_ogs")


def test_local_top_k_k3_ep8():
    assert peer_ogs.local_top_k(16, 896, None) == 16
    assert peer_ogs.local_top_k(16, 896, 112) == 2
    assert peer_ogs.local_top_k(16, 896, 8) == 1
    with pytest.raises(ValueError):
        peer_ogs.local_top_k(16, 896, 0)


@pytest.mark.skipif(importlib.util.find_spec("triton_kernels") is not None, reason="peer package present")
def test_absent_peer_one_line_and_table(tmp_path, monkeypatch, capsys):
    if "triton_kernels" in sys.modules:
        pytest.skip("peer package already imported")
    monkeypatch.setenv(peer_ogs.ENV_VAR, str(tmp_path))
    with pytest.raises(ImportError) as exc:
        peer_ogs.find_triton_kernels()
    assert "\n" not in str(exc.value) and peer_ogs.ENV_VAR in str(exc.value)
    peer_ogs.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("| not installed |") == len(peer_ogs.ROWS) and out.count(peer_ogs.ENV_VAR) == 1
    rows = json.loads((tmp_path / "peer_ogs.json").read_text())["rows"]
    assert [(r["tokens"], r["num_local"]) for r in rows] == peer_ogs.ROWS
    assert rows[0]["ms"] is None


@pytest.fixture
def peer():
    """The peer package, importable here and run by the Triton interpreter; else the test is skipped."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("peer checks need TRITON_INTERPRET=1 when the peer is imported")
    try:
        return peer_ogs.find_triton_kernels()
    except ImportError as exc:
        pytest.skip(str(exc))


def test_routing_matches_torch_topk(peer):
    from triton_kernels.tensor_details.ragged_tensor import make_ragged_tensor_metadata_torch
    from triton_kernels.topk import topk_torch

    torch.manual_seed(0)
    tokens, experts, k = 8, 16, 4
    logits = torch.randn(tokens, experts)
    routing, gather, scatter = peer_ogs.make_routing(logits, k, topk_torch, make_ragged_tensor_metadata_torch)
    assert (routing.n_expts_tot, routing.n_expts_act) == (experts, k)
    ref_w, ref_e = torch.topk(logits, k, dim=1)
    counts = torch.bincount(ref_e.flatten(), minlength=experts)
    assert torch.equal(routing.expt_hist.long(), counts)
    # row i of the grouped GEMM is pair src[i] = token * k + slot, of the expert whose slice holds i
    src, dst = gather.src_indx.long(), gather.dst_indx.long()
    assert torch.equal(torch.sort(src)[0], torch.arange(tokens * k))
    assert torch.equal(src[dst], torch.arange(tokens * k))  # dst is src's inverse
    assert torch.equal(scatter.src_indx.long(), dst) and torch.equal(scatter.dst_indx.long(), src)
    expert_of_row = torch.repeat_interleave(torch.arange(experts), counts)
    token = src // k
    for i in range(tokens * k):
        slot = (ref_e[token[i]] == expert_of_row[i]).nonzero()
        assert slot.numel() == 1
        assert torch.allclose(routing.gate_scal[i].float(), torch.softmax(ref_w[token[i]], 0)[slot[0, 0]],
                              atol=1e-6)


def test_chunked_pack_is_the_peer_layout(peer):
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp_torch
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    torch.manual_seed(0)
    vals, scales = downcast_to_mxfp_torch(torch.randn(5, 256, 192).to(torch.bfloat16), torch.uint8, axis=1)
    assert vals.shape == (5, 128, 192) and vals.stride(-2) == 1
    opts_v, opts_s = {"mx_axis": 1}, {"mx_axis": 1, "num_warps": 4}
    w, s = peer_ogs.pack_experts(vals, scales, HopperMXValueLayout, opts_v, HopperMXScaleLayout, opts_s, chunk=2)
    for got, t, dtype, layout, opts in ((w, vals, FP4, HopperMXValueLayout, opts_v),
                                        (s, scales, None, HopperMXScaleLayout, opts_s)):
        ref = convert_layout(wrap_torch_tensor(t, dtype=dtype), layout, **opts)
        assert torch.equal(got.storage.data, ref.storage.data)
        assert got.storage.data.stride() == ref.storage.data.stride()
        assert got.storage.layout == ref.storage.layout and got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.equal(w.storage.layout.unswizzle_data(w.storage.data), vals)
    assert w.stride(-2) == 1  # the peer's grouped GEMM asserts K-contiguous MXFP4 weights below sm_100


def test_chunked_quantize_is_one_downcast(peer):
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp_torch

    torch.manual_seed(0)
    vals, scales = peer_ogs.quantize_experts(3, 128, 64, "cpu", downcast_to_mxfp_torch, chunk=2)
    torch.manual_seed(0)
    w = torch.cat([torch.randn((2, 128, 64), dtype=torch.bfloat16) * 128 ** -0.5,
                   torch.randn((1, 128, 64), dtype=torch.bfloat16) * 128 ** -0.5])
    ref_v, ref_s = downcast_to_mxfp_torch(w, torch.uint8, axis=1)
    assert torch.equal(vals, ref_v) and torch.equal(scales, ref_s)
    assert vals.shape == (3, 64, 64) and vals.stride(-2) == 1 and scales.shape == (3, 4, 64)
