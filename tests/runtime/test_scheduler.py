"""Cache managers (paged MLA blocks, KDA slots, budget sizing) and the continuous-batching scheduler.

The scheduler tests drive it with a fake "model": each step, every sampling sequence gets a token that
is a pure function of (seq_id, its token count), so the expected output of a sequence is known without a
model and must not change under preemption/recompute.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3rocm.config import preset
from k3rocm.errors import ConfigError, PlanError
from k3rocm.runtime.cache import (CacheExhausted, KDAStatePool, MLACache, mla_bytes_per_block, size_caches,
                                  size_from_capacity)
from k3rocm.runtime.scheduler import Scheduler, Sequence, Status
from k3rocm.runtime.sizing import kda_state_bytes_per_seq


@pytest.fixture(scope="module")
def cfg():
    return preset("k3-tiny")


# ------------------------------------------------------------------------------------------- cache sizes
def test_byte_sizes_match_k3_facts():
    k3 = preset("k3")
    # K3_FACTS §7: 24 MLA layers x 576 values x 2 B = 27,648 B per token; KDA ~434 MB per sequence.
    assert mla_bytes_per_block(k3, 1, torch.bfloat16) == 24 * 576 * 2
    assert kda_state_bytes_per_seq(k3) == 69 * (96 * 128 * 128 + 3 * 12288 * 3) * 4
    # the recurrent-state part alone is K3_FACTS's "~434 MB per sequence"; conv state adds ~30.5 MB
    assert 69 * 96 * 128 * 128 * 4 == 434_110_464
    # TP8: heads per rank 12 -> an eighth of the state
    assert kda_state_bytes_per_seq(k3, num_heads=12) * 8 == kda_state_bytes_per_seq(k3)


def test_size_caches_split_and_errors(cfg):
    sb, bb = kda_state_bytes_per_seq(cfg), mla_bytes_per_block(cfg, 16, torch.bfloat16)
    budget = 3 * sb + 40 * bb + 7
    s = size_caches(cfg, budget, max_seqs=3, block_size=16)
    assert (s.num_slots, s.num_blocks) == (3, 40)
    assert s.used_bytes <= budget and budget - s.used_bytes < bb
    # more sequences than fit: slots limited so each keeps a block
    s2 = size_caches(cfg, 2 * (sb + bb), max_seqs=100, block_size=16)
    assert s2.num_slots == 2 and s2.num_blocks == 2
    with pytest.raises(PlanError):
        size_caches(cfg, sb, max_seqs=1)  # a slot but no block


# ------------------------------------------------------------------------------------------- MLA cache
def test_mla_alloc_exhaust_free_reuse(cfg):
    c = MLACache(cfg, num_blocks=5, block_size=4, dtype=torch.float32)
    assert len(c.layers) == cfg.num_mla_layers == 4
    assert c.kv_cache[c.layers[0]].shape == (5, 4, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert c.allocate(7, 9) == [0, 1, 2]  # ceil(9/4) blocks
    assert c.allocate(7, 12) == []  # already covered
    assert c.allocate(8, 5) == [3, 4]
    assert c.num_free_blocks == 0 and not c.can_allocate(7, 13)
    with pytest.raises(CacheExhausted):
        c.allocate(9, 1)
    assert 9 not in c.block_tables  # a failed allocation takes nothing
    # slot mapping follows the block table
    sm = c.slot_mapping(8, 2, 6)
    assert sm.tolist() == [3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1]
    with pytest.raises(CacheExhausted):
        c.slot_mapping(8, 0, 9)
    bt = c.block_table([7, 8])
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert c.free(7) == 3 and c.free(7) == 0
    assert c.allocate(9, 8) == [0, 1]  # FIFO reuse of freed blocks


FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *FP8])
def test_mla_write_gather_roundtrip(cfg, dtype):
    g = torch.Generator().manual_seed(3)
    R, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    c = MLACache(cfg, num_blocks=6, block_size=4, dtype=dtype, kv_scale=0.5 if dtype in FP8 else 1.0)
    L = c.layers[1]
    c.allocate(1, 7)
    c.allocate(2, 3)
    lat, rope = torch.randn(7, R, generator=g), torch.randn(7, Dr, generator=g)
    c.write(L, c.slot_mapping(1, 0, 7), lat, rope)
    other = torch.randn(3, R + Dr, generator=g)
    sm2 = c.slot_mapping(2, 0, 3)
    sm2[1] = -1  # skipped row
    c.write(L, sm2, other[:, :R], other[:, R:])
    got = c.gather(L, 1, 7)
    ref = torch.cat([lat, rope], -1)
    tol = {torch.float32: 0, torch.bfloat16: 8e-3, torch.float8_e4m3fn: 0.07, torch.float8_e4m3fnuz: 0.07}[dtype]
    assert torch.allclose(got, ref, rtol=tol, atol=tol * 0.1 if tol else 0)
    g2 = c.gather(L, 2, 3)
    assert torch.allclose(g2[0], other[0], rtol=tol, atol=tol * 0.1 if tol else 0)
    assert torch.all(g2[1] == 0)  # -1 wrote nothing
    # other layers untouched
    assert all(torch.all(c.kv_cache[i].float() == 0) for i in c.layers if i != L)


@pytest.mark.parametrize("dtype, limit", [(torch.float8_e4m3fn, 448.0), (torch.float8_e4m3fnuz, 240.0)])
def test_mla_fp8_write_saturates_to_its_format(cfg, dtype, limit):
    """A value beyond the format's range is stored as its largest finite value (NaN otherwise on e4m3fnuz)."""
    c = MLACache(cfg, num_blocks=1, block_size=4, dtype=dtype, kv_scale=1.0)
    L = c.layers[0]
    c.allocate(1, 1)
    R, Dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    c.write(L, c.slot_mapping(1, 0, 1), torch.full((1, R), 1e4), torch.full((1, Dr), -1e4))
    got = c.gather(L, 1, 1)[0]
    assert torch.all(got[:R] == limit) and torch.all(got[R:] == -limit)


# ------------------------------------------------------------------------------------------- KDA pool
def test_kda_pool_alloc_exhaust_reuse_zeroed(cfg):
    p = KDAStatePool(cfg, num_slots=2)
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    L0 = p.layers[0]
    assert p.state[L0].shape == (2, H, K, K) and p.conv[L0].shape == (2, 3, H * K, W - 1)
    a, b = p.allocate(10), p.allocate(11)
    assert (a, b) == (0, 1) and p.allocate(10) == a
    with pytest.raises(CacheExhausted):
        p.allocate(12)
    for i in p.layers:  # dirty both slots
        p.state[i].normal_()
        p.conv[i].normal_()
    keep = {i: p.state[i][b].clone() for i in p.layers}
    assert p.free(10) == a and p.free(10) is None
    c = p.allocate(12)
    assert c == a
    for i in p.layers:
        assert torch.all(p.state[i][c] == 0) and torch.all(p.conv[i][c] == 0)  # no stale state
        assert torch.equal(p.state[i][b], keep[i])  # the other slot untouched


# ------------------------------------------------------------------------------------------- scheduler
def _tok(seq: Sequence) -> int:
    return 100 + (seq.seq_id * 7 + seq.num_tokens) % 50


def _expected(seq_id: int, plen: int, n: int) -> list[int]:
    return [100 + (seq_id * 7 + plen + j) % 50 for j in range(n)]


def _run(sched: Scheduler, max_steps: int = 1000):
    plans = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert not out.empty
        plans.append(out)
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        sampled = {s.seq.seq_id: _tok(s.seq) for s in out.scheduled if s.sample}
        # sample before update sees the token count of the step's end
        for s in out.scheduled:
            if s.sample:
                assert s.start + s.num_tokens == s.seq.num_tokens
        sched.update(out, sampled)
    assert not sched.has_unfinished
    return plans


def _mk(cfg, blocks=64, bs=4, slots=4, **kw):
    return Scheduler(MLACache(cfg, blocks, bs, torch.float32), KDAStatePool(cfg, slots), **kw)


def test_chunked_prefill_budget_and_outputs(cfg):
    s = _mk(cfg, max_num_seqs=4, max_num_batched_tokens=6)
    lens = [13, 3, 8]
    for i, L in enumerate(lens):
        s.add(Sequence(i, list(range(1, L + 1)), max_tokens=5))
    plans = _run(s)
    first = plans[0].scheduled
    assert [(x.seq.seq_id, x.start, x.num_tokens, x.sample) for x in first] == [(0, 0, 6, False)]
    # every finished sequence has exactly its expected tokens
    for q in s.finished:
        assert q.output == _expected(q.seq_id, len(q.prompt), 5) and q.finish_reason == "length"
    assert s.mla.num_free_blocks == s.mla.num_blocks and s.kda.num_free == s.kda.num_slots
    # decodes are placed before prefill chunks in every step
    for p in plans:
        kinds = [x.is_decode for x in p.scheduled]
        assert kinds == sorted(kinds, reverse=True)


def test_admission_limited_by_slots_and_max_seqs(cfg):
    s = _mk(cfg, slots=2, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(5):
        s.add(Sequence(i, [5] * 4, max_tokens=3))
    out = s.schedule()
    assert [x.seq.seq_id for x in out.scheduled] == [0, 1]  # only 2 KDA slots
    assert [q.seq_id for q in s.waiting] == [2, 3, 4]
    s2 = _mk(cfg, slots=8, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(5):
        s2.add(Sequence(i, [5] * 4, max_tokens=3))
    assert [x.seq.seq_id for x in s2.schedule().scheduled] == [0, 1, 2]


def test_admission_limited_by_blocks_fcfs_no_overtaking(cfg):
    s = _mk(cfg, blocks=4, bs=4, slots=4, max_num_batched_tokens=64)
    s.add(Sequence(0, [1] * 8, max_tokens=1))   # 2 blocks
    s.add(Sequence(1, [1] * 12, max_tokens=1))  # 3 blocks: does not fit beside 0
    s.add(Sequence(2, [1] * 2, max_tokens=1))   # would fit, but must not overtake 1
    out = s.schedule()
    assert [x.seq.seq_id for x in out.scheduled] == [0]
    _run(s)
    assert [q.seq_id for q in s.finished] == [0, 1, 2]


def test_preemption_recompute_and_resumption(cfg):
    # 6 blocks of 2 tokens; two sequences each growing to 4 + 6 = 10 tokens (5 blocks) cannot both live.
    s = _mk(cfg, blocks=6, bs=2, slots=4, max_num_batched_tokens=16)
    s.add(Sequence(0, [3] * 4, max_tokens=6))
    s.add(Sequence(1, [4] * 4, max_tokens=6))
    plans = _run(s)
    pre = [q.seq_id for p in plans for q in p.preempted]
    assert pre and set(pre) == {1}  # the later admitted is the victim
    by_id = {q.seq_id: q for q in s.finished}
    assert by_id[1].num_preemptions >= 1 and by_id[0].num_preemptions == 0
    # recompute keeps generated tokens: outputs equal the unpreempted expectation
    for i in (0, 1):
        assert by_id[i].output == _expected(i, 4, 6)
    # after a preemption the victim resumes by re-prefilling prompt + its outputs from position 0
    k = next(j for j, p in enumerate(plans) if p.preempted)
    resumed = next(x for p in plans[k + 1:] for x in p.scheduled if x.seq.seq_id == 1)
    assert resumed.start == 0 and resumed.num_tokens > 4
    assert s.mla.num_free_blocks == 6


def test_preempted_goes_first_and_eos_finishes(cfg):
    s = _mk(cfg, blocks=64, slots=1, max_num_batched_tokens=64)
    s.add(Sequence(0, [1, 2], max_tokens=10, eos_token_id=_expected(0, 2, 3)[2]))
    s.add(Sequence(1, [1, 2], max_tokens=2, eos_token_id=_expected(1, 2, 1)[0], ignore_eos=True))
    _run(s)
    f = {q.seq_id: q for q in s.finished}
    assert f[0].finish_reason == "eos" and len(f[0].output) == 3
    assert f[1].finish_reason == "length" and len(f[1].output) == 2  # ignore_eos


def test_deterministic_and_input_errors(cfg):
    def trace():
        s = _mk(cfg, blocks=10, bs=2, slots=3, max_num_batched_tokens=5)
        for i, L in enumerate([7, 2, 5, 3]):
            s.add(Sequence(i, [9] * L, max_tokens=4))
        return [[(x.seq.seq_id, x.start, x.num_tokens) for x in p.scheduled] for p in _run(s)]

    assert trace() == trace()
    s = _mk(cfg, blocks=2, bs=2)
    with pytest.raises(ConfigError):
        s.add(Sequence(0, [], max_tokens=1))
    with pytest.raises(PlanError):
        s.add(Sequence(1, [1] * 4, max_tokens=1))  # 5 tokens > 2 blocks x 2
    s.add(Sequence(2, [1], max_tokens=1))
    with pytest.raises(ConfigError):
        s.add(Sequence(2, [1], max_tokens=1))
    assert s.abort(2).finish_reason == "abort" and not s.has_unfinished
    assert Status.FINISHED.value == "finished"


def test_size_from_plan_capacity(cfg):
    sb, bb = kda_state_bytes_per_seq(cfg), mla_bytes_per_block(cfg, 16, torch.float8_e4m3fn)
    cap = SimpleNamespace(budget_bytes=4 * sb + 100 * bb, kv_dtype="fp8", max_sequences=4)
    s = size_from_capacity(cfg, cap)
    assert (s.num_slots, s.num_blocks) == (4, 100) and s.block_bytes == bb
    with pytest.raises(PlanError):
        size_from_capacity(cfg, SimpleNamespace(budget_bytes=10**9, kv_dtype="int3", max_sequences=1))
