"""Distributed launcher, watchdog, and the TP/EP forward on k3-tiny (gloo, 2 processes)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from k3rocm.runtime import dist


def _sum_ranks(ctx, n):
    t = torch.arange(n, dtype=torch.float32) * (ctx.rank + 1)
    dist.all_reduce(t, ctx)
    g = dist.all_gather_cat(torch.tensor([float(ctx.rank)]), ctx)
    return {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend, "sum": t.tolist(),
            "gather": g.tolist(), "pid": os.getpid()}


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose\nsecond line")
    dist.all_reduce(torch.ones(1), ctx)  # rank 0 blocks in a collective its peer never joins
    return ctx.rank


def _die_on_rank1(ctx):
    if ctx.rank == 1:
        os._exit(7)
    time.sleep(60)
    return ctx.rank


def _hang(ctx):
    if ctx.rank == 0:
        time.sleep(60)
    return ctx.rank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill 0; read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_launch_all_reduce_gloo():
    out = dist.launch(_sum_ranks, 2, args=(4,), backend="gloo", timeout_s=60)
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert o["world"] == 2 and o["backend"] == "gloo"
        assert o["sum"] == [0.0, 3.0, 6.0, 9.0]  # (1 + 2) * arange(4)
        assert o["gather"] == [0.0, 1.0]
    assert out[0]["pid"] != out[1]["pid"] != os.getpid()


def _children_of_me() -> set[int]:
    import multiprocessing as mp
    return {p.pid for p in mp.active_children()}


def test_worker_exception_stops_everyone():
    t = time.monotonic()
    with pytest.raises(dist.WorkerFailed) as ei:
        dist.launch(_raise_on_rank1, 2, backend="gloo", timeout_s=30)
    msg = str(ei.value)
    assert "\n" not in msg and "rank 1" in msg and "ValueError: boom on purpose" in msg
    assert "ValueError" in ei.value.worker_traceback
    assert time.monotonic() - t < 25  # did not wait for the collective timeout
    assert not _children_of_me()


def test_worker_death_is_reported():
    with pytest.raises(dist.WorkerFailed, match=r"rank 1 exited with code 7"):
        dist.launch(_die_on_rank1, 2, backend="gloo", timeout_s=30)
    assert not _children_of_me()


def test_hang_is_ended_by_deadline():
    t = time.monotonic()
    with pytest.raises(dist.WorkerFailed, match=r"ranks \[0\] hung"):
        dist.launch(_hang, 2, backend="gloo", timeout_s=5, deadline_s=4)
    assert time.monotonic() - t < 20
    assert not _children_of_me()


def test_init_without_env_is_clear(monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(dist.HardwareError, match="torchrun"):
        dist.init("gloo")
    assert not dist.under_torchrun()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert dist.under_torchrun()
