"""Fused routing (``moe_route``: logits + top-k whose last program groups the pairs) against the fp32 oracle
and against ``moe_router`` + ``dispatch_gpu``: same ids and weights, the same dispatch tensors field by field.

Without a GPU this module reruns itself in a child process with ``TRITON_INTERPRET=1`` (as
tests/kernels/test_moe_triton.py does; the router takes its fp32 path there). On a GPU the same tests run
compiled, in bf16; the K3-width GPU case at 64 tokens is in tests/kernels/test_moe_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from k3rocm.model import moe as M

from tests.helpers import REPO, near_tie_router_inputs, script_module

GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CHILD = not GPU and not INTERP
FIELDS = ("sorted_pair", "pos", "counts", "offsets", "block_expert", "block_start")


def test_in_interpreter_child_process():
    """On a machine without a GPU: every test below, in a fresh process with TRITON_INTERPRET=1."""
    if not CHILD:
        pytest.skip("kernels run in this process (GPU present or TRITON_INTERPRET=1 already)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


@pytest.fixture(scope="module")
def tk():
    if CHILD:
        pytest.skip("run by test_in_interpreter_child_process")
    import k3rocm.kernels.moe.ops as ops

    yield types.SimpleNamespace(ops=ops, dev="cuda" if GPU else "cpu",
                                act_dtype=torch.bfloat16 if GPU else torch.float32)


def _same_dispatch(a, b):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
    assert a.block_m == b.block_m


@pytest.mark.parametrize("T,E,D,k,first,num_local,bm", [
    (1, 16, 64, 4, 0, 16, 16), (7, 16, 128, 4, 4, 8, 16), (37, 128, 96, 16, 32, 32, 32),
    (40, 64, 64, 8, 0, 64, 16)])
def test_route_equals_router_then_dispatch(tk, T, E, D, k, first, num_local, bm):
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, D, generator=g).bfloat16()
    w = (torch.randn(E, D, generator=g) * 0.1).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    xd, wd, bd = x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), bias.to(tk.dev)
    ids, wts, d = tk.ops.moe_route(xd, wd, bd, k, first, num_local, bm, scaling=2.5)
    rid, rw = M.moe_router(x, w, bias, k, scaling=2.5)
    assert (ids.cpu() == rid).all()
    torch.testing.assert_close(wts.cpu(), rw, rtol=1e-5, atol=1e-6)
    i2, w2 = tk.ops.moe_router(xd, wd, bd, k, scaling=2.5)
    assert torch.equal(ids, i2) and torch.equal(wts, w2)
    _same_dispatch(d, tk.ops.dispatch_gpu(ids, first, num_local, bm, one_program=True))
    radix = tk.ops.dispatch_gpu(ids, first, num_local, bm, one_program=False)  # -1 blocks' starts differ
    for f in FIELDS[:-1]:
        assert torch.equal(getattr(d, f), getattr(radix, f)), f
    ref = M.dispatch(ids.cpu(), E, (first, first + num_local))
    n = int(d.offsets[-1])
    assert torch.equal(d.sorted_pair[:n].cpu().long(), ref.sorted_pair.long())
    # repeatable: the handshake counter is back at zero, and the result is bitwise the same
    again = tk.ops.moe_route(xd, wd, bd, k, first, num_local, bm, scaling=2.5)
    assert torch.equal(again[0], ids) and torch.equal(again[1], wts)
    _same_dispatch(again[2], d)


def test_route_near_ties_and_no_bias(tk):
    x, w, bias = near_tie_router_inputs(5, 64, 64, 16)
    ids, _, _ = tk.ops.moe_route(x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), bias.to(tk.dev), 16,
                                 0, 64, 16)
    assert (ids.cpu() == M.moe_router(x, w, bias, 16)[0]).all()
    ids, wts, _ = tk.ops.moe_route(x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), None, 16, 0, 64, 16,
                                   renormalize=False)
    rid, rw = M.moe_router(x, w, None, 16, renormalize=False)
    assert (ids.cpu() == rid).all()
    torch.testing.assert_close(wts.cpu(), rw, rtol=1e-5, atol=1e-6)


def test_route_k3_width(tk):
    # K3: hidden 7168, 896 experts, top-16; random inputs, a few tokens (interpreter). Picks equal the oracle
    # wherever the biased top-16 margin exceeds fp32 accumulation noise.
    T, E, H = 2, 896, 7168
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(E, H, generator=g) * H ** -0.5).bfloat16()
    bias = torch.rand(E, generator=g) * 0.01
    ids, wts, d = tk.ops.moe_route(x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), bias.to(tk.dev), 16,
                                   0, E, 16, scaling=2.446)
    rid, rw = M.moe_router(x, w, bias, 16, scaling=2.446)
    biased = torch.sigmoid(x.float() @ w.float().t()) + bias
    for t in range(T):
        if not torch.equal(ids[t].cpu(), rid[t]):
            gap = (biased[t, ids[t].cpu().long()] - biased[t, rid[t].long()]).abs().max().item()
            assert gap < 2e-6, f"token {t}: picks differ beyond fp32 noise ({gap:.3g})"
        else:
            torch.testing.assert_close(wts[t].cpu(), rw[t], rtol=1e-5, atol=1e-6)
    _same_dispatch(d, tk.ops.dispatch_gpu(ids, 0, E, 16, one_program=True))


def test_route_rejects_bad_experts(tk):
    from k3rocm.errors import ConfigError

    x = torch.zeros(2, 32, device=tk.dev, dtype=tk.act_dtype)
    w = torch.zeros(16, 32, device=tk.dev, dtype=tk.act_dtype)
    with pytest.raises(ConfigError, match="local experts"):
        tk.ops.moe_route(x, w, None, 4, 8, 16, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="no GPU")
@pytest.mark.parametrize("T,ranks", [(1, 1), (64, 1), (64, 8), (512, 1)])
def test_route_k3_gpu(tk, T, ranks):
    # K3 size compiled: ids / weights / dispatch equal moe_router + dispatch_gpu bitwise, picks equal the fp32
    # oracle beyond fp32 noise, 20 repeats bitwise identical, and the launch captures in a CUDA/HIP graph
    E, H = 896, 7168
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    bias = torch.rand(E, device="cuda", generator=g) * 0.01
    per = E // ranks
    first = (ranks - 1) * per
    ids, wts, d = tk.ops.moe_route(x, w, bias, 16, first, per, 16, scaling=2.446)
    i2, w2 = tk.ops.moe_router(x, w, bias, 16, scaling=2.446)
    assert torch.equal(ids, i2) and torch.equal(wts, w2)
    _same_dispatch(d, tk.ops.dispatch_gpu(ids, first, per, 16, one_program=True))
    rid, _ = M.moe_router(x.float(), w.float(), bias, 16, scaling=2.446)
    biased = torch.sigmoid(x.float() @ w.float().t()) + bias
    for t in (ids != rid).any(1).nonzero().flatten().tolist():
        gap = (biased[t, ids[t].long()] - biased[t, rid[t].long()]).abs().max().item()
        assert gap < 2e-6, f"token {t}: picks differ beyond fp32 noise ({gap:.3g})"
    for _ in range(20):
        a = tk.ops.moe_route(x, w, bias, 16, first, per, 16, scaling=2.446)
        assert torch.equal(a[0], ids) and torch.equal(a[1], wts)
        _same_dispatch(a[2], d)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap = tk.ops.moe_route(x, w, bias, 16, first, per, 16, scaling=2.446)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cap[0], ids) and torch.equal(cap[1], wts)
    _same_dispatch(cap[2], d)


def test_bench_route_script_runs(tk, tmp_path):
    # the benchmark at k3-tiny sizes: both paths agree and the table and JSON are written
    bench = script_module("bench_route")
    assert bench.main(["--small", "--device", tk.dev, "--tokens", "3", "--no-graphs", "--out", str(tmp_path)]) == 0
    assert "| 3 |" in (tmp_path / "route_bench.md").read_text()
    assert (tmp_path / "route_bench.json").exists()
