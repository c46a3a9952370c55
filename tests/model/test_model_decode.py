"""Decode with a cache equals the full causal forward (K3 oracle, random k3-tiny weights).

Batch of 2 sequences of different lengths: prefill the prompts into a cache, then >= 8 decode steps
(``kda_decode`` with its conv/SSM slot pools, ``mla_cache_write`` + absorbed ``mla_decode`` over a paged
latent cache with several blocks per sequence). Every decode step's logits must equal the logits of one
cache-free forward over the whole sequence at the same position (<= 1e-4 absolute), and so must a prefill
split into two chunks (continuation through the cache).
"""

from __future__ import annotations

import math

import pytest
import torch

from k3rocm.checkpoint.layout import iter_specs
from k3rocm.config import preset
from k3rocm.errors import ConfigError
from k3rocm.model.model import K3Model

TOL = 1e-4


def random_k3_weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of ``cfg`` (names/shapes/dtypes from the layout), at realistic scales."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in iter_specs(cfg):
        n, shape = s.name, s.shape
        if s.dtype == "U8":
            if n.endswith("weight_scale"):  # E8M0 around 2^-4 .. 2^-2 -> weight RMS ~ 1/sqrt(in)
                t = torch.randint(122, 126, shape, generator=g, dtype=torch.uint8)
            else:
                t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif n.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
        elif n.endswith("dt_bias"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif "conv1d" in n:
            t = 0.5 * torch.randn(shape, generator=g)
        elif n.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif n.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=g)
        elif len(shape) == 1:  # norm weights
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif n.endswith("_res_proj.weight"):
            # AttnRes scores = <rms_norm(v), norm.w * proj.w>: with proj ~ N(0, 1) they spread by ~sqrt(hidden)
            # and the random 13-layer model becomes chaotic (a 1e-7 input perturbation moves logits by 1e-3..3e-2),
            # which would hide any cache bug under rounding noise. 0.05 keeps the softmax non-uniform (score
            # std ~0.6) and the fp32 noise floor of the logits near 3e-5.
            t = 0.05 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        out[n] = t.to(torch.float32 if s.dtype == "F32" else torch.bfloat16) if s.dtype != "U8" else t
    return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes: one intra-op thread is fastest and avoids OpenMP spin-waiting on a shared 2-core runner."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    cfg = preset("k3-tiny")
    return K3Model(cfg, random_k3_weights(cfg, seed=1234))


def test_decode_equals_forward(model):
    cfg = model.cfg
    g = torch.Generator().manual_seed(7)
    lens, steps = [5, 11], 9
    prompts = [torch.randint(3, cfg.vocab_size, (L,), generator=g) for L in lens]
    new = torch.randint(3, cfg.vocab_size, (2, steps), generator=g)
    cache = model.new_cache(2, max_len=32, block_size=4)  # several MLA blocks per sequence
    for kv in cache.kv.values():  # poison: a read of a slot nobody wrote turns the logits into NaN
        kv.fill_(float("nan"))
    pre = model.prefill(prompts, cache)
    assert cache.lengths.tolist() == lens
    dec = []
    for j in range(steps):
        d = torch.full((2, cfg.vocab_size), float("nan"))
        d[:] = model.decode(new[:, j], cache)
        dec.append(d)
    dec = torch.stack(dec, 1)  # [2, steps, V]
    assert cache.lengths.tolist() == [L + steps for L in lens]
    worst = 0.0
    for n in range(2):
        full = model.forward(torch.cat([prompts[n], new[n]]).unsqueeze(0))[0]
        L = lens[n]
        assert torch.isfinite(dec[n]).all()
        worst = max(worst, float((pre[n] - full[:L]).abs().max()))
        # decode step j consumes new[n, j] at position L + j
        worst = max(worst, float((dec[n] - full[L:]).abs().max()))
        assert full.abs().max() > 1.0  # the comparison is on non-trivial logits
    assert worst <= TOL, f"decode vs forward max abs error {worst:.3e}"


def test_chunked_prefill_and_varlen(model):
    """Prefill in two chunks (the second reads the cache) == one forward; packed varlen == separate rows."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, cfg.vocab_size, (13,), generator=g)
    b = torch.randint(3, cfg.vocab_size, (6,), generator=g)
    cache = model.new_cache(2, max_len=24, block_size=4)
    p1 = model.prefill([a[:7], b[:2]], cache)
    p2 = model.prefill([a[7:], b[2:]], cache)
    fa = model.forward(a.unsqueeze(0))[0]
    fb = model.forward(b.unsqueeze(0))[0]
    err = max(float((torch.cat([p1[0], p2[0]]) - fa).abs().max()),
              float((torch.cat([p1[1], p2[1]]) - fb).abs().max()))
    assert err <= TOL, f"chunked prefill vs forward max abs error {err:.3e}"
    # a batch of equal-length rows is the same as each row alone
    both = model.forward(torch.stack([a[:6], b]))
    assert float((both[1] - fb).abs().max()) <= TOL
    with pytest.raises(ConfigError):
        model.decode(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ConfigError):
        model.prefill([a, a], model.new_cache(2, max_len=8, block_size=4))


def test_generate_greedy_matches_forward_argmax(model):
    cfg = model.cfg
    prompt = torch.randint(3, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    toks = model.generate_greedy(prompt, 5)
    assert toks.shape == (2, 5)
    seq = torch.cat([prompt, toks], 1)
    ref = model.forward(seq)[:, 3:-1].argmax(-1)
    assert torch.equal(ref, toks)


def test_ops_table_is_used(model):
    """Every op goes through the ``ops`` mapping (the engine swaps kernels in there); unknown names are refused."""
    from k3rocm.model.layer import resolve_ops

    calls: dict[str, int] = {}
    base = resolve_ops()

    def counted(name):
        def fn(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return base[name](*a, **k)
        return fn

    m = K3Model(model.cfg, model.w, ops={n: counted(n) for n in base})
    cache = m.new_cache(1, max_len=8)
    ref = model.prefill([torch.tensor([5, 6, 7])], model.new_cache(1, max_len=8))[0]
    out = m.prefill([torch.tensor([5, 6, 7])], cache)[0]
    assert torch.equal(out, ref)
    m.decode(torch.tensor([9]), cache)
    assert set(calls) == set(base), f"ops never called: {set(base) - set(calls)}"
    with pytest.raises(ConfigError):
        K3Model(model.cfg, model.w, ops={"not_an_op": lambda: None})


@pytest.mark.gpu
def test_gpu_oracle_equals_cpu(model):
    """The oracle on a GPU (weights there, true fp32, no TF32).

    Its cached decode equals its own forward (<= 1e-4, same device); its forward equals the CPU forward within
    the cross-device rounding floor of this 13-layer model (1.2e-4 measured on an H200; bound 5e-4); greedy
    tokens are the same.
    """
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm GPU")
    gm = K3Model(model.cfg, {k: v.cuda() for k, v in model.w.source.items()})
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 20), generator=g)
    cpu = model.forward(ids)
    full = gm.forward(ids.cuda())
    assert full.is_cuda and full.dtype == torch.float32
    cross = float((full.cpu() - cpu).abs().max())
    assert cross <= 5e-4, f"GPU vs CPU forward max abs error {cross:.3e}"
    cache = gm.new_cache(2, max_len=32, block_size=4)
    pre = gm.prefill([ids[0, :12], ids[1, :7]], cache)
    steps = [gm.decode(torch.stack([ids[0, 12 + j], ids[1, 7 + j]]), cache) for j in range(8)]
    err = max(float((pre[0] - full[0, :12]).abs().max()), float((pre[1] - full[1, :7]).abs().max()))
    for j, d in enumerate(steps):
        err = max(err, float((d[0] - full[0, 12 + j]).abs().max()), float((d[1] - full[1, 7 + j]).abs().max()))
    assert err <= TOL, f"GPU cached path vs GPU forward max abs error {err:.3e}"
    assert torch.equal(gm.generate_greedy(ids[:, :5].cuda(), 4), model.generate_greedy(ids[:, :5], 4))


def test_mla_is_called_with_the_nope_plus_rope_scale(model):
    """The model passes (qk_nope + qk_rope)^-0.5 to both MLA paths (K3: 192^-0.5; 128^-0.5 is a silent 22%
    error, K3_FACTS §5) — checked at the call, not only through end-to-end agreement."""
    from k3rocm.model.layer import resolve_ops

    base = resolve_ops()
    seen: list[tuple[str, float]] = []

    def spy(name, pos):
        def fn(*a, **k):
            seen.append((name, float(a[pos]) if len(a) > pos else float(k["scale"])))
            return base[name](*a, **k)
        return fn

    m = K3Model(model.cfg, model.w, ops={"mla_prefill": spy("mla_prefill", 6), "mla_decode": spy("mla_decode", 7)})
    cache = m.new_cache(1, max_len=8)
    m.prefill([torch.tensor([5, 6, 7])], cache)
    m.decode(torch.tensor([9]), cache)
    want = (model.cfg.qk_nope_head_dim + model.cfg.qk_rope_head_dim) ** -0.5
    assert {n for n, _ in seen} == {"mla_prefill", "mla_decode"}
    assert all(abs(s - want) < 1e-12 for _, s in seen), (seen, want)
    assert preset("k3").qk_head_dim == 192
