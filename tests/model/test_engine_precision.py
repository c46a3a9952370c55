"""Precision scope of the dense projections: ``k3rocm.model.common.matmul_dtype`` / ``linear``.

* inside ``matmul_dtype(bf16)`` a bf16-stored weight is multiplied with a bf16-rounded input, fp32
  accumulation, fp32 result (on the CPU rounded once to bf16): checked against an fp64 product of the
  bf16-rounded operands, and shown to differ from the fp32 math by a bf16-sized amount;
* outside the scope (and for weights of another dtype, and in other threads) ``linear`` is bit for bit the
  fp32 expression it always was;
* the engine with ``matmul_dtype=bf16`` (CPU, bf16 weights) serves exactly the tokens and logits of
  ``K3Model(..., matmul_dtype=bf16)`` on the same weights (prefill + decode of the engine's step path vs the
  model's prefill/decode), while the default ``K3Model`` (the fp32 oracle) is unchanged even when called
  from inside a bf16 scope.

Bounds: bf16 keeps 8 significant bits, so one rounding moves a value by at most 2^-9 of itself (half an
ulp); a dot product of bf16-rounded inputs accumulated in fp32 and rounded once stays within 2^-8 of the
exact product's magnitude plus fp32 accumulation error (K3_FACTS §5: the engine stores weights in bf16).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from k3rocm.errors import ConfigError
from k3rocm.model.common import current_matmul_dtype, fp32_out_supported, linear, matmul_dtype

from tests.helpers import load_ckpt

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _operands(seed: int, lead=(3, 5), k: int = 96, n: int = 40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g) * 2.0
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(BF16)
    b = torch.randn(n, generator=g)
    return x, w, b


def _old(x, w, b=None):
    """The fp32 expression ``linear`` always computed (both operands widened)."""
    return F.linear(x.float(), w.float(), None if b is None else b.float())


# ---------------------------------------------------------------------------------------------- linear
def test_linear_bf16_scope_is_bf16_math():
    x, w, b = _operands(11)
    with matmul_dtype(BF16) as d:
        assert d is BF16 and current_matmul_dtype() is BF16
        y = linear(x, w, b)
        y0 = linear(x, w)
    assert current_matmul_dtype() is None
    assert y.dtype == torch.float32 and y.shape == (3, 5, 40) and y0.shape == (3, 5, 40)
    # exact product of the bf16-rounded operands, in fp64
    exact = x.to(BF16).double() @ w.double().T
    err = (y0.double() - exact).abs()
    assert bool((err <= exact.abs() * 2.0 ** -8 + 1e-5).all()), float((err - exact.abs() * 2.0 ** -8).max())
    # the CPU fallback rounds the fp32-accumulated product once to bf16: every value is a bf16 number
    assert torch.equal(y0, y0.to(BF16).float())
    # the bias is added in fp32 after the product
    assert torch.allclose(y, y0 + b, atol=1e-6, rtol=0)
    # vs the fp32 math: a bf16-sized difference (relative RMS between 1e-4 and 2e-2), not zero
    ref = _old(x, w, b)
    rel = float((y - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert 1e-4 < rel < 2e-2, rel
    assert float((y - ref).abs().max()) > 0


def test_linear_outside_the_scope_is_unchanged():
    x, w, b = _operands(12)
    want = _old(x, w, b)
    assert torch.equal(linear(x, w, b), want)
    w32 = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    with matmul_dtype(BF16):
        # a weight stored in fp32 (conv, A_log, ... in the engine) keeps the fp32 math inside the scope
        assert torch.equal(linear(x, w32, b), _old(x, w32, b))
        with matmul_dtype(None):  # nested "off"
            assert torch.equal(linear(x, w, b), want)
        assert current_matmul_dtype() is BF16  # restored after the nested scope
    with matmul_dtype(torch.float16):  # scope dtype != weight dtype: fp32 math
        assert torch.equal(linear(x, w, b), want)
    with pytest.raises(RuntimeError):
        with matmul_dtype(BF16):
            raise RuntimeError("boom")
    assert current_matmul_dtype() is None  # restored on an exception too
    assert torch.equal(linear(x, w, b), want)


def test_linear_fp16_scope_and_edge_shapes():
    x, w, _ = _operands(13, lead=(7,), k=64, n=24)
    w16 = w.to(torch.float16)
    with matmul_dtype(torch.float16):
        y = linear(x, w16)
        empty = linear(torch.randn(0, 64), w16)
        vec = linear(x[0], w16)
    exact = x.to(torch.float16).double() @ w16.double().T
    assert y.dtype == torch.float32 and bool(((y.double() - exact).abs() <= exact.abs() * 2.0 ** -10 + 1e-5).all())
    assert empty.shape == (0, 24) and empty.dtype == torch.float32
    assert vec.shape == (24,) and torch.equal(vec, y[0])


def test_scope_rejects_other_dtypes_and_cpu_has_no_fp32_out():
    for bad in (torch.float32, torch.float64, torch.int8):
        with pytest.raises(ConfigError):
            with matmul_dtype(bad):
                pass
    assert current_matmul_dtype() is None
    assert fp32_out_supported("cpu") is False


def test_scope_does_not_leak_between_threads():
    x, w, b = _operands(14)
    want = _old(x, w, b)
    with matmul_dtype(BF16):
        inside = linear(x, w, b)
    out: dict[str, object] = {}

    def worker_plain():  # started inside the main thread's scope: a new thread has no scope
        out["dtype"] = current_matmul_dtype()
        out["y"] = linear(x, w, b)

    with matmul_dtype(BF16):
        t = threading.Thread(target=worker_plain)
        t.start()
        t.join()
    assert out["dtype"] is None and torch.equal(out["y"], want)

    entered, release = threading.Event(), threading.Event()

    def worker_scoped():  # holds a bf16 scope while the main thread computes
        with matmul_dtype(BF16):
            entered.set()
            release.wait(10)
            out["scoped"] = linear(x, w, b)

    t = threading.Thread(target=worker_scoped)
    t.start()
    assert entered.wait(10)
    try:
        assert current_matmul_dtype() is None and torch.equal(linear(x, w, b), want)
    finally:
        release.set()
        t.join()
    assert torch.equal(out["scoped"], inside)


# ---------------------------------------------------------------------------------------------- model / engine
@pytest.fixture(scope="module")
def tiny(golden_ckpt):
    return load_ckpt(golden_ckpt)


def _rel(a, b) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def test_oracle_untouched_and_bf16_model(tiny):
    """The default K3Model is the fp32 oracle even inside a bf16 scope; ``matmul_dtype=bf16`` changes its math by a
    bf16-sized amount at the first layer, through ``forward`` and through the layer-by-layer API alike."""
    from k3rocm.model.layer import Batch
    from k3rocm.model.model import K3Model

    cfg, w = tiny
    ids = torch.randint(3, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    oracle = K3Model(cfg, w)
    assert oracle.matmul_dtype is None
    ref, ref_layers = oracle.forward(ids, return_layers=True)
    with matmul_dtype(BF16):
        again = oracle.forward(ids)
    assert torch.equal(again, ref)
    lowp = K3Model(cfg, w, matmul_dtype=BF16)
    got, got_layers = lowp.forward(ids, return_layers=True)
    assert current_matmul_dtype() is None
    first = _rel(got_layers["layer00.attn_out"], ref_layers["layer00.attn_out"])
    assert 1e-4 < first < 3e-2, first
    assert float((got - ref).abs().max()) > 1e-3
    # the layer-by-layer API (what the correctness tier calls) runs the same scoped math
    st = lowp.embed(ids.reshape(-1), Batch(torch.tensor([0, 10], dtype=torch.int32)))
    for i in range(cfg.num_hidden_layers):
        lowp.run_layer(i, st)
    assert torch.equal(lowp.final(st), got[0])
    with pytest.raises(ConfigError):
        K3Model(cfg, w, matmul_dtype=torch.float32)


def _serve(eng, prompt, n):
    """Tokens and the logits rows they were sampled from, through ``Engine.step``."""
    seen = []
    orig = eng._forward

    def spy(*a, **k):
        out = orig(*a, **k)
        seen.append(out.clone())
        return out

    eng._forward = spy
    try:
        rid = eng.add_request(prompt, n, ignore_eos=True)
        while eng.has_unfinished():
            eng.step()
    finally:
        eng._forward = orig
    return list(eng.seqs[rid].output), torch.cat(seen, 0)


def test_engine_bf16_matmul_equals_model_bf16(tiny):
    """CPU, bf16 weights, bf16 matmuls: the engine's step path (one prefill chunk, then decode steps on the slot
    pool and paged cache) gives bit for bit the logits and tokens of K3Model(matmul_dtype=bf16) prefill + decode on
    the same weights and ops; four sequences batched give K3Model's batched greedy tokens."""
    from k3rocm.model.model import K3Model
    from k3rocm.runtime.engine import Engine

    cfg, w = tiny
    kw = dict(device="cpu", dtype=BF16, block_size=4, max_model_len=32, matmul_dtype=BF16)
    eng = Engine(cfg, w, max_batch=1, max_num_batched_tokens=32, **kw)
    d = eng.describe()
    assert eng.matmul_dtype is BF16 and d["matmul_dtype"] == "bfloat16" and "fp32 accumulation" in d["matmul"]
    assert eng.weights.get("language_model.lm_head.weight").dtype == BF16
    model = K3Model(cfg, eng.weights, ops=dict(eng.ops), matmul_dtype=BF16)
    oracle = K3Model(cfg, eng.weights)
    g = torch.Generator().manual_seed(31)
    n = 5
    for L in (1, 6, 13):
        prompt = torch.randint(3, cfg.vocab_size, (L,), generator=g).tolist()
        toks, got = _serve(eng, prompt, n)
        cache = model.new_cache(1, 32)
        rows = [model.prefill(torch.tensor([prompt]), cache)[0, -1]]
        for t in toks[:-1]:
            rows.append(model.decode(torch.tensor([t]), cache)[0])
        want = torch.stack(rows)
        assert got.shape == (n, cfg.vocab_size)
        assert torch.equal(got, want), float((got - want).abs().max())
        assert toks == want.argmax(-1).tolist()
        # the fp32 oracle on the same prompt: the bf16 path really ran (first logits row differs)
        o = oracle.forward(torch.tensor([prompt]))[0, -1]
        assert float((o - got[0]).abs().max()) > 1e-3
    assert eng.mla.num_free_blocks == eng.mla.num_blocks and eng.kda.num_free == eng.kda.num_slots
    prompts = torch.randint(3, cfg.vocab_size, (4, 9), generator=g)
    batched = Engine(cfg, w, max_batch=4, max_num_batched_tokens=64, **kw)
    assert batched.generate(prompts.tolist(), n) == model.generate_greedy(prompts, n).tolist()


def test_engine_matmul_dtype_defaults_and_errors(tiny):
    from k3rocm.runtime.engine import Engine

    cfg, w = tiny
    kw = dict(max_batch=1, max_num_batched_tokens=8, block_size=4, max_model_len=16, device="cpu")
    cpu_bf16 = Engine(cfg, w, dtype=BF16, **kw)  # auto: no low-precision matmuls on the CPU
    assert cpu_bf16.matmul_dtype is None
    assert cpu_bf16.describe()["matmul_dtype"] is None and cpu_bf16.describe()["matmul"].startswith("fp32")
    assert Engine(cfg, w, **kw).matmul_dtype is None
    for bad in (torch.float32, "bf16"):
        with pytest.raises(ConfigError):
            Engine(cfg, w, matmul_dtype=bad, **kw)


def test_dense_gemm_hook_takes_few_rows_only():
    """``common.DENSE_GEMM`` (the GPU scripts' switch to the Triton skinny GEMM) routes the low-precision path's
    products of at most ``max_rows`` rows through its function, with the rounded operands; more rows, the fp32 path
    and the default (None) never call it, and the result is the function's, reshaped."""
    from k3rocm.model import common as C
    seen = []

    def fake(a, w):
        seen.append((tuple(a.shape), a.dtype))
        return (a.float() @ w.float().T) + 1.0

    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 8, generator=g).bfloat16()
    x = torch.randn(2, 3, 8, generator=g)
    saved = list(C.DENSE_GEMM)
    try:
        C.DENSE_GEMM[:] = [fake, 6]
        with C.matmul_dtype(torch.bfloat16):
            y = C.linear(x, w)
            big = C.linear(torch.randn(7, 8, generator=g), w)
        fp32 = C.linear(x, w)
    finally:
        C.DENSE_GEMM[:] = saved
    assert seen == [((6, 8), torch.bfloat16)]
    torch.testing.assert_close(y, (x.reshape(6, 8).bfloat16().float() @ w.float().T + 1.0).reshape(2, 3, 6))
    assert big.shape == (7, 6) and fp32.shape == (2, 3, 6)
    assert C.DENSE_GEMM[0] is None
