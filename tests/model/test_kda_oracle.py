"""The fp32 KDA oracle checks itself: chunked == recurrent, packing invariance, conv against torch's
conv1d, decode step == one more prefill token, padding rows, gate forms, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3rocm.errors import ConfigError
from k3rocm.model import kda as K


def _inputs(B, T, H, D, gen, lo=-3.0, hi=3.0):
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.randn(B, T, H, D, generator=gen)
    v = torch.randn(B, T, H, D, generator=gen)
    dr = torch.empty(B, T, H * D).uniform_(lo, hi, generator=gen)
    br = torch.randn(B, T, H, generator=gen)
    A_log = torch.randn(H + 3, generator=gen) * 0.5
    dt = torch.randn(H * D, generator=gen) * 0.5
    return q, k, v, dr, br, A_log, dt


@pytest.mark.parametrize("form", ["k3", "kimi_linear"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_equals_recurrent(form, chunk):
    seed = torch.seed() % 2**31  # fresh inputs every run; the seed is in the failure message to reproduce it
    gen = torch.Generator().manual_seed(seed)
    args = _inputs(2, 70, 3, 16, gen)
    s0 = torch.randn(2, 3, 16, 16, generator=gen)
    o1, f1 = K.kda_recurrent(*args, initial_state=s0, gate_form=form)
    o2, f2 = K.kda_chunked(*args, initial_state=s0, gate_form=form, chunk_size=chunk)
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(f2, f1, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


def test_gate_bounds_and_formula():
    gen = torch.Generator().manual_seed(1)
    H, D = 4, 8
    raw = torch.randn(5, H * D, generator=gen) * 10
    A_log = torch.randn(H + 4, generator=gen)
    dt = torch.randn(H * D, generator=gen)
    g = K.kda_gate(raw, A_log, dt, H)
    assert g.shape == (5, H, D) and bool((g <= 0).all()) and bool((g >= -5).all())
    h, c = 2, 3
    want = -5.0 * torch.sigmoid(torch.exp(A_log[h]) * (raw[1, h * D + c] + dt[h * D + c]))
    assert torch.allclose(g[1, h, c], want)
    gk = K.kda_gate(raw, A_log, dt, H, form="kimi_linear")
    want = -torch.exp(A_log[h]) * F.softplus(raw[1, h * D + c] + dt[h * D + c])
    assert torch.allclose(gk[1, h, c], want)
    with pytest.raises(ConfigError):
        K.kda_gate(raw, A_log, dt, H, form="bogus")


def test_packing_invariance_and_state_continuation():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    H, D = 2, 16
    lens = [5, 1, 40]
    T = sum(lens)
    q, k, v, dr, br, A_log, dt = _inputs(1, T, H, D, gen)
    s0 = torch.randn(len(lens), H, D, D, generator=gen)
    cu = torch.tensor([0, 5, 6, 46], dtype=torch.int32)
    o, f = K.kda_prefill(q, k, v, dr, br, A_log, dt, initial_state=s0, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        o1, f1 = K.kda_recurrent(q[:, sl], k[:, sl], v[:, sl], dr[:, sl], br[:, sl], A_log, dt, initial_state=s0[n:n + 1])
        torch.testing.assert_close(o[:, sl], o1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f[n:n + 1], f1, rtol=1e-5, atol=1e-5)
    # split one sequence in two: state continuation
    oa, fa = K.kda_prefill(q[:, :17], k[:, :17], v[:, :17], dr[:, :17], br[:, :17], A_log, dt)
    ob, fb = K.kda_prefill(q[:, 17:], k[:, 17:], v[:, 17:], dr[:, 17:], br[:, 17:], A_log, dt, initial_state=fa)
    oc, fc = K.kda_prefill(q, k, v, dr, br, A_log, dt)
    torch.testing.assert_close(torch.cat([oa, ob], 1), oc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, fc, rtol=1e-5, atol=1e-5)


def test_short_conv_matches_conv1d_and_state():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    C, W = 6, 4
    x = torch.randn(1, 9, C, generator=gen)
    w = torch.randn(C, 1, W, generator=gen)
    st = torch.randn(2, C, W - 1, generator=gen)
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    y, fin = K.short_conv(x, w, st, cu)
    for n, (a, b) in enumerate([(0, 2), (2, 9)]):
        xin = torch.cat([st[n], x[0, a:b].t()], dim=1).unsqueeze(0)  # [1, C, W-1+L]
        ref = F.silu(F.conv1d(xin, w, groups=C))[0].t()
        torch.testing.assert_close(y[0, a:b], ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fin[n], xin[0, :, -(W - 1):])
    # length-2 sequence keeps one value of its initial state in the final state
    assert torch.equal(fin[0, :, 0], st[0, :, 2])
    y0, f0 = K.short_conv(x, w)
    torch.testing.assert_close(f0[0], x[0, -3:].t())
    with pytest.raises(ConfigError):
        K.short_conv(x, w, torch.zeros(3, C, W - 1), cu)


def test_decode_equals_prefill_plus_padding_rows():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    H, D, W, T = 2, 16, 4, 9
    C = H * D
    xq, xk, xv = (torch.randn(T + 1, C, generator=gen) for _ in range(3))
    dr = torch.randn(T + 1, C, generator=gen)
    br = torch.randn(T + 1, H, generator=gen)
    gr = torch.randn(T + 1, C, generator=gen)
    ws = tuple(torch.randn(C, 1, W, generator=gen) * 0.5 for _ in range(3))
    A_log = torch.randn(H, generator=gen) * 0.5
    dt = torch.randn(C, generator=gen) * 0.5
    onw = torch.rand(D, generator=gen) + 0.5
    # prefill the whole T+1 tokens
    cq, _ = K.short_conv(xq[None], ws[0])
    ck, _ = K.short_conv(xk[None], ws[1])
    cv, _ = K.short_conv(xv[None], ws[2])
    o_full, s_full = K.kda_prefill(cq.view(1, T + 1, H, D), ck.view(1, T + 1, H, D), cv.view(1, T + 1, H, D),
                                   dr[None], br[None], A_log, dt)
    want = K.kda_gated_norm(o_full[0, T], gr[T], onw, 1e-5)
    # prefill T, then decode the last token from slot 2 of a pool, with a padding row
    pool = torch.full((4, 3, C, W - 1), float("nan"))
    spool = torch.full((4, H, D, D), float("nan"))
    for i, (x, w) in enumerate(zip((xq, xk, xv), ws)):
        _, fin = K.short_conv(x[None, :T], w)
        pool[2, i] = fin[0]
    _, s_T = K.kda_prefill(cq[:, :T].view(1, T, H, D), ck[:, :T].view(1, T, H, D), cv[:, :T].view(1, T, H, D),
                           dr[None, :T], br[None, :T], A_log, dt)
    spool[2] = s_T[0]
    before = spool.clone()
    rows = lambda a: torch.stack([a[T], a[T]])  # noqa: E731  row 0 padding, row 1 real
    out = K.kda_decode(rows(xq), rows(xk), rows(xv), rows(dr), rows(br), rows(gr), ws, A_log, dt, onw, pool, spool,
                       torch.tensor([-1, 2], dtype=torch.int32), 1e-5)
    torch.testing.assert_close(out[1], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], torch.zeros(C))
    torch.testing.assert_close(spool[2], s_full[0], rtol=1e-5, atol=1e-5)
    assert torch.isnan(spool[0]).all() and torch.isnan(pool[0]).all()  # untouched slots
    assert not torch.equal(spool[2], before[2])
    with pytest.raises(ConfigError):
        K.kda_decode(rows(xq), rows(xk), rows(xv), rows(dr), rows(br), rows(gr), ws, A_log, dt, onw, pool, spool,
                     torch.tensor([7, 2], dtype=torch.int32), 1e-5)


def test_gated_norm():
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(3, 2, 8, generator=gen)
    gr = torch.randn(3, 16, generator=gen)
    w = torch.rand(8, generator=gen)
    y = K.kda_gated_norm(o, gr, w, 1e-5)
    ref = (o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w).reshape(3, 16) * torch.sigmoid(gr)
    torch.testing.assert_close(y, ref)
