"""The compile/autotune watcher (kernels.compile_watch) and the shape buckets kernels key on (tune.pow2)."""

from __future__ import annotations

import math

import pytest

from k3rocm.kernels import compile_watch, tune
from k3rocm.kernels.compile_watch import CompileWatch


def test_pow2_ladder_covers_every_length_with_a_bounded_count():
    for limit in (1, 2, 3, 255, 256, 257, 4096, 131072):
        ladder = tune.pow2_ladder(limit)
        assert len(ladder) == 1 + math.ceil(math.log2(limit))  # bounded: logarithmic in the longest length
        assert ladder[-1] >= limit
        if limit <= 4096:
            assert {tune.pow2(n) for n in range(1, limit + 1)} <= set(ladder)


def test_watch_counts_pick_timing_runs_per_kernel(monkeypatch):
    """A first-seen key with several candidates is timed once (counted); the cached key again is not; a watch
    that ended counts nothing more."""
    monkeypatch.setattr(tune, "interpreting", lambda: False)
    monkeypatch.setattr(tune, "_capturing", lambda: False)
    monkeypatch.delenv("K3ROCM_TUNE", raising=False)
    monkeypatch.setattr(tune.triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    cands = [{"BLOCK": 16}, {"BLOCK": 32}]
    with CompileWatch() as w:
        tune.pick("watch_test_kernel", ("k", 1), cands, run=lambda c: None)
        tune.pick("watch_test_kernel", ("k", 1), cands, run=lambda c: None)  # cached: not timed again
        tune.pick("watch_test_kernel", ("k", 2), cands, run=lambda c: None)
    assert w.autotunes == {"watch_test_kernel": 2} and w.summary()["autotune_runs"] == 2
    tune.pick("watch_test_kernel", ("k", 3), cands, run=lambda c: None)
    assert w.autotunes["watch_test_kernel"] == 2 and w._on_tune not in tune.LISTENERS
    for k in (1, 2, 3):
        tune._CACHE.pop(("watch_test_kernel", ("k", k)), None)


def test_watch_counts_compiles_through_the_triton_hook_and_chains_it():
    knobs = compile_watch._KNOBS
    if knobs is None or not hasattr(knobs, "jit_post_compile_hook"):
        pytest.skip("this Triton has no knobs.runtime.jit_post_compile_hook")
    seen = []
    prev = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        class Fn:
            name = "k3_fake_kernel"
        with CompileWatch() as w:
            assert w.available
            # what JITFunction._call_hook passes after compiling a new specialisation
            knobs.jit_post_compile_hook(key=(), repr="k3_fake_kernel[num_warps=4]()", fn=Fn(), compile={},
                                        is_manual_warmup=False, already_compiled=False)
        assert w.compiles == {"k3_fake_kernel": 1} and seen == ["k3_fake_kernel"]
        assert w.summary()["compiled"] == {"k3_fake_kernel": 1} and w.total == 1
    finally:
        restored = knobs.jit_post_compile_hook
        knobs.jit_post_compile_hook = prev
    assert restored is not w._on_compile  # the watch put the earlier hook back


def _v2_class(n: int) -> tuple[bool, int]:
    """How Triton specialises an argument ``c * n``: on ``n == 1`` and on the exponent of 2 in ``n`` up to 4."""
    return n == 1, min((n & -n).bit_length() - 1, 4)


def test_spec_cover_meets_every_specialisation_and_bucket_with_a_bounded_count():
    for limit in (1, 2, 3, 5, 15, 16, 17, 63, 64, 255, 256, 4096):
        cover = tune.spec_cover(limit)
        assert cover == sorted(set(cover)) and 1 <= cover[0] and cover[-1] <= limit
        assert len(cover) <= 2 * (1 + math.ceil(math.log2(max(limit, 1))))
        everything = range(1, limit + 1)
        assert {_v2_class(n) for n in everything} <= {_v2_class(n) for n in cover}
        assert {tune.pow2(n) for n in everything} <= {tune.pow2(n) for n in cover}
    assert tune.spec_cover(64) == [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64]


def test_tune_modes(monkeypatch):
    """"time" times a new key and caches it; "first" takes the first candidate that launches on the device (a
    config that raises, e.g. over the shared memory, is passed over), remembered per key, and never times;
    "frozen" returns a choice timed before, else the first that launches, and never times; the mode is restored
    on exit and an unknown one refused."""
    monkeypatch.setattr(tune, "interpreting", lambda: False)
    monkeypatch.setattr(tune, "_capturing", lambda: False)
    monkeypatch.delenv("K3ROCM_TUNE", raising=False)
    runs, benched = [], []

    def bench(fn, **kw):
        benched.append(1)
        fn()
        return 1.0

    monkeypatch.setattr(tune.triton.testing, "do_bench", bench)
    cands = [{"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": 64}]

    def run(c):
        runs.append(c["BLOCK"])
        if c["BLOCK"] == 16:
            raise RuntimeError("out of resources: shared memory")  # never chosen on this device

    name = "mode_test_kernel"
    try:
        assert tune.current_mode() == "time"
        with tune.mode("first"):
            assert tune.pick(name, ("a",), cands, run) == {"BLOCK": 32} and runs == [16, 32] and not benched
            assert tune.pick(name, ("a",), cands, run) == {"BLOCK": 32} and runs == [16, 32]  # remembered
            assert tune.pick(name, ("a",), [{"BLOCK": 8, "max_rows": 4}, {"BLOCK": 64}], run, rows=9) == {"BLOCK": 64}
            # a call that must not be repeated (can_time=False) is never run by the pick: the first candidate
            assert tune.pick(name, ("c",), cands, run, can_time=False) == {"BLOCK": 16} and runs == [16, 32]
        assert tune.current_mode() == "time"
        runs.clear()
        assert tune.pick(name, ("t",), cands, run) == {"BLOCK": 32} and runs == [16, 32, 64] and len(benched) == 3
        with tune.mode("frozen"):
            assert tune.pick(name, ("t",), cands, run) == {"BLOCK": 32}  # timed before
            assert tune.pick(name, ("b",), cands, run) == {"BLOCK": 32}  # never timed: the first that launches
        assert len(benched) == 3 and (name, ("b",)) not in tune._CACHE
        with pytest.raises(tune.ConfigError):
            with tune.mode("fastest"):
                pass
    finally:
        for k in ("a", "b", "c", "t"):
            tune._CACHE.pop((name, (k,)), None)
            tune._FIT.pop((name, (k,)), None)


def test_graphed_pick_times_replays_and_falls_back_to_eager(monkeypatch):
    """``graphed=True`` times each candidate graph-replayed (after one run outside the capture); a candidate whose
    capture fails is timed eagerly instead of dropped, so it can still win; one that cannot launch is skipped."""
    monkeypatch.setattr(tune, "interpreting", lambda: False)
    monkeypatch.setattr(tune, "_capturing", lambda: False)
    monkeypatch.setattr(tune, "_spin_up", lambda: None)
    monkeypatch.setattr(tune.torch.cuda, "synchronize", lambda: None)
    monkeypatch.delenv("K3ROCM_TUNE", raising=False)
    times = {16: 3.0, 32: 2.0, 64: 1.0}  # 64 only capturable eagerly: its graph capture raises
    graphed, eager = [], []

    def bench_graph(fn, **kw):
        fn()
        block = last[0]
        graphed.append(block)
        if block == 64:
            raise RuntimeError("operation not permitted when stream is capturing")
        return times[block]

    def bench_eager(fn, **kw):
        fn()
        eager.append(last[0])
        return times[last[0]]

    last = [None]

    def run(c):
        if c["BLOCK"] == 8:
            raise RuntimeError("out of resources: shared memory")
        last[0] = c["BLOCK"]

    monkeypatch.setattr(tune.triton.testing, "do_bench_cudagraph", bench_graph)
    monkeypatch.setattr(tune.triton.testing, "do_bench", bench_eager)
    name = "graphed_test_kernel"
    try:
        got = tune.pick(name, ("g",), [{"BLOCK": 8}, {"BLOCK": 16}, {"BLOCK": 32}, {"BLOCK": 64}], run, graphed=True)
        assert got == {"BLOCK": 64}
        assert graphed == [16, 32, 64] and eager == [64]
    finally:
        tune._CACHE.pop((name, ("g",)), None)


def test_candidates_are_left_out_unless_asked():
    """A table entry marked ``candidate`` (not yet run on a GPU) is not among the configs a pick or serving sees,
    only where asked (tests, benchmarks); the key is a known selection key (no typo error) and never a launch
    option or meta-parameter."""
    table = {"cuda": [{"BV": 64}, {"BV": 32, "candidate": True}, {"BV": 16}]}
    assert tune.configs(table, "cuda") == [{"BV": 64}, {"BV": 16}]
    assert tune.configs(table, "cuda", candidates=True) == table["cuda"]
    meta, opts = tune.split({"BV": 32, "candidate": True, "num_warps": 4}, interp=False)
    assert meta == {"BV": 32} and opts == {"num_warps": 4}


def test_pick_max_pairs_serves_only_counts_it_covers():
    """A config carrying ``max_pairs`` is chosen only for a given pair count at most its own; without a count it
    is never chosen (callers that know nothing of pairs keep the plain rows rule)."""
    cands = [{"B": 1, "max_pairs": 2, "max_rows": 16}, {"B": 2, "max_pairs": 8, "max_rows": 16},
             {"B": 3, "max_rows": 16}, {"B": 4}]
    with tune.mode("first"):
        assert tune.pick("pairs_test", ("a",), cands, rows=1, pairs=1) == cands[0]
        assert tune.pick("pairs_test", ("b",), cands, rows=1, pairs=3) == cands[1]
        assert tune.pick("pairs_test", ("c",), cands, rows=1, pairs=9) == cands[2]
        assert tune.pick("pairs_test", ("d",), cands, rows=1) == cands[2]
        assert tune.pick("pairs_test", ("e",), cands, rows=40, pairs=1) == cands[3]


@pytest.mark.parametrize("tokens,expect", [(1, dict(split_k=4, num_warps=4)), (2, dict(split_k=4, num_warps=4)),
                                           (4, dict(split_k=2, num_warps=4)), (8, dict(split_k=1, num_warps=8)),
                                           (16, dict(split_k=1, num_warps=4, num_stages=3)),
                                           (64, dict(split_k=1, num_warps=4, num_stages=3)),
                                           (256, dict(split_k=1, num_warps=4, num_stages=4))])
def test_cuda_moe_table_splits_k_for_a_few_local_pairs(tokens, expect):
    """The CUDA expert-GEMM table as ``ops.gemm_pick`` reads it for the K3 rank of EP16 (56 of 896 experts,
    top-16): one to two tokens split K in 4, four in 2, eight take 8 warps unsplit, up to 128 local pairs the 4-warp
    m16 tile with 3 stages, more the served 4-stage one (the order bench_moe_decode.py measured on an H100); the
    same m16 tile everywhere, so the routing's grouping (BLOCK_M) does not change with the split."""
    from k3rocm.kernels.moe.configs import GEMM_CONFIGS

    pairs = math.ceil(tokens * 16 * 56 / 896)
    rows = pairs / max(1, min(56, pairs))
    cfg = tune.pick("moe_gemm_table_test", (tokens,), tune.configs(GEMM_CONFIGS, "cuda"), rows=rows, pairs=pairs)
    assert (cfg.get("split_k", 1), cfg["num_warps"], cfg["BLOCK_M"], cfg["kind"]) == (
        expect["split_k"], expect["num_warps"], 16, "dqp")
    if "num_stages" in expect:
        assert cfg["num_stages"] == expect["num_stages"]
