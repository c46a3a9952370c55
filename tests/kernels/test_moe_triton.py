"""MoE Triton kernels against the fp32 oracle: router ids (exact), experts in both modes, every config.

Without a GPU the kernels run under the Triton interpreter, which must be switched on before Triton is first
imported (Triton's own library functions are decorated at import). Other test modules in the same pytest
process may already have imported Triton in compiled mode, so on a machine without a GPU this module runs
itself in a child process with ``TRITON_INTERPRET=1`` (one test in the parent; the child reports every
case) and leaves the parent's Triton untouched. ``tl.dot_scaled`` runs under the interpreter with bf16 and
E4M3 operands; the router runs its fp32 path there (the interpreter's bf16 ``tl.dot`` is not trustworthy).
On a GPU the same tests run compiled, in bf16.
"""

from __future__ import annotations

import math
import os
import types

import pytest
import torch

from k3rocm.errors import ConfigError
from k3rocm.model import moe as M
from k3rocm.model.common import situ_glu

from tests.helpers import run_module_in_interpreter, latent_layer_inputs, near_tie_router_inputs, random_experts, script_module


GPU = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CHILD = not GPU and not INTERP  # this process cannot interpret: run the module in a child that can


def test_in_interpreter_child_process():
    """On a machine without a GPU: every test below, in a fresh process with TRITON_INTERPRET=1."""
    run_module_in_interpreter(__file__)


@pytest.fixture(scope="module")
def tk():
    if CHILD:
        pytest.skip("run by test_in_interpreter_child_process")
    import k3rocm.kernels.moe as moe
    import k3rocm.kernels.mx as mx
    from k3rocm.kernels import tune

    yield types.SimpleNamespace(moe=moe, mx=mx, dev="cuda" if GPU else "cpu",
                                configs=tune.configs(moe.GEMM_CONFIGS),
                                act_dtype=torch.bfloat16 if GPU else torch.float32)


def _to(ew, dev):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in ew.items()}


def _rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def test_mxfp8_rows_bitwise(tk):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 256, generator=g) * torch.logspace(-20, 20, 6)[:, None]).bfloat16()
    x[0, :32] = 0
    x[1, :32] = torch.linspace(-1.76, 1.0, 32).bfloat16()
    q, s = tk.mx.quantize_mxfp8_rows(x.to(tk.dev))
    rq, rs, _ = M.quantize_mxfp8_e4m3(x)
    assert (s.cpu() == rs).all()
    assert (q.cpu().view(torch.uint8) == rq.view(torch.uint8)).all()


@pytest.mark.parametrize("T,E,D,k", [(1, 16, 64, 4), (7, 16, 128, 4), (33, 128, 96, 16)])
def test_router_exact_ids(tk, T, E, D, k):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g).bfloat16()
    w = (torch.randn(E, D, generator=g) * 0.1).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    ids, wts = tk.moe.moe_router(x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), bias.to(tk.dev), k)
    rid, rw = M.moe_router(x, w, bias, k)
    assert (ids.cpu() == rid).all()
    torch.testing.assert_close(wts.cpu(), rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,E,D,k", [(1, 16, 64, 4), (7, 128, 256, 16), (33, 64, 96, 8)])
def test_router_fp32_x_bf16_gate(tk, T, E, D, k):
    """The engine's call: fp32 activations (not bf16-representable) with the BF16 gate, split into three bf16
    parts in the kernel: ids equal the fp32 oracle's and the weights carry fp32 accuracy (one bf16 part alone
    is ~1e-3 off, which this tolerance rejects)."""
    g = torch.Generator().manual_seed(100 + T)
    x = torch.randn(T, D, generator=g)
    w = (torch.randn(E, D, generator=g) * D ** -0.5).bfloat16()
    bias = torch.randn(E, generator=g) * 0.01
    ids, wts = tk.moe.moe_router(x.to(tk.dev), w.to(tk.dev), bias.to(tk.dev), k)
    rid, rw = M.moe_router(x.double(), w.double(), bias.double(), k)
    assert (ids.cpu() == rid).all()
    torch.testing.assert_close(wts.cpu().double(), rw.double(), rtol=2e-6, atol=1e-7)


def test_router_near_ties(tk):
    x, w, bias = near_tie_router_inputs(5, 64, 64, 16)
    ids, _ = tk.moe.moe_router(x.to(tk.dev, tk.act_dtype), w.to(tk.dev, tk.act_dtype), bias.to(tk.dev), 64)
    rid, _ = M.moe_router(x, w, bias, 64)
    assert (ids.cpu() == rid).all()


def _case(T, E, D, inter, k, seed, ranks=1, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16()
    if skew:  # every token on experts 0..k-1: the other ranks get no tokens
        ids = torch.arange(k, dtype=torch.int32).repeat(T, 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k, generator=g)
    return x, ids, wts, random_experts(E, D, inter, seed=seed + 100)


def _slice(ew, r, ranks):
    per = ew["num_experts"] // ranks
    sl = slice(r * per, (r + 1) * per)
    return dict(w13_packed=ew["w13_packed"][sl], w13_scale=ew["w13_scale"][sl], w2_packed=ew["w2_packed"][sl],
                w2_scale=ew["w2_scale"][sl], num_experts=per, first_expert=r * per)


TOL = {"a16w4": 5e-4, "a8w4": 1e-2}  # a16w4: one-ulp flips of a stored bf16 h (fp32 order), ~1e-4


def _store_bf16(h: torch.Tensor) -> torch.Tensor:
    """How the A16W4 kernel stores ``h`` (bf16): round-to-nearest-even on a GPU; the Triton interpreter's
    fp32 -> bf16 cast truncates (rounds toward zero), so under the interpreter the reference does the same."""
    if GPU:
        return h.bfloat16().float()
    return (h.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)


def _ref_a16w4(x, ids, wts, ew):
    """Independent fp32 reference of the A16W4 kernel's arithmetic, pair by pair: bf16 x, decoded MXFP4
    weights, SiTU in fp32, h stored as bf16, W2, router weight, sum per token."""
    first, n = int(ew.get("first_expert", 0)), int(ew["num_experts"])
    xf = x.float()
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if not 0 <= e < n:
                continue
            w13, w2 = M.expert_dense_weights(ew, e)
            gu = xf[t] @ w13.t()
            inter = gu.shape[0] // 2
            h = _store_bf16(situ_glu(gu[:inter], gu[inter:]))
            out[t] += float(wts[t, j]) * (h @ w2.t())
    return out


@pytest.mark.parametrize("mode", ["a16w4", "a8w4"])
@pytest.mark.parametrize("T", [1, 2, 7, 64])
def test_experts_every_config(tk, mode, T):
    x, ids, wts, ew = _case(T, 16, 64, 64, 4, seed=T)
    # A16W4: against a reference that stores h as the kernel does (bf16), so the bound is set by one-ulp flips
    # of h under a different fp32 summation order (~1e-4), not by the bf16 storage error itself (~3e-3); the
    # oracle's own A16W4 (h kept in fp32) is checked too, within that storage error
    ref = _ref_a16w4(x, ids, wts, ew) if mode == "a16w4" else M.moe_experts(x, ids, wts, ew, mode=mode)
    oracle = M.moe_experts(x, ids, wts, ew, mode=mode)
    ewd = _to(ew, tk.dev)
    seen = set()
    for cfg in tk.configs:
        tiles = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"], str(cfg.get("w2")))
        if mode == "a8w4" and tiles in seen:  # A8W4 runs the scaled kernel whatever the kind: same launch
            continue
        seen.add(tiles)
        out = tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, mode=mode, config=cfg,
                                 poison=True)
        assert torch.isfinite(out).all(), f"{tk.moe.gemm_name(cfg)}: unwritten (NaN) output"
        assert _rel(out, ref) < TOL[mode], f"{tk.moe.gemm_name(cfg)} {mode} T={T}: rel err {_rel(out, ref):.3g}"
        assert _rel(out, oracle) < 1e-2, f"{tk.moe.gemm_name(cfg)} {mode} T={T}: rel err vs oracle {_rel(out, oracle):.3g}"
        again = tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, mode=mode, config=cfg)
        assert torch.equal(again, out), f"{tk.moe.gemm_name(cfg)}: not deterministic"


@pytest.mark.parametrize("ranks,skew", [(2, False), (2, True), (4, True)])
def test_experts_expert_parallel(tk, ranks, skew):
    x, ids, wts, ew = _case(7, 16, 64, 64, 4, seed=11, skew=skew)
    ref = M.moe_experts(x, ids, wts, ew)
    total = 0
    for r in range(ranks):
        sub = _slice(ew, r, ranks)
        part = tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), _to(sub, tk.dev), poison=True)
        rref = M.moe_experts(x, ids, wts, sub)
        if skew and r > 0:
            assert (part.cpu() == 0).all()  # a rank without tokens contributes exact zeros
        assert _rel(part, rref) < 1e-2 or rref.abs().max() == 0
        total = total + part.cpu()
    assert _rel(total, ref) < 1e-2


def test_a8w4_differs_from_a16w4_by_activation_error(tk):
    x, ids, wts, ew = _case(7, 16, 64, 64, 4, seed=21)
    ewd = _to(ew, tk.dev)
    a16 = tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, mode="a16w4")
    a8 = tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, mode="a8w4")
    d = _rel(a8, a16)
    assert 1e-3 < d < 0.15, f"A8W4 vs A16W4 rel diff {d:.3g}: modes mixed up or MXFP8 broken"
    from k3rocm.errors import ConfigError
    with pytest.raises(ConfigError, match="mode"):
        tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, mode="auto")


def test_situ_extreme_inputs(tk):
    # large weights: |g|, |u| reach ~1000, SiTU saturates at |h| <= 100
    x, ids, wts, ew = _case(5, 16, 64, 64, 4, seed=31)
    ew["w13_scale"].fill_(131)
    ew["w2_scale"].fill_(115)
    ref = M.moe_experts(x, ids, wts, ew)
    xl = x.float()
    gu = xl @ M.expert_dense_weights(ew, int(ids[0, 0]))[0].t()
    assert gu.abs().max() > 300
    out = tk.moe.moe_experts(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), _to(ew, tk.dev))
    assert _rel(out, ref) < 1e-2


def test_nibble_order_known_values(tk):
    D = inter = 64
    w13 = torch.zeros(1, 2 * inter, D // 2, dtype=torch.uint8)
    w13[0, 0, 0] = 0x72  # gate row 0: element 0 = 1.0 (low nibble), element 1 = 6.0
    w13[0, inter, 0] = 0x72
    w2 = torch.zeros(1, D, inter // 2, dtype=torch.uint8)
    w2[0, 3, 0] = 0x02
    ew = dict(w13_packed=w13, w13_scale=torch.full((1, 2 * inter, 2), 127, dtype=torch.uint8), w2_packed=w2,
              w2_scale=torch.full((1, D, 2), 127, dtype=torch.uint8), num_experts=1, first_expert=0)
    x = torch.zeros(2, D, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    x[1, 1] = 1.0
    out = tk.moe.moe_experts(x.to(tk.dev), torch.zeros(2, 1, dtype=torch.int32, device=tk.dev),
                             torch.ones(2, 1, device=tk.dev), _to(ew, tk.dev)).cpu()

    def situ(g, u):
        return 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)

    assert out[0, 3].item() == pytest.approx(situ(1.0, 1.0), rel=4e-3)  # h is stored in bf16
    assert out[1, 3].item() == pytest.approx(situ(6.0, 6.0), rel=4e-3)
    out[:, 3] = 0
    assert (out == 0).all()


def test_registry_selects_triton(tk):
    from k3rocm.runtime.registry import implementations, select

    impls = implementations("moe_experts")
    assert "triton" in impls and "triton" in implementations("moe_router")
    name, impl = select("moe_experts", override={"moe_experts": "triton"}, allow_interpreter=True)
    assert name == "triton"


@pytest.mark.parametrize("mode", ["a16w4", "a8w4"])
def test_latent_moe_layer(tk, mode):
    # whole layer: router, down projection, experts, reduction fused with the latent RMSNorm, up, shared experts
    x, gate, bias, down, normw, up, sg, su, sd, ew, k = latent_layer_inputs(41, 9, expert_seed=42)
    ref = M.latent_moe(x, gate, bias, ew, k, down, normw, up, sg, su, sd, mode=mode)
    dv = [t.to(tk.dev) for t in (x, gate, bias, down, normw, up, sg, su, sd)]
    out = tk.moe.latent_moe(dv[0], dv[1], dv[2], _to(ew, tk.dev), k, *dv[3:], mode=mode)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    # the same composition from oracle pieces with the kernel path's one extra rounding (latent in bf16)
    ids, w = M.moe_router(x, gate, bias, k)
    xl = (x.float() @ down.float().t()).bfloat16()
    sh = M.shared_experts(x, sg, su, sd)
    ref_bf = M.latent_tail(M.moe_experts(xl, ids, w, ew, mode=mode), normw, up, sh)
    assert _rel(out, ref_bf) < 1e-2, f"{mode}: {_rel(out, ref_bf):.3g}"
    # against the all-fp32 oracle: bf16 latent / h / normed latent, and for A8W4 MXFP8 of a different latent
    assert _rel(out, ref) < (3e-2 if mode == "a16w4" else 8e-2), f"{mode}: {_rel(out, ref):.3g}"


def test_fp16_and_fp32_activations(tk):
    # fp16 activations take dot_scaled's "fp16" operand; fp32 activations are rounded to bf16 (A16W4)
    x, ids, wts, ew = _case(7, 16, 64, 64, 4, seed=51)
    ewd = _to(ew, tk.dev)
    for xa in (x.half(), x.float()):
        ref = M.moe_experts(xa, ids, wts, ew)
        out = tk.moe.moe_experts(xa.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, poison=True)
        assert _rel(out, ref) < 1e-2, f"{xa.dtype}: {_rel(out, ref):.3g}"


# ---------------------------------------------------------------------------------------- decode path (kind "dq")


def _decode_probe(tk, packed, scale, fused=False, bits=0):
    """Run ``mxfp4_decode_tile`` + ``mxfp4_k_order`` on one tile; returns (decoded fp32 [N, K], K order [N, K]).
    ``fused``: the one-multiply variant (scales <= 128); on a CUDA GPU both run their PTX bf16x2 multiplies.
    ``bits`` 1: the checkpoint bytes ``packed`` are first moved to planar lanes (``mx.layout``) and decoded so."""
    from k3rocm.kernels.moe.gemm import mxfp4_decode_probe_kernel
    from k3rocm.kernels.mx.layout import permute_value_bits
    from k3rocm.kernels.target import current_target

    if bits:
        packed = permute_value_bits(packed, True)

    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.full((N, K), float("nan"), device=tk.dev)
    idx = torch.arange(K, dtype=torch.int32, device=tk.dev).repeat(N, 1)
    order = torch.full_like(idx, -1)
    mxfp4_decode_probe_kernel[(1,)](packed.to(tk.dev), scale.to(tk.dev), out, idx, order, BN=N, BK=K,
                                    F32=not GPU, FUSED_SCALE=fused,
                                    PTX=GPU and current_target().backend == "cuda", BITS=bits)
    return out.cpu(), order.cpu()


def _all_codes_tile(scales):
    """[16, 32] packed tile (64 elements): row r holds every E2M1 code in both nibbles, in a different order per row
    (byte b of row r = codes (b + r) % 16 | ((b * 7 + r) % 16) << 4); scales [16, 2] from ``scales``."""
    r = torch.arange(16)[:, None]
    b = torch.arange(32)[None, :]
    packed = (((b + r) % 16) | (((b * 7 + r) % 16) << 4)).to(torch.uint8)
    s = torch.tensor(scales, dtype=torch.uint8).reshape(16, 2)
    return packed, s


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
@pytest.mark.parametrize("lo,hi,fused", [(2, 65, False), (65, 128, False), (128, 191, False), (191, 253, False),
                                         (2, 65, True), (65, 129, True)])
def test_decode_every_code_and_scale_bit_exact(tk, lo, hi, fused, bits):
    # every code x every scale whose products are bf16 normals: bit-equal to the MXFP4 oracle rounded to bf16;
    # the one-multiply variant over every scale it may run with (2..128; 0 and 1 below); both value-bit layouts
    from k3rocm.mx import dequantize_mxfp4

    for start in range(lo, hi, 32):
        sc = [min(start + i, hi - 1) for i in range(32)]
        packed, s = _all_codes_tile(sc)
        got, order = _decode_probe(tk, packed, s, fused, bits)
        ref = dequantize_mxfp4(packed, s).bfloat16().float()
        perm = order[0].long()
        assert sorted(perm.tolist()) == list(range(64))
        assert torch.equal(got, ref[:, perm]), f"scales {start}..: {(got != ref[:, perm]).sum()} elements differ"
        assert (got == 0).any() and (got.signbit() & (got == 0)).any()  # +0 and -0 codes both present


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
def test_decode_from_the_mma_element_order_is_the_natural_k_order(tk, bits):
    # the layout's mma order (mx.layout.MMA_ORDER) stores each block's elements so that the decode, which places
    # pair (j, b) of word q at K position 8j + 2q + b, gives every element at its own position: the whole tile
    # equals the MXFP4 oracle column for column, for every code and scale of the probe tile, both value bits
    from k3rocm.kernels.mx.layout import permute_block_order
    from k3rocm.mx import dequantize_mxfp4

    packed, s = _all_codes_tile([100 + i for i in range(32)])
    got, order = _decode_probe(tk, permute_block_order(packed, True), s, False, bits)
    assert sorted(order[0].tolist()) == list(range(64)) and order[0].tolist() != list(range(64))
    assert torch.equal(got, dequantize_mxfp4(packed, s).bfloat16().float())
    # and the checkpoint order decodes to the permuted positions, not the natural ones
    natural, _ = _decode_probe(tk, packed, s, False, bits)
    assert not torch.equal(natural, got)


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
@pytest.mark.parametrize("tiles", [None, (16, 32)], ids=["backend", "chunk-spanning"])
def test_mma_element_order_layout_equals_the_checkpoint_layout(tk, tiles, bits):
    # the mma element order is a permutation of the checkpoint's bits that the decode undoes: every decode-path
    # config (split-K ones too) gives the checkpoint layout's output up to the fp32 summation order inside the
    # matrix products (its k16 steps now sum natural runs of K), and the fp32 oracle's within TOL; 20 repeats
    # identical on the GPU; the scaled kernel (A8W4) refuses the layout with one line
    from k3rocm.kernels.moe.configs import DQ_KINDS

    x, ids, wts, ew = _case(3, 8, 64, 96, 4, seed=73)
    ewd = _to(ew, tk.dev)
    lay = tk.moe.ops.kernel_layout(ewd, tiles, check=True, bits=bits, order=1)
    assert lay.w13.order == lay.w2.order == 1 and lay.w13.bits == bits
    ewt = dict(ewd, kernel_layout=lay)
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    ref = _ref_a16w4(x, ids, wts, ew)
    runs = [c for c in tk.configs if c["kind"] in DQ_KINDS]
    assert runs
    for cfg in runs if tiles is None else runs[:2]:
        want = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=cfg)
        got = tk.moe.moe_experts(*args, ewt, mode="a16w4", config=cfg, poison=True)
        assert torch.isfinite(got).all(), f"{tk.moe.gemm_name(cfg)}: unwritten output"
        assert _rel(got, want) < 1e-5, f"{tk.moe.gemm_name(cfg)}: mma order differs {_rel(got, want):.3g}"
        assert _rel(got.cpu(), ref) < TOL["a16w4"], f"{tk.moe.gemm_name(cfg)}: {_rel(got.cpu(), ref):.3g}"
    with pytest.raises(ConfigError, match="planar value bits" if bits else "mma element order"):
        tk.moe.moe_experts(*args, ewt, mode="a8w4", config=runs[0])
    if GPU:
        outs = [tk.moe.moe_experts(*args, ewt, mode="a16w4") for _ in range(20)]
        assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
@pytest.mark.parametrize("fused", [False, True])
def test_decode_extreme_scales(tk, fused, bits):
    # E8M0 0 (2^-127: results are bf16 subnormals) and 253/254 (6 x 2^127 overflows to inf, as in fp32); the
    # one-multiply variant at the ends of its range (0, 1: subnormal results; 127, 128: its largest multiplier)
    from k3rocm.mx import dequantize_mxfp4

    packed, s = _all_codes_tile(([0, 1, 127, 128] if fused else [0, 1, 253, 254]) * 8)
    got, order = _decode_probe(tk, packed, s, fused, bits)
    ref = dequantize_mxfp4(packed, s).bfloat16().float()[:, order[0].long()]
    assert torch.equal(got.nan_to_num(), ref.nan_to_num()), f"{(got != ref).sum()} elements differ"
    if fused:
        assert (ref.abs() < 2.0 ** -126).any() and (ref != 0).any()  # the subnormal results are in the tile


def test_fused_scale_ok_reads_each_tensor_once(tk, monkeypatch):
    # the one-multiply decode only where every scale byte is <= 128; the answer is remembered per tensor and
    # redone after an in-place change
    ops = tk.moe.ops
    s = torch.full((3, 8, 4), 120, dtype=torch.uint8, device=tk.dev)
    assert ops.fused_scale_ok(s)
    s[2, 7, 3] = ops.FUSED_SCALE_MAX
    assert ops.fused_scale_ok(s)
    s[1, 0, 0] = ops.FUSED_SCALE_MAX + 1
    assert not ops.fused_scale_ok(s)
    calls = []
    real_max = torch.Tensor.max
    monkeypatch.setattr(torch.Tensor, "max", lambda self, *a, **k: calls.append(1) or real_max(self, *a, **k))
    assert not ops.fused_scale_ok(s) and not calls  # remembered
    assert ops.fused_scale_ok(torch.empty(0, dtype=torch.uint8, device=tk.dev))


@pytest.mark.parametrize("big", [False, True], ids=["scales<=128", "a-scale-of-130"])
def test_experts_fused_and_general_decode_agree(tk, monkeypatch, big):
    # the decode kernel's two scale variants give bit-identical outputs (the same exact bf16 weights), and weights
    # with a scale byte above 128 take the general one and still match the oracle
    x, ids, wts, ew = _case(9, 8, 128, 64, 4, seed=91)
    if big:  # one block of expert 3's w1 rows and of its w2 rows at 2^3: |weights| up to 48
        ew["w13_scale"][3, 5, 1] = 130
        ew["w2_scale"][3, 7, 0] = 130
    ref = _ref_a16w4(x, ids, wts, ew)
    ewd = _to(ew, tk.dev)
    assert tk.moe.ops.fused_scale_ok(ewd["w13_scale"]) is (not big)
    cfg = next(c for c in tk.configs if c["kind"] == "dq")
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, "situ", "a16w4", 4.0, 25.0, cfg)
    auto, _ = tk.moe.ops._experts_impl(*args, poison=True)
    assert _rel(auto, ref) < TOL["a16w4"], f"rel err {_rel(auto, ref):.3g}"
    if big:
        assert torch.isfinite(auto).all()
    else:
        monkeypatch.setattr(tk.moe.ops, "fused_scale_ok", lambda s: False)
        general, _ = tk.moe.ops._experts_impl(*args, poison=True)
        assert torch.equal(auto, general)


def test_tiled_layout_takes_its_own_scale_flag(tk):
    # a tiled kernel_layout carries its scales: the one-multiply choice is the layout's (read at repack), never
    # the checkpoint tensors' -- which may be absent, or (here) disagree with the layout
    x, ids, wts, ew = _case(9, 8, 128, 64, 4, seed=93)
    ew["w13_scale"][3, 5, 1] = 130
    ew["w2_scale"][3, 7, 0] = 130
    ref = _ref_a16w4(x, ids, wts, ew)
    ewd = _to(ew, tk.dev)
    lay = tk.moe.ops.kernel_layout(ewd, check=True)
    assert lay.w13.max_scale == 130 and lay.w2.max_scale == 130
    cfg = next(c for c in tk.configs if c["kind"] == "dq")
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    small = dict(ewd, w13_scale=ewd["w13_scale"].clamp(max=120), w2_scale=ewd["w2_scale"].clamp(max=120),
                 kernel_layout=lay)
    gone = dict(ewd, w13_scale=None, w2_scale=None, kernel_layout=lay)
    for name, ewt in (("disagreeing checkpoint scales", small), ("no checkpoint scales", gone)):
        out = tk.moe.moe_experts(*args, ewt, config=cfg, poison=True)
        assert torch.isfinite(out).all() and _rel(out, ref) < TOL["a16w4"], f"{name}: rel err {_rel(out, ref):.3g}"
    fine = tk.moe.ops.kernel_layout(_to(_case(9, 8, 128, 64, 4, seed=93)[3], tk.dev))
    assert fine.w13.max_scale <= tk.moe.ops.FUSED_SCALE_MAX and fine.w2.max_scale <= tk.moe.ops.FUSED_SCALE_MAX


def test_fused_scale_ok_on_inference_tensors(tk):
    # weights loaded under torch.inference_mode have no version counter; the check still answers, once
    ops = tk.moe.ops
    with torch.inference_mode():
        s = torch.full((2, 4, 4), 100, dtype=torch.uint8, device=tk.dev)
        b = s.clone()
        b[1, 2, 3] = 200
    assert ops.fused_scale_ok(s) and not ops.fused_scale_ok(b)
    assert ops.fused_scale_ok(s) and not ops.fused_scale_ok(b)


def test_decode_k_order_matches_activation_order(tk):
    # the weight and activation K permutations are the same map, so a dot product over K is unchanged
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=g)
    s = torch.randint(118, 124, (16, 4), dtype=torch.uint8, generator=g)
    from k3rocm.mx import dequantize_mxfp4

    got, order = _decode_probe(tk, packed, s)
    ref = dequantize_mxfp4(packed, s)
    assert torch.equal(got, ref[:, order[0].long()])
    x = torch.randn(128, generator=g)
    torch.testing.assert_close(got @ x[order[0].long()], ref @ x, rtol=1e-5, atol=1e-5)


def test_every_cuda_config_code_path_small(tk):
    # every tile of the CUDA list (and of the HIP list) through its own kernel at a small size: under the
    # interpreter this runs the decode kernel's code with the shipped tiles, not only the interpreter's tiles;
    # plus the untransposed decode variant ("dqn", a benchmark candidate) and the benchmark's candidates
    import k3rocm.kernels.moe.configs as C

    CANDIDATES = script_module("bench_moe").CANDIDATES

    x, ids, wts, ew = _case(7, 16, 128, 128, 4, seed=61)
    ref = _ref_a16w4(x, ids, wts, ew)
    ewd = _to(ew, tk.dev)
    extra = [C.gemm_config(32, 64, 64, 4, 1, kind="dqn")]
    # on a GPU only the variant not covered elsewhere (compile time): the backend's list runs in
    # test_experts_every_config and the candidates are checked at K3 size by bench_moe.py --check
    cfgs = extra if GPU else C.GEMM_CONFIGS["cuda"] + C.GEMM_CONFIGS["hip"] + extra + CANDIDATES
    for cfg in cfgs:
        stages: dict = {}
        out, _ = tk.moe.ops._experts_impl(x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, "situ", "a16w4",
                                          4.0, 25.0, cfg, poison=True, stages=stages)
        assert stages["kernel"] == cfg["kind"], f"{C.gemm_name(cfg)}: ran the {stages['kernel']} kernel"
        assert torch.isfinite(out).all(), f"{C.gemm_name(cfg)}: unwritten (NaN) output"
        assert _rel(out, ref) < TOL["a16w4"], f"{C.gemm_name(cfg)}: rel err {_rel(out, ref):.3g}"


@pytest.mark.parametrize("bits", [0, 1], ids=["nibble", "planar"])
@pytest.mark.parametrize("tiles", [None, (16, 32)], ids=["backend", "chunk-spanning"])
def test_kernel_layout_equals_checkpoint_layout(tk, tiles, bits):
    # the tiled layout made at load is a permutation of the checkpoint's bits: every config (and A8W4 on the
    # first) gives bit-identical output from it, 20 repeats identical; (16, 32): n-tiles smaller than each
    # config's BLOCK_N and k-steps fitted to the layout's k-tile. Planar value bits: every decode-path config
    # bit-identical; the scaled kernel (and A8W4) refuse them with one line
    from k3rocm.kernels.moe.configs import DQ_KINDS

    x, ids, wts, ew = _case(3, 8, 64, 96, 4, seed=71)
    ewd = _to(ew, tk.dev)
    lay = tk.moe.ops.kernel_layout(ewd, tiles, check=True, bits=bits)
    assert lay.w13.bits == lay.w2.bits == bits
    ewt = dict(ewd, kernel_layout=lay)
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    runs = [(c, "a16w4") for c in tk.configs if not bits or c["kind"] in DQ_KINDS]
    runs += [(tk.configs[0], "a8w4")] if not bits else []
    for cfg, mode in runs if tiles is None else runs[:1]:
        want = tk.moe.moe_experts(*args, ewd, mode=mode, config=cfg)
        got = tk.moe.moe_experts(*args, ewt, mode=mode, config=cfg, poison=True)
        assert torch.equal(got, want), f"{tk.moe.gemm_name(cfg)} {mode}: tiled layout differs from checkpoint"
    if bits:
        with pytest.raises(ConfigError, match="planar value bits"):
            tk.moe.moe_experts(*args, ewt, mode="a8w4", config=runs[0][0])
    if GPU:
        outs = [tk.moe.moe_experts(*args, ewt, mode="a16w4") for _ in range(20)]
        assert all(torch.equal(o, outs[0]) for o in outs)


def test_decode_configs_never_run_a8w4_or_fp16(tk):
    # A8W4 keeps tl.dot_scaled with E4M3 activations; fp16 activations keep the scaled kernel (fp16 operand)
    import k3rocm.kernels.moe.configs as C

    dq = next(c for c in tk.configs if c["kind"] == "dq")
    x, ids, wts, ew = _case(7, 16, 64, 64, 4, seed=71)
    ewd = _to(ew, tk.dev)
    for mode, xa, want in (("a16w4", x, "dq"), ("a8w4", x, "scaled"), ("a16w4", x.half(), "scaled")):
        stages: dict = {}
        out, _ = tk.moe.ops._experts_impl(xa.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev), ewd, "situ", mode,
                                          4.0, 25.0, dq, stages=stages)
        assert stages["kernel"] == want, f"{mode} {xa.dtype}: {stages['kernel']}"
        assert _rel(out, M.moe_experts(xa, ids, wts, ew, mode=mode)) < 1e-2
    from k3rocm.errors import ConfigError
    with pytest.raises(ConfigError, match="kind"):
        C.gemm_config(16, 32, 64, 4, 1, kind="fast")


@pytest.mark.parametrize("T,k,E,first,num_local,bm", [(1, 1, 4, 0, 4, 16), (7, 4, 16, 0, 16, 16),
                                                      (64, 16, 896, 0, 896, 16), (33, 16, 128, 32, 32, 32),
                                                      (300, 4, 16, 8, 8, 64), (5, 4, 16, 12, 4, 16)])
def test_one_program_dispatch_equals_torch_path(tk, T, k, E, first, num_local, bm):
    # the one-launch dispatch kernel and the torch (radix sort) path give the same tensors, and the grouping of
    # the oracle's dispatch (stable within an expert; pairs of other ranks dropped / -1)
    g = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().to(tk.dev)
    a = tk.moe.dispatch_gpu(ids, first, num_local, bm, one_program=True)
    b = tk.moe.dispatch_gpu(ids, first, num_local, bm, one_program=False)
    for f in ("sorted_pair", "pos", "counts", "offsets", "block_expert"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
    used = a.block_expert >= 0
    assert torch.equal(a.block_start[used], b.block_start[used])
    ref = M.dispatch(ids.cpu(), E, (first, first + num_local))
    n = int(a.offsets[-1])
    assert n == ref.sorted_pair.numel()
    assert torch.equal(a.sorted_pair[:n].cpu().long(), ref.sorted_pair.long())
    # every block covers rows of one expert only, and together the blocks cover each expert's rows once
    for e in range(num_local):
        lo, hi = int(a.offsets[e]), int(a.offsets[e + 1])
        starts = sorted(int(s) for s in a.block_start[a.block_expert == e])
        assert starts == list(range(lo, hi, bm))


@pytest.mark.parametrize("T,E,D,inter", [(1, 8, 64, 64), (3, 16, 64, 96), (9, 4, 128, 64)],
                         ids=["one-row-one-kstep", "empty-experts", "rows-past-tile"])
@pytest.mark.parametrize("tiled", [False, True], ids=["checkpoint", "tiled"])
def test_scale_prefetch_variants_bit_identical(tk, T, E, D, inter, tiled):
    # kinds "dqp" / "dqw" / "dqnp" (scales read a k-step ahead; "dqw" one byte per word) give the plain decode
    # kernel's bits: the same bytes decoded the same way, the same dot order. Edge shapes: one token (experts
    # with 0 and 1 rows), a single k-step (the prefetch masked off at once: K = BLOCK_K = 64), 16 experts for 12
    # pairs (most empty), 9 tokens on 4 experts (rows not a multiple of BLOCK_M=16), w2's K = 96 (k-steps of 32)
    import k3rocm.kernels.moe.configs as C

    x, ids, wts, ew = _case(T, E, D, inter, 4 if E >= 4 else E, seed=T + E)
    ewd = _to(ew, tk.dev)
    if tiled:
        ewd = dict(ewd, kernel_layout=tk.moe.ops.kernel_layout(ewd, check=True))
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    pairs = [(C.gemm_config(16, 32, 64, 4, 1, kind="dq"), ("dqp", "dqw")),
             (C.gemm_config(32, 64, 32, 4, 1, kind="dqn"), ("dqnp",))]
    for base, kinds in pairs:
        want = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=base)
        assert torch.isfinite(want).all()
        for kind in kinds:
            cfg = dict(base, kind=kind)
            stages: dict = {}
            got, _ = tk.moe.ops._experts_impl(*args, ewd, "situ", "a16w4", 4.0, 25.0, cfg, poison=True,
                                              stages=stages)
            assert stages["kernel"] == kind
            if tk.dev == "cpu":  # the interpreter runs both programs op for op: the same bits
                assert torch.equal(got, want), f"{C.gemm_name(cfg)}: differs from {C.gemm_name(base)}"
            else:
                # compiled, a one-stage tile of the prefetch kinds may schedule the fp32 accumulation
                # differently (H200, 2026-12-02: <= 1.6e-7 of max |out| at these tiles, 0.0 at the served 4-stage
                # tiles, gpu-runs/moe_pf_check.py): at most a few fp32 ulps, far below a wrong scale (>= 2x)
                d = (got.float() - want.float()).abs().max().item()
                assert d <= 1e-6 * want.float().abs().max().item(), \
                    f"{C.gemm_name(cfg)}: differs from {C.gemm_name(base)} by {d}"


@pytest.mark.parametrize("T,E,D,inter", [(1, 8, 128, 96), (3, 16, 64, 96), (9, 4, 128, 64)],
                         ids=["one-row", "empty-experts", "rows-past-tile"])
@pytest.mark.parametrize("tiled", [False, True], ids=["checkpoint", "tiled"])
def test_split_k_variants(tk, T, E, D, inter, tiled):
    # split_k (decode kinds): K cut into ranges of whole k-steps, fp32 partials summed in a fixed order (w1|w3 by
    # moe_glu_finish_kernel, w2 by the reduction). Against the oracle-like reference like every config, within
    # fp32-order noise of the unsplit kernel, and the same bits on every run. Edge shapes: experts with 0 / 1
    # rows, rows not a multiple of BLOCK_M, K not a multiple of the split (splits start at whole layout chunks,
    # 64 elements here: w2 K = 96 = 3 chunks of 32 in ranges of 64 + 32; w1|w3 K = 128 in 2 ranges of 64 with
    # k-steps of 32 inside a chunk), splits > chunks; the tiled layout gives the checkpoint layout's bits
    import k3rocm.kernels.moe.configs as C

    x, ids, wts, ew = _case(T, E, D, inter, 4, seed=T + E + 5)
    ref = _ref_a16w4(x, ids, wts, ew)
    ewc = ewd = _to(ew, tk.dev)
    if tiled:
        ewd = dict(ewd, kernel_layout=tk.moe.ops.kernel_layout(ewd, check=True))
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    for kind, bm, bn, sk in (("dqp", 16, 32, 2), ("dq", 16, 32, 3), ("dqn", 32, 64, 2), ("dqw", 16, 32, 8)):
        cfg = C.gemm_config(bm, bn, 32, 4, 1, kind=kind, split_k=sk)
        base = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=C.gemm_config(bm, bn, 32, 4, 1, kind=kind))
        got = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=cfg, poison=True)
        name = C.gemm_name(cfg)
        assert torch.isfinite(got).all(), f"{name}: unwritten (NaN) output"
        assert _rel(got, ref) < TOL["a16w4"], f"{name}: rel err {_rel(got, ref):.3g}"
        assert _rel(got, base) < TOL["a16w4"], f"{name}: vs unsplit {_rel(got, base):.3g}"
        for _ in range(20 if GPU else 2):
            again = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=cfg)
            assert torch.equal(again, got), f"{name}: not deterministic"
        if tiled:
            assert torch.equal(tk.moe.moe_experts(*args, ewc, mode="a16w4", config=cfg), got), f"{name}: layouts differ"


@pytest.mark.parametrize("T,E,D,inter", [(1, 8, 128, 96), (3, 16, 64, 96), (9, 4, 128, 64), (16, 3, 64, 64)],
                         ids=["one-row", "empty-experts", "rows-past-tile", "more-programs-than-blocks"])
@pytest.mark.parametrize("tiled", [False, True], ids=["checkpoint", "tiled"])
def test_persistent_grid_bit_identical(tk, T, E, D, inter, tiled):
    # persist (decode kinds): a persistent grid whose programs walk the live blocks' (block, split, n tile) items and
    # stop at the first empty block. Each item is the plain grid's program of the same (block, n tile, split): the
    # same bits, for every kind, with split-K and with w2 on its own n-tile. Under the interpreter a program per
    # "SM" times persist, so 1 or 2 programs walk every item (one-row: a single live block; empty-experts: most
    # blocks empty; more-programs-than-blocks: the grid capped at the items, 3 experts x 16 tokens x 4 = 64 pairs)
    import k3rocm.kernels.moe.configs as C

    x, ids, wts, ew = _case(T, E, D, inter, min(4, E), seed=T + E + 11)
    ewd = _to(ew, tk.dev)
    if tiled:
        ewd = dict(ewd, kernel_layout=tk.moe.ops.kernel_layout(ewd, check=True))
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    d = tk.moe.ops.dispatch_gpu(args[1], 0, E, 16)
    live = (d.block_expert >= 0).cpu()  # the contract the persistent walk relies on: live blocks first, then -1
    assert not (live[1:] & ~live[:-1]).any(), "block table: a live block after an empty one"
    for base in (C.gemm_config(16, 32, 64, 4, 1, kind="dqp"), C.gemm_config(32, 64, 32, 4, 1, kind="dqn"),
                 C.gemm_config(16, 32, 32, 4, 1, kind="dq", split_k=2),
                 C.gemm_config(16, 32, 64, 4, 1, kind="dqw", w2=dict(BLOCK_N=64))):
        want = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=base)
        assert torch.isfinite(want).all()
        for persist in (1, 2, 1000):
            cfg = dict(base, persist=persist)
            got = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=cfg, poison=True)
            name = C.gemm_name(cfg)
            if tk.dev == "cpu":
                assert torch.equal(got, want), f"{name}: differs from {C.gemm_name(base)}"
            else:  # compiled, another kernel may schedule the fp32 accumulation differently (a few ulps at most)
                dd = (got.float() - want.float()).abs().max().item()
                assert dd <= 1e-6 * want.float().abs().max().item(), f"{name}: differs by {dd}"
                for _ in range(20):
                    assert torch.equal(tk.moe.moe_experts(*args, ewd, mode="a16w4", config=cfg), got), \
                        f"{name}: not deterministic"


def test_persist_config_checks():
    import k3rocm.kernels.moe.configs as C
    from k3rocm.errors import ConfigError
    from k3rocm.kernels.moe.ops import _dq_grid

    with pytest.raises(ConfigError, match="persist"):
        C.gemm_config(16, 32, 64, 4, 1, persist=2)  # the scaled kernel has no persistent form
    with pytest.raises(ConfigError, match="persist"):
        C.gemm_config(16, 32, 64, 4, 1, kind="dq", persist=-1)
    assert C.gemm_name(C.gemm_config(16, 128, 128, 4, 4, kind="dqp", split_k=2, persist=3)) == "dqp-m16n128k128w4s4sk2p3"
    assert "persist" not in C.gemm_config(16, 32, 64, 4, 1, kind="dq")
    assert C.stage_config(C.gemm_config(16, 32, 64, 4, 1, kind="dq", persist=2), False)["persist"] == 2  # w2 too
    assert _dq_grid(10, 4, 2, 0, torch.device("cpu")) == (10, 4, 2)


def test_split_k_config_checks():
    import k3rocm.kernels.moe.configs as C
    from k3rocm.errors import ConfigError
    from k3rocm.kernels.moe.ops import _split_k

    with pytest.raises(ConfigError):
        C.gemm_config(16, 32, 64, 4, 1, split_k=2)  # the scaled kernel has no split
    with pytest.raises(ConfigError):
        C.gemm_config(16, 32, 64, 4, 1, kind="dq", split_k=0)
    assert C.gemm_name(C.gemm_config(16, 32, 64, 4, 1, kind="dqp", split_k=4)) == "dqp-m16n32k64w4s1sk4"
    assert "split_k" not in C.gemm_config(16, 32, 64, 4, 1, kind="dq")
    assert _split_k(3584, 128, 4) == (896, 4) and _split_k(3072, 128, 4) == (768, 4)
    assert _split_k(96, 32, 2) == (64, 2) and _split_k(64, 32, 3) == (32, 2) and _split_k(64, 32, 8) == (32, 2)
    assert _split_k(64, 32, 1) == (64, 1)
    assert _split_k(3584, 64, 4, 128) == (896, 4) and _split_k(128, 32, 4, 64) == (64, 2)  # whole chunks


def test_w2_override_config():
    # a config may give w2 its own n-tile / launch (configs.stage_config); BLOCK_M, BLOCK_K, kind and split stay shared
    import k3rocm.kernels.moe.configs as C
    from k3rocm.errors import ConfigError
    from k3rocm.kernels import tune
    from k3rocm.kernels.moe.gemm import dq_isa_case, isa_options

    cfg = C.gemm_config(16, 128, 128, 4, 4, max_rows=16, kind="dqp", w2=dict(BLOCK_N=256, num_warps=8))
    assert C.gemm_name(cfg) == "dqp-m16n128k128w4s4+w2n256w8s4"
    w13, w2 = C.stage_config(cfg, True), C.stage_config(cfg, False)
    assert "w2" not in w13 and "w2" not in w2
    assert (w13["BLOCK_N"], w13["num_warps"]) == (128, 4) and (w2["BLOCK_N"], w2["num_warps"], w2["num_stages"]) == (256, 8, 4)
    assert w2["BLOCK_M"] == w13["BLOCK_M"] == 16 and w2["kind"] == "dqp"
    assert tune.split(cfg, interp=False)[1] == {"num_warps": 4, "num_stages": 4}  # w1|w3's launch
    assert C.gemm_name(C.gemm_config(16, 32, 64, 4, 1)) == "m16n32k64w4s1"  # no suffix without an override
    # a register cap (CUDA launch option) is named, passed to the launch and to the ISA compile, and w2 inherits it
    capped = C.gemm_config(16, 128, 128, 4, 3, kind="dqp", maxnreg=128, w2=dict(num_stages=4))
    assert C.gemm_name(capped) == "dqp-m16n128k128w4s3r128+w2n128w4s4r128"
    assert tune.split(C.stage_config(capped, False), interp=False)[1] == {"num_warps": 4, "num_stages": 4, "maxnreg": 128}
    assert dq_isa_case(True, capped, "cuda", tiles=(128, 128))[5] == {"num_warps": 4, "num_stages": 3, "maxnreg": 128}
    assert "maxnreg" not in isa_options(capped, "hip")
    with pytest.raises(ConfigError, match="BLOCK_M"):
        C.gemm_config(16, 32, 64, 4, 1, w2=dict(BLOCK_M=32))  # the dispatch's row blocks are shared
    # the ISA cases compile w2 with its own tile
    _, _, _, consts, _, opts = dq_isa_case(False, cfg, "cuda", tiles=(128, 128))
    assert consts["BLOCK_N"] == 256 and opts["num_warps"] == 8
    _, _, _, consts, _, opts = dq_isa_case(True, cfg, "cuda", tiles=(128, 128))
    assert consts["BLOCK_N"] == 128 and opts["num_warps"] == 4


def test_weights_use_kernel_layout(tk, tiny_ckpt):
    # Weights.use_kernel_layout (what the engine runs at build on a GPU): every MoE layer's experts move into the
    # tiled layout with a checked read-back, the checkpoint-layout stacks are released (meta, no storage), and
    # nothing observable changes: the Triton GEMMs give the same bits, the fp32 oracle's per-expert weights and
    # get() of an expert tensor read back the checkpoint's bytes, a cast carries the layout
    from k3rocm.model.moe import expert_dense_weights
    from k3rocm.model.weights import load_weights
    from k3rocm.checkpoint import layout as ck

    w = load_weights(tiny_ckpt, device=tk.dev)
    cfg = w.config
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert moe, "k3-tiny has MoE layers"
    i = moe[-1]
    ew = w.experts(i)
    E, D = ew.num_experts, ew.in_features
    g = torch.Generator().manual_seed(2024)
    T, k = 9, min(4, E)
    x = torch.randn(T, D, generator=g).to(tk.act_dtype).to(tk.dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().to(tk.dev)
    wts = torch.rand(T, k, generator=g).to(tk.dev)
    want = tk.moe.moe_experts(x, ids, wts, ew, config=tk.configs[0])
    dense = [expert_dense_weights(ew, e) for e in range(E)]
    raw = {sp.name: w[sp.name].clone() for sp in ck.expert_specs(cfg, i, E - 1)}  # w1 / w2 / w3 values + scales
    before = w.nbytes()

    # no room: nothing converted, nothing released, and it says why
    st = w.use_kernel_layout(lambda e: tk.moe.ops.kernel_layout(e, check=True), room=lambda n: False)
    assert st["layers"] == 0 and "no room" in st["stopped"] and not ew.released and ew.kernel_layout is None

    def oom(e):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    st = w.use_kernel_layout(oom)
    assert st["layers"] == 0 and "out of device memory" in st["stopped"] and not ew.released

    st = w.use_kernel_layout(lambda e: tk.moe.ops.kernel_layout(e, check=True))
    assert (st["layers"], st["total"], st["stopped"]) == (len(moe), len(moe), "") and st["bytes"] > 0
    assert w.experts(i) is ew and ew.released and ew.kernel_layout is not None
    assert ew.w13_packed.is_meta and ew.w2_scale.is_meta
    with pytest.raises((NotImplementedError, RuntimeError)):  # a released stack cannot be computed with
        ew.w13_packed.float().sum().item()
    got = tk.moe.moe_experts(x, ids, wts, ew, config=tk.configs[0], poison=True)
    assert torch.equal(got, want), "the tiled layout gives other bits than the checkpoint layout"
    for e in range(E):
        a, b = expert_dense_weights(ew, e)
        assert torch.equal(a, dense[e][0]) and torch.equal(b, dense[e][1]), f"expert {e} reads back wrong"
    for name, t in raw.items():
        assert torch.equal(w[name], t), f"{name} reads back wrong from the kernel layout"
    assert w.nbytes() >= before * 0.5, "the layout's bytes are counted"
    # converted layers are not converted again; a cast (the engine's copy) keeps layout and released stacks
    assert w.use_kernel_layout(lambda e: pytest.fail("repacked twice"))["already"] == len(moe)
    c = w.cast(tk.dev, torch.float32)
    assert c.experts(i).released and torch.equal(tk.moe.moe_experts(x, ids, wts, c.experts(i), config=tk.configs[0]), want)
    assert all(torch.equal(c[name], t) for name, t in raw.items())
    # a sub-range (expert parallelism) slices the layout
    half = w.experts(i, (ew.first_expert + 1, ew.first_expert + E))
    assert half.released and half.kernel_layout.w13.num_experts == E - 1
    assert torch.equal(expert_dense_weights(half, 0)[0], dense[1][0])


@pytest.mark.parametrize("T,E,ranks", [(1, 8, 4), (12, 16, 4), (24, 4, 1)],
                         ids=["one-row-ep4", "ep4-slice", "all-local"])
def test_reduce_ilp_same_bits(tk, monkeypatch, T, E, ranks):
    # configs.REDUCE_LAUNCH ILP: the reduction's slots unrolled as masked loads of -0.0 for the pairs of other ranks
    # (tokens with no local pair among them) gives the loop's bits exactly, signed zeros included, at the 4 / 16
    # warps it runs with; split-K partials keep the loop (ILP is ignored there)
    import k3rocm.kernels.moe.configs as C

    x, ids, wts, ew = _case(T, E * ranks, 128, 96, min(4, E), seed=T + E + 41)
    ewd = _to(_slice(ew, 0, ranks), tk.dev)
    args = (x.to(tk.dev), ids.to(tk.dev), wts.to(tk.dev))
    backend = "cuda" if GPU else "interpreter"
    for base in (C.gemm_config(16, 32, 64, 4, 1, kind="dqp"), C.gemm_config(16, 32, 32, 4, 1, kind="dq", split_k=2),
                 C.gemm_config(16, 32, 64, 4, 1)):
        monkeypatch.setitem(C.REDUCE_LAUNCH, backend, dict(ILP=False, num_warps=4))
        want = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=base)
        for warps in (4, 16):
            monkeypatch.setitem(C.REDUCE_LAUNCH, backend, dict(ILP=True, num_warps=warps))
            got = tk.moe.moe_experts(*args, ewd, mode="a16w4", config=base, poison=True)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{C.gemm_name(base)} {warps} warps"
