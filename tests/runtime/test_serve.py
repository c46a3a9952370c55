"""The distributed engine (k3rocm.runtime.serve) on CPU gloo processes: equality with one process, faults.

Every test starts real follower processes on this host; rank 0 is the test process.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.checkpoint.writer import write_checkpoint
from k3rocm.config import preset
from k3rocm.model.weights import load_weights
from k3rocm.runtime.dist import WorkerFailed
from k3rocm.runtime.engine import Engine
from k3rocm.runtime.serve import Cluster, RankSpec, merge_load_reports

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41]]
ENGINE = dict(max_batch=4, max_num_batched_tokens=8, max_model_len=64)


def _single(ckpt, n):
    w = load_weights(ckpt)
    eng = Engine(w.config, w, device="cpu", record_logits=True, **ENGINE)
    logits = []
    ids = [eng.add_request(p, n, ignore_eos=True) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
        logits.append(eng.last_logits)
    return [eng.seqs[i].output for i in ids], logits


def _distributed(ckpt, tp, ep, n, timeout_s=60.0):
    cl = Cluster.start(RankSpec(str(ckpt), "cpu", tp, ep, timeout_s=timeout_s), tp)
    try:
        rep = cl.call("load")
        eng = cl.engine(record_logits=True, **ENGINE)
        logits = []
        ids = [eng.add_request(p, n, ignore_eos=True) for p in PROMPTS]
        while eng.has_unfinished():
            eng.step()
            logits.append(eng.last_logits)
        return [eng.seqs[i].output for i in ids], logits, rep, cl.worker.par.stats.snapshot()
    finally:
        cl.close()


@pytest.fixture(scope="module")
def tp8_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp8") / "k3-tiny-tp8"
    return write_checkpoint(preset("k3-tiny-tp8"), out, seed=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_equal_one_process(tiny_ckpt, tp):
    """TP=EP=2 and 4 gloo processes: the same greedy tokens as one process, logits within 1e-4, each rank
    loading only its slice, and every collective of the decoder issued."""
    ref_toks, ref_logits = _single(tiny_ckpt, 5)
    toks, logits, rep, stats = _distributed(tiny_ckpt, tp, tp, 5)
    assert toks == ref_toks
    assert len(logits) == len(ref_logits)
    # the first step (prefill) differs only by the fp32 order of the TP partial sums: <= 1e-4 of the logit scale
    # (~3.5 here; measured 1e-6 at TP2, 1.2e-4 absolute at TP8). Later steps carry
    # KDA state and cached latents built from earlier rounding, and random k3-tiny weights amplify it about 2x
    # per layer (test_dist: TP vs oracle <= 1e-3 of the logit scale), so they are held to that bound
    assert (logits[0] - ref_logits[0]).abs().max().item() <= 1e-4 * ref_logits[0].abs().max().item()
    for a, b in zip(logits, ref_logits):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-3 * b.abs().max().item()
    assert sorted(rep["bytes_loaded"]) == list(range(tp)) and not rep["problems"]
    assert rep["tensors_verified"] == rep["tensors_planned"]
    total = sum(e.nbytes for e in open_checkpoint(tiny_ckpt).entries.values())
    assert max(rep["bytes_loaded"].values()) < total  # no rank holds the whole model
    assert {"attn", "mlp", "moe", "embed", "greedy"} <= set(stats)


@pytest.mark.slow
def test_tp8_ep8_eight_processes(tp8_ckpt):
    """k3-tiny-tp8 (8 heads, 32 experts) at TP8/EP8 on 8 processes: one head and 4 experts per rank."""
    ref_toks, ref_logits = _single(tp8_ckpt, 3)
    toks, logits, rep, _ = _distributed(tp8_ckpt, 8, 8, 3, timeout_s=120.0)
    assert toks == ref_toks
    assert (logits[0] - ref_logits[0]).abs().max().item() <= 1e-4 * ref_logits[0].abs().max().item()
    assert all((a - b).abs().max().item() <= 1e-3 * b.abs().max().item() for a, b in zip(logits, ref_logits))
    assert len(rep["bytes_loaded"]) == 8


def _start_and_step(ckpt, timeout_s):
    cl = Cluster.start(RankSpec(str(ckpt), "cpu", 2, 2, timeout_s=timeout_s), 2)
    cl.call("load")
    eng = cl.engine(**ENGINE)
    for p in PROMPTS:
        eng.add_request(p, 40, ignore_eos=True)
    for _ in range(3):
        eng.step()
    return cl, eng


def _no_orphans(cl):
    for p in cl.procs:
        p.join(timeout=5)
        assert not p.is_alive()


def test_killed_rank_mid_serving_is_one_line(tiny_ckpt):
    cl, eng = _start_and_step(tiny_ckpt, 30.0)
    os.kill(cl.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        while eng.has_unfinished():
            eng.step()
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "\n" not in msg and "rank 1" in msg and "signal" in msg, msg
    _no_orphans(cl)


def test_hung_rank_mid_serving_ends_at_the_timeout(tiny_ckpt):
    # 8 s: the group must form first, and a follower's start (a spawned interpreter importing torch) took over 4 s
    # on a loaded 2-core machine; the hang is still caught well inside the 30 s bound below
    cl, eng = _start_and_step(tiny_ckpt, 8.0)
    os.kill(cl.procs[0].pid, signal.SIGSTOP)  # alive, never answers
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerFailed) as e:
            while eng.has_unfinished():
                eng.step()
    finally:
        os.kill(cl.procs[0].pid, signal.SIGKILL) if cl.procs[0].is_alive() else None
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "\n" not in msg and "hung" in msg and "serving step" in msg, msg
    _no_orphans(cl)


def test_merge_load_reports_keeps_every_rank():
    a = {"ranks": [0], "tensors_planned": 3, "tensors_loaded": 3, "tensors_verified": 3, "bytes_planned": {"0": 10},
         "bytes_loaded": {"0": 10}, "device_bytes_used": {"0": 10}, "seconds": {"0": 1.0}, "gbps": {"0": 1.0},
         "total_seconds": 1.0, "verify_seconds": 0.1, "aggregate_gbps": 1.0, "problems": [], "raw_read_gbps": 2.0}
    b = dict(a, ranks=[1], bytes_planned={"1": 20}, bytes_loaded={"1": 20}, device_bytes_used={"1": 20},
             seconds={"1": 2.0}, gbps={"1": 0.5}, total_seconds=2.0, problems=["x differs"])
    m = merge_load_reports([a, b])
    assert m["bytes_loaded"] == {0: 10, 1: 20} and m["tensors_planned"] == 6
    assert m["problems"] == ["rank 1: x differs"] and m["total_seconds"] == 2.0
    assert m["aggregate_gbps"] == 2.0 and m["load_vs_raw"] == pytest.approx(1.0)  # ranks load side by side


def test_merge_load_reports_prefixes_a_rank_once_and_counts_a_shared_problem_once():
    """Each rank's problems name their rank already: the merge adds no second prefix ("rank 0: rank 0: ...") and
    a problem both ranks report (a replicated tensor of the checkpoint) is one problem naming both."""
    a = {"ranks": [0], "tensors_planned": 3, "tensors_loaded": 3, "tensors_verified": 2, "bytes_planned": {"0": 10},
         "bytes_loaded": {"0": 10}, "device_bytes_used": {"0": 10}, "seconds": {"0": 1.0}, "gbps": {"0": 1.0},
         "total_seconds": 1.0, "verify_seconds": 0.1, "aggregate_gbps": 1.0, "raw_read_gbps": 2.0,
         "problems": ["rank 0: w holds 1 NaN/Inf values in the checkpoint (s); the file is corrupt"]}
    b = dict(a, ranks=[1], bytes_planned={"1": 10}, bytes_loaded={"1": 10}, device_bytes_used={"1": 10},
             seconds={"1": 1.0}, gbps={"1": 1.0},
             problems=["rank 1: w holds 1 NaN/Inf values in the checkpoint (s); the file is corrupt",
                       "rank 1: v checksum differs from the source bytes"])
    m = merge_load_reports([a, b])
    assert m["problems"] == ["ranks 0-1: w holds 1 NaN/Inf values in the checkpoint (s); the file is corrupt",
                             "rank 1: v checksum differs from the source bytes"]
    assert merge_load_reports([a])["problems"] == a["problems"]
