"""`make demo`'s three commands, run as the installed console script on the embedded k3-tiny."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _k3rocm() -> list[str]:
    exe = Path(sys.executable).parent / "k3rocm"
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "from k3rocm.cli.main import main; main()"]


def _demo_commands() -> list[list[str]]:
    """The demo's commands as the Makefile spells them (so a Makefile change is noticed here)."""
    mk = (ROOT / "Makefile").read_text()
    body = mk.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    cmds = [ln.strip().split()[1:] for ln in body.splitlines() if "$(BIN)/k3rocm" in ln]
    assert [c[0] for c in cmds] == ["load", "validate", "bench"], cmds
    return cmds


def test_demo_end_to_end(tmp_path):
    env = dict(os.environ, K3ROCM_CACHE=str(tmp_path / "cache"), COLUMNS="200")
    env.pop("OMP_NUM_THREADS", None)
    report = tmp_path / "reports" / "demo"
    for cmd in _demo_commands():
        args = [str(report) if a == "$(REPORT)" else a for a in cmd]
        r = subprocess.run(_k3rocm() + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
        assert f"report: {report}/report.html" in r.stdout
    rep = json.loads((report / "report.json").read_text())
    assert rep["status"] == "passed"
    assert list(rep["stages"]) == ["env", "load", "forward", "correctness", "performance", "bench"]
    assert all(s["status"] == "passed" for s in rep["stages"].values())
    assert [h["command"].split()[1] for h in rep["history"]] == ["load", "validate", "bench"]
    repro = rep["reproduction"]
    assert repro["checkpoint"] == str(tmp_path / "cache" / "k3-tiny-v1")
    assert len(repro["shards"]) >= 1 and repro["config_hash"] and repro["software"]["torch"]
    assert set(repro["stage_seconds"]) == set(rep["stages"])
    html = (report / "report.html").read_text()
    assert len(re.findall(r"<svg", html)) >= 4
    bench = {e["name"]: e for e in rep["stages"]["bench"]["evidence"]}
    conc = [k.split(".")[0] for k in bench if k.endswith(".completed")]
    assert len(conc) == 1 and bench[f"{conc[0]}.failed"]["value"] == 0
    n = int(conc[0][1:])
    assert bench[f"{conc[0]}.completed"]["value"] == 10 * n  # default num-prompts = 10 x concurrency


@pytest.mark.parametrize("cmd", [["--help"], ["validate", "--help"]])
def test_console_script_runs(cmd, tmp_path):
    r = subprocess.run(_k3rocm() + cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and ("Examples:" in r.stdout or "Exit codes" in r.stdout)
