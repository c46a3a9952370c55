"""Triton MLA kernels against the fp32 oracle (k3rocm.model.mla) at small sizes.

Without a GPU the kernels run in the Triton interpreter with fp32 inputs (``tl.dot`` on bf16 is wrong
there): the module fixture sets ``TRITON_INTERPRET=1`` for this module only (the kernels switch at launch). Outputs are poisoned (NaN) before each call so unwritten elements fail. Large sizes,
bf16/FP8 and 20 repeats per config are in ``tests/kernels/test_mla_gpu.py``.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from k3rocm.errors import ConfigError
from k3rocm.model import mla as M
from tests.helpers import interpreter_without_gpu

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=2e-5, rtol=2e-5) if DEV == "cpu" else dict(atol=5e-3, rtol=5e-3)  # tf32 dots on GPU
DN, DR, DV, R = 32, 16, 32, 32  # k3-tiny MLA dims (K3_FACTS: 128/64/128/512)


@pytest.fixture(scope="module")
def K():
    """(prefill module, decode module). Without a GPU, ``TRITON_INTERPRET=1`` is set for this module's tests
    only: the kernels are compiled-mode objects and switch to the interpreter at launch time."""
    with interpreter_without_gpu():
        yield [importlib.import_module(m) for m in ("k3rocm.kernels.mla.prefill", "k3rocm.kernels.mla.decode")]


def _cfgs(table):
    return table["cuda" if DEV == "cuda" else "interpreter"]


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)


def _prefill_inputs(lq, lk, H, g):
    q = torch.randn(sum(lq), H, DN + DR, generator=g)
    return (q, torch.randn(sum(lk), H, DN, generator=g), torch.randn(sum(lk), DR, generator=g),
            torch.randn(sum(lk), H, DV, generator=g), torch.randn(sum(lq), H * DV, generator=g))


@pytest.mark.parametrize("lq,lk", [
    ([1, 15, 16, 17], [1, 15, 16, 17]),        # around the 16-row block boundary
    ([31, 32, 33], [31, 32, 33]),              # around the 32-row block boundary
    ([5, 16, 1], [21, 48, 33]),                # chunked prefill: a chunk after cached context
    ([0, 7], [4, 7]),                          # a sequence with no queries in the batch
])
def test_prefill_every_config(K, lq, lk):
    P, _ = K
    g = torch.Generator().manual_seed(sum(lq) * 7 + sum(lk))
    H = 2
    q, kn, kr, v, gate = _prefill_inputs(lq, lk, H, g)
    scale = (DN + DR) ** -0.5
    for use_gate in (False, True):
        ref = M.mla_prefill(q, kn, kr, v, _cu(lq), _cu(lk), scale, gate=gate if use_gate else None)
        for cfg in _cfgs(P.PREFILL_CONFIGS):
            out = torch.full((sum(lq), H, DV), float("nan"), device=DEV)
            o = P.mla_prefill(q.to(DEV), kn.to(DEV), kr.to(DEV), v.to(DEV), _cu(lq).to(DEV), _cu(lk).to(DEV), scale,
                              gate=gate.to(DEV) if use_gate else None, out=out, config=cfg)
            torch.testing.assert_close(o.cpu(), ref, **TOL)


def test_prefill_deterministic_and_errors(K):
    P, _ = K
    g = torch.Generator().manual_seed(3)
    q, kn, kr, v, _ = _prefill_inputs([20], [20], 1, g)
    args = [t.to(DEV) for t in (q, kn, kr, v)] + [_cu([20]).to(DEV), _cu([20]).to(DEV), 0.1]
    for cfg in _cfgs(P.PREFILL_CONFIGS):
        a = P.mla_prefill(*args, config=cfg)
        b = P.mla_prefill(*args, config=cfg)
        assert torch.equal(a, b)
    with pytest.raises(ConfigError):
        P.mla_prefill(q[..., :-1].to(DEV), *args[1:])
    with pytest.raises(ConfigError):  # the kernels fold the scale into exp2 of a running max: it must be > 0
        P.mla_prefill(*args[:-1], -0.1)


@pytest.mark.parametrize("dn,dr,dv,H", [(24, 6, 20, 3), (40, 10, 8, 5)])
def test_prefill_odd_head_dims(K, dn, dr, dv, H):
    """Head dims that are not powers of two (and below 16), odd head counts: padded + masked in the kernel."""
    P, _ = K
    g = torch.Generator().manual_seed(dn + dr + dv)
    lq, lk = [3, 18], [7, 18]
    q = torch.randn(sum(lq), H, dn + dr, generator=g)
    kn, kr = torch.randn(sum(lk), H, dn, generator=g), torch.randn(sum(lk), dr, generator=g)
    v, gate = torch.randn(sum(lk), H, dv, generator=g), torch.randn(sum(lq), H * dv, generator=g)
    scale = (dn + dr) ** -0.5
    ref = M.mla_prefill(q, kn, kr, v, _cu(lq), _cu(lk), scale, gate=gate)
    out = torch.full((sum(lq), H, dv), float("nan"), device=DEV)
    o = P.mla_prefill(q.to(DEV), kn.to(DEV), kr.to(DEV), v.to(DEV), _cu(lq).to(DEV), _cu(lk).to(DEV), scale,
                      gate=gate.to(DEV), out=out, config=_cfgs(P.PREFILL_CONFIGS)[0])
    torch.testing.assert_close(o.cpu(), ref, **TOL)


def _paged(lens, page, g):
    nblk = sum(math.ceil(L / page) for L in lens) + 2
    perm = torch.randperm(nblk, generator=g)
    bt = torch.zeros(len(lens), max(1, max(math.ceil(L / page) for L in lens)), dtype=torch.int32)
    i, slots = 0, []
    for n, L in enumerate(lens):
        for b in range(math.ceil(L / page)):
            bt[n, b] = perm[i]
            i += 1
        slots += [int(bt[n, p // page]) * page + p % page for p in range(L)]
    return nblk, bt, torch.tensor(slots, dtype=torch.int64)


def test_cache_write_matches_oracle(K):
    _, D = K
    g = torch.Generator().manual_seed(4)
    nblk, bt, slots = _paged([5, 19], 8, g)
    sm = torch.cat([slots, torch.tensor([-1])])[torch.randperm(slots.numel() + 1, generator=g)]
    lat, kr = torch.randn(sm.numel(), R, generator=g), torch.randn(sm.numel(), DR, generator=g)
    ref = torch.full((nblk, 8, R + DR), float("nan"))
    M.mla_cache_write(ref, sm, lat, kr)
    got = torch.full((nblk, 8, R + DR), float("nan"), device=DEV)
    D.mla_cache_write(got, sm.to(DEV), lat.to(DEV), kr.to(DEV))
    assert torch.equal(got.cpu().nan_to_num(123.0), ref.nan_to_num(123.0))


def _cached_context(lens, page, H, g):
    """A paged latent cache holding random contexts of ``lens`` tokens (unused slots NaN), its block table, and
    the absorbed ``kv_b`` factors of ``H`` heads: ``(cache, block_table, w_kc, w_vc)``."""
    nblk, bt, slots = _paged(lens, page, g)
    cache = torch.full((nblk, page, R + DR), float("nan"))
    lat, kr = torch.randn(slots.numel(), R, generator=g), torch.randn(slots.numel(), DR, generator=g)
    M.mla_cache_write(cache, slots, lat, kr)
    W = torch.randn(H * (DN + DV), R, generator=g) * R ** -0.5
    return (cache, bt, *M.split_kv_b(W, H, DN, DV))


@pytest.mark.parametrize("H", [8, 12, 24, 96])
@pytest.mark.parametrize("Tq", [1, 2])
def test_decode_heads_and_lengths(K, H, Tq):
    """Heads per rank {8,12,24,96}; mixed contexts (1, 23, 70, a padding row) in one batch; forced splits."""
    _, D = K
    g = torch.Generator().manual_seed(H * 10 + Tq)
    lens = [max(1, Tq), 23, 70, 0]
    page = 16
    cache, bt, w_kc, w_vc = _cached_context(lens, page, H, g)
    qn, qr = torch.randn(4, Tq, H, DN, generator=g), torch.randn(4, Tq, H, DR, generator=g)
    gate = torch.randn(4, Tq, H * DV, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32)
    scale = (DN + DR) ** -0.5
    ref = M.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, scale, gate=gate)
    cfgs = _cfgs(D.DECODE_CONFIGS)
    for cfg, splits in ((cfgs[0], None), (cfgs[-1], 3)):
        out = torch.full((4, Tq, H, DV), float("nan"), device=DEV)
        o = D.mla_decode(qn.to(DEV), qr.to(DEV), cache.to(DEV), bt.to(DEV), cl.to(DEV), w_kc.to(DEV), w_vc.to(DEV),
                         scale, gate=gate.to(DEV), out=out, config=cfg, num_splits=splits)
        torch.testing.assert_close(o.cpu(), ref, **TOL)
        assert torch.equal(o[3].cpu(), torch.zeros_like(o[3].cpu()))  # padding row (context 0)


@pytest.mark.parametrize("H,Tq,xcd", [(24, 1, 8), (96, 2, 3), (12, 2, 8)])
def test_decode_die_ordered_grid_is_the_same_computation(K, H, Tq, xcd):
    """The die-ordered linear grid (``num_xcd`` > 1: MI300 / MI355X put workgroup p on die p % 8) runs exactly the
    programs of the 3-D grid in another order: bit-identical output to ``num_xcd=1`` and equal to the oracle, with
    head groups > 1, slice counts not multiples of the die count, a padding row and forced / planned splits."""
    _, D = K
    g = torch.Generator().manual_seed(H + xcd)
    lens = [Tq, 45, 130, 0, 17]
    page = 16
    cache, bt, w_kc, w_vc = _cached_context(lens, page, H, g)
    N = len(lens)
    qn, qr = torch.randn(N, Tq, H, DN, generator=g), torch.randn(N, Tq, H, DR, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32)
    scale = (DN + DR) ** -0.5
    ref = M.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, scale)
    cfg = _cfgs(D.DECODE_CONFIGS)[0]
    assert math.ceil(Tq * H / cfg["BLOCK_H"]) > 1  # several head groups share each slice
    args = (qn.to(DEV), qr.to(DEV), cache.to(DEV), bt.to(DEV), cl.to(DEV), w_kc.to(DEV), w_vc.to(DEV), scale)
    for splits in (None, 3):
        base = D.mla_decode(*args, config=cfg, num_splits=splits, num_xcd=1)
        o = D.mla_decode(*args, config=cfg, num_splits=splits, num_xcd=xcd)
        assert torch.equal(o, base)
        torch.testing.assert_close(o.cpu(), ref, **TOL)
        assert torch.equal(o[3].cpu(), torch.zeros_like(o[3].cpu()))


def test_xcd_count_by_target(K, monkeypatch):
    """8 dies on gfx942 / gfx950, 1 elsewhere (the plain 3-D grid)."""
    from k3rocm.kernels.target import Target
    _, D = K
    for arch, want in (("gfx950", 8), ("gfx942", 8), ("gfx90a", 1)):
        monkeypatch.setattr(D, "current_target", lambda a=arch: Target("hip", a))
        assert D.xcd_count() == want
    monkeypatch.setattr(D, "current_target", lambda: Target("cuda", "90"))
    assert D.xcd_count() == 1


@pytest.mark.parametrize("r,dr,dn,dv,H", [(40, 6, 24, 20, 3), (24, 16, 16, 16, 7)])
def test_decode_odd_rank_and_dims(K, r, dr, dn, dv, H):
    """A latent rank, rope width, head dims and head count that are not powers of two (padded + masked)."""
    _, D = K
    g = torch.Generator().manual_seed(r * 7 + dr)
    lens, page = [1, 21, 40], 8
    nblk, bt, slots = _paged(lens, page, g)
    cache = torch.full((nblk, page, r + dr), float("nan"))
    M.mla_cache_write(cache, slots, torch.randn(slots.numel(), r, generator=g), torch.randn(slots.numel(), dr, generator=g))
    w_kc, w_vc = M.split_kv_b(torch.randn(H * (dn + dv), r, generator=g) * r ** -0.5, H, dn, dv)
    qn, qr = torch.randn(3, 1, H, dn, generator=g), torch.randn(3, 1, H, dr, generator=g)
    gate = torch.randn(3, 1, H * dv, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32)
    scale = (dn + dr) ** -0.5
    ref = M.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, scale, gate=gate)
    out = torch.full((3, 1, H, dv), float("nan"), device=DEV)
    o = D.mla_decode(qn.to(DEV), qr.to(DEV), cache.to(DEV), bt.to(DEV), cl.to(DEV), w_kc.to(DEV), w_vc.to(DEV),
                     scale, gate=gate.to(DEV), out=out, config=_cfgs(D.DECODE_CONFIGS)[0], num_splits=2)
    torch.testing.assert_close(o.cpu(), ref, **TOL)


def test_decode_with_an_upper_bound_on_the_context(K):
    """As under graph capture: max_context_len an upper bound far above the real lengths, splits forced;
    each sequence's slices come from its real length on the device."""
    _, D = K
    g = torch.Generator().manual_seed(21)
    H, lens, page = 2, [150, 3, 64], 16
    nblk, bt, slots = _paged(lens, page, g)
    cache = torch.full((nblk, page, R + DR), float("nan"))
    M.mla_cache_write(cache, slots, torch.randn(slots.numel(), R, generator=g), torch.randn(slots.numel(), DR, generator=g))
    w_kc, w_vc = M.split_kv_b(torch.randn(H * (DN + DV), R, generator=g) * R ** -0.5, H, DN, DV)
    qn, qr = torch.randn(3, 1, H, DN, generator=g), torch.randn(3, 1, H, DR, generator=g)
    cl = torch.tensor(lens, dtype=torch.int32)
    ref = M.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, 0.2)
    o = D.mla_decode(qn.to(DEV), qr.to(DEV), cache.to(DEV), bt.to(DEV), cl.to(DEV), w_kc.to(DEV), w_vc.to(DEV), 0.2,
                     config=_cfgs(D.DECODE_CONFIGS)[0], num_splits=3, max_context_len=4096, total_context_tokens=12288)
    torch.testing.assert_close(o.cpu(), ref, **TOL)


def test_registry_takes_every_rank():
    """supports() of the MLA kernels never refuses a valid config (any rank)."""
    from k3rocm.kernels.mla import TRITON_IMPLS
    for _op, _fn, supports, _note in TRITON_IMPLS:
        assert supports is None or all(supports(kv_lora_rank=k) for k in (32, 384, 448, 512))


def test_decode_after_prefill_equals_prefill_of_longer_sequence(K):
    """Prefill L tokens (kernel), write their latents (kernel), decode token L+1 (kernel) == prefill of L+1."""
    P, D = K
    g = torch.Generator().manual_seed(11)
    H, L, page = 4, 37, 16
    W = torch.randn(H * (DN + DV), R, generator=g) * R ** -0.5
    w_kc, w_vc = M.split_kv_b(W, H, DN, DV)
    lat, kr = torch.randn(L + 1, R, generator=g), torch.randn(L + 1, DR, generator=g)
    q = torch.randn(L + 1, H, DN + DR, generator=g)
    kn = torch.einsum("hdr,tr->thd", w_kc, lat)
    v = torch.einsum("hrv,tr->thv", w_vc, lat)
    scale = (DN + DR) ** -0.5
    full = P.mla_prefill(q.to(DEV), kn.to(DEV), kr.to(DEV), v.to(DEV), _cu([L + 1]).to(DEV), _cu([L + 1]).to(DEV),
                         scale)
    nblk, bt, slots = _paged([L + 1], page, g)
    cache = torch.full((nblk, page, R + DR), float("nan"), device=DEV)
    D.mla_cache_write(cache, slots.to(DEV), lat.to(DEV), kr.to(DEV))
    o = D.mla_decode(q[L:, None, :, :DN].to(DEV), q[L:, None, :, DN:].to(DEV), cache, bt.to(DEV),
                     torch.tensor([L + 1], dtype=torch.int32, device=DEV), w_kc.to(DEV), w_vc.to(DEV), scale)
    torch.testing.assert_close(o[0, 0].cpu(), full[L].cpu(), **TOL)


def test_split_plan_bounds(K):
    _, D = K
    s, c = D.num_splits_for(131072, 131072 + 255, 256, 96, 512, 132)
    assert s * c >= 131072 and c % 64 == 0
    assert s * 256 * 96 * 512 * 4 <= D.PARTIAL_BUDGET
    s1, c1 = D.num_splits_for(1, 1, 1, 12, 512, 132)
    assert s1 == 1 and c1 >= 1
    # whole waves: 64 sequences x 5 slices = 320 equal programs on 132 multiprocessors take 3 waves' time,
    # 4 slices (256 programs) two
    s2, c2 = D.num_splits_for(32768, 64 * 32768, 64, 12, 512, 132)
    assert (s2, c2) == (4, 8192)
    # the program count follows the head-group width: 64-row groups of 96 heads are cut into more slices
    assert D.num_splits_for(8192, 64 * 8192, 64, 96, 512, 132, block_h=64)[0] > \
        D.num_splits_for(8192, 64 * 8192, 64, 96, 512, 132, block_h=16)[0]


def test_chunked_prefill_from_latent_cache(K):
    """Chunks after context in the paged cache (expanded through kv_b) == prefill of the whole sequences."""
    P, D = K
    g = torch.Generator().manual_seed(12)
    H, page = 2, 16
    cached, chunk = [17, 0, 32], [16, 9, 1]
    total = [a + b for a, b in zip(cached, chunk)]
    W = torch.randn(H * (DN + DV), R, generator=g) * R ** -0.5
    w_kc, w_vc = M.split_kv_b(W, H, DN, DV)
    lat, kr = torch.randn(sum(total), R, generator=g), torch.randn(sum(total), DR, generator=g)
    q = torch.randn(sum(total), H, DN + DR, generator=g)
    kn = torch.einsum("hdr,tr->thd", w_kc, lat)
    v = torch.einsum("hrv,tr->thv", w_vc, lat)
    scale = (DN + DR) ** -0.5
    full = M.mla_prefill(q, kn, kr, v, _cu(total), _cu(total), scale)
    nblk, bt, slots = _paged(total, page, g)
    cache = torch.full((nblk, page, R + DR), float("nan"))
    M.mla_cache_write(cache, slots, lat, kr)  # the whole sequences; only the first `cached` rows are read
    starts = _cu(total).tolist()
    sel = torch.cat([torch.arange(s + c, s + c + k) for s, c, k in zip(starts, cached, chunk)])
    o = P.mla_prefill_chunked(q[sel].to(DEV), kn[sel].to(DEV), kr[sel].to(DEV), v[sel].to(DEV), _cu(chunk).to(DEV),
                              cache.to(DEV), bt.to(DEV), cached, w_kc.to(DEV), w_vc.to(DEV), scale)
    torch.testing.assert_close(o.cpu(), full[sel], **TOL)
