"""Streaming load (k3rocm.runtime.load): planned byte ranges land exactly, and damage is caught."""

from __future__ import annotations

import os

import pytest
import torch

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.errors import ValidationFailed
from k3rocm.profiles import load_profile
from k3rocm.runtime import load as loadmod
from k3rocm.runtime.load import VERIFY_TEXT, checksum, load, verify_loaded
from k3rocm.runtime.plan import plan


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def any_ckpt(golden_ckpt):
    """The external golden k3-tiny checkpoint (shipped in tests/data)."""
    return golden_ckpt


@pytest.fixture(scope="module")
def index(any_ckpt):
    return open_checkpoint(any_ckpt)


def test_load_tp1_every_tensor_exact(index):
    pl = plan(index.config, load_profile("cpu"), tp=1, ep=1)
    seen = []
    verified = []
    res = load(index, pl, progress=lambda d, t, name: (verified if name == VERIFY_TEXT else seen).append((d, t)))
    rep = res.report
    n = len(index.entries)
    assert rep.ok and rep.tensors_planned == rep.tensors_loaded == rep.tensors_verified == n
    assert rep.bytes_loaded[0] == rep.bytes_planned[0] == pl.ranks[0].weights_bytes
    assert rep.device_bytes_used[0] == rep.bytes_planned[0]
    assert rep.raw_read_bytes > 0 and rep.raw_read_gbps > 0 and rep.aggregate_gbps > 0 and rep.load_vs_raw > 0
    # progress: monotone, ends at the total
    assert seen and all(a[0] <= b[0] for a, b in zip(seen, seen[1:])) and seen[-1][0] == seen[-1][1]
    # then the verification pass, from 0 to the planned bytes, monotone as well
    assert verified[0] == (0, pl.ranks[0].weights_bytes) and verified[-1] == (pl.ranks[0].weights_bytes,) * 2
    assert len(verified) > 2 and all(a[0] <= b[0] for a, b in zip(verified, verified[1:]))
    w = res.weights
    for name in index.entries:  # independent check: the reader's own bytes
        assert torch.equal(_bytes(w[name]), _bytes(index.read(name))), name
    # MXFP4 stays packed
    packed = w["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    assert packed.dtype == torch.uint8 and packed.shape == (64, 32)
    d = rep.to_dict()
    assert d["ok"] and d["bytes_loaded"]["0"] == rep.bytes_loaded[0]


def test_load_tp2_ep2_slices_and_reassembly(index):
    cfg = index.config
    pl = plan(cfg, load_profile("cpu"), tp=2, ep=2)
    res = load(index, pl, threads=3, measure_raw=False)
    rep = res.report
    assert rep.ok and rep.tensors_verified == rep.tensors_planned == sum(r.num_tensors for r in pl.ranks)
    for r in (0, 1):
        assert rep.bytes_loaded[r] == pl.ranks[r].weights_bytes
    # a column (strided) slice and a row slice hold exactly the right part of the source
    o = "language_model.model.layers.0.self_attn.o_proj.weight"
    q = "language_model.model.layers.3.self_attn.q_b_proj.weight"
    w2 = "language_model.model.layers.1.block_sparse_moe.experts.9.w2.weight_packed"
    src_o, src_q = index.read(o), index.read(q)
    assert torch.equal(res.rank_weights[1][o], src_o[:, 64:])
    assert torch.equal(res.rank_weights[0][q], src_q[: src_q.shape[0] // 2])
    assert w2 in res.rank_weights[1] and w2 not in res.rank_weights[0]
    assert res.rank_weights[1].expert_range == (8, 16)
    # the slices of all ranks re-assemble into the full tensors
    full = res.weights
    for name in index.entries:
        if name.endswith("A_log"):  # stored [head_dim]; only the first num_heads entries are placed
            h = cfg.kda_num_heads
            assert torch.equal(full[name][:h], index.read(name)[:h])
            continue
        assert torch.equal(_bytes(full[name]), _bytes(index.read(name))), name


def test_expert_intermediate_split(index):
    """tp=2, ep=1: experts split by intermediate — w2 packed/scale columns cut on group boundaries."""
    pl = plan(index.config, load_profile("cpu"), tp=2, ep=1)
    res = load(index, pl, measure_raw=False)
    n = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_scale"
    src = index.read(n)  # [64, 2]: one scale byte per 32 intermediate columns
    assert torch.equal(res.rank_weights[1][n], src[:, 1:2])
    p = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight_packed"
    assert torch.equal(res.rank_weights[0][p], index.read(p)[:, :16])


def test_corrupted_byte_and_missing_tensor_are_caught(index):
    pl = plan(index.config, load_profile("cpu"), tp=2, ep=2)
    res = load(index, pl, measure_raw=False)
    w = res.rank_weights[1]
    name = "language_model.model.layers.5.self_attn.k_proj.weight"
    n_ok, probs = verify_loaded(index, pl, {1: w})
    assert not probs and n_ok == pl.ranks[1].num_tensors
    t = w[name]
    b = _bytes(t)
    b[b.numel() // 2] ^= 0x01  # one flipped bit in the middle of one tensor
    n_ok2, probs = verify_loaded(index, pl, {1: w})
    assert n_ok2 == n_ok - 1 and len(probs) == 1 and name in probs[0] and "checksum" in probs[0]
    b[b.numel() // 2] ^= 0x01
    # a tensor that never landed
    tensors = dict(w.items())
    gone = "language_model.model.layers.7.block_sparse_moe.experts.12.w3.weight_scale"
    del tensors[gone]
    _, probs = verify_loaded(index, pl, {1: tensors})
    assert len(probs) == 1 and gone in probs[0] and "not loaded" in probs[0]


def test_skipped_read_is_caught_by_load(index, monkeypatch):
    """A loader that forgets one byte range fails verification (the poison fill stays visible)."""
    pl = plan(index.config, load_profile("cpu"), tp=2, ep=2)
    victim = "language_model.model.layers.4.self_attn.dt_bias"
    real = loadmod._jobs_for

    def skipping(sl, entry, dst):
        jobs = real(sl, entry, dst)
        return [lambda sh: 0] if sl.name == victim else jobs

    monkeypatch.setattr(loadmod, "_jobs_for", skipping)
    with pytest.raises(ValidationFailed) as ei:
        load(index, pl, ranks=[0], measure_raw=False)
    msg = str(ei.value)
    assert "\n" not in msg and "problem" in msg
    res = load(index, pl, ranks=[0], measure_raw=False, strict=False)
    probs = res.report.problems
    assert not res.report.ok
    assert any("bytes read" in p for p in probs) and any(victim in p and "checksum" in p for p in probs)
    assert torch.isnan(res.rank_weights[0][victim]).all()  # the poison, never silently zeros


def test_checksum_properties():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1000, generator=g)
    c = checksum(t)
    u = t.clone()
    u[[3, 4]] = u[[4, 3]]  # swap two elements: same byte multiset, different positions
    assert checksum(u) != c and checksum(u)[0] == c[0]
    u = t.clone()
    _bytes(u)[17] ^= 0x80
    assert checksum(u)[0] != c[0]
    assert checksum(t.to(torch.bfloat16)) != checksum(t.to(torch.bfloat16) + 1)


@pytest.mark.gpu
def test_load_to_gpu(tiny_ckpt):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    index = open_checkpoint(tiny_ckpt)
    pl = plan(index.config, load_profile("cpu"), tp=2, ep=2)
    res = load(index, pl, device="cuda:0")
    rep = res.report
    assert rep.ok and rep.tensors_verified == rep.tensors_planned
    for r in (0, 1):
        assert rep.device_bytes_used[r] >= rep.bytes_planned[r] == rep.bytes_loaded[r]
        t = res.rank_weights[r]["language_model.model.layers.0.self_attn.o_proj.weight"]
        assert t.is_cuda
    src = index.read("language_model.model.layers.0.self_attn.o_proj.weight")
    assert torch.equal(res.rank_weights[1]["language_model.model.layers.0.self_attn.o_proj.weight"].cpu(),
                       src[:, src.shape[1] // 2:])


def test_checksum_is_position_weighted_across_chunks():
    """The chunked checksum equals the one-pass definition at chunk edges, and moves when two bytes swap."""
    from k3rocm.runtime.load import _CK_STEP, checksum

    def one_pass(t):
        b = t.contiguous().view(-1).view(torch.uint8).to(torch.int64)
        w = (torch.arange(b.numel(), dtype=torch.int64) % 251) + 1
        return int(b.sum()), int((b * w).sum())

    g = torch.Generator().manual_seed(5)
    for n in (0, 1, _CK_STEP - 1, _CK_STEP, _CK_STEP + 3):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert checksum(t) == one_pass(t), n
    t = torch.randint(0, 256, (_CK_STEP + 3,), dtype=torch.uint8, generator=g)
    t[_CK_STEP - 1], t[_CK_STEP] = 7, 9
    u = t.clone()
    u[_CK_STEP - 1], u[_CK_STEP] = 9, 7  # a swap across the chunk edge: same sum, different weighted sum
    assert checksum(t)[0] == checksum(u)[0] and checksum(t) != checksum(u)


def test_nan_weights_in_the_checkpoint_are_caught(tiny_cfg, tmp_path):
    """A checkpoint whose bf16 weight holds NaN bytes (no manifest to catch it) fails verification by name."""
    from k3rocm.checkpoint.writer import write_checkpoint
    ck = write_checkpoint(tiny_cfg, tmp_path / "ck", seed=1)
    idx = open_checkpoint(ck)
    name = "language_model.model.embed_tokens.weight"
    e = idx.entries[name]
    with open(ck / e.shard, "r+b") as f:  # 0xFFFF is a bf16 NaN; e.start is the absolute offset in the shard
        f.seek(e.start)
        f.write(b"\xff" * 64)
    idx = open_checkpoint(ck)
    pl = plan(idx.config, load_profile("cpu"))
    with pytest.raises(ValidationFailed, match="NaN/Inf") as err:
        load(idx, pl, measure_raw=False)
    assert name in str(err.value) and "32 NaN" in str(err.value)
    res = load(idx, pl, measure_raw=False, verify=False)
    n_ok, probs = verify_loaded(idx, pl, res.rank_weights)
    assert len(probs) == 1 and name in probs[0] and n_ok == pl.ranks[0].num_tensors - 1, probs


def test_one_bad_replicated_tensor_is_one_problem_naming_every_rank(tiny_cfg, tmp_path):
    """A NaN in a tensor every rank holds whole (a norm, replicated at TP2) is one problem naming both ranks, with
    one rank prefix and the checkpoint tensor's count (it was one line per rank: load.problems = 2 for one
    tensor); a NaN in a split tensor is found by the rank that holds it."""
    from k3rocm.checkpoint.writer import write_checkpoint
    ck = write_checkpoint(tiny_cfg, tmp_path / "ck", seed=1)
    idx = open_checkpoint(ck)
    norm = "language_model.model.layers.0.input_layernorm.weight"
    split = "language_model.model.embed_tokens.weight"
    for name in (norm, split):
        with open(ck / idx.entries[name].shard, "r+b") as f:  # 0xFFFF: one bf16 NaN at the tensor's first value
            f.seek(idx.entries[name].start)
            f.write(b"\xff\xff")
    idx = open_checkpoint(ck)
    pl = plan(idx.config, load_profile("cpu"), tp=2, ep=2)
    assert pl.ranks[0].tensors[norm].local_shape == pl.ranks[1].tensors[norm].local_shape  # replicated
    res = load(idx, pl, measure_raw=False, verify=False)
    _, probs = verify_loaded(idx, pl, res.rank_weights)
    bad_norm = [p for p in probs if norm in p]
    assert len(bad_norm) == 1 and bad_norm[0].startswith(f"ranks 0-1: {norm} holds 1 NaN/Inf"), probs
    bad_split = [p for p in probs if split in p]
    assert pl.ranks[0].tensors[split].start == 0 and pl.ranks[1].tensors[split].start > 0  # rows split: rank 0's
    assert len(bad_split) == 1 and bad_split[0].startswith(f"rank 0: {split} holds 1 NaN/Inf"), probs
    assert len(probs) == 2


def test_merge_rank_problems():
    from k3rocm.runtime.load import merge_rank_problems, rank_line

    lines = ["rank 0: x bad", "rank 1: y bad", "rank 1: x bad", "rank 3: x bad", "no rank here"]
    merged = merge_rank_problems(lines)
    assert merged == ["ranks 0-1, 3: x bad", "rank 1: y bad", "no rank here"]
    assert merge_rank_problems(merged + ["rank 2: x bad"]) == ["ranks 0-3: x bad", "rank 1: y bad", "no rank here"]
    assert rank_line(2, "rank 0: x") == "rank 0: x" and rank_line(2, "x") == "rank 2: x"


def test_raw_read_bypasses_the_page_cache_or_says_it_could_not(tmp_path, monkeypatch):
    import os

    from k3rocm.runtime.load import raw_read_throughput

    f = tmp_path / "shard.bin"
    f.write_bytes(os.urandom((1 << 20) + 333))  # not a multiple of the block size: the last O_DIRECT read is short
    n, secs, bypassed = raw_read_throughput([f])
    assert n == f.stat().st_size and secs > 0
    try:
        os.close(os.open(f, os.O_RDONLY | os.O_DIRECT))
        can = True
    except OSError:
        can = False
    assert bypassed is can
    monkeypatch.delattr(os, "O_DIRECT")
    n2, _, bypassed2 = raw_read_throughput([f])
    assert n2 == n and bypassed2 is False  # only advice was given: the report says the cache was not bypassed
