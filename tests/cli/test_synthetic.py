"""``validate`` / ``bench --synthetic``: random weights of one rank, no checkpoint; bad options are one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from k3rocm.cli.main import cli

torch.set_num_threads(1)


def run(args, code=0):
    r = CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "200"})
    assert r.exit_code == code, (args, r.exit_code, r.output, r.exception)
    return r


def one_error(r) -> str:
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("k3rocm: ")]
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return err[0]


def test_validate_forward_reads_no_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("K3ROCM_CACHE", str(tmp_path / "cache"))  # the embedded checkpoint would be written here
    out = tmp_path / "r"
    r = run(["validate", "--synthetic", "--profile", "cpu", "--tp", "2", "--ep", "2", "--rank", "1", "--out", out])
    assert "RANDOM WEIGHTS" in r.output
    assert not (tmp_path / "cache").exists()
    rep = json.loads((out / "report.json").read_text())
    assert "RANDOM WEIGHTS" in json.dumps(rep)
    assert "RANDOM WEIGHTS" in (out / "report.md").read_text()
    # on the profile's own hardware (cpu here) the report and the console still say why every row is a fallback
    why = "--synthetic: every measurement is measured-fallback even on the profile's hardware"
    assert why in r.output and why in (out / "report.md").read_text()
    assert set(rep["stages"]) == {"env", "load", "forward"}  # --synthetic stops at forward by default
    world = next(e for e in rep["stages"]["forward"]["evidence"] if e["name"] == "dist.world")
    # rank 1 of TP2/EP2 ran alone: the layout's other rank never ran, so its world is not a measurement
    assert world["value"] == 2 and world["level"] == "projected" and "only rank 1 ran" in world["detail"]


@pytest.mark.parametrize("args,words", [
    (["validate", "--rank", "1"], "needs --synthetic"),
    (["bench", "--tp", "2"], "needs --synthetic"),
    (["validate", "--synthetic", "--level", "correctness"], "random weights"),
    (["validate", "--synthetic", "--level", "performance"], "random weights"),
    (["validate", "--synthetic", "--profile", "cpu", "--tp", "2", "--ep", "2", "--rank", "2", "--level", "forward"],
     "ranks 0..1"),
    (["bench", "--synthetic", "--preset", "k3-tiny", "--checkpoint", "."], "not both"),
    (["bench", "--synthetic", "--preset", "nope", "--profile", "cpu"], "unknown preset"),
    (["bench", "--synthetic", "--checkpoint", "/nonexistent"], "config.json"),
    (["bench", "--synthetic", "--endpoint", "http://127.0.0.1:9"], "drop one"),
    (["validate", "--synthetic", "--profile", "cpu", "--tp", "3", "--level", "forward"], "3"),
    # a rank outside the layout is named even where the layout does not fit the device either
    (["bench", "--synthetic", "--preset", "k3", "--profile", "cpu", "--tp", "16", "--ep", "16", "--rank", "99"],
     "ranks 0..15"),
])
def test_bad_options_are_one_line(tmp_path, args, words):
    r = CliRunner().invoke(cli, args + ["--out", str(tmp_path / "r")], env={"COLUMNS": "200"})
    assert r.exit_code != 0
    assert words in one_error(r)
    assert not (tmp_path / "r").exists()


def test_min_fraction_and_performance_with_synthetic_agree(tmp_path):
    """--min-fraction cannot be honoured with --synthetic at any level, so its refusal says so instead of suggesting
    --level performance (which is refused next); that refusal gives the performance tier's own reason (it runs
    only after correctness passes), not the correctness tier's."""
    for args in (["--min-fraction", "0.5"], ["--min-fraction", "0.5", "--level", "performance"]):
        r = CliRunner().invoke(cli, ["validate", "--synthetic", *args, "--out", str(tmp_path / "r")],
                               env={"COLUMNS": "200"})
        line = one_error(r)
        assert r.exit_code == 2 and "--min-fraction with --synthetic" in line and "drop --min-fraction" in line, line
        assert "add --level performance" not in line
    r = CliRunner().invoke(cli, ["validate", "--synthetic", "--level", "performance", "--out", str(tmp_path / "r")],
                           env={"COLUMNS": "200"})
    line = one_error(r)
    assert "runs only after the correctness tier passes" in line and "bench --synthetic" in line, line
    assert not (tmp_path / "r").exists()


def test_a_synthetic_ranks_breakdown_says_its_collectives_were_counted_not_run(tmp_path):
    # one rank of TP2 alone: the collectives family of the step breakdown is the counting and a sync, and says so
    out = tmp_path / "r"
    run(["bench", "--synthetic", "--preset", "k3-tiny", "--profile", "cpu", "--tp", "2", "--ep", "2", "--rank", "1",
         "--concurrency", "2", "--num-prompts", "2", "--warmups", "0", "--input-len", "6", "--output-len", "3",
         "--out", out])
    ev = {e["name"]: e for e in json.loads((out / "report.json").read_text())["stages"]["bench"]["evidence"]}
    row = ev["c2.breakdown.decode.collectives"]
    assert "counts its collectives without running them" in row["detail"]
    assert "counts its collectives" not in ev["c2.breakdown.decode.KDA"]["detail"]


def test_help_names_synthetic():
    for cmd in ("validate", "bench"):
        out = run([cmd, "--help"]).output
        assert "--synthetic" in out and "--rank" in out and "RANDOM" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_forward_of_one_full_width_rank_on_the_gpu(tmp_path):
    """One rank of k3-prefix-2 at TP16/EP16 (full widths) on the selected kernels: the forward tier passes."""
    out = tmp_path / "r"
    r = run(["validate", "--level", "forward", "--synthetic", "--preset", "k3-prefix-2", "--profile", "h200-8",
             "--tp", "16", "--ep", "16", "--rank", "3", "--out", out])
    assert "RANDOM WEIGHTS" in r.output
    rep = json.loads((out / "report.json").read_text())
    assert "RANDOM WEIGHTS" in json.dumps(rep)


def test_does_not_fit_hint_counts_nodes_of_the_profile_as_written(tmp_path):
    """A synthetic layout wider than the profile stretches its device count to the layout; the "try more GPUs" hint
    still counts nodes of the profile as written (h100-8: tp=32 is 4 nodes of 8), and a profile file is named by
    its path, not as a shipped hwprofiles/ file."""
    r = CliRunner().invoke(cli, ["bench", "--synthetic", "--preset", "k3", "--profile", "h100-8", "--tp", "16",
                                 "--ep", "16", "--out", str(tmp_path / "r")], env={"COLUMNS": "200"})
    msg = one_error(r)
    assert r.exit_code != 0 and "does not fit" in msg
    assert "on 4 nodes under torchrun" in msg and "one node of 8" in msg and "hwprofiles/h100-8.toml" in msg
    from importlib import resources

    src = (resources.files("k3rocm.hwprofiles") / "h100-8.toml").read_text()
    f = tmp_path / "h100-16.toml"
    f.write_text(src.replace("count = 8", "count = 16"))
    r = CliRunner().invoke(cli, ["plan", "--preset", "k3", "--profile", str(f), "--tp", "16", "--ep", "16"],
                           env={"COLUMNS": "200"})
    msg = one_error(r)
    assert r.exit_code != 0 and "on 2 nodes under torchrun" in msg and f"a copy of {f.resolve()}" in msg
    assert "hwprofiles//" not in msg and ".toml.toml" not in msg


def test_a_rank_outside_a_layout_without_ep_names_the_effective_ep(tmp_path):
    """--tp 2 without --ep: the EP is plan's default (the profile's where it divides --tp: the cpu profile's 1),
    the same layout `plan --tp 2` shows, and never "EPNone"."""
    r = CliRunner().invoke(cli, ["bench", "--synthetic", "--tp", "2", "--rank", "5", "--out", str(tmp_path / "r")],
                           env={"COLUMNS": "200"})
    line = one_error(r)
    assert r.exit_code == 2 and line == "error: --rank 5 is not a rank of the TP2/EP1 layout (ranks 0..1)", line
