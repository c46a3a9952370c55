"""Cache sizes and the step roofline (k3rocm.runtime.sizing), and that plan, cache pools and bench all use them."""

from __future__ import annotations

import itertools

import pytest
import torch

from k3rocm.config import preset
from k3rocm.errors import ConfigError, PlanError
from k3rocm.profiles import load_profile
from k3rocm.runtime.cache import mla_bytes_per_block, size_caches
from k3rocm.runtime.plan import plan
from k3rocm.runtime.sizing import (StepRoofline, experts_touched, kda_state_bytes_per_seq, kv_dtype_bytes,
                           mla_cache_bytes_per_token)


def test_k3_cache_sizes():
    k3 = preset("k3")
    assert mla_cache_bytes_per_token(k3, 2) == 24 * 576 * 2 == 27_648  # K3_FACTS §7
    assert mla_cache_bytes_per_token(k3, 1, num_layers=1) == 576
    assert kda_state_bytes_per_seq(k3) == 69 * (96 * 128 * 128 + 3 * 12288 * 3) * 4 == 464_633_856
    assert kda_state_bytes_per_seq(k3, num_heads=12) * 8 == kda_state_bytes_per_seq(k3)
    assert kv_dtype_bytes("fp8") == 1 and kv_dtype_bytes("fp32") == 4
    with pytest.raises(PlanError, match="kv_dtype"):
        kv_dtype_bytes("int3")


def test_experts_touched_is_the_exact_expectation():
    """E * (1 - (1 - k/E)^T) against brute-force enumeration of every routing of T tokens, k of E each."""
    E, k = 6, 2
    choices = list(itertools.combinations(range(E), k))
    for T in (1, 2, 3):
        total = sum(len(set().union(*r)) for r in itertools.product(choices, repeat=T))
        assert experts_touched(E, k, T) == pytest.approx(total / len(choices) ** T)
    assert experts_touched(896, 16, 1) == pytest.approx(16) and experts_touched(896, 16, 10**6) == pytest.approx(896)
    assert experts_touched(896, 16, 0) == 0 and experts_touched(0, 0, 5) == 0


def test_plan_cache_pool_and_bench_use_the_same_figures():
    k3, tiny = preset("k3"), preset("k3-tiny")
    pl = plan(k3, load_profile("mi355x-8"))
    assert pl.cache.mla_bytes_per_token == mla_cache_bytes_per_token(k3, 2)
    assert pl.cache.kda_state_bytes_per_seq == kda_state_bytes_per_seq(k3, 96 // pl.tp)
    assert pl.roofline.kda_slot_bytes == pl.cache.kda_state_bytes_per_seq
    assert pl.roofline.mla_bytes_per_token == pl.cache.mla_bytes_per_token
    s = size_caches(tiny, 10**8, max_seqs=4, block_size=16, kv_dtype=torch.float8_e4m3fn, num_heads=2)
    assert s.slot_bytes == kda_state_bytes_per_seq(tiny, 2)
    assert s.block_bytes == mla_bytes_per_block(tiny, 16, torch.float8_e4m3fn) == 16 * mla_cache_bytes_per_token(tiny, 1)
    # one rank of a one-rank plan is the single-device roofline bench uses
    cpu = load_profile("cpu")
    one = plan(tiny, cpu, tp=1, ep=1).roofline
    assert one == StepRoofline.from_config(tiny, cpu.hbm_bandwidth, cpu.peak("bf16"))


def test_rank_roofline_splits_experts_heads_and_embedding():
    k3 = preset("k3")
    r8 = plan(k3, load_profile("mi355x-8")).roofline
    r1 = StepRoofline.from_config(k3, r8.bandwidth, r8.peak_flops)
    assert r8.ep == 8 and r8.expert_bytes == r1.expert_bytes  # ep = tp: whole experts, 1/8 of those touched
    assert r8.kda_slot_bytes * 8 == r1.kda_slot_bytes and r8.embed_row_bytes * 8 == r1.embed_row_bytes
    assert r8.kda_flops_per_token * 8 == r1.kda_flops_per_token and r8.mla_flops_per_pair * 8 == r1.mla_flops_per_pair
    c8, c1 = r8.step([1024]), r1.step([1024])
    assert c1.bytes - c8.bytes == pytest.approx(r1.trunk_bytes - r8.trunk_bytes + 92 * 16 * r1.expert_bytes * 7 / 8
                                                + r1.embed_row_bytes * 7 / 8 + 2 * 7 / 8 * r1.kda_slot_bytes)
    with pytest.raises(ConfigError, match="rank's trunk"):
        StepRoofline.from_config(k3, 1e12, 1e15, tp=8, ep=8)
    with pytest.raises(ConfigError, match="ep dividing"):
        StepRoofline.from_config(k3, 1e12, 1e15, tp=8, ep=3, rank_trunk=(1, 1))
