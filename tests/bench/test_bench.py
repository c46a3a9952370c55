"""Benchmark pieces: metrics definitions on synthetic timelines, load generator bounds, roofline model,
hang watchdog, a k3-tiny engine run, and the endpoint client against a local fake streaming server."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest
import torch

from k3rocm.bench import run_bench, sweep
from k3rocm.bench.client import OpenAIClient
from k3rocm.bench.loadgen import length_bounds, make_requests, plan_load
from k3rocm.bench.metrics import RequestRecord, aggregate
from k3rocm.bench.roofline import fraction_of_roofline
from k3rocm.config import preset
from k3rocm.errors import ConfigError
from k3rocm.runtime.sizing import StepRoofline

from tests.helpers import FakeCompletions, load_ckpt


# ------------------------------------------------------------------------------------------------ metrics
def _rand_records(rng, n):
    recs = []
    for i in range(n):
        issue = float(rng.uniform(0, 5))
        k = int(rng.integers(1, 9))
        gaps = rng.uniform(0.001, 0.2, size=k)
        times = list(issue + np.cumsum(gaps))
        recs.append(RequestRecord(i, int(rng.integers(3, 50)), k, issue, times, k, True))
    return recs


def test_metrics_follow_definitions():
    rng = np.random.default_rng(11)
    recs = _rand_records(rng, 9)
    failed = RequestRecord(99, 1000, 5, 0.0, [0.5], 1, False, "boom")
    dur = 7.25
    m = aggregate(recs + [failed], dur, num_gpus=4)
    ttft = [r.token_times[0] - r.issue_time for r in recs]
    e2el = [r.token_times[-1] - r.issue_time for r in recs]
    tpot = [(e - t) / (r.output_tokens - 1) for r, e, t in zip(recs, e2el, ttft) if r.output_tokens > 1]
    itl = [b - a for r in recs for a, b in zip(r.token_times[:-1], r.token_times[1:])]
    for name, vals in (("ttft", ttft), ("e2el", e2el), ("tpot", tpot), ("itl", itl)):
        v = np.array(vals) * 1000
        assert m[f"mean_{name}_ms"] == pytest.approx(v.mean(), rel=1e-12)
        assert m[f"median_{name}_ms"] == pytest.approx(statistics.median(v.tolist()), rel=1e-12)
        s = sorted(v.tolist())
        for p in (90, 99):  # linear interpolation between closest ranks
            pos = (len(s) - 1) * p / 100
            lo = int(pos)
            want = s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)
            assert m[f"p{p}_{name}_ms"] == pytest.approx(want, rel=1e-12)
    tin = sum(r.input_len for r in recs)
    tout = sum(r.output_tokens for r in recs)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (9, 1, tin, tout)
    assert m["duration"] == dur
    assert m["request_throughput"] == pytest.approx(9 / dur)
    assert m["output_throughput"] == pytest.approx(tout / dur)
    assert m["total_token_throughput"] == pytest.approx((tin + tout) / dur)
    assert m["output_throughput_per_gpu"] == pytest.approx(tout / dur / 4)


def test_tpot_hand_example():
    # issued at 1.0; tokens at 1.5, 1.7, 2.0 -> TTFT 0.5, E2EL 1.0, TPOT (1.0-0.5)/2, ITLs 0.2, 0.3
    r = RequestRecord(0, 10, 3, 1.0, [1.5, 1.7, 2.0], 3, True)
    assert r.ttft == pytest.approx(0.5) and r.e2el == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.25) and r.itls == pytest.approx([0.2, 0.3])
    one = RequestRecord(1, 10, 1, 0.0, [0.4], 1, True)
    assert one.tpot is None  # undefined for a single output token
    m = aggregate([r, one], 2.0)
    assert m["mean_tpot_ms"] == pytest.approx(250.0) and m["mean_ttft_ms"] == pytest.approx(450.0)


# ------------------------------------------------------------------------------------------------ loadgen
@pytest.mark.parametrize("L,ratio", [(100, 0.8), (7, 0.8), (1, 0.8), (50, 1.0), (64, 0.25)])
def test_loadgen_length_bounds(L, ratio):
    lo, hi = length_bounds(L, ratio)
    assert lo == max(1, int(np.floor(ratio * L))) and hi == L
    reqs = make_requests(400, L, 2 * L, vocab_size=97, range_ratio=ratio, seed=5, special_ids=(0, 1, 2))
    il = [r.input_len for r in reqs]
    ol = [r.output_len for r in reqs]
    assert min(il) >= lo and max(il) <= hi
    lo_o, hi_o = length_bounds(2 * L, ratio)
    assert min(ol) >= lo_o and max(ol) <= hi_o
    if hi - lo <= 20:  # both ends are reached when the range is small
        assert min(il) == lo and max(il) == hi
    ids = np.concatenate([r.prompt_ids for r in reqs])
    assert ids.min() >= 3 and ids.max() < 97  # specials excluded


def test_loadgen_counts_seed_and_errors():
    p = plan_load(3, 20, 10, vocab_size=512, seed=1)
    assert len(p.requests) == 30 and len(p.warmups) == 6
    assert all(w.warmup for w in p.warmups) and not any(r.warmup for r in p.requests)
    assert plan_load(3, 20, 10, 512, seed=1).requests == p.requests
    assert plan_load(3, 20, 10, 512, seed=2).requests != p.requests
    assert len(plan_load(2, 5, 5, 512, num_prompts=3, warmups=0).requests) == 3
    for bad in (dict(concurrency=0), dict(input_len=0), dict(range_ratio=1.5)):
        kw = dict(concurrency=2, input_len=5, output_len=5, vocab_size=512) | bad
        with pytest.raises(ConfigError):
            plan_load(**kw)


# ------------------------------------------------------------------------------------------------ roofline
def test_roofline_k3_decode_and_prefill():
    k3 = preset("k3")
    r = StepRoofline.from_config(k3, bandwidth=8e12, peak_flops=2.5e15)
    assert r.experts_touched(1) == pytest.approx(16)  # one token touches exactly top-k experts
    assert r.experts_touched(10_000) == pytest.approx(896)
    assert r.expert_bytes == 17_547_264  # K3_FACTS §2
    assert r.mla_bytes_per_token == 24 * 576 * 2
    assert r.flops_per_token == 2 * 104_189_614_848
    c1 = r.step([1024])
    want = (r.trunk_bytes + r.embed_row_bytes + 92 * 16 * 17_547_264 + 1025 * 24 * 576 * 2 + 2 * r.kda_slot_bytes)
    assert c1.bytes == pytest.approx(want) and c1.bound == "memory"
    assert c1.floor_s == pytest.approx(want / 8e12)
    # a long prefill chunk is compute bound
    c2 = r.step([], [(8192, 8192)])
    assert c2.bound == "compute" and c2.floor_s == pytest.approx(c2.flops / 2.5e15)

    class S:  # a step record like the engine's
        decode_contexts, prefill_contexts, prefill_sizes = (1024,), (), ()
        num_decode, num_prefill_tokens, seconds = 1, 0, 2 * c1.floor_s

    f = fraction_of_roofline(r, [S])
    assert f["fraction"] == pytest.approx(0.5)

    class P:  # a step that mixes a 256-token prefill chunk into the same decode row, at the roofline
        decode_contexts, prefill_contexts, prefill_sizes = (1024,), (256,), (256,)
        num_decode, num_prefill_tokens = 1, 256
        seconds = r.step([1024], [(256, 256)]).floor_s

    f = fraction_of_roofline(r, [S, P, S])
    d = f["decode_only"]  # the pure decode steps alone: the mixed step neither counts nor dilutes
    assert d["steps"] == 2 and d["fraction"] == pytest.approx(0.5) and d["median_fraction"] == pytest.approx(0.5)
    assert f["fraction"] > 0.5
    assert f["with_prefill"]["steps"] == 1 and f["with_prefill"]["fraction"] == pytest.approx(1.0)
    assert fraction_of_roofline(r, [P])["decode_only"] == {"steps": 0, "floor_s": 0, "measured_s": 0,
                                                           "fraction": 0.0, "median_fraction": 0.0,
                                                           "issue_share": None}
    assert f["decode_only"]["issue_share"] is None  # no step logged its host time

    class Si(S):  # the same decode step, its host at the synchronisation after a quarter of its time
        issue_seconds = S.seconds / 4

    class Pi(P):  # the mixed step, host-bound: the host reached the synchronisation at 90% of the step
        issue_seconds = 0.9 * P.seconds

    f = fraction_of_roofline(r, [Si, Pi, S])
    assert f["per_step"][0]["issue_s"] == pytest.approx(S.seconds / 4) and f["per_step"][2]["issue_s"] is None
    # shares over the steps that logged it only (S did not): not diluted by a step without the figure
    assert f["decode_only"]["issue_share"] == pytest.approx(0.25)
    assert f["with_prefill"]["issue_share"] == pytest.approx(0.9)
    with pytest.raises(ConfigError):
        StepRoofline.from_config(k3, 0, 1)


# ------------------------------------------------------------------------------------------------ watchdog
class FakeEngine:
    """Each step emits one token per running request after sleeping ``dt``; request ``stall`` never progresses."""

    def __init__(self, dt=0.002, stall=None, vocab=64):
        from types import SimpleNamespace
        self.cfg = SimpleNamespace(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        self.dt, self.stall = dt, stall
        self.live, self.n, self.next = {}, {}, 0
        self.added = 0
        self.aborted = []

    def add_request(self, prompt, max_tokens, ignore_eos=False):
        rid = self.next
        self.next += 1
        self.live[rid] = max_tokens
        self.n[rid] = 0
        self.added += 1
        return rid

    def step(self):
        from k3rocm.runtime.engine import TokenEvent
        time.sleep(self.dt)
        out = []
        for rid in list(self.live):
            if rid == self.stall:
                continue
            self.n[rid] += 1
            fin = self.n[rid] >= self.live[rid]
            out.append(TokenEvent(rid, 5, fin, "length" if fin else None, time.perf_counter()))
            if fin:
                del self.live[rid]
        return out

    def has_unfinished(self):
        return bool(self.live)

    def abort(self, rid):
        self.aborted.append(rid)
        self.live.pop(rid, None)

    def where(self, rid):
        return {"status": "decode", "output_tokens": self.n.get(rid, 0)}


def test_watchdog_marks_hang_and_ends_cleanly():
    eng = FakeEngine(stall=7)  # 2 warm-ups are ids 0, 1; measured request 5 is engine id 7
    res = run_bench(eng, concurrency=2, input_len=4, output_len=3, num_prompts=60, warmups=2, watchdog_factor=10)
    assert res.hang is not None and res.hang["request_id"] == 5
    assert res.hang["elapsed_s"] > res.hang["threshold_s"] == pytest.approx(10 * res.hang["median_e2el_s"])
    assert res.hang["where"]["status"] == "decode"
    assert 7 in eng.aborted and not eng.live  # nothing left running
    assert eng.added < 62  # the run stopped issuing requests
    assert res.metrics["completed"] >= 3 and res.metrics["failed"] >= 1
    assert not res.completed_cleanly
    d = res.to_dict()
    json.dumps(d)
    assert d["hang"]["request_id"] == 5 and len(d["requests"]) == res.metrics["completed"] + res.metrics["failed"]
    # a sweep stops after a hang
    assert len(sweep(FakeEngine(stall=3), [1, 2, 4], 4, 3, num_prompts=6, warmups=2)) == 1
    ok = run_bench(FakeEngine(), 3, 4, 3, num_prompts=9, warmups=3)
    assert ok.hang is None and ok.metrics["completed"] == 9 and ok.completed_cleanly


# ------------------------------------------------------------------------------------------------ engine run
@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_bench_on_k3_tiny_engine(golden_ckpt, one_thread):
    from k3rocm.runtime.engine import Engine

    cfg, w = load_ckpt(golden_ckpt)
    eng = Engine(cfg, w, max_batch=3, max_num_batched_tokens=16, block_size=4, max_model_len=32)
    seen = []
    roof = StepRoofline.from_config(cfg, bandwidth=50e9, peak_flops=100e9, kv_bytes=4, trunk_dtype_bytes=4)
    res = run_bench(eng, concurrency=3, input_len=10, output_len=4, num_prompts=6, warmups=1, seed=3,
                    progress=lambda ph, d, n, **_: seen.append((ph, d, n)), roofline=roof)
    m = res.metrics
    assert res.hang is None and m["completed"] == 6 and m["failed"] == 0
    want_out = sum(r.output_len_target for r in res.records)
    assert m["total_output_tokens"] == want_out  # ignore_eos: every request runs to its length
    assert m["total_input_tokens"] == sum(r.input_len for r in res.records)
    assert all(8 <= r.input_len <= 10 and 3 <= r.output_len_target <= 4 for r in res.records)
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["mean_tpot_ms"] > 0 and m["p99_itl_ms"] >= m["median_itl_ms"]
    assert seen[-1] == ("measure", 6, 6)
    # each phase reports 0 finished as it starts (a bar's clock starts then, not at the first token)
    assert seen[0] == ("warmup", 0, 1) and ("measure", 0, 6) in seen
    assert seen.index(("measure", 0, 6)) < min(i for i, x in enumerate(seen) if x[0] == "measure" and x[1] > 0)
    assert res.roofline is not None and 0 < res.roofline["fraction"] and len(res.roofline["per_step"]) > 0
    # what the report names as run: the torch oracle on the CPU, the Triton kernel on a GPU (auto-selected)
    assert res.target["ops"]["kda_decode"] == ("torch" if res.target["device"] == "cpu" else "triton")
    assert set(res.target["ops"].values()) <= {"torch", "triton", "aiter"}
    json.dumps(res.to_dict())
    assert not eng.has_unfinished() and eng.mla.num_free_blocks == eng.mla.num_blocks
    # the measured phase compiled and tuned nothing (the CPU oracle never does); the breakdown after it timed a
    # mixed and a decode step per op family, the families within the step's wall time
    c = res.to_dict()["compiles"]
    assert c["compiles"] == 0 and c["autotune_runs"] == 0 and c["compiled"] == {} and c["tuned"] == {}
    assert set(res.breakdown) == {"mixed", "decode"}
    mixed, dec = res.breakdown["mixed"], res.breakdown["decode"]
    # at the point's concurrency (3): a chunk beside 2 decode rows, then a 3-row decode step
    assert mixed["num_decode"] == 2 and mixed["num_prefill_tokens"] > 0
    assert dec["num_decode"] == 3 and dec["num_prefill_tokens"] == 0
    for part in (mixed, dec):
        fams = part["ms"]
        assert fams["KDA"] > 0 and fams["MLA"] > 0 and fams["lm_head"] > 0 and fams["experts"] > 0
        assert fams["AttnRes"] > 0 and fams["router"] > 0  # every op family the step runs is attributed
        assert all(v >= 0 for v in fams.values()) and sum(fams.values()) == pytest.approx(part["wall_ms"], rel=1e-3)
    assert eng.profiler is None and "channel" not in vars(eng.dec) and "_mix" not in vars(eng)  # all undone


def test_ctrl_c_during_the_breakdown_keeps_the_measured_point(golden_ckpt, one_thread, monkeypatch):
    """Ctrl-C after the measured phase (during the step breakdown) raises PointInterrupted carrying the point's
    measured result without a breakdown, so a sweep keeps it."""
    import k3rocm.bench.breakdown as BD
    from k3rocm.bench import PointInterrupted
    from k3rocm.runtime.engine import Engine

    def cut(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(BD, "step_breakdown", cut)
    cfg, w = load_ckpt(golden_ckpt)
    eng = Engine(cfg, w, max_batch=2, max_num_batched_tokens=16, block_size=4, max_model_len=32)
    with pytest.raises(PointInterrupted) as ei:
        run_bench(eng, concurrency=2, input_len=8, output_len=3, num_prompts=4, warmups=0, seed=5)
    res = ei.value.result
    assert res.metrics["completed"] == 4 and res.metrics["failed"] == 0 and res.breakdown == {}
    assert res.to_dict(per_request=False)["concurrency"] == 2


def test_a_sweep_keeps_a_point_cut_after_its_measured_phase():
    from k3rocm.bench import PointInterrupted
    from k3rocm.validation.bench_job import run_sweep
    from k3rocm.validation.evidence import Stage

    def point(c):
        if c == 2:
            raise PointInterrupted({"concurrency": 2, "completed": 3})
        return {"concurrency": c, "completed": 3}
    st = Stage("bench")
    results, stopped = run_sweep(st, [1, 2, 4], point)
    assert stopped and [r["concurrency"] for r in results] == [1, 2]
    row = next(e for e in st.evidence if e.name == "sweep.interrupted")
    assert "concurrency 2 after its measured phase" in row.detail and "2 of 3 points" in row.detail


def test_bench_rows_fail_on_measured_compiles_and_draw_the_breakdown():
    """A point whose measured phase compiled or tuned fails its stage with one row naming the kernels; warm-up's
    seconds and compiles are rows; the breakdown becomes rows and one stacked bar per step kind."""
    from k3rocm.validation.evidence import Stage
    from k3rocm.validation.render import _series_svg
    from k3rocm.validation.tiers.performance import _breakdown_rows, _compile_rows

    ok = {"compiles": {"compiles": 0, "autotune_runs": 0, "compiled": {}, "tuned": {}, "available": True},
          "warmup": {"ladder": {"graphs": [1, 2, 4], "prefill_buckets": [1, 2, 4, 8]}}}
    st = Stage("bench")
    _compile_rows(st, "bench", "c4", ok, "measured")
    assert st.status == "passed" and [e.name for e in st.evidence] == ["c4.measured.compiles",
                                                                        "c4.measured.autotune_runs"]
    bad = {"compiles": {"compiles": 3, "autotune_runs": 1, "compiled": {"_kda_conv_kernel": 3},
                        "tuned": {"kda_conv": 1}, "available": True}}
    st = Stage("bench")
    _compile_rows(st, "bench", "c4", bad, "measured")
    assert st.status == "failed" and len(st.failures) == 2
    assert "_kda_conv_kernel x3" in st.failures[0].detail and "kda_conv x1" in st.failures[1].detail
    # a GPU warm-up says how long it took and how much it compiled (informational rows before the checks)
    warm = {"compiles": ok["compiles"], "warmup": {"ladder": {**ok["warmup"]["ladder"], "seconds": 41.5,
                                                              "compiles": 57, "autotune_runs": 0,
                                                              "tune_mode": "first"}}}
    st = Stage("bench")
    _compile_rows(st, "bench", "c4", warm, "measured")
    rows = {e.name: e for e in st.evidence}
    assert st.status == "passed" and rows["c4.warmup.seconds"].value == 41.5
    assert rows["c4.warmup.compiles"].value == 57 and "first" in rows["c4.warmup.seconds"].detail
    part = {"ms": {"KDA": 1.0, "MLA": 2.0, "host + other": 0.5}, "wall_ms": 3.5, "num_decode": 2,
            "num_prefill_tokens": 0}
    st = Stage("bench")
    _breakdown_rows(st, "bench", "c4", {"breakdown": {"decode": part}}, "measured")
    names = {e.name: e for e in st.evidence}
    assert names["c4.breakdown.decode.wall_ms"].value == 3.5 and "57.1%" in names["c4.breakdown.decode.MLA"].detail
    svg = _series_svg("breakdown", {"kind": "stacked", "x": ["c4 decode", "c4 mixed"],
                                    "y": {"KDA": [1.0, 2.0], "MLA": [2.0, 1.0]}, "ylabel": "ms"})
    assert svg is not None and "<svg" in svg


# ------------------------------------------------------------------------------------------------ client
def test_client_against_fake_endpoint(fake_server):
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    cl = OpenAIClient(url, model="k3", vocab_size=300, special_ids=(0, 1, 2), timeout=5)
    res = run_bench(cl, concurrency=2, input_len=12, output_len=5, num_prompts=5, warmups=1, seed=4)
    m = res.metrics
    assert res.hang is None and m["completed"] == 5
    assert m["total_output_tokens"] == sum(r.output_len_target for r in res.records)
    assert all(len(r.token_times) == r.output_len_target for r in res.records)
    assert m["mean_ttft_ms"] > 0 and m["mean_itl_ms"] >= 2.0  # the server spaces tokens >= 3 ms apart
    assert len(FakeCompletions.seen) == 6  # 1 warm-up + 5 measured, bounded
    path, body = FakeCompletions.seen[-1]
    assert path == "/v1/completions" and body["stream"] is True and body["ignore_eos"] is True
    assert body["model"] == "k3" and all(3 <= t < 300 for t in body["prompt"])
    with pytest.raises(ConfigError):
        OpenAIClient("ftp://x")


def test_client_watchdog_on_stalled_stream(fake_server):
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    cl = OpenAIClient(url, vocab_size=300, special_ids=(0, 1, 2), timeout=5)
    reqs = plan_load(1, 12, 3, 300, num_prompts=8, warmups=2, seed=9, special_ids=(0, 1, 2))
    target = 4
    FakeCompletions.stall_after = list(reqs.requests[target].prompt_ids)  # stall that request after its first token
    t0 = time.perf_counter()
    res = run_bench(cl, concurrency=1, input_len=12, output_len=3, num_prompts=8, warmups=2, seed=9,
                    watchdog_factor=10)
    assert time.perf_counter() - t0 < 3.0  # ended at the watchdog, not at the 3 s stall
    assert res.hang is not None and res.hang["request_id"] == target
    assert res.hang["where"]["output_tokens"] == 1
    assert res.metrics["completed"] == target


def test_endpoint_url_forms_all_post_to_v1_completions():
    """http://host:port, the OpenAI base-URL form .../v1 and the full .../v1/completions (with or without a
    trailing slash, under a path prefix) all address the same completions route."""
    from k3rocm.bench.client import OpenAIClient

    for url, want in (("http://h:8000", "/v1/completions"), ("http://h:8000/v1", "/v1/completions"),
                      ("http://h:8000/v1/", "/v1/completions"), ("http://h:8000/v1/completions", "/v1/completions"),
                      ("http://h:8000/proxy/v1", "/proxy/v1/completions")):
        assert OpenAIClient(url).path == want, url


def test_profiled_ops_keep_their_signature():
    """The breakdown's timing wrapper keeps the op's signature, so code that picks a path from it (the MoE block's
    fused routing looks for ``experts`` / ``dispatch`` parameters) takes the served path while profiled."""
    import inspect
    import types

    from k3rocm.bench.breakdown import StepProfiler

    def moe_router(x, gate_weight, bias, top_k, renormalize=True, scaling=1.0, experts=None):
        return x

    prof = StepProfiler(types.SimpleNamespace(device=torch.device("cpu")))
    wrapped = prof._wrap("router", moe_router)
    assert "experts" in inspect.signature(wrapped).parameters
    assert wrapped(3, None, None, 1) == 3 and prof.seconds["router"] >= 0.0


def test_wall_ms_is_the_median_after_a_warm_call():
    """``wall_ms`` (the scripts' CPU stand-in for do_bench) calls once to warm, then times ``repeats`` calls and
    returns their median in milliseconds."""
    from k3rocm.bench import wall_ms

    delays = iter([0.0, 0.030, 0.001, 0.010])  # warm call, then three timed calls: 30, 1, 10 ms
    calls = []

    def fn():
        d = next(delays)
        calls.append(d)
        time.sleep(d)

    ms = wall_ms(fn, repeats=3)
    assert len(calls) == 4 and 8.0 <= ms < 25.0  # the middle one (10 ms), never the 30 ms or 1 ms call


def test_sigterm_ends_a_sweep_like_ctrl_c_and_exits_143():
    from k3rocm.errors import Terminated
    from k3rocm.validation.bench_job import _interrupted, run_sweep
    from k3rocm.validation.evidence import Stage

    def point(c):
        if c == 4:
            raise Terminated()
        return {"concurrency": c, "completed": 3}
    st = Stage("bench")
    results, stopped = run_sweep(st, [1, 2, 4, 8], point)
    assert stopped == "SIGTERM" and [r["concurrency"] for r in results] == [1, 2]
    row = next(e for e in st.evidence if e.name == "sweep.interrupted")
    assert "SIGTERM" in row.detail and "2 of 4 points" in row.detail
    e = _interrupted(results, 4, stopped)
    assert e.exit_code == 143 and "SIGTERM" in str(e) and "\n" not in str(e)
    assert _interrupted(results, 4).exit_code == 130


def test_a_sweep_interrupted_before_its_first_point_says_nothing_was_measured_and_draws_no_plot(tmp_path):
    # Ctrl-C during the first point: the message does not claim finished points, and the report's empty series
    # (labels with no values) become neither an SVG in the HTML nor a plot line in the Markdown
    from k3rocm.validation.bench_job import _interrupted, run_sweep
    from k3rocm.validation.evidence import Stage
    from k3rocm.validation.render import _series_svg, has_points

    def point(c):
        raise KeyboardInterrupt()
    st = Stage("bench")
    results, stopped = run_sweep(st, [1, 2], point)
    assert results == [] and stopped == "Ctrl-C"
    msg = str(_interrupted(results, 2, stopped))
    assert "before any of the 2 points finished" in msg and "nothing was measured" in msg
    assert "finished points are in" not in msg
    empty = {"x": [], "y": {"TTFT p50": [], "TPOT p50": []}, "xlabel": "concurrency", "ylabel": "ms"}
    assert not has_points(empty) and _series_svg("latency", empty) is None
    one = {"x": [1], "y": {"TTFT p50": [12.5], "TPOT p50": []}, "xlabel": "concurrency", "ylabel": "ms"}
    assert has_points(one) and "<svg" in _series_svg("latency", one)
