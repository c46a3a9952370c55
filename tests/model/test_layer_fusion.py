"""Fewer launches per layer: the engine's (memoising) weight view multiplies the projections that share an
input as one GEMM over concatenated weights and widens small fp32 parameters once; the oracle's view
fuses nothing (its math is unchanged). Counts of aten ops per sublayer call, before / after."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3rocm.model import layer as L
from k3rocm.model.common import matmul_dtype
from k3rocm.model.weights import load_weights

MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "_scaled_mm"}
# aten ops that only make a view (no kernel on a GPU)
VIEWS = {"view", "_unsafe_view", "reshape", "slice", "split", "split_with_sizes", "unsqueeze", "squeeze", "t",
         "transpose", "permute", "select", "expand", "as_strided", "alias", "detach", "unbind", "narrow"}


class _Count(TorchDispatchMode):
    """aten ops that launch work (views left out) outside the heavy ops; each heavy op (``ops[name]``, a kernel on the GPU) counts as one."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and func.overloadpacket.__name__ not in VIEWS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def wrap(self, ops):
        def one(name, fn):
            @functools.wraps(fn)  # the op's signature stays visible (the decoder asks what an op takes)
            def call(*a, **k):
                self.ops.append("op:" + name)
                self.inside += 1
                try:
                    return fn(*a, **k)
                finally:
                    self.inside -= 1
            return call
        return {n: one(n, f) for n, f in ops.items()}


@pytest.fixture(scope="module")
def tiny(tiny_ckpt, tiny_cfg):
    return tiny_cfg, load_weights(tiny_ckpt).cast("cpu", torch.bfloat16)


def _calls(cfg):
    """(name, setup() -> batch, fn(view, ops, batch) -> tensor): KDA prefill and decode, MLA decode, the MLA
    projections, the MoE block (router, latent projections, experts, shared experts)."""
    kda = cfg.layer_types.index("kda")
    mla = cfg.layer_types.index("mla")
    moe = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, cfg.hidden_size, generator=g)
    x2 = torch.randn(2, cfg.hidden_size, generator=g)
    prefill = L.Batch(torch.tensor([0, 5], dtype=torch.int32))

    def decode():  # a fresh cache per call: the same result every time
        return L.Batch(torch.tensor([0, 1, 2], dtype=torch.int32), cache=L.K3Cache.empty(cfg, 2, 32),
                       start_pos=torch.zeros(2, dtype=torch.int64), decode=True)
    return [
        ("kda_prefill", lambda: prefill, lambda w, ops, b: L.kda_mixer(x, w, kda, cfg, ops, b)),
        ("kda_decode", decode, lambda w, ops, b: L.kda_mixer(x2, w, kda, cfg, ops, b)),
        ("mla_decode", decode, lambda w, ops, b: L.mla_mixer(x2, w, mla, cfg, ops, b)),
        ("mla_project", lambda: None,
         lambda w, ops, b: torch.cat([t.reshape(5, -1) for t in L.mla_project(x, w, mla, cfg)], 1)),
        ("moe_block", lambda: None, lambda w, ops, b: L.moe_block(x, w, moe, cfg, ops)),
    ]


def launches(cfg, weights) -> dict[str, tuple[int, int]]:
    """Per sublayer call: (aten ops + heavy ops with the oracle's view, the same with the engine's view),
    both under ``matmul_dtype(bf16)``; asserts the results agree."""
    out = {}
    for name, setup, fn in _calls(cfg):
        memo = L.WeightView(weights, memo=True)
        fn(memo, L.resolve_ops(), setup())  # first call builds the concatenations and the fp32 copies
        res = []
        for view in (L.WeightView(weights), memo):
            b = setup()
            with matmul_dtype(torch.bfloat16), _Count() as c:
                y = fn(view, c.wrap(L.resolve_ops()), b)
            res.append((y, c.ops))
        # one bf16 GEMM over concatenated weights: the same products, fp32 accumulation (order may differ)
        torch.testing.assert_close(res[1][0], res[0][0], rtol=2e-2, atol=2e-3)
        out[name] = (len(res[0][1]), len(res[1][1]), sum(o in MATMULS for o in res[0][1]),
                     sum(o in MATMULS for o in res[1][1]))
    return out


def test_oracle_view_fuses_nothing(tiny):
    cfg, weights = tiny
    w = L.WeightView(weights)
    assert w.fused(("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight")) is None


def test_engine_view_fewer_launches_same_result(tiny):
    cfg, weights = tiny
    counts = launches(cfg, weights)
    print("ops per call (oracle view, engine view, matmuls oracle, engine):", counts)
    for name, (old, new, mm_old, mm_new) in counts.items():
        assert new < old, (name, counts[name])
    # KDA: q|k|v|g|b|f_a in one GEMM (+ f_b, o_proj); MLA: q_a|kv_a in one (+ q_b); shared MLP: gate|up in one
    assert counts["kda_prefill"][2:] == (8, 3) and counts["kda_decode"][2:] == (8, 3)
    assert counts["mla_project"][2:] == (3, 2)
    assert counts["moe_block"][3] == counts["moe_block"][2] - 1


def test_fp32_math_unchanged_by_the_engine_view(tiny_ckpt, tiny_cfg):
    # without a low-precision scope the engine's view multiplies each weight alone: bitwise the oracle's result
    weights = load_weights(tiny_ckpt)
    memo = L.WeightView(weights, memo=True)
    for name, setup, fn in _calls(tiny_cfg):
        a = fn(L.WeightView(weights), L.resolve_ops(), setup())
        b = fn(memo, L.resolve_ops(), setup())
        assert torch.equal(a, b), name
    assert not any(k.startswith("cat:") for k in memo._memo)


def test_batch_host_offsets_and_shared_device_ints():
    # the engine hands the mixers the offsets on the host (no per-layer device read) and shares per-step
    # index tensors across layers; both must describe exactly the batch's device offsets
    from k3rocm.model.layer import Batch

    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    b = Batch(cu, slots=torch.tensor([2, 0, 1]), cu_host=[0, 3, 3, 10])
    assert b.cu_list() == cu.tolist() and b.seqlens == [3, 0, 7]
    assert torch.equal(b.cu_host_tensor(), cu)
    assert Batch(cu).cu_list() == [0, 3, 3, 10]  # no host copy: read from the tensor
    s1 = b.device_ints("slots", b.slot_list(), torch.int64, "cpu")
    assert s1.tolist() == [2, 0, 1] and s1.dtype == torch.int64
    assert b.device_ints("slots", b.slot_list(), torch.int64, "cpu") is s1  # made once per batch
    assert b.device_ints("slots", b.slot_list(), torch.int32, "cpu") is not s1
    assert Batch(cu, slots=torch.tensor([1, 2, 0])).device_ints("slots", [1, 2, 0], torch.int64, "cpu").tolist() == [1, 2, 0]


def test_fused_rows_padded_to_alignment_and_dropped():
    # odd projection widths (a TP rank's KDA: 4 x 768 + 6 + 128) get zero rows up to FUSED_ROW_ALIGN; the split
    # returns exactly the named widths, equal to one GEMM per weight
    g = torch.Generator().manual_seed(3)
    ws = {"model.a.weight": torch.randn(6, 32, generator=g).bfloat16(),
          "model.b.weight": torch.randn(13, 32, generator=g).bfloat16()}

    class Src:
        def get(self, name):
            return ws.get(name)

    view = L.WeightView(Src(), prefix="model.", memo=True)
    cat, sizes = view.fused(("a.weight", "b.weight"))
    assert sizes == [6, 13] and cat.shape == (L.FUSED_ROW_ALIGN, 32)
    assert torch.equal(cat[:6], ws["model.a.weight"]) and torch.equal(cat[6:19], ws["model.b.weight"])
    assert not cat[19:].any()
    x = torch.randn(5, 32, generator=g)
    with matmul_dtype(torch.bfloat16):
        ya, yb = L.linears(x, view, ("a.weight", "b.weight"))
        ra, rb = (L.linear(x, ws[f"model.{n}.weight"]) for n in ("a", "b"))
    assert ya.shape == (5, 6) and yb.shape == (5, 13)
    torch.testing.assert_close(ya, ra, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(yb, rb, rtol=1e-2, atol=1e-2)


def test_kda_mixer_asks_for_fp16_products_in_a_bf16_scope(tiny):
    # the engine (bf16 matmul scope, fp32 activations) asks the prefill kernel for its fp16 form; the
    # oracle (no scope) asks nothing, and an implementation without the parameter is called without it
    cfg, weights = tiny
    kda = cfg.layer_types.index("kda")
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(int(torch.empty(()).uniform_() * 1e6)))
    seen = []
    real = L.resolve_ops()["kda_prefill"]

    def spy(*a, products=None, **k):
        seen.append(products)
        return real(*a, **k)

    def plain(*a, **k):
        seen.append("plain")
        return real(*a, **k)

    for scope, impl in ((torch.bfloat16, spy), (None, spy), (torch.bfloat16, plain)):
        ops = dict(L.resolve_ops(), kda_prefill=impl)
        with matmul_dtype(scope):
            y = L.kda_mixer(x, L.WeightView(weights), kda, cfg, ops, L.Batch(torch.tensor([0, 5], dtype=torch.int32)))
        assert torch.isfinite(y).all()
    assert seen == ["fp16", None, "plain"]


def test_prefix_add_deferred_into_the_next_aggregation(tiny_ckpt, tiny_cfg):
    """With an AttnRes op that takes ``addend`` (the oracle's and the kernel's), the decoder leaves each sublayer's
    ``prefix += out`` to the next aggregation (``AttnResState.pending``): logits and every recorded sublayer output
    bit for bit those of an op without it (each add its own), and two fewer standalone fp32 ``add`` launches a
    layer; a state read mid-way (``.prefix``, ``clone``) sees the sum."""
    from k3rocm.model.attnres import attn_res_norm
    from k3rocm.model.model import K3Model

    def no_addend(bank, num_rows, prefix, weight, norm_weight, eps, append=False, norm_eps=None):
        return attn_res_norm(bank, num_rows, prefix, weight, norm_weight, eps, append=append, norm_eps=norm_eps)

    weights = load_weights(tiny_ckpt)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    runs = []
    for ops in (None, {"attn_res_norm": no_addend}):
        m = K3Model(tiny_cfg, weights, ops=ops)
        with _Count() as c:
            m.ops = c.wrap(m.ops)  # each op one count: only the adds outside the ops are counted
            st = m.embed(ids.reshape(-1), L.Batch(torch.tensor([0, 7, 14], dtype=torch.int32)), record=True)
            for i in range(tiny_cfg.num_hidden_layers):
                m.run_layer(i, st)
        pending = st.res.pending
        mid = st.clone()  # a copy of the state before the output aggregation, the sum settled
        logits = m.final(st)
        runs.append((logits, st.outputs, c.ops.count("add"), pending, mid))
    (la, oa, adds_a, pa, ma), (lb, ob, adds_b, pb, mb) = runs
    assert torch.equal(la, lb)
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    assert adds_b - adds_a == 2 * tiny_cfg.num_hidden_layers, (adds_a, adds_b)
    assert pa is not None and pb is None
    assert ma.res.pending is None and torch.equal(ma.res.prefix, mb.res.prefix)
    # an op table swapped mid-forward for one without addend (the owner swaps ops in place): the pending output
    # is added first, no TypeError, the same logits
    m = K3Model(tiny_cfg, weights)
    st = m.embed(ids.reshape(-1), L.Batch(torch.tensor([0, 7, 14], dtype=torch.int32)))
    half = tiny_cfg.num_hidden_layers // 2
    for i in range(half):
        m.run_layer(i, st)
    assert st.res.pending is not None
    m.ops["attn_res_norm"] = no_addend
    for i in range(half, tiny_cfg.num_hidden_layers):
        m.run_layer(i, st)
    assert torch.equal(m.final(st), lb)
