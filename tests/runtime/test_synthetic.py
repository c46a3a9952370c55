"""Synthetic weights (``--synthetic``): the loader's tensor set for one rank, finite over every layer, and the
projected collectives of a rank run alone."""

from __future__ import annotations

import math

import pytest
import torch

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.errors import ConfigError, HardwareError
from k3rocm.model.model import K3Model
from k3rocm.mx import dequantize_mxfp4
from k3rocm.profiles import load_profile
from k3rocm.runtime.dist import ProjectedGroup, TPGroup
from k3rocm.runtime.load import load
from k3rocm.runtime.plan import plan, scaled_profile
from k3rocm.runtime.synthetic import (check_rank, collective_projection, e8m0_exponent, synthetic_weights,
                                      tpot_projection)

torch.set_num_threads(1)


@pytest.mark.parametrize("tp,ep,rank", [(1, 1, 0), (2, 2, 1), (4, 2, 3)])
def test_same_tensors_as_the_loader(tiny_ckpt, tp, ep, rank):
    idx = open_checkpoint(tiny_ckpt)
    pl = plan(idx.config, load_profile("cpu"), tp=tp, ep=ep)
    got = synthetic_weights(idx.config, pl, rank, seed=3)
    want = load(idx, pl, ranks=[rank], measure_raw=False, verify=False).rank_weights[rank]
    assert sorted(got.keys()) == sorted(want.keys())
    for k in want.keys():
        assert (tuple(got.get(k).shape), got.get(k).dtype) == (tuple(want.get(k).shape), want.get(k).dtype), k
    assert got.expert_range == want.expert_range


def test_finite_over_every_layer_as_one_rank(tiny_cfg):
    pl = plan(tiny_cfg, load_profile("cpu"), tp=2, ep=2)
    w = synthetic_weights(tiny_cfg, pl, 1, seed=0)
    grp = ProjectedGroup(pl, 1)
    model = K3Model(tiny_cfg, w, par=grp)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model.forward(ids)
    assert logits.shape == (2, 8, tiny_cfg.vocab_size) and bool(torch.isfinite(logits).all())
    # one forward: one attn reduce per layer, one mlp / moe reduce per dense / MoE layer, as the real group counts
    snap = grp.stats.snapshot()
    assert snap["attn"]["calls"] == tiny_cfg.num_hidden_layers
    assert snap["moe"]["calls"] + snap["mlp"]["calls"] == tiny_cfg.num_hidden_layers
    assert snap["attn"]["bytes"] == tiny_cfg.num_hidden_layers * 16 * tiny_cfg.hidden_size * logits.element_size()
    assert isinstance(grp, TPGroup) and grp.world == 2 and grp.vocab_start == tiny_cfg.vocab_size // 2
    toks = model.generate_greedy(ids[0], 2)
    assert bool(((toks >= grp.vocab_start) & (toks < grp.vocab_stop)).all())


def test_expert_scales_give_unit_fan_in_rms():
    fan_in = 4096
    codes = torch.randint(0, 256, (256, fan_in // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scale = torch.full((256, fan_in // 32), e8m0_exponent(fan_in), dtype=torch.uint8)
    rms = float(dequantize_mxfp4(codes, scale).float().pow(2).mean().sqrt())
    assert 0.7 / math.sqrt(fan_in) < rms < 1.42 / math.sqrt(fan_in)  # one power of two around 1/sqrt(fan_in)


def test_projection_arithmetic(tiny_cfg):
    pl = plan(tiny_cfg, load_profile("cpu"), tp=4, ep=4)
    grp = ProjectedGroup(pl, 0)
    x = torch.zeros(3, tiny_cfg.hidden_size, dtype=torch.bfloat16)
    grp.reduce(x, "attn")
    grp.reduce(x, "attn")
    grp.greedy(torch.zeros(3, tiny_cfg.vocab_size // 4))
    p = collective_projection(grp, 1e9, rows=10)
    row = tiny_cfg.hidden_size * 2
    assert p["attn"]["calls"] == 2 and p["attn"]["bytes"] == 2 * 10 * row
    assert p["attn"]["seconds"] == pytest.approx(2 * 3 / 4 * 2 * 10 * row / 1e9)  # ring: 2 (w-1)/w
    assert p["greedy"]["seconds"] == pytest.approx(3 * 10 * 16 / 1e9)  # all_gather: (w-1) x its input
    with pytest.raises(HardwareError, match="link bandwidth"):
        grp.projected_seconds("attn", 1.0, 0.0)
    tp = tpot_projection(0.01, pl, pl, 4, 64, 0.002)
    assert tp["ratio"] == pytest.approx(1.0) and tp["tpot_s"] == pytest.approx(0.012)


def test_rank_outside_the_layout_and_official_layout(tiny_cfg):
    pl = plan(tiny_cfg, load_profile("cpu"), tp=2, ep=2)
    with pytest.raises(ConfigError, match="ranks 0..1"):
        synthetic_weights(tiny_cfg, pl, 2)
    from k3rocm.config import preset
    k3 = preset("k3")  # the official model as 16 ranks of H200s: one rank is about 100 GB and fits one
    big = plan(k3, scaled_profile(load_profile("h200-8"), 16), tp=16, ep=16)
    assert 90e9 < big.ranks[0].weights_bytes < 120e9 and big.fits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_k3_prefix_rank_on_the_device():
    """Random weights made on the GPU (no host copy) for one rank of k3-prefix-2 at TP16/EP16: the planned bytes,
    finite forward."""
    from k3rocm.config import preset
    cfg = preset("k3-prefix-2")
    pl = plan(cfg, scaled_profile(load_profile("h200-8"), 16), tp=16, ep=16)
    w = synthetic_weights(cfg, pl, 5, device="cuda")
    assert w.nbytes() == pl.ranks[5].weights_bytes
    assert all(w.get(k).device.type == "cuda" for k in w.keys())
    model = K3Model(cfg, w, par=ProjectedGroup(pl, 5, "cuda"))
    logits = model.forward(torch.randint(0, cfg.vocab_size, (1, 8), device="cuda"))
    assert bool(torch.isfinite(logits).all())


def test_experts_are_made_as_one_buffer_per_layer(tiny_cfg):
    pl = plan(tiny_cfg, load_profile("cpu"), tp=2, ep=2)
    w = synthetic_weights(tiny_cfg, pl, 0)
    i = next(j for j in range(tiny_cfg.num_hidden_layers) if tiny_cfg.is_moe_layer(j))
    p = f"language_model.model.layers.{i}.block_sparse_moe.experts."
    ptr = {w.get(f"{p}{e}.{wn}.weight_packed").untyped_storage().data_ptr() for e in (0, 1) for wn in ("w1", "w3")}
    assert len(ptr) == 1
    ew = w.experts(i)  # the engine's stacks: w1 rows then w3 rows, as made
    assert torch.equal(ew.w13_packed[1, :w.get(f"{p}1.w1.weight_packed").shape[0]], w.get(f"{p}1.w1.weight_packed"))


def test_check_rank_names_the_layout_without_a_none():
    with pytest.raises(ConfigError, match=r"^--rank 4 is not a rank of the TP4/EP2 layout \(ranks 0\.\.3\)$"):
        check_rank((4, 2), 4)
    with pytest.raises(ConfigError, match=r"^--rank 4 is not a rank of the TP4 layout \(ranks 0\.\.3\)$"):
        check_rank((4, None), 4)  # an EP not known yet is left out, never printed as None
    check_rank((4, None), 3)


def test_projected_embedding_has_no_zero_rows(tiny_cfg):
    """A rank run alone stands in a row of its own slice for every id another rank holds: no zero rows (a zero
    row ties every router score and goes to experts 0..k-1), own ids exactly their rows, the reduce counted."""
    pl = plan(tiny_cfg, load_profile("cpu"), tp=4, ep=4)
    grp = ProjectedGroup(pl, 2)
    V = tiny_cfg.vocab_size
    table = torch.randn(grp.vocab_stop - grp.vocab_start, tiny_cfg.hidden_size, dtype=torch.bfloat16,
                        generator=torch.Generator().manual_seed(5))
    ids = torch.randint(0, V, (64,), generator=torch.Generator().manual_seed(6))
    ids[:2] = torch.tensor([grp.vocab_start, grp.vocab_stop - 1])
    x = grp.embed_rows(table, ids)
    assert x.dtype == torch.float32 and x.shape == (64, tiny_cfg.hidden_size)
    assert bool((x.abs().sum(-1) > 0).all())
    mine = (ids >= grp.vocab_start) & (ids < grp.vocab_stop)
    assert 0 < int(mine.sum()) < 64
    assert torch.equal(x[mine], table[ids[mine] - grp.vocab_start].float())
    assert torch.equal(x[~mine], table[ids[~mine] % table.shape[0]].float())
    snap = grp.stats.snapshot()
    assert snap["embed"]["calls"] == 1 and snap["embed"]["bytes"] == 64 * tiny_cfg.hidden_size * 4


def test_real_group_embedding_masks_other_ranks_rows(tiny_cfg, monkeypatch):
    """The real group zeroes the rows of ids another rank holds before its all_reduce sums them."""
    import k3rocm.runtime.dist as dist

    pl = plan(tiny_cfg, load_profile("cpu"), tp=2, ep=2)
    grp = ProjectedGroup(pl, 1)
    seen = {}

    def fake_all_reduce(t, ctx):
        seen["t"] = t.clone()
        return t
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    table = torch.randn(grp.vocab_stop - grp.vocab_start, tiny_cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, grp.vocab_start, grp.vocab_stop - 1, 1])
    x = dist.TPGroup.embed_rows(grp, table, ids)
    assert torch.equal(x, seen["t"])
    assert bool((x[[0, 3]] == 0).all()) and torch.equal(x[1], table[0]) and torch.equal(x[2], table[-1])


def test_replicated_embedding_is_looked_up_without_a_collective(tiny_cfg):
    """At TP1 the embedding is not vocabulary-split: the rows are the table's own and no "embed" reduce is counted
    (as before the embedding moved into the parallel context)."""
    pl = plan(tiny_cfg, load_profile("cpu"), tp=1, ep=1)
    grp = ProjectedGroup(pl, 0)
    assert grp.vocab_start is None
    table = torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, tiny_cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(grp.embed_rows(table, ids), table[ids])
    assert "embed" not in grp.stats.snapshot()
