"""Fused routing (``moe_route``: logits + top-k whose last program groups the pairs) against the fp32 oracle
and against ``moe_router`` + ``dispatch_gpu``: same ids and weights, the same dispatch tensors field by field.

Without a GPU this module reruns itself in a child process with ``TRITON_INTERPRET=1`` (as
tests/kernels/test_moe_triton.py does; the router takes its fp32 path there). On a GPU the same tests run
compiled, in bf16; the K3-width GPU case at 64 tokens is in tests/kernels/test_moe_gpu.py.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from k3rocm.model import moe as M

from tests.helpers import run_module_in_interpreter, near_tie_router_inputs, random_experts, script_module

GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CHILD = not GPU and not INTERP
FIELDS = ("sorted_pair", "pos", "counts", "offsets", "block_expert", "block_start")


def test_in_interpreter_child_process():
    """On a machine without a GPU: every test below, in a fresh process with TRITON_INTERPRET=1."""
    run_module_in_interpreter(__file__)


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


@pytest.mark.parametrize("T,E,D,k,first,num_local,bm,bt", [
    (1, 16, 64, 4, 0, 16, 16, None), (7, 16, 128, 4, 4, 8, 16, None), (37, 128, 96, 16, 32, 32, 32, None),
    (40, 64, 64, 8, 0, 64, 16, None),
    # groups of 2 and 4 tokens: many groups, several tiles of group counts and of pairs in the last program
    (37, 64, 64, 8, 16, 32, 16, 2), (29, 32, 64, 16, 0, 32, 16, 4)])
@pytest.mark.parametrize("grouping", ["fused", "experts", "experts_sort"])
def test_route_equals_router_then_dispatch(tk, T, E, D, k, first, num_local, bm, bt, grouping):
    # experts_sort: the per-expert grouping after a top-k launch that picks by tl.topk (where Triton has it)
    grouping, sort = grouping.split("_")[0], grouping.endswith("sort")
    if sort and not tk.ops._topk_sort(True, "interpreter"):
        pytest.skip("this Triton has no tl.topk")
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, D, generator=g).bfloat16()
    w = (torch.randn(E, D, generator=g) * 0.1).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    xd, wd, bd = x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), bias.to(tk.dev)
    ids, wts, d = tk.ops.moe_route(xd, wd, bd, k, first, num_local, bm, scaling=2.5, bucket_tokens=bt,
                                   grouping=grouping, topk_sort=sort)
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
    again = tk.ops.moe_route(xd, wd, bd, k, first, num_local, bm, scaling=2.5, bucket_tokens=bt,
                             grouping=grouping, topk_sort=sort)
    assert torch.equal(again[0], ids) and torch.equal(again[1], wts)
    _same_dispatch(again[2], d)


@pytest.mark.parametrize("case", ["random", "multi_tile", "one_hot_expert", "all_off_rank", "one_local", "tail"])
def test_group_pairs_per_expert_equals_torch_dispatch(tk, case):
    # the per-expert grouping (router.group_pairs_kernel) on crafted ids against the torch path (radix sort) and
    # the one-program counting sort: more than one 1024-pair tile, one expert with more than 16 M blocks (several
    # block-table steps), no local pair at all, a single local expert, ids only in the last local expert
    g = torch.Generator().manual_seed(len(case))
    E, k, bm = 64, 8, 16
    T, first, num_local = 40, 8, 32
    if case == "multi_tile":
        T = 200  # 1600 pairs: two tiles
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if case == "one_hot_expert":
        T = 300
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[:, 0] = first + 3  # 300 pairs of one expert: 19 blocks of 16 rows
        ids[:, 1:] = torch.where(ids[:, 1:] == first + 3, first + 40 % E, ids[:, 1:])
    elif case == "all_off_rank":
        ids = torch.randint(first + num_local, E, (T, k), generator=g)
    elif case == "one_local":
        num_local = 1
    elif case == "tail":
        ids = torch.where(torch.rand(T, k, generator=g) < 0.3, torch.full((T, k), first + num_local - 1), ids)
    ids = ids.to(torch.int32).to(tk.dev)
    got = tk.ops.dispatch_gpu(ids, first, num_local, bm, per_expert=True)
    radix = tk.ops.dispatch_gpu(ids, first, num_local, bm, one_program=False)
    for f in FIELDS[:-1]:  # the torch path leaves other block starts for empty (-1) blocks
        assert torch.equal(getattr(got, f), getattr(radix, f)), f
    live = got.block_expert >= 0
    assert torch.equal(got.block_start[live], radix.block_start[live])
    assert (got.block_start[~live] == 0).all()
    if ids.numel() <= tk.ops.ONE_PROGRAM_MAX_PAIRS:
        _same_dispatch(got, tk.ops.dispatch_gpu(ids, first, num_local, bm, one_program=True))


def test_route_default_grouping_follows_the_local_expert_bound(tk, monkeypatch):
    # configs.ROUTER_GROUPING: the per-expert launch serves up to that many local experts, the fused one above;
    # both the same tensors, so the check is that the bound is read (and which kernel ran, by the scratch counters)
    from k3rocm.kernels.moe import configs
    from k3rocm.kernels.target import current_target

    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=g).to(tk.dev, tk.act_dtype)
    w = (torch.randn(32, 64, generator=g) * 0.1).to(tk.dev, tk.act_dtype)
    ref = tk.ops.moe_route(x, w, None, 4, 0, 16, 16, grouping="fused", small_tokens=0)
    ran = []
    real = tk.ops._group_pairs
    monkeypatch.setattr(tk.ops, "_group_pairs", lambda *a: (ran.append(a[2]), real(*a))[1])
    backend = current_target().backend
    for bound, expect in ((16, [16]), (15, [])):
        ran.clear()
        monkeypatch.setitem(configs.ROUTER_GROUPING, backend, bound)
        monkeypatch.setattr(tk.ops, "ROUTER_GROUPING", configs.ROUTER_GROUPING)
        got = tk.ops.moe_route(x, w, None, 4, 0, 16, 16, small_tokens=0)
        assert ran == expect, bound
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        _same_dispatch(got[2], ref[2])


def test_route_rejects_bad_grouping(tk):
    x = torch.randn(4, 16).to(tk.dev)
    with pytest.raises(tk.ops.ConfigError, match="grouping 'bogus'"):
        tk.ops.moe_route(x, torch.randn(8, 16).to(tk.dev), None, 2, 0, 8, 16, grouping="bogus")


@pytest.mark.parametrize("T,E,k,first,num_local,bias,renorm", [
    (1, 16, 4, 0, 16, True, True), (2, 64, 8, 16, 32, True, True), (5, 128, 16, 96, 32, False, True),
    (8, 64, 8, 0, 64, True, False), (3, 32, 16, 0, 32, True, True), (6, 48, 4, 40, 8, True, True)])
def test_route_one_program_equals_two_level(tk, T, E, k, first, num_local, bias, renorm):
    # the one-program routing of a decode-sized batch (router_topk_small_kernel) against the per-token programs
    # and their two-level grouping: the same ids, weights and every dispatch tensor; E = 32 with 32 local experts
    # fills every lane of the key tile (the offsets' last entry past the lanes)
    g = torch.Generator().manual_seed(T * 7 + E)
    D = 64
    x = torch.randn(T, D, generator=g).to(tk.dev, tk.act_dtype)
    w = (torch.randn(E, D, generator=g) * 0.1).to(tk.dev, tk.act_dtype)
    b = (torch.randn(E, generator=g) * 0.01).to(tk.dev) if bias else None
    bm = 16
    one = tk.ops.moe_route(x, w, b, k, first, num_local, bm, renormalize=renorm, scaling=2.5, small_tokens=8)
    two = tk.ops.moe_route(x, w, b, k, first, num_local, bm, renormalize=renorm, scaling=2.5, small_tokens=0)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    _same_dispatch(one[2], two[2])
    _same_dispatch(one[2], tk.ops.dispatch_gpu(one[0], first, num_local, bm, one_program=True))
    assert int(one[2].offsets[-1]) == int(((one[0] >= first) & (one[0] < first + num_local)).sum())


def test_route_rejects_bad_small_tokens(tk):
    x = torch.randn(3, 16).to(tk.dev)
    with pytest.raises(tk.ops.ConfigError, match="small_tokens 9"):
        tk.ops.moe_route(x, torch.randn(8, 16).to(tk.dev), None, 2, 0, 8, 16, small_tokens=9)


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
    with pytest.raises(ConfigError, match="power of two"):
        tk.ops.moe_route(x, w, None, 4, 0, 16, 16, bucket_tokens=3)


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


def _experts_on(ew, dev, first, num_local):
    sl = slice(first, first + num_local)
    return {**{n: ew[n][sl].to(dev) for n in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")},
            "num_experts": num_local, "first_expert": first}


@pytest.mark.parametrize("T,first,num_local", [(1, 0, 16), (7, 0, 16), (9, 8, 8)])
def test_experts_take_the_routed_dispatch(tk, T, first, num_local):
    # moe_router(..., experts=) groups the pairs for the BLOCK_M that moe_experts picks; handing that dispatch
    # to moe_experts gives bitwise the output of grouping inside moe_experts (one rank of EP2 included)
    g = torch.Generator().manual_seed(T)
    E, D, k = 16, 64, 4
    x = torch.randn(T, D, generator=g).bfloat16()
    gate = (torch.randn(E, D, generator=g) * 0.1).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    ew = _experts_on(random_experts(E, D, 64, seed=5), tk.dev, first, num_local)
    xd = x.to(tk.dev, tk.act_dtype)
    ids, wts, d = tk.ops.moe_router(xd, gate.to(tk.dev, tk.act_dtype), bias.to(tk.dev), k, experts=ew)
    # the rank's share of the pairs sizes the tile (num_experts: the global count)
    cfg = tk.ops.gemm_pick(T * k, num_local, num_experts=E)
    assert d.block_m == cfg["BLOCK_M"] and d.num_experts == E
    _same_dispatch(d, tk.ops.dispatch_gpu(ids, first, num_local, d.block_m, one_program=True))
    xl = x.to(tk.dev)
    alone = tk.ops.moe_experts(xl, ids, wts, ew, poison=True, config=cfg)
    given = tk.ops.moe_experts(xl, ids, wts, ew, poison=True, dispatch=d)
    assert torch.isfinite(given).all() and torch.equal(given, alone)


def test_experts_reject_a_dispatch_for_other_tiles(tk):
    from k3rocm.errors import ConfigError

    ew = _experts_on(random_experts(16, 64, 64, seed=1), tk.dev, 0, 16)
    ids = torch.arange(8, dtype=torch.int32, device=tk.dev).reshape(2, 4)
    wts = torch.full((2, 4), 0.25, device=tk.dev)
    bm = tk.ops.gemm_pick(8, 16)["BLOCK_M"]
    with pytest.raises(ConfigError, match="does not fit"):
        tk.ops.moe_experts(torch.zeros(2, 64, device=tk.dev), ids, wts, ew,
                           dispatch=tk.ops.dispatch_gpu(ids, 0, 16, 2 * bm))


def test_moe_block_routes_once_for_the_experts(tk, tiny_ckpt, tiny_cfg, monkeypatch):
    # the model's MoE block on the Triton pair routes and groups in moe_router and never groups again in
    # moe_experts; the output is bitwise that of the unfused path (the same ops behind wrappers that hide the
    # optional parameters)
    from k3rocm.model import layer as L
    from k3rocm.model.weights import load_weights

    w = L.WeightView(load_weights(tiny_ckpt, device=tk.dev), memo=True)
    layer = next(i for i in range(tiny_cfg.num_hidden_layers) if tiny_cfg.is_moe_layer(i))
    x = torch.randn(5, tiny_cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(tk.dev)
    fused = {"moe_router": tk.ops.moe_router, "moe_experts": tk.ops.moe_experts}
    plain = {n: (lambda f: lambda *a, **kw: f(*a, **kw))(f) for n, f in fused.items()}
    groupings = []
    real = tk.ops.dispatch_gpu
    monkeypatch.setattr(tk.ops, "dispatch_gpu", lambda *a, **kw: groupings.append(1) or real(*a, **kw))
    y_plain = L.moe_block(x, w, layer, tiny_cfg, plain)
    assert len(groupings) == 1
    y_fused = L.moe_block(x, w, layer, tiny_cfg, fused)
    assert len(groupings) == 1, "moe_experts grouped the pairs again"
    assert torch.isfinite(y_fused).all() and torch.equal(y_fused, y_plain)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="no GPU")
@pytest.mark.parametrize("T,ranks", [(2, 1), (64, 1), (64, 8), (512, 1)])
def test_routed_dispatch_k3_gpu(tk, T, ranks):
    # K3 width (hidden 7168 -> latent 3584, 896 experts, top-16, intermediate 3072): the routed dispatch
    # handed to moe_experts gives bitwise the output of grouping inside it; route + experts capture in one
    # graph and replay to the same output
    E, H, LAT, INTER = 896, 7168, 3584, 3072
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    gate = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    bias = torch.rand(E, device="cuda", generator=g) * 0.01
    xl = torch.randn(T, LAT, device="cuda", generator=g).bfloat16()
    per = E // ranks
    ew = dict(w13_packed=torch.randint(0, 256, (per, 2 * INTER, LAT // 2), dtype=torch.uint8, device="cuda",
                                       generator=g),
              w13_scale=torch.randint(119, 123, (per, 2 * INTER, LAT // 32), dtype=torch.uint8, device="cuda",
                                      generator=g),
              w2_packed=torch.randint(0, 256, (per, LAT, INTER // 2), dtype=torch.uint8, device="cuda", generator=g),
              w2_scale=torch.randint(119, 123, (per, LAT, INTER // 32), dtype=torch.uint8, device="cuda",
                                     generator=g),
              num_experts=per, first_expert=0)
    ids, wts, d = tk.ops.moe_router(x, gate, bias, 16, scaling=2.446, experts=ew)
    alone = tk.ops.moe_experts(xl, ids, wts, ew)
    given = tk.ops.moe_experts(xl, ids, wts, ew, dispatch=d)
    assert torch.isfinite(alone).all() and torch.equal(given, alone)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ci, cw, cd = tk.ops.moe_router(x, gate, bias, 16, scaling=2.446, experts=ew)
        cap = tk.ops.moe_experts(xl, ci, cw, ew, dispatch=cd)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ci, ids) and torch.equal(cap, alone)


def test_bench_route_script_runs(tk, tmp_path):
    # the benchmark at k3-tiny sizes: both paths agree and the table and JSON are written
    bench = script_module("bench_route")
    assert bench.main(["--small", "--device", tk.dev, "--tokens", "3", "--no-graphs", "--out", str(tmp_path)]) == 0
    assert "| 3 |" in (tmp_path / "route_bench.md").read_text()
    assert (tmp_path / "route_bench.json").exists()


def test_gemm_pick_counts_the_ranks_share_of_pairs(tk):
    # 256 pairs over 16 local experts: 16 rows each when all experts are local, 4 when the 16 are a quarter of
    # 64 (expert parallelism: the rank expects 64 of the 256 pairs), so a narrower tile may be picked
    # (the backend's table may start with few-pairs entries, ``max_pairs``: a rank's 64 expected pairs skip them)
    table = tk.ops.tune.configs(tk.ops.GEMM_CONFIGS)
    inf = float("inf")
    covering = lambda rows, pairs: next(c for c in table if rows <= c.get("max_rows", inf)  # noqa: E731
                                        and pairs <= c.get("max_pairs", inf))
    assert tk.ops.gemm_pick(256, 16) == covering(16, 256) != covering(4, 64)
    assert tk.ops.gemm_pick(256, 16, num_experts=64) == covering(4, 64)
    assert tk.ops.gemm_pick(256, 16, num_experts=16) == tk.ops.gemm_pick(256, 16)


def test_bench_moe_decode_script_runs(tk, tmp_path):
    # the few-pair expert benchmark at k3-tiny sizes on a rank's slice: every decode config it runs matches the
    # served config's output, and the table and JSON are written
    import json

    bench = script_module("bench_moe_decode")
    assert bench.main(["--small", "--device", tk.dev, "--tokens", "3", "9", "--ep-ranks", "4",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "moe_decode.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [3, 9]
    for r in rows:
        rels = {k: v for k, v in r.items() if k.endswith("_rel")}
        assert rels and not [k for k in r if k.endswith("_error")], r
        assert max(rels.values()) < 1e-3, rels
    assert "| 9 |" in (tmp_path / "moe_decode.md").read_text()


@pytest.mark.parametrize("warps", [1, 2, 8])
def test_route_any_topk_warps_same_tensors(tk, warps):
    # the fused top-k + grouping launch at another warp count gives the same ids, weights and grouping
    T, E, D, k = 37, 64, 128, 4
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(warps)).to(tk.dev)
    gate = torch.randn(E, D, generator=torch.Generator().manual_seed(1)).to(tk.dev) * D ** -0.5
    bias = torch.rand(E, generator=torch.Generator().manual_seed(2)).to(tk.dev) * 0.01
    ref = tk.ops.moe_route(x, gate, bias, k, 8, 32, 16, bucket_tokens=4)
    got = tk.ops.moe_route(x, gate, bias, k, 8, 32, 16, bucket_tokens=4, topk_warps=warps)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    _same_dispatch(ref[2], got[2])


def test_route_rejects_bad_topk_warps(tk):
    x = torch.randn(3, 16).to(tk.dev)
    with pytest.raises(tk.ops.ConfigError, match="topk_warps 3"):
        tk.ops.moe_route(x, torch.randn(8, 16).to(tk.dev), None, 2, 0, 8, 16, topk_warps=3)
