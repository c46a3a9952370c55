"""MLA and AttnRes kernels on a GPU at K3 sizes (bf16, FP8 cache), against the fp32 oracle.

Grid (issue 4): heads per rank {8, 12, 24, 96}; batch {1, 2, 3, 64, 256}; contexts {1, 23, 500, 8000,
131072} mixed within one batch; decode q lengths 1 and 2; prefill lengths around block and chunk
boundaries; decode after prefill; every config 20 times, bit-identical. Fresh random inputs, poisoned outputs.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]

DN, DR, DV, R = 128, 64, 128, 512
SCALE = (DN + DR) ** -0.5
BF = torch.bfloat16
CTX = [1, 23, 500, 8000, 131072]
PAGE = 64


def _cu(lens, dev="cuda"):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


@pytest.mark.parametrize("lq,lk", [
    ([1, 63, 64, 65, 127, 128, 129], [1, 63, 64, 65, 127, 128, 129]),
    ([500, 2048], [500, 2048]),
    ([64, 100, 128], [1064, 164, 4224]),  # chunks after cached context (chunk boundaries)
])
def test_prefill_bf16_vs_oracle(lq, lk):
    from k3rocm.kernels.mla import prefill as P
    from k3rocm.model.mla import mla_prefill as ref_fn
    g = torch.Generator(device="cuda").manual_seed(sum(lk))
    H = 12
    q = torch.randn(sum(lq), H, DN + DR, device="cuda", generator=g).to(BF)
    kn = torch.randn(sum(lk), H, DN, device="cuda", generator=g).to(BF)
    kr = torch.randn(sum(lk), DR, device="cuda", generator=g).to(BF)
    v = torch.randn(sum(lk), H, DV, device="cuda", generator=g).to(BF)
    gate = torch.randn(sum(lq), H * DV, device="cuda", generator=g).to(BF)
    ref = ref_fn(q, kn, kr, v, _cu(lq), _cu(lk), SCALE, gate=gate)
    for cfg in P.PREFILL_CONFIGS["hip" if torch.version.hip else "cuda"]:
        out = torch.full((sum(lq), H, DV), float("nan"), device="cuda", dtype=BF)
        o = P.mla_prefill(q, kn, kr, v, _cu(lq), _cu(lk), SCALE, gate=gate, out=out, config=cfg)
        assert torch.isfinite(o).all()
        assert _rel(o, ref) < 1e-2, (cfg, _rel(o, ref))
        runs = [P.mla_prefill(q, kn, kr, v, _cu(lq), _cu(lk), SCALE, gate=gate, config=cfg) for _ in range(20)]
        assert all(torch.equal(r, runs[0]) for r in runs)


@pytest.fixture(scope="module")
def big_cache():
    """A bf16 paged cache for 256 sequences with contexts cycling through CTX (+2 spare tokens each)."""
    from k3rocm.kernels.mla.decode import mla_cache_write
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [CTX[i % len(CTX)] + 1 for i in range(256)]  # +1 so that Tq=2 always fits
    nblk_seq = [math.ceil(L / PAGE) for L in lens]
    nblk = sum(nblk_seq)
    perm = torch.randperm(nblk, device="cuda", generator=g).to(torch.int32)
    bt = torch.zeros(256, max(nblk_seq), dtype=torch.int32, device="cuda")
    off = 0
    for n, nb in enumerate(nblk_seq):
        bt[n, :nb] = perm[off:off + nb]
        off += nb
    cache = torch.empty(nblk, PAGE, R + DR, dtype=BF, device="cuda")
    cache.normal_(generator=g)
    # write a few rows through the kernel too (slot path on real sizes)
    slots = (bt[:, 0].long() * PAGE).contiguous()
    lat = torch.randn(256, R, device="cuda", generator=g).to(BF)
    kr = torch.randn(256, DR, device="cuda", generator=g).to(BF)
    mla_cache_write(cache, slots, lat, kr)
    assert torch.equal(cache.view(-1, R + DR)[slots], torch.cat([lat, kr], -1))
    return cache, bt, lens


@pytest.mark.parametrize("H", [8, 12, 24, 96])
@pytest.mark.parametrize("N", [1, 2, 3, 64, 256])
@pytest.mark.parametrize("Tq", [1, 2])
def test_decode_grid(big_cache, H, N, Tq):
    from k3rocm.kernels.mla.decode import mla_decode
    from k3rocm.model.mla import mla_decode as ref_fn
    cache, bt, lens = big_cache
    g = torch.Generator(device="cuda").manual_seed(H * 1000 + N * 10 + Tq)
    sel = torch.randperm(256, device="cuda", generator=g)[:N] if N < 256 else torch.arange(256, device="cuda")
    cl = torch.tensor([lens[i] for i in sel.tolist()], dtype=torch.int32, device="cuda")
    btn = bt[sel]
    W = torch.randn(H * (DN + DV), R, device="cuda", generator=g) * R ** -0.5
    w_kc = W.view(H, DN + DV, R)[:, :DN].contiguous()
    w_vc = W.view(H, DN + DV, R)[:, DN:].transpose(1, 2).contiguous()
    qn = torch.randn(N, Tq, H, DN, device="cuda", generator=g).to(BF)
    qr = torch.randn(N, Tq, H, DR, device="cuda", generator=g).to(BF)
    gate = torch.randn(N, Tq, H * DV, device="cuda", generator=g).to(BF)
    out = torch.full((N, Tq, H, DV), float("nan"), device="cuda", dtype=BF)
    o = mla_decode(qn, qr, cache, btn, cl, w_kc.to(BF), w_vc.to(BF), SCALE, gate=gate, out=out)
    assert torch.isfinite(o).all()  # every row written (poisoned output)
    # the fp32 oracle loops over sequences: check up to 24 of them, always including the longest context
    chk = torch.arange(N, device="cuda")
    if N > 24:
        chk = torch.unique(torch.cat([chk[torch.randperm(N, device="cuda", generator=g)[:23]], cl.argmax()[None]]))
    ref = ref_fn(qn[chk], qr[chk], cache, btn[chk], cl[chk], w_kc.to(BF), w_vc.to(BF), SCALE, gate=gate[chk])
    assert _rel(o[chk], ref) < 2e-2, _rel(o[chk], ref)


def test_decode_every_config_20x_and_fp8():
    from k3rocm.kernels.mla import decode as D
    from k3rocm.model import mla as M
    from k3rocm.numerics import FP8_MAX
    g = torch.Generator(device="cuda").manual_seed(7)
    H, N, L = 12, 8, 3000
    nb = math.ceil(L / PAGE)
    bt = torch.randperm(N * nb, device="cuda", generator=g).to(torch.int32).view(N, nb)
    lat = torch.randn(N * L, R, device="cuda", generator=g)
    kr = torch.randn(N * L, DR, device="cuda", generator=g)
    pos = torch.arange(L, device="cuda")
    slots = (bt.long()[:, pos // PAGE] * PAGE + pos % PAGE).flatten()
    W = torch.randn(H * (DN + DV), R, device="cuda", generator=g) * R ** -0.5
    w_kc, w_vc = M.split_kv_b(W, H, DN, DV)
    qn = torch.randn(N, 1, H, DN, device="cuda", generator=g).to(BF)
    qr = torch.randn(N, 1, H, DR, device="cuda", generator=g).to(BF)
    cl = torch.full((N,), L, dtype=torch.int32, device="cuda")
    c16 = torch.empty(N * nb, PAGE, R + DR, device="cuda", dtype=BF)
    D.mla_cache_write(c16, slots, lat.to(BF), kr.to(BF))
    for cfg in D.DECODE_CONFIGS["hip" if torch.version.hip else "cuda"]:
        for splits in (None, 5):
            runs = [D.mla_decode(qn, qr, c16, bt, cl, w_kc.to(BF), w_vc.to(BF), SCALE, config=cfg, num_splits=splits)
                    for _ in range(20)]
            assert all(torch.equal(r, runs[0]) for r in runs)
            assert _rel(runs[0], M.mla_decode(qn, qr, c16, bt, cl, w_kc.to(BF), w_vc.to(BF), SCALE)) < 2e-2
    fp8 = M.fp8_cache_dtype(torch.cuda.get_device_properties(0).gcnArchName if torch.version.hip else "sm_90")
    scale = float(torch.cat([lat, kr], -1).abs().max()) / FP8_MAX[fp8]
    c8 = torch.empty(N * nb, PAGE, R + DR, device="cuda", dtype=fp8)
    c8_ref = torch.empty_like(c8)
    D.mla_cache_write(c8, slots, lat, kr, kv_scale=scale)
    M.mla_cache_write(c8_ref, slots, lat, kr, kv_scale=scale)
    # compare the written slots only (the last page of each sequence has unwritten, uninitialised slots)
    got_b = c8.view(torch.uint8).view(-1, R + DR)[slots]
    ref_b = c8_ref.view(torch.uint8).view(-1, R + DR)[slots]
    same = (got_b == ref_b).float().mean().item()
    assert same > 0.999, same
    o8 = D.mla_decode(qn, qr, c8, bt, cl, w_kc.to(BF), w_vc.to(BF), SCALE, kv_scale=scale)
    ref8 = M.mla_decode(qn, qr, c8_ref, bt, cl, w_kc.to(BF), w_vc.to(BF), SCALE, kv_scale=scale)
    ref32 = M.mla_decode(qn, qr, c16.float(), bt, cl, w_kc, w_vc, SCALE)
    print(f"fp8 decode: rel vs fp8 oracle {_rel(o8, ref8):.4%}, vs bf16-cache fp32 oracle {_rel(o8, ref32):.4%}")
    assert _rel(o8, ref8) < 2e-2


def test_decode_after_prefill_k3_dims():
    from k3rocm.kernels.mla import decode as D
    from k3rocm.kernels.mla import prefill as P
    from k3rocm.model import mla as M
    g = torch.Generator(device="cuda").manual_seed(9)
    H, L = 12, 777
    W = torch.randn(H * (DN + DV), R, device="cuda", generator=g) * R ** -0.5
    w_kc, w_vc = M.split_kv_b(W, H, DN, DV)
    lat = torch.randn(L + 2, R, device="cuda", generator=g).to(BF).float()
    kr = torch.randn(L + 2, DR, device="cuda", generator=g).to(BF).float()
    q = torch.randn(L + 2, H, DN + DR, device="cuda", generator=g).to(BF).float()
    kn = torch.einsum("hdr,tr->thd", w_kc, lat)
    v = torch.einsum("hrv,tr->thv", w_vc, lat)
    full = M.mla_prefill(q, kn, kr, v, _cu([L + 2]), _cu([L + 2]), SCALE)
    fullk = P.mla_prefill(q.to(BF), kn.to(BF), kr.to(BF), v.to(BF), _cu([L + 2]), _cu([L + 2]), SCALE)
    assert _rel(fullk, full) < 1e-2
    nb = math.ceil((L + 2) / PAGE)
    bt = torch.randperm(nb + 3, device="cuda", generator=g)[:nb].to(torch.int32)[None]
    pos = torch.arange(L + 2, device="cuda")
    cache = torch.full((nb + 3, PAGE, R + DR), float("nan"), device="cuda", dtype=BF)
    D.mla_cache_write(cache, (bt[0].long()[pos // PAGE] * PAGE + pos % PAGE), lat.to(BF), kr.to(BF))
    o = D.mla_decode(q[None, L:, :, :DN].to(BF), q[None, L:, :, DN:].to(BF), cache, bt,
                     torch.tensor([L + 2], dtype=torch.int32, device="cuda"), w_kc.to(BF), w_vc.to(BF), SCALE)
    assert _rel(o[0], full[L:]) < 2e-2


def test_attnres_k3_dims_every_config_20x():
    from k3rocm.kernels.attnres import attnres as K
    from k3rocm.model import attnres as A
    g = torch.Generator(device="cuda").manual_seed(5)
    T, D = 300, 7168
    for dt in (torch.float32, BF):
        bank = torch.randn(8, T, D, device="cuda", generator=g).to(dt)
        bank[7] = float("nan")
        pre = torch.randn(T, D, device="cuda", generator=g).to(dt)
        w = torch.randn(D, device="cuda", generator=g) * D ** -0.5 * 4
        nw = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
        bref = bank.clone()
        h_ref, hn_ref = A.attn_res_norm(bref, 7, pre, w, nw, 1e-5, append=True)
        for cfg in K.ATTNRES_CONFIGS["hip" if torch.version.hip else "cuda"]:
            runs = []
            for _ in range(20):
                b = bank.clone()
                runs.append(K.attn_res_norm(b, 7, pre, w, nw, 1e-5, append=True, config=cfg))
                assert torch.equal(b, bref)
            assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)
            torch.testing.assert_close(runs[0][0], h_ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(runs[0][1], hn_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dn,dr,dv,r,H", [(96, 32, 96, 384, 12), (128, 64, 128, 448, 7)])
def test_odd_dims_bf16(dn, dr, dv, r, H):
    """Head dims, rank and head counts that are not powers of two (padded + masked): prefill and decode."""
    from k3rocm.kernels.mla import decode as D
    from k3rocm.kernels.mla import prefill as P
    from k3rocm.model import mla as M
    g = torch.Generator(device="cuda").manual_seed(dn + r)
    T = 333
    q = torch.randn(T, H, dn + dr, device="cuda", generator=g).to(BF).float()
    kn = torch.randn(T, H, dn, device="cuda", generator=g).to(BF).float()
    kr = torch.randn(T, dr, device="cuda", generator=g).to(BF).float()
    v = torch.randn(T, H, dv, device="cuda", generator=g).to(BF).float()
    sc = (dn + dr) ** -0.5
    ref = M.mla_prefill(q, kn, kr, v, _cu([T]), _cu([T]), sc)
    for cfg in P.PREFILL_CONFIGS["hip" if torch.version.hip else "cuda"]:
        o = P.mla_prefill(q.to(BF), kn.to(BF), kr.to(BF), v.to(BF), _cu([T]), _cu([T]), sc, config=cfg)
        assert _rel(o, ref) < 1e-2, cfg
    N, L = 3, 1000
    nb = math.ceil(L / PAGE)
    bt = torch.randperm(N * nb, device="cuda", generator=g).to(torch.int32).view(N, nb)
    pos = torch.arange(L, device="cuda")
    slots = (bt.long()[:, pos // PAGE] * PAGE + pos % PAGE).flatten()
    cache = torch.zeros(N * nb, PAGE, r + dr, device="cuda", dtype=BF)
    D.mla_cache_write(cache, slots, torch.randn(N * L, r, device="cuda", generator=g).to(BF),
                      torch.randn(N * L, dr, device="cuda", generator=g).to(BF))
    w_kc, w_vc = M.split_kv_b(torch.randn(H * (dn + dv), r, device="cuda", generator=g) * r ** -0.5, H, dn, dv)
    qn = torch.randn(N, 1, H, dn, device="cuda", generator=g).to(BF)
    qr = torch.randn(N, 1, H, dr, device="cuda", generator=g).to(BF)
    cl = torch.tensor([L, 1, 517], dtype=torch.int32, device="cuda")
    ref = M.mla_decode(qn, qr, cache.float(), bt, cl, w_kc, w_vc, sc)
    for cfg in D.DECODE_CONFIGS["hip" if torch.version.hip else "cuda"]:
        o = D.mla_decode(qn, qr, cache, bt, cl, w_kc.to(BF), w_vc.to(BF), sc, config=cfg)
        assert _rel(o, ref) < 2e-2, cfg


def test_decode_graph_replay_at_other_lengths():
    """Captured once with an upper bound on the context (and forced splits, as the engine does), replayed after
    the real lengths changed: equal to an eager call at those lengths."""
    from k3rocm.kernels.mla import decode as D
    from k3rocm.model import mla as M
    g = torch.Generator(device="cuda").manual_seed(13)
    H, N, L = 12, 4, 4096
    nb = L // PAGE
    bt = torch.randperm(N * nb, device="cuda", generator=g).to(torch.int32).view(N, nb)
    cache = torch.randn(N * nb, PAGE, R + DR, device="cuda", generator=g).to(BF)
    w_kc, w_vc = M.split_kv_b(torch.randn(H * (DN + DV), R, device="cuda", generator=g) * R ** -0.5, H, DN, DV)
    w_kc, w_vc = w_kc.to(BF), w_vc.to(BF)
    qn = torch.randn(N, 1, H, DN, device="cuda", generator=g).to(BF)
    qr = torch.randn(N, 1, H, DR, device="cuda", generator=g).to(BF)
    cl = torch.tensor([L, 1, 100, 2000], dtype=torch.int32, device="cuda")
    out = torch.empty(N, 1, H, DV, device="cuda", dtype=BF)
    kw = dict(out=out, max_context_len=L, num_splits=8, config=D.DECODE_CONFIGS["hip" if torch.version.hip else "cuda"][0])
    D.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, SCALE, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        D.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, SCALE, **kw)
    cl.copy_(torch.tensor([7, 3000, 64, 4095], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = M.mla_decode(qn, qr, cache.float(), bt, cl, w_kc.float(), w_vc.float(), SCALE)
    assert _rel(out, ref) < 2e-2
