"""The MoE fp32 oracle (k3rocm/model/moe.py) against independent float64 references and hand-built cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.model import moe as M
from k3rocm.model.common import situ_glu
from k3rocm.mx import pack_fp4, quantize_mxfp4, quantize_mxfp8

from tests.helpers import latent_layer_inputs, near_tie_router_inputs, random_experts


def _ref_router(x, w, bias, k, renorm=True, scaling=1.0):
    """float64 numpy reference: order by (-biased score, id)."""
    logits = x.double().numpy() @ w.double().numpy().T
    s = 1.0 / (1.0 + np.exp(-logits))
    b = s + (bias.double().numpy() if bias is not None else 0.0)
    ids = np.stack([np.lexsort((np.arange(b.shape[1]), -row))[:k] for row in b])
    wts = np.take_along_axis(s, ids, 1)
    if renorm:
        wts = wts / (wts.sum(1, keepdims=True) + 1e-20)
    return ids, wts * scaling


def test_router_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    T, E, D, k = 37, 896, 256, 16
    x = torch.randn(T, D, generator=g).bfloat16()
    w = (torch.randn(E, D, generator=g) * 0.05).bfloat16()
    bias = torch.randn(E, generator=g) * 0.02
    ids, wts = M.moe_router(x, w, bias, k)
    rid, rw = _ref_router(x, w, bias, k)
    assert ids.dtype == torch.int32 and wts.dtype == torch.float32 and ids.shape == (T, k)
    assert (ids.numpy() == rid).all()
    np.testing.assert_allclose(wts.numpy(), rw, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(wts.sum(1).numpy(), 1.0, rtol=1e-6)


def test_router_near_ties_and_exact_ties():
    x, w, bias = near_tie_router_inputs(9, 64, 128, 16)
    ids, _ = M.moe_router(x, w, bias, 64)  # full ordering
    pos = {int(e): i for i, e in enumerate(ids[0].tolist())}
    for j in range(0, 62, 2):
        assert pos[j + 1] < pos[j], f"expert {j + 1} (bias +2^-14) must rank above {j}"
    assert pos[62] < pos[63], "exact tie: lower id first"
    rid, _ = _ref_router(x, w, bias, 64)
    assert (ids.numpy() == rid).all()


def test_router_options_and_errors():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    ids, wts = M.moe_router(x, w, None, 4, renormalize=False, scaling=2.5)
    rid, rw = _ref_router(x, w, None, 4, renorm=False, scaling=2.5)
    assert (ids.numpy() == rid).all()
    np.testing.assert_allclose(wts.numpy(), rw, rtol=1e-5)
    with pytest.raises(ConfigError):
        M.moe_router(x, w, None, 17)
    with pytest.raises(ConfigError):
        M.moe_router(x, w[:, :16], None, 4)


@pytest.mark.parametrize("case", ["random", "all_one_expert", "empty_experts"])
@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_dispatch_groups_and_expert_parallel(case, ranks):
    E, T, k = 16, 11, 4
    g = torch.Generator().manual_seed(3)
    if case == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    elif case == "all_one_expert":
        ids = torch.full((T, 1), 5, dtype=torch.int32)
        k = 1
    else:  # only experts 0..3 used: the ranks holding 4..15 get no tokens
        ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(T)]).int()
    per = E // ranks
    seen = torch.zeros(T * k, dtype=torch.int64)
    for r in range(ranks):
        d = M.dispatch(ids, E, (r * per, (r + 1) * per))
        flat = ids.reshape(-1).long()
        mine = (flat >= r * per) & (flat < (r + 1) * per)
        assert d.sorted_pair.numel() == int(mine.sum()) == int(d.counts.sum())
        assert d.offsets[0] == 0 and d.offsets[-1] == d.sorted_pair.numel()
        assert (d.offsets[1:] - d.offsets[:-1] == d.counts).all()
        assert (d.global_to_local[r * per:(r + 1) * per] == torch.arange(per)).all()
        assert (d.global_to_local[:r * per] == -1).all() and (d.global_to_local[(r + 1) * per:] == -1).all()
        for e in range(per):
            grp = d.sorted_pair[d.offsets[e]:d.offsets[e + 1]]
            assert (flat[grp] == r * per + e).all()
            assert (grp[1:] > grp[:-1]).all()  # ascending pair order inside a group
            assert (d.sorted_expert[d.offsets[e]:d.offsets[e + 1]] == e).all()
        assert (d.sorted_token == d.sorted_pair // k).all()
        seen[d.sorted_pair] += 1
    assert (seen == 1).all()  # every pair on exactly one rank


def test_dispatch_errors():
    with pytest.raises(ConfigError):
        M.dispatch(torch.tensor([[0, 16]]), 16)
    with pytest.raises(ConfigError):
        M.dispatch(torch.tensor([[0, 1]]), 16, (8, 20))


def test_nibble_order_with_known_values():
    # one expert, D = I = 64; byte 0x72 = element 0 code 2 (1.0, low nibble), element 1 code 7 (6.0)
    D = inter = 64
    w13 = torch.zeros(1, 2 * inter, D // 2, dtype=torch.uint8)
    w13[0, 0, 0] = 0x72
    w13[0, inter, 0] = 0x72
    w2 = torch.zeros(1, D, inter // 2, dtype=torch.uint8)
    w2[0, 3, 0] = 0x02  # out[3] = 1.0 * h[0]
    sc13 = torch.full((1, 2 * inter, D // 32), 127, dtype=torch.uint8)
    sc13[0, inter, 0] = 128  # up row 0 scaled x2
    ew = dict(w13_packed=w13, w13_scale=sc13, w2_packed=w2,
              w2_scale=torch.full((1, D, inter // 32), 127, dtype=torch.uint8), num_experts=1, first_expert=0)
    w13d, _ = M.expert_dense_weights(ew, 0)
    assert w13d[0, 0] == 1.0 and w13d[0, 1] == 6.0 and w13d[inter, 0] == 2.0 and w13d[inter, 1] == 12.0
    x = torch.zeros(2, D)
    x[0, 0] = 1.0
    x[1, 1] = 1.0
    out = M.moe_experts(x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), ew)

    def situ(g, u):
        return 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)

    assert out[0, 3].item() == pytest.approx(situ(1.0, 2.0), rel=1e-6)
    assert out[1, 3].item() == pytest.approx(situ(6.0, 12.0), rel=1e-6)
    out[:, 3] = 0
    assert (out == 0).all()


def test_scale_ff_is_a_checkpoint_error():
    ew = random_experts(2, 64, 64)
    ew["w2_scale"][1, 0, 0] = 0xFF
    with pytest.raises(CheckpointError):
        M.moe_experts(torch.randn(3, 64), torch.tensor([[1], [0], [1]]), torch.ones(3, 1), ew)


def _naive_experts(x, ids, wts, ew, mode):
    """Token-by-token float64 reference from the packed bytes (own decoding path through k3rocm.mx)."""
    from k3rocm.mx import dequantize_mxfp4, dequantize_mxfp8

    def q8(v):
        if mode == "a16w4":
            return v.double()
        q, s = quantize_mxfp8(v.float(), "e4m3", "round-up")
        return dequantize_mxfp8(q, s).double()

    first = ew["first_expert"]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if not 0 <= e < ew["num_experts"]:
                continue
            w13 = dequantize_mxfp4(ew["w13_packed"][e], ew["w13_scale"][e]).double()
            w2 = dequantize_mxfp4(ew["w2_packed"][e], ew["w2_scale"][e]).double()
            gu = w13 @ q8(x[t:t + 1]).reshape(-1)
            inter = gu.numel() // 2
            h = situ_glu(gu[:inter].float(), gu[inter:].float()).double()
            out[t] += float(wts[t, j]) * (w2 @ q8(h.reshape(1, -1).float()).reshape(-1))
    return out


@pytest.mark.parametrize("mode", ["a16w4", "a8w4"])
def test_moe_experts_against_naive_loop(mode):
    E, D, inter, T, k = 8, 64, 96, 6, 3
    ew = random_experts(E, D, inter, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, generator=g)
    out = M.moe_experts(x, ids, wts, ew, mode=mode)
    ref = _naive_experts(x, ids, wts, ew, mode)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=2e-4, atol=2e-4 * ref.abs().max().item())


def test_expert_parallel_partial_sums_add_up():
    E, D, inter, T, k = 8, 64, 64, 7, 4
    ew = random_experts(E, D, inter, seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, generator=g)
    full = M.moe_experts(x, ids, wts, ew)
    parts = 0
    for r in range(4):
        sl = slice(2 * r, 2 * r + 2)
        sub = dict(w13_packed=ew["w13_packed"][sl], w13_scale=ew["w13_scale"][sl], w2_packed=ew["w2_packed"][sl],
                   w2_scale=ew["w2_scale"][sl], num_experts=2, first_expert=2 * r)
        parts = parts + M.moe_experts(x, ids, wts, sub)
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-5)


def test_mxfp8_rule_matches_k3rocm_mx_round_up_bitwise():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-30, 30, 16)[:, None]
    x[0, :32] = 0.0  # all-zero block
    x[1, :32] = torch.linspace(-1.75, 1.75, 32)  # amax mantissa exactly 1.75: no bump
    x[2, :32] = torch.linspace(-1.76, 1.0, 32)  # amax mantissa above 1.75: bumped exponent
    q, s, deq = M.quantize_mxfp8_e4m3(x)
    rq, rs = quantize_mxfp8(x, "e4m3", "round-up")
    assert (s == rs).all()
    assert (q.view(torch.uint8) == rq.view(torch.uint8)).all()
    assert int(s[1, 0]) == 127 + 0 - 8 and int(s[2, 0]) == 127 + 0 - 7
    assert (deq.abs() <= x.abs().amax(-1, keepdim=True) * 1.0625 + 1e-30).all()  # no saturation blow-up
    rel = ((deq - x).abs() / x.abs().clamp_min(1e-30))[x.abs() > x.abs().amax(-1, keepdim=True) * 2 ** -6]
    assert rel.max() <= 2 ** -4 + 1e-6  # 3 mantissa bits, RNE


def test_situ_extremes_bounded():
    g = torch.linspace(-1000, 1000, 2001)
    u = torch.linspace(1000, -1000, 2001)
    h = M._act(g, u, "situ", 4.0, 25.0)
    torch.testing.assert_close(h, situ_glu(g, u))
    assert h.abs().max() <= 100.0 + 1e-4


def test_errors_and_unquantized_experts():
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    w = torch.full((3, 2), 0.5)
    ew = random_experts(2, 64, 64)
    with pytest.raises(ConfigError):
        M.moe_experts(x, ids, w, ew, mode="a4w4")
    with pytest.raises(ConfigError):
        M.moe_experts(x, ids, w, ew, act="gelu")
    # unquantized bf16 stacks give the same result as their MXFP4 source dequantized
    w13 = torch.stack([M.expert_dense_weights(ew, e)[0] for e in range(2)]).bfloat16()
    w2 = torch.stack([M.expert_dense_weights(ew, e)[1] for e in range(2)]).bfloat16()
    dense = dict(w13=w13, w2=w2, num_experts=2, first_expert=0)
    torch.testing.assert_close(M.moe_experts(x, ids, w, dense), M.moe_experts(x, ids, w, ew), rtol=1e-5, atol=1e-5)
    silu = M.moe_experts(x, ids, w, dense, act="silu")
    assert not torch.allclose(silu, M.moe_experts(x, ids, w, dense))


def test_latent_moe_composition():
    x, gate, bias, down, normw, up, sg, su, sd, ew, k = latent_layer_inputs(9, 5, expert_seed=10)
    out = M.latent_moe(x, gate, bias, ew, k, down, normw, up, sg, su, sd, eps=1e-5)
    ids, w = M.moe_router(x, gate, bias, k)
    xl = x.double() @ down.double().t()
    r = M.moe_experts(xl.float(), ids, w, ew).double()
    r = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * normw.double()
    ref = r @ up.double().t()
    ref += situ_glu(x.float() @ sg.float().t(), x.float() @ su.float().t()).double() @ sd.double().t()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_mxfp4_roundtrip_through_oracle_decoder():
    # quantize known weights with k3rocm.mx and decode with the oracle's expert path: exact grid values
    g = torch.Generator().manual_seed(11)
    w = torch.randn(2, 128, 64, generator=g)
    p, s = quantize_mxfp4(w, "even")
    ew = dict(w13_packed=p, w13_scale=s, w2_packed=p[:, :64, :32].contiguous(), w2_scale=s[:, :64, :2].contiguous(),
              num_experts=2, first_expert=0)
    d, _ = M.expert_dense_weights(ew, 1)
    assert (pack_fp4(torch.zeros(1, 2)) == 0).all()
    err = (d - w[1]).abs() / w[1].abs().amax(-1, keepdim=True)
    assert err.max() <= 0.25  # within half an E2M1 step of the block scale


def test_negative_expert_id_is_refused():
    """An unfilled router slot (-1) must not be routed to expert 0 by the oracle kernels are checked against."""
    from k3rocm.errors import ConfigError
    from k3rocm.model import moe as M

    ew = random_experts(4, 64, 64, seed=1)
    x = torch.randn(2, 64)
    ids = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)
    with pytest.raises(ConfigError, match="< 0"):
        M.moe_experts(x, ids, torch.rand(2, 2), ew)
