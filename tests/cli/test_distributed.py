"""The three jobs across ranks through the command line, as a user runs them: a cpu profile file whose
[parallel] section asks for N ranks starts N gloo processes (rank 0 is the command); torchrun starts them
across "nodes" on localhost. Each run is a real subprocess of `python -m k3rocm.cli`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3rocm.runtime.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
CPU_PROFILE = ROOT / "hwprofiles" / "cpu.toml"


def _profile(tmp_path: Path, ranks: int) -> Path:
    text = CPU_PROFILE.read_text().replace("tp = 1", f"tp = {ranks}").replace("ep = 1", f"ep = {ranks}")
    p = tmp_path / f"cpu-tp{ranks}.toml"
    p.write_text(text)
    return p


def _env(cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(K3ROCM_CACHE=str(cache), OMP_NUM_THREADS="1", COLUMNS="200", PYTHONUNBUFFERED="1", **extra)
    return env


def _k3(args, env, timeout=300, check=True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "k3rocm.cli", *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, (args, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r


def _rows(report: Path, stage: str) -> dict:
    rep = json.loads((report / "report.json").read_text())
    return {e["name"]: e for e in rep["stages"][stage]["evidence"]}


BENCH = ["bench", "--concurrency", "1,4", "--input-len", "24", "--output-len", "6", "--num-prompts", "6",
         "--warmups", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("k3rocm-cache")


@pytest.fixture(scope="module")
def one_process(cache, tmp_path_factory):
    """The reference: the same benchmark load served by one process."""
    out = tmp_path_factory.mktemp("one")
    _k3([*BENCH, "--out", out], _env(cache))
    rows = _rows(out, "bench")
    return {c: rows[f"c{c}.outputs_sha256"]["value"] for c in (1, 4)}


@pytest.mark.parametrize("ranks", [2, 4])
def test_profile_file_with_n_ranks_runs_the_three_jobs(tmp_path, cache, one_process, ranks):
    """load, validate --level performance and bench --concurrency 1,4 on N gloo ranks: every tier passes, each
    rank loads only its slice, the report says world N, and the served tokens equal one process's."""
    prof, out, env = _profile(tmp_path, ranks), tmp_path / "r", _env(cache)
    _k3(["load", "--profile", prof, "--out", out], env)
    load = _rows(out, "load")
    assert {f"bytes[rank {k}]" for k in range(ranks)} <= set(load)
    assert all(load[f"bytes[rank {k}]"]["passed"] for k in range(ranks))
    assert "2 rank" in load["load.seconds"]["detail"] or f"{ranks} rank" in load["load.seconds"]["detail"]
    _k3(["validate", "--level", "performance", "--profile", prof, "--out", out], env)
    rep = json.loads((out / "report.json").read_text())
    assert all(rep["stages"][t]["status"] == "passed" for t in ("load", "forward", "correctness", "performance"))
    _k3([*BENCH, "--profile", prof, "--out", out], env)
    bench = _rows(out, "bench")
    assert bench["dist.world"]["value"] == ranks and bench["dist.layout"]["value"] == f"TP{ranks}/EP{ranks}"
    # every rank ran: the layout is measured here (the cpu profile on this CPU), not projected
    perf = _rows(out, "performance")
    for rows in (bench, perf):
        assert rows["dist.layout"]["level"] == rows["dist.world"]["level"] == "measured", rows["dist.layout"]
        assert "alone" not in rows["dist.layout"]["detail"]
    for c in (1, 4):
        assert bench[f"c{c}.outputs_sha256"]["value"] == one_process[c]
    assert bench["c4.collective.moe.bytes_per_step"]["value"] > 0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        f = task / "children"
        if f.exists():
            out += [int(x) for x in f.read_text().split()]
    return out


def _start_bench(tmp_path, cache, **env):
    """A 2-rank bench, returned once its measured phase has begun (its progress says so), with rank 1's pid."""
    prof, out, log = _profile(tmp_path, 2), tmp_path / "r", tmp_path / "stderr.log"
    args = ["bench", "--concurrency", "4", "--input-len", "24", "--output-len", "200", "--num-prompts", "40",
            "--warmups", "1", "--profile", prof, "--out", out]
    err = log.open("w")
    p = subprocess.Popen([sys.executable, "-m", "k3rocm.cli", *map(str, args)], env=_env(cache, **env),
                         stdout=subprocess.DEVNULL, stderr=err, text=True)
    p.err_file, p.err_path = err, log
    t0 = time.monotonic()
    while time.monotonic() - t0 < 240 and "measured:" not in log.read_text() and p.poll() is None:
        time.sleep(0.5)
    assert p.poll() is None and "measured:" in log.read_text(), log.read_text()[-2000:]
    follower = next(k for k in _children(p.pid)
                    if "spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace"))
    return p, follower, out


def _ends_with_one_line(p, within: float):
    try:
        p.wait(timeout=within)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"the run did not end within {within} s")
    p.err_file.close()
    lines = [x for x in p.err_path.read_text().strip().splitlines() if x.startswith("error:")]
    return p.returncode, lines


def _no_orphans(pid: int) -> None:
    time.sleep(1.0)
    left = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _ppid(int(d.name)) == pid]
    assert not left, left


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_a_killed_rank_mid_bench_is_one_line_and_leaves_nothing_running(tmp_path, cache):
    p, follower, out = _start_bench(tmp_path, cache)
    os.kill(follower, signal.SIGKILL)
    code, lines = _ends_with_one_line(p, 60)
    assert code == 3 and len(lines) == 1 and "rank 1" in lines[0] and "signal" in lines[0], lines
    _no_orphans(p.pid)
    rep = json.loads((out / "report.json").read_text())
    assert rep["stages"]["bench"]["status"] != "passed" and "rank 1" in (rep["stages"]["bench"]["error"] or "")


def test_a_hung_rank_mid_bench_ends_at_the_collective_timeout(tmp_path, cache):
    p, follower, out = _start_bench(tmp_path, cache, K3ROCM_DIST_TIMEOUT="6")
    os.kill(follower, signal.SIGSTOP)
    try:
        code, lines = _ends_with_one_line(p, 90)
    finally:
        try:
            os.kill(follower, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code == 3 and len(lines) == 1 and "hung" in lines[0], lines


def test_torchrun_two_nodes_of_two_processes(tmp_path, cache, one_process):
    """torchrun on localhost as 2 nodes x 2 processes: rank 0 runs the command, ranks 1-3 follow it."""
    pytest.importorskip("torch.distributed.run")
    prof, out, port = _profile(tmp_path, 4), tmp_path / "r", free_port()
    env = _env(cache)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port)]
    job = ["-m", "k3rocm.cli", *BENCH, "--profile", str(prof), "--out", str(out)]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(n), *job], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-1500:] for o in outs]
    bench = _rows(out, "bench")
    assert bench["dist.world"]["value"] == 4
    assert bench["c4.outputs_sha256"]["value"] == one_process[4]


def test_ctrl_c_mid_multi_rank_sweep_keeps_the_finished_points(tmp_path, cache):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) during the second point of a 2-rank
    sweep: exit 130, the finished point and a sweep.interrupted row in the report, no rank left running."""
    prof, out, log = _profile(tmp_path, 2), tmp_path / "r", tmp_path / "stderr.log"
    args = ["bench", "--concurrency", "1,4", "--input-len", "24", "--output-len", "120", "--num-prompts", "8",
            "--warmups", "1", "--profile", prof, "--out", out]
    with log.open("w") as err:
        # Ctrl-C's default disposition in the run, as a terminal's shell gives it: a test process may have been
        # started with SIGINT ignored (a background job of a non-interactive shell), and an ignored SIGINT is
        # inherited across exec, so the run would never see the Ctrl-C (twice on fresh-clone CI runs: rc 0)
        p = subprocess.Popen([sys.executable, "-m", "k3rocm.cli", *map(str, args)], env=_env(cache),
                             stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240 and "c=4 measured:" not in log.read_text() and p.poll() is None:
            time.sleep(0.3)
        assert "c=4 measured:" in log.read_text(), log.read_text()[-1500:]
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=60)
    assert p.returncode == 130, log.read_text()[-1500:]
    rows = _rows(out, "bench")
    assert "c1.outputs_sha256" in rows and "sweep.interrupted" in rows
    _no_orphans(p.pid)


def test_torchrun_with_another_count_than_the_plan_ends_every_rank(tmp_path, cache):
    """3 processes for a 2-rank plan: rank 0 refuses in one line and the other ranks leave at once."""
    prof, port = _profile(tmp_path, 2), free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "k3rocm.cli", "load", "--profile",
           str(prof), "--out", str(tmp_path / "r")]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=_env(cache), capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 25, "the other ranks waited on a rank 0 that had refused"
    assert r.returncode != 0 and "torchrun started 3 processes but the plan has 2 ranks" in r.stderr
