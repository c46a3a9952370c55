"""Block AttnRes: the oracle against a float64 hand formulation, and the Triton kernel against the oracle
(one step, every config, and whole 13- and 93-layer stacks with bank bookkeeping; K3_FACTS §5).

Without a GPU the kernel runs in the Triton interpreter (fp32): the module fixture sets
``TRITON_INTERPRET=1`` for this module only (the kernel switches at launch).
"""

from __future__ import annotations

import importlib

import pytest
import torch
# Triton's compiler imported in compiled mode, before the K fixture sets TRITON_INTERPRET: the ahead-of-time test
# below needs the jitted (not interpreted) standard library that its first compile imports
import triton.compiler.code_generator  # noqa: F401

from k3rocm.config import preset
from k3rocm.errors import ConfigError
from k3rocm.model import attnres as A
from tests.helpers import interpreter_without_gpu

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def K():
    """The kernel module. Without a GPU, ``TRITON_INTERPRET=1`` is set for this module's tests only: the
    kernel is a compiled-mode object and switches to the interpreter at launch time."""
    with interpreter_without_gpu():
        yield importlib.import_module("k3rocm.kernels.attnres.attnres")


def _configs(K):
    return K.ATTNRES_CONFIGS["cuda" if DEV == "cuda" else "interpreter"]


def test_oracle_matches_float64_formula():
    g = torch.Generator().manual_seed(0)
    S, T, D, eps = 4, 3, 10, 1e-5
    src = torch.randn(S, T, D, generator=g)
    w = torch.randn(D, generator=g)
    out = A.attn_res(src, w, eps)
    s64 = src.double()
    for t in range(T):
        scores = torch.stack([(s64[j, t] / torch.sqrt((s64[j, t] ** 2).mean() + eps)) @ w.double() for j in range(S)])
        p = torch.exp(scores - scores.max())
        p = p / p.sum()
        ref = sum(p[j] * s64[j, t] for j in range(S))  # raw values, not keys
        torch.testing.assert_close(out[t].double(), ref, atol=1e-6, rtol=1e-6)


def test_single_source_passes_through_and_fold():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 5, 8, generator=g)
    torch.testing.assert_close(A.attn_res(x, torch.randn(8, generator=g), 1e-5), x[0])
    n, p = torch.randn(8, generator=g), torch.randn(1, 8, generator=g)
    torch.testing.assert_close(A.fold_res_weight(n, p), n * p[0])
    with pytest.raises(ConfigError):
        A.fold_res_weight(n, torch.randn(2, 8))


def test_oracle_append_and_full_bank():
    g = torch.Generator().manual_seed(2)
    bank = torch.full((2, 3, 8), float("nan"))
    pre = torch.randn(3, 8, generator=g)
    w, nw = torch.randn(8, generator=g), torch.ones(8)
    A.attn_res_norm(bank, 0, pre, w, nw, 1e-5, append=True)
    torch.testing.assert_close(bank[0], pre)
    assert torch.isnan(bank[1]).all()
    with pytest.raises(ConfigError):
        A.attn_res_norm(bank, 2, pre, w, nw, 1e-5, append=True)


def test_bank_rows_match_config():
    assert preset("k3").num_attn_res_bank_rows == 8
    st = A.AttnResStack.random(93, 8, 12)
    assert st.bank_rows == 8
    tiny = preset("k3-tiny")
    assert A.AttnResStack.random(tiny.num_hidden_layers, 8, tiny.attn_res_block_size).bank_rows == \
        tiny.num_attn_res_bank_rows


@pytest.mark.parametrize("num_rows,append", [(0, True), (0, False), (3, False), (3, True), (7, True)])
def test_kernel_step_every_config(K, num_rows, append):
    g = torch.Generator().manual_seed(10 + num_rows)
    T, D = 5, 72  # D not a multiple of any BLOCK_D
    bank0 = torch.randn(8, T, D, generator=g)
    bank0[num_rows:] = float("nan")  # rows past the live ones must never be read
    pre = torch.randn(T, D, generator=g)
    w, nw = torch.randn(D, generator=g) * 0.3, 1 + 0.1 * torch.randn(D, generator=g)
    b_ref = bank0.clone()
    h_ref, hn_ref = A.attn_res_norm(b_ref, num_rows, pre, w, nw, 1e-5, append=append)
    for cfg in _configs(K):
        b = bank0.clone().to(DEV)
        outs = (torch.full((T, D), float("nan"), device=DEV), torch.full((T, D), float("nan"), device=DEV))
        h, hn = K.attn_res_norm(b, num_rows, pre.to(DEV), w.to(DEV), nw.to(DEV), 1e-5, append=append, config=cfg,
                                out=outs)
        assert h.data_ptr() == outs[0].data_ptr()
        torch.testing.assert_close(h.cpu(), h_ref, **TOL)
        torch.testing.assert_close(hn.cpu(), hn_ref, **TOL)
        torch.testing.assert_close(b.cpu(), b_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("num_rows,append", [(0, True), (3, False), (7, True), (8, False)])
def test_kernel_pending_add_every_config(K, T, num_rows, append):
    """``addend`` / ``prefix_out`` (the decoder's pending ``prefix += out`` in the step): on every config (the
    single-pass, streamed and phased paths) ``prefix_out`` is ``prefix + addend`` bit for bit (an fp32 addend and a
    bf16 one), and ``h``, ``h_normed`` and the appended bank row are those of the call on that sum, bit for bit
    (the sum is the prefix source); the prefix and addend are left as they were; the oracle agrees."""
    g = torch.Generator().manual_seed(90 + 10 * T + num_rows)
    D = 72
    bank0 = torch.randn(9, T, D, generator=g)
    bank0[num_rows:] = float("nan")
    pre = torch.randn(T, D, generator=g)
    w, nw = torch.randn(D, generator=g) * 0.3, 1 + 0.1 * torch.randn(D, generator=g)
    for add in (torch.randn(T, D, generator=g), torch.randn(T, D, generator=g).to(torch.bfloat16)):
        want_p = pre + add.float()
        b_ref = bank0.clone()
        po_ref = torch.full((T, D), float("nan"))
        h_ref, hn_ref = A.attn_res_norm(b_ref, num_rows, pre, w, nw, 1e-5, append=append, addend=add,
                                        prefix_out=po_ref)
        assert torch.equal(po_ref, want_p)
        pd, ad = pre.to(DEV), add.to(DEV)
        for cfg in _configs(K):
            b_sum, b = bank0.clone().to(DEV), bank0.clone().to(DEV)
            h_sum, hn_sum = K.attn_res_norm(b_sum, num_rows, want_p.to(DEV), w.to(DEV), nw.to(DEV), 1e-5,
                                            append=append, config=cfg)
            po = torch.full((T, D), float("nan"), device=DEV)
            h, hn = K.attn_res_norm(b, num_rows, pd, w.to(DEV), nw.to(DEV), 1e-5, append=append, config=cfg,
                                    addend=ad, prefix_out=po)
            assert torch.equal(po.cpu(), want_p), cfg
            assert torch.equal(h, h_sum) and torch.equal(hn, hn_sum), cfg
            assert torch.equal(b.cpu().nan_to_num(7.0), b_sum.cpu().nan_to_num(7.0)), cfg
            assert torch.equal(pd.cpu(), pre) and torch.equal(ad.cpu(), add), cfg
            torch.testing.assert_close(hn.cpu(), hn_ref, **TOL)
            torch.testing.assert_close(h.cpu(), h_ref, **TOL)
            # without h stored (the decoder's call), in bf16: the same normed output as the call on the sum
            po2 = torch.empty(T, D, device=DEV)
            _, hn2 = K.attn_res_norm(bank0.clone().to(DEV), num_rows, pd, w.to(DEV), nw.to(DEV), 1e-5, config=cfg,
                                     store_h=False, out_dtype=torch.bfloat16, addend=ad, prefix_out=po2)
            _, hn2_sum = K.attn_res_norm(bank0.clone().to(DEV), num_rows, want_p.to(DEV), w.to(DEV), nw.to(DEV),
                                         1e-5, config=cfg, store_h=False, out_dtype=torch.bfloat16)
            assert torch.equal(hn2, hn2_sum) and torch.equal(po2.cpu(), want_p), cfg


def test_pending_add_refusals(K):
    """An ``addend`` needs its own fp32 ``prefix_out`` of the prefix's shape, apart from the prefix, the addend and
    the bank: otherwise one clear ConfigError (oracle and kernel alike), and nothing written."""
    T, D = 3, 16
    bank = torch.zeros(4, T, D, device=DEV)
    pre, add = torch.randn(T, D, device=DEV), torch.randn(T, D, device=DEV)
    w, nw = torch.randn(D, device=DEV), torch.ones(D, device=DEV)
    bad = [dict(addend=add), dict(addend=add, prefix_out=pre), dict(addend=add, prefix_out=add),
           dict(addend=add, prefix_out=bank[1]), dict(addend=add, prefix_out=torch.empty(T, D, dtype=torch.bfloat16)),
           dict(addend=add[:2], prefix_out=torch.empty(T, D, device=DEV))]
    for fn in (A.attn_res_norm, K.attn_res_norm):
        for kw in bad:
            before = (pre.clone(), add.clone(), bank.clone())
            with pytest.raises(ConfigError, match="prefix_out|addend"):
                fn(bank, 1, pre, w, nw, 1e-5, append=True, **kw)
            assert all(torch.equal(x, y) for x, y in zip(before, (pre, add, bank)))


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("num_rows,append", [(0, True), (0, False), (7, True), (8, False)])
def test_kernel_without_h_every_config(K, T, num_rows, append):
    """``store_h=False`` (the decoder layer's call): no ``h`` stored or returned, ``h_normed`` and the bank exactly
    those of the call that stores ``h`` (one token, and 5 tokens: not a multiple of the 2 / 3 walking programs),
    and the oracle's; ``out``'s ``h`` slot is left untouched."""
    g = torch.Generator().manual_seed(60 + 10 * T + num_rows)
    D = 72
    bank0 = torch.randn(9, T, D, generator=g)
    bank0[num_rows:] = float("nan")
    pre = torch.randn(T, D, generator=g)
    w, nw = torch.randn(D, generator=g) * 0.3, 1 + 0.1 * torch.randn(D, generator=g)
    b_ref = bank0.clone()
    _h_ref, hn_ref = A.attn_res_norm(b_ref, num_rows, pre, w, nw, 1e-5, append=append)
    args = (num_rows, pre.to(DEV), w.to(DEV), nw.to(DEV), 1e-5)
    for cfg in _configs(K):
        b_h, b = bank0.clone().to(DEV), bank0.clone().to(DEV)
        _h, hn_h = K.attn_res_norm(b_h, *args, append=append, config=cfg)
        spare = torch.full((T, D), 7.0, device=DEV)
        h, hn = K.attn_res_norm(b, *args, append=append, config=cfg, store_h=False,
                                out=(spare, torch.empty(T, D, device=DEV)))
        assert h is None and hn.shape == (T, D) and bool((spare == 7.0).all()), cfg
        assert torch.equal(hn, hn_h), cfg
        torch.testing.assert_close(hn.cpu(), hn_ref, **TOL)
        torch.testing.assert_close(b.cpu(), b_ref, equal_nan=True, atol=0, rtol=0)
        h2, hn2 = K.attn_res_norm(bank0.clone().to(DEV), *args, config=cfg, store_h=False, out_dtype=torch.bfloat16)
        assert h2 is None and hn2.dtype == torch.bfloat16


def test_pipe_stages_fit_shared_memory(K):
    """The PIPE stream's stage count as launched: the CUDA table's PIPE configs stage bf16 tiles as written
    (within the budget), an fp32 bank gets fewer stages (at least 2), and a backend without a budget keeps them."""
    pipes = [c for c in K.ATTNRES_CONFIGS["cuda"] if c.get("PIPE")]
    assert pipes and all(c["BLOCK_D"] >= 7168 for c in pipes)
    budget = K.PIPE_SMEM_BYTES["cuda"]
    for c in pipes:
        rows, bd, s = c["ROWS"], c["BLOCK_D"], c["PIPE"]
        assert K._pipe_stages(s, rows, bd, 2, "cuda") == s, c
        s4 = K._pipe_stages(s, rows, bd, 4, "cuda")
        assert 2 <= s4 <= s and ((s4 - 1) * (rows + 1) * bd * 4 <= budget or s4 == 2), c
    assert K._pipe_stages(9, 4, 8192, 4, "interpreter") == 9


def test_pipe_configs_compile_for_sm90(K, monkeypatch):
    """Every PIPE config of the CUDA table compiles ahead of time for sm_90 (bf16 bank, write layer, no h; and with
    the decoder's pending prefix add, ADD, at the stage count the launch lowers it to) and its tiles are staged by
    the loop pipeliner (``cp.async`` into shared memory), within the 227 KiB of a block."""
    isa = pytest.importorskip("k3rocm.kernels.isa")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    seen = set()
    for c, add in ((c, add) for c in K.ATTNRES_CONFIGS["cuda"] if c.get("PIPE") for add in (False, True)):
        pipe = K._pipe_stages(c["PIPE"], c["ROWS"], c["BLOCK_D"], 4 if add else 2, "cuda", add=add)
        key = (c["ROWS"], pipe, c["num_warps"], add)
        if key in seen:
            continue
        seen.add(key)
        sig, consts, _ = K.isa_signature("bf16", append=True, block_d=c["BLOCK_D"], one_block=True, rows=c["ROWS"],
                                         pipe=pipe, store_h=False, add=add)
        hinted = tuple(n for n, t in sig.items() if t.startswith("*")) + (
            "D", "stride_br", "stride_bt", "stride_pt", "stride_ht", "stride_hnt", "stride_at",
            "stride_pot")  # as a launch at D 7168 marks them
        rep = isa.compile_kernel(K._attn_res_kernel, sig, consts, "sm_90", name=str(c),
                                 options=dict(num_warps=c["num_warps"], num_stages=c["num_stages"]), aligned=hinted)
        assert rep.error is None, rep.error
        assert "cp.async" in rep.asm, c
        assert rep.lds_bytes <= 227 * 1024, (c, rep.lds_bytes)


@pytest.mark.parametrize("num_rows,append", [(0, True), (3, False), (7, True)])
def test_kernel_bf16_normed_output(K, num_rows, append):
    """``out_dtype=bf16`` (the engine's low-precision path: the token mixer's input, which every projection
    rounds to bf16 anyway): ``h`` is the fp32 one of an fp32 call, ``h_normed`` the fp32 call's ``h_normed``
    rounded to bf16 — to nearest even on a GPU, as ``.to`` rounds (bit for bit); the interpreter's cast truncates,
    so there it is within one bf16 ulp, and at most that far from the oracle's rounding; the bank is written alike."""
    g = torch.Generator().manual_seed(40 + num_rows)
    T, D = 6, 200  # several BLOCK_D tiles for the small configs
    bank0 = torch.randn(8, T, D, generator=g) * 3
    pre = torch.randn(T, D, generator=g) * 3
    w, nw = torch.randn(D, generator=g) * 0.3, 1 + 0.1 * torch.randn(D, generator=g)
    for cfg in _configs(K):
        args = (num_rows, pre.to(DEV), w.to(DEV), nw.to(DEV), 1e-5)
        b32, b16 = bank0.clone().to(DEV), bank0.clone().to(DEV)
        h32, hn32 = K.attn_res_norm(b32, *args, append=append, config=cfg)
        h, hn = K.attn_res_norm(b16, *args, append=append, config=cfg, out_dtype=torch.bfloat16)
        assert h.dtype == torch.float32 and hn.dtype == torch.bfloat16 and hn.shape == (T, D)
        assert torch.equal(h, h32) and torch.equal(b16, b32)
        rne = hn32.to(torch.bfloat16)
        if DEV == "cuda":
            assert torch.equal(hn, rne)
        else:
            ulp = (rne.float().abs() * 2.0 ** -7).clamp_min(1e-30)
            assert bool(((hn.float() - rne.float()).abs() <= ulp).all())
            assert bool(((hn.float() - hn32).abs() < ulp).all())  # a rounding of the fp32 value, not another value
        assert float((hn.float() - hn32).abs().max()) > 0  # really bf16


def test_kernel_op_and_errors(K):
    g = torch.Generator().manual_seed(3)
    src = torch.randn(3, 4, 40, generator=g)
    w = torch.randn(40, generator=g)
    torch.testing.assert_close(K.attn_res(src.to(DEV), w.to(DEV), 1e-5).cpu(), A.attn_res(src, w, 1e-5), **TOL)
    bank = torch.zeros(2, 4, 40, device=DEV)
    with pytest.raises(ConfigError):
        K.attn_res_norm(bank, 2, src[0].to(DEV), w.to(DEV), w.to(DEV), 1e-5, append=True)
    with pytest.raises(ConfigError):  # an output that aliases the bank
        K.attn_res_norm(bank, 1, src[0].to(DEV), w.to(DEV), w.to(DEV), 1e-5, out=(bank[1], torch.empty(4, 40, device=DEV)))


def test_kernel_more_than_sixteen_sources(K):
    """A config with more bank rows than 16 runs on the kernel (score vector padded to the next power of two),
    on the single-pass and the blocked path; supports() takes it."""
    from k3rocm.kernels.attnres import TRITON_IMPLS
    assert all(sup is None or sup(num_sources=40) for _op, _fn, sup, _n in TRITON_IMPLS)
    g = torch.Generator().manual_seed(5)
    src = torch.randn(20, 2, 24, generator=g)
    w = torch.randn(24, generator=g)
    ref = A.attn_res(src, w, 1e-5)
    for cfg in (_configs(K)[0], _configs(K)[-1]):
        torch.testing.assert_close(K.attn_res(src.to(DEV), w.to(DEV), 1e-5, config=cfg).cpu(), ref, **TOL)


def _mixer(D, L, g):
    """Deterministic stand-in mixers: a fixed random tanh layer per (layer, side), so errors propagate."""
    Ws = {(i, s): torch.randn(D, D, generator=g) * D ** -0.5 for i in range(L) for s in ("attn", "mlp")}

    def mix(i, side, x):
        Wd = Ws[(i, side)].to(x.device)
        return torch.tanh(x.float() @ Wd) * 0.5
    return mix


@pytest.mark.parametrize("layers,block", [(13, 3), (93, 12)])
def test_kernel_whole_stack(K, layers, block):
    g = torch.Generator().manual_seed(layers)
    T, D = 3, 32
    stack = A.AttnResStack.random(layers, D, block, generator=g)
    mix = _mixer(D, layers, g)
    emb = torch.randn(T, D, generator=g)
    tr_ref: list = []
    h_ref, x_ref = A.run_attnres_stack(emb, stack, mix, trace=tr_ref)

    written: dict[int, torch.Tensor] = {}
    live = {"bank": None}

    def step(bank, rows, prefix, w, nw, eps, append=False):
        live["bank"] = bank
        h, hn = K.attn_res_norm(bank, rows, prefix, w.to(DEV), nw.to(DEV), eps, append=append,
                                config=_configs(K)[0])
        b0, b1 = bank.data_ptr(), bank.data_ptr() + bank.numel() * bank.element_size()
        for o in (h, hn):  # no output may alias a live bank row
            assert not (b0 < o.data_ptr() + o.numel() * o.element_size() and o.data_ptr() < b1)
        if append:
            written[rows] = bank[rows].clone()
        for r, snap in written.items():  # rows once written never change
            assert torch.equal(bank[r], snap), f"bank row {r} changed"
        return h, hn

    stack_dev = A.AttnResStack(*(getattr(stack, k).to(DEV) for k in
                                 ("attn_w", "mlp_w", "input_norm", "post_norm", "out_w", "final_norm")),
                               stack.block_size, stack.eps)
    tr: list = []
    h, x = A.run_attnres_stack(emb.to(DEV), stack_dev, mix, step=step, trace=tr)
    assert len(written) == stack.bank_rows
    assert len(tr) == len(tr_ref) == 2 * layers
    worst = max((a[3].cpu() - b[3]).abs().max().item() for a, b in zip(tr, tr_ref))
    assert worst < 1e-3, worst  # fp32 reassociation over up to 187 chained steps
    torch.testing.assert_close(x.cpu(), x_ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(h.cpu(), h_ref, atol=1e-3, rtol=1e-3)


def test_layer_asks_the_kernel_not_to_store_h(K):
    """``model/layer.py`` reads only ``h_normed``: it passes ``store_h=False`` to an op that takes it (the kernel)
    and nothing to one that does not (the oracle); both give the oracle's normed output, fp32 and bf16."""
    from k3rocm.model import layer as Lm
    g = torch.Generator().manual_seed(7)
    T, D = 3, 40
    bank = torch.randn(4, T, D, generator=g)
    pre = torch.randn(T, D, generator=g)
    w, nw = torch.randn(D, generator=g) * 0.3, 1 + 0.1 * torch.randn(D, generator=g)
    seen = []

    def op(bank, num_rows, prefix, weight, norm_weight, eps, append=False, out_dtype=None, store_h=True):
        seen.append(store_h)
        h, hn = K.attn_res_norm(bank, num_rows, prefix, weight, norm_weight, eps, append=append,
                                out_dtype=out_dtype, store_h=store_h, config=_configs(K)[0])
        assert h is None
        return h, hn

    for dt in (None, torch.bfloat16):
        ref = Lm._normed({"attn_res_norm": A.attn_res_norm}, dt, bank.clone(), 2, pre, w, nw, 1e-5, append=True)
        x = Lm._normed({"attn_res_norm": op}, dt, bank.clone().to(DEV), 2, pre.to(DEV), w.to(DEV), nw.to(DEV), 1e-5,
                       append=True)
        assert x.dtype == ref.dtype
        torch.testing.assert_close(x.cpu().float(), ref.float(), **(TOL if dt is None else dict(atol=2e-2, rtol=2e-2)))
    assert seen == [False, False]


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("num_rows,append", [(0, True), (3, False), (4, True), (8, False)])
def test_kernel_bf16_bank_every_config(K, T, num_rows, append):
    """A bf16 bank and prefix (what the engine keeps; the tests above use fp32 banks), every config: ``h`` and
    ``h_normed`` within the tolerance of the oracle on the same values in fp32, the appended row bit for bit, the
    call without ``h`` bit for bit the one with it."""
    g = torch.Generator().manual_seed(90 + 10 * T + num_rows)
    D = 72
    bank0 = torch.randn(9, T, D, generator=g).to(torch.bfloat16)
    bank0[num_rows:] = float("nan")
    pre = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w, nw = torch.randn(D, generator=g) * 0.3, 1 + 0.1 * torch.randn(D, generator=g)
    b_ref = bank0.float()
    h_ref, hn_ref = A.attn_res_norm(b_ref, num_rows, pre.float(), w, nw, 1e-5, append=append)
    args = (num_rows, pre.to(DEV), w.to(DEV), nw.to(DEV), 1e-5)
    for cfg in _configs(K):
        b, b2 = bank0.clone().to(DEV), bank0.clone().to(DEV)
        h, hn = K.attn_res_norm(b, *args, append=append, config=cfg)
        torch.testing.assert_close(h.cpu(), h_ref, **TOL)
        torch.testing.assert_close(hn.cpu(), hn_ref, **TOL)
        torch.testing.assert_close(b.cpu().float(), b_ref, equal_nan=True, atol=0, rtol=0)
        h2, hn2 = K.attn_res_norm(b2, *args, append=append, config=cfg, store_h=False)
        assert h2 is None and torch.equal(hn2, hn), cfg

