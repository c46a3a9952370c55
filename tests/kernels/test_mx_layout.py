"""The tiled MXFP4 kernel layout (k3rocm.kernels.mx.layout): exact round trip, the documented byte addresses,
and a check that catches any changed byte (torch only: runs on the CPU, no Triton)."""

from __future__ import annotations

import pytest
import torch

from k3rocm.errors import ConfigError
from k3rocm.kernels.mx.layout import check_repack, fit_tile_k, repack_mxfp4, unpack_mxfp4


def _weights(E, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("groups,tile_n,tile_k", [(2, 16, 64), (1, 32, 128), (2, 64, 32)])
def test_round_trip_and_addresses(groups, tile_n, tile_k):
    E, N, K = 3, 2 * 40, 96  # 40 rows per group: the last n-tile is padded; K = 96 fits tile_k to 32
    p, s = _weights(E, N, K)
    t = repack_mxfp4(p, s, groups, tile_n, tile_k)
    assert t.tile_k == fit_tile_k(tile_k, K) == 32
    rp, rs = unpack_mxfp4(t)
    assert torch.equal(rp, p) and torch.equal(rs, s)
    rep = check_repack(t, p, s)
    assert rep["checkpoint_bytes"] == p.numel() + s.numel() and rep["bytes"] == t.data.numel()
    d = t.data.flatten()
    nt, kt, chunk = t.data.shape[1:]
    assert chunk == groups * tile_n * (t.tile_k // 2 + t.tile_k // 32)
    ng, tk = N // groups, t.tile_k
    g = torch.Generator().manual_seed(1)
    for _ in range(100):  # the module docstring's formulas, element by element
        e, gg, n, j = (int(torch.randint(0, m, (1,), generator=g)) for m in (E, groups, ng, K // 2))
        base = (e * nt + n // tile_n) * kt
        assert d[(base + j // (tk // 2)) * chunk + (gg * tile_n + n % tile_n) * (tk // 2) + j % (tk // 2)] == \
            p[e, gg * ng + n, j]
        b = j // 16
        assert d[(base + b // (tk // 32)) * chunk + groups * tile_n * (tk // 2) + (gg * tile_n + n % tile_n) *
                 (tk // 32) + b % (tk // 32)] == s[e, gg * ng + n, b]


def test_check_catches_any_changed_byte():
    p, s = _weights(2, 2 * 24, 64, seed=3)
    for where in (0, 100, -1):  # a value byte, another, the last scale byte (padding rows: 24 of 32 used)
        t = repack_mxfp4(p, s, 2, 32, 64)
        t.data.view(-1)[where] ^= 1
        with pytest.raises(ConfigError, match="differ"):
            check_repack(t, p, s)


def test_bad_shapes_rejected():
    p, s = _weights(1, 32, 64)
    with pytest.raises(ConfigError):
        repack_mxfp4(p, s[:, :16], 2, 16, 64)
    with pytest.raises(ConfigError):
        fit_tile_k(128, 48)


@pytest.mark.parametrize("experts_per_step", [1, 2])
def test_chunked_repack_and_check(monkeypatch, experts_per_step):
    # repack and check walk the experts a few at a time (bounded device temporaries): any step size gives the same
    # bytes as one step over all experts, and a changed byte in any step's experts is caught and named
    import k3rocm.kernels.mx.layout as L

    E, N, K = 5, 2 * 40, 96
    p, s = _weights(E, N, K, seed=9)
    whole = repack_mxfp4(p, s, 2, 16, 64)  # 5 small experts: one step
    monkeypatch.setattr(L, "EXPERT_CHUNK_BYTES", experts_per_step * p[0].numel())
    assert L.expert_chunk(p) == experts_per_step
    t = repack_mxfp4(p, s, 2, 16, 64)
    assert torch.equal(t.data, whole.data)
    check_repack(t, p, s)
    for e in (0, E - 1):
        bad = repack_mxfp4(p, s, 2, 16, 64)
        bad.data[e].view(-1)[7] ^= 0x10
        with pytest.raises(ConfigError, match=f"first expert {e}"):
            check_repack(bad, p, s)


def test_planar_bits_documented_positions_and_round_trip(monkeypatch):
    # planar value bits: element j of each 16-bit lane (lane 0 = elements 8w..8w+3, lane 1 = 8w+4..8w+7) has its
    # magnitude at PLANAR_MAG[j] .. +2 and its sign at PLANAR_SIGN[j]; the permutation is a bijection, works in
    # any step size, and the tiled layout with planar bits reads back (and checks) as the checkpoint's bytes
    import k3rocm.kernels.mx.layout as L

    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, 256, (9, 24), dtype=torch.uint8, generator=g)
    y = L.permute_value_bits(x, True)
    assert not torch.equal(y, x) and torch.equal(L.permute_value_bits(y, False), x)
    w = x.view(-1, 4).to(torch.int64)
    wi = w[:, 0] | w[:, 1] << 8 | w[:, 2] << 16 | w[:, 3] << 24
    v = y.view(-1, 4).to(torch.int64)
    vi = v[:, 0] | v[:, 1] << 8 | v[:, 2] << 16 | v[:, 3] << 24
    for e in range(8):
        lane, j = divmod(e, 4)
        code = (wi >> (4 * e)) & 15
        assert torch.equal((vi >> (16 * lane + L.PLANAR_MAG[j])) & 7, code & 7)
        assert torch.equal((vi >> (16 * lane + L.PLANAR_SIGN[j])) & 1, code >> 3)
    assert sorted(L._lane_lut(False, torch.device("cpu")).tolist()) == list(range(1 << 16))
    monkeypatch.setattr(L, "PERMUTE_STEP_BYTES", 6)  # several steps, one ending mid-tensor
    assert torch.equal(L.permute_value_bits(x, True), y)
    p, s = _weights(3, 2 * 40, 96, seed=12)
    t = repack_mxfp4(p, s, 2, 16, 64, bits=1)
    nib = repack_mxfp4(p, s, 2, 16, 64)
    vb = 2 * 16 * t.tile_k // 2
    assert t.bits == 1 and torch.equal(t.data[..., vb:], nib.data[..., vb:])  # scales untouched
    assert torch.equal(t.data[..., :vb], L.permute_value_bits(nib.data[..., :vb], True))
    rp, rs = unpack_mxfp4(t)
    assert torch.equal(rp, p) and torch.equal(rs, s)
    check_repack(t, p, s)
    assert t.experts(1, 3).bits == 1
    t.data.view(-1)[5] ^= 0x80  # a planar sign bit: caught
    with pytest.raises(ConfigError, match="differ"):
        check_repack(t, p, s)
    with pytest.raises(ConfigError, match="bits"):
        repack_mxfp4(p, s, 2, 16, 64, bits=2)


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
def test_mma_element_order_documented_positions_and_round_trip(monkeypatch, bits):
    # the mma order: nibble slot 8q + j + 4b of each 32-element block (16 bytes) holds element 8j + 2q + b; the
    # permutation is a bijection in any step size, the value bits go on top, the scales are untouched, and the
    # tiled layout with it reads back (and checks) as the checkpoint's bytes; a flipped nibble is caught
    import k3rocm.kernels.mx.layout as L

    assert sorted(L.MMA_ORDER) == list(range(32))
    for q in range(4):
        for j in range(4):
            for b in range(2):
                assert L.MMA_ORDER[8 * q + j + 4 * b] == 8 * j + 2 * q + b
    g = torch.Generator().manual_seed(13)
    x = torch.randint(0, 256, (5, 48), dtype=torch.uint8, generator=g)
    y = L.permute_block_order(x, True)
    assert not torch.equal(y, x) and torch.equal(L.permute_block_order(y, False), x)
    nx = torch.stack((x & 15, x >> 4), -1).reshape(5, 3, 32)
    ny = torch.stack((y & 15, y >> 4), -1).reshape(5, 3, 32)
    assert torch.equal(ny, nx[..., list(L.MMA_ORDER)])
    monkeypatch.setattr(L, "PERMUTE_STEP_BYTES", 48)  # three blocks a step, one step ending mid-tensor
    assert torch.equal(L.permute_block_order(x, True), y)
    p, s = _weights(3, 2 * 40, 96, seed=14)
    t = repack_mxfp4(p, s, 2, 16, 64, bits=bits, order=1)
    base = repack_mxfp4(p, s, 2, 16, 64)
    vb = 2 * 16 * t.tile_k // 2
    assert t.order == 1 and t.experts(1, 3).order == 1 and torch.equal(t.data[..., vb:], base.data[..., vb:])
    want = L.permute_block_order(base.data[..., :vb], True)
    assert torch.equal(t.data[..., :vb], L.permute_value_bits(want, True) if bits else want)
    rp, rs = unpack_mxfp4(t)
    assert torch.equal(rp, p) and torch.equal(rs, s)
    check_repack(t, p, s)
    t.data.view(-1)[3] ^= 0x01
    with pytest.raises(ConfigError, match="differ"):
        check_repack(t, p, s)
    with pytest.raises(ConfigError, match="order"):
        repack_mxfp4(p, s, 2, 16, 64, order=2)
    with pytest.raises(ConfigError, match="16-byte blocks"):
        L.permute_block_order(x[:, :40], True)
