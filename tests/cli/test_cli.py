"""CLI integration on k3-tiny: every command runs, exit codes, one-line errors, report merging."""

from __future__ import annotations

import json
import re
import shutil
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from k3rocm.cli.main import cli
from k3rocm.runtime import registry

from tests.helpers import FakeCompletions

torch.set_num_threads(1)

COMMANDS = [["load"], ["validate"], ["bench"], ["profiles"], ["env"], ["plan"], ["checkpoint", "make"],
            ["checkpoint", "inspect"], ["checkpoint", "verify"], ["kernels", "list"], ["kernels", "isa"]]


def run(args, code=0, env=None):
    # a fixed width: tables must not depend on the terminal (or worker) the suite happens to run in
    r = CliRunner().invoke(cli, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})})
    assert r.exit_code == code, (args, r.exit_code, r.output, r.exception)
    return r


def one_line_error(r) -> str:
    """The run printed exactly one ``error: ...`` line on stderr (besides the ``k3rocm: ...`` progress lines a
    non-terminal stderr gets) and no traceback."""
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("k3rocm: ")]
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return err[0]


def no_gpu():
    return not torch.cuda.is_available()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private user cache for the embedded default checkpoint."""
    monkeypatch.setenv("K3ROCM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_help_teaches():
    top = run(["--help"]).output
    for word in ("load", "validate", "bench", "Exit codes", "--profile mi355x-8"):
        assert word in top
    for cmd in COMMANDS:
        out = run(cmd + ["--help"]).output
        assert "Examples:" in out and "k3rocm " + cmd[0] in out, cmd


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["plan", "--preset", "k3", "--profile", "mi355x-8"]])
def test_help_and_a_preset_plan_import_neither_torch_nor_triton(args):
    """Help and a plan of a preset need no torch (~1.2 s to import) and no Triton: the commands import them where
    they use them."""
    code = ("import sys\nfrom k3rocm.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("heavy: []"), r.stdout[-300:]


def _plan_with_env(name: str, value: str) -> str:
    """``plan`` run with ``$name=value``: it must stop before it works, one ``error:`` line naming the variable, exit
    2, nothing on stdout. Returns that line."""
    env = dict(os.environ, **{name: value})
    r = subprocess.run([sys.executable, "-c", "from k3rocm.cli.main import main; main()", "plan", "--preset", "k3",
                        "--profile", "mi355x-8"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout[-300:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}="), r.stderr
    return lines[0]


@pytest.mark.parametrize("value", ["not-a-sha", "abc12", "g" * 40, "0123456789abcdef0123456789abcdef012345678"])
def test_malformed_source_commit_is_one_line_exit_2(value):
    """A malformed $K3ROCM_SOURCE_COMMIT stops every command before it works (not when its report is written)."""
    assert "hex" in _plan_with_env("K3ROCM_SOURCE_COMMIT", value)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan"])
def test_malformed_dist_timeout_is_one_line_exit_2(value):
    """A malformed $K3ROCM_DIST_TIMEOUT stops every command before it works, one process or many (it was parsed only
    when a multi-rank run started, as a ValueError traceback, and ignored otherwise)."""
    assert "seconds" in _plan_with_env("K3ROCM_DIST_TIMEOUT", value)


@pytest.mark.parametrize("value", ["yes", "true", "2", "off"])
def test_malformed_tune_setting_is_one_line_exit_2(value):
    """$K3ROCM_TUNE is 1 or 0: anything else stops every command before it works (``yes`` used to mean off,
    silently)."""
    assert "must be 1" in _plan_with_env("K3ROCM_TUNE", value)


@pytest.mark.parametrize("cmd", [["checkpoint", "make"], ["plan"], ["bench"], ["validate"]])
def test_every_preset_option_lists_every_preset(cmd):
    """The --preset help of each command comes from one list (k3rocm.config.PRESETS): none lacks a preset."""
    from k3rocm.config import PRESETS

    text = "".join(run(cmd + ["--help"]).output.split())  # help text wraps, even inside a name
    missing = [p for p in PRESETS if p not in text]
    assert not missing, (cmd, missing)


def test_profiles_env_and_kernels_list():
    table = run(["profiles"]).output
    assert "mi355x-8" in table
    # the CPU profile's figures are not datasheet ones, and its 0.1 TFLOP/s assumption is not printed as 0
    cpu_row = next(line for line in table.splitlines() if line.strip("│ ").startswith("cpu "))
    assert "0.10" in cpu_row and "peaks assumed" in cpu_row and "memory detected" in cpu_row, cpu_row
    mi = next(line for line in table.splitlines() if line.strip("│ ").startswith("mi355x-8"))
    assert "datasheet" in mi and "assumed" not in mi, mi
    prof = json.loads(run(["profiles", "--json"]).output)
    assert {p["name"] for p in prof} >= {"cpu", "mi355x-8", "h200-1"}
    assert "backend" in run(["env"]).output
    out = run(["kernels", "list"]).output
    for op in registry.ORACLE_OPS:
        assert op in out
    assert "aiter: a registry slot with no kernels wired in yet" in out  # the README's aiter slot is visible
    one_line_error(run(["kernels", "list", "--kernels", "bogus"], code=2))


def test_profiles_and_plan_show_hbm_in_the_same_unit():
    """288 GiB per MI355X: `profiles` once showed "HBM GiB 288" where `plan` shows "309.2 GB"; both say GB now."""
    table = run(["profiles"]).output
    assert "HBM GB" in table and "HBM GiB" not in table
    mi = next(line for line in table.splitlines() if line.strip("│ ").startswith("mi355x-8"))
    assert "309.2" in mi.split("│")[5], mi  # the HBM column (name, device, arch, GPUs, HBM)
    plan_out = run(["plan", "--preset", "k3", "--profile", "mi355x-8"]).output
    assert "309.2 GB" in plan_out


@pytest.mark.skipif(not no_gpu(), reason="checks the CPU-only answer")
def test_env_profile_mismatch_is_exit_3():
    line = one_line_error(run(["env", "--profile", "mi355x-8"], code=3))
    assert "gfx950" in line and "cpu" in line


def test_plan_fits_and_does_not_fit(cache):
    out = run(["plan", "--preset", "k3", "--profile", "mi355x-8"]).output
    assert "fits: yes" in out and "784..895" in out  # EP: 112 experts per rank
    r = run(["plan", "--preset", "k3", "--profile", "mi300x-8"], code=2)
    line = one_line_error(r)
    assert "does not fit mi300x-8" in line and "GB" in line
    assert "NO" in r.stdout  # the table with the numbers was printed first
    d = json.loads(run(["plan", "--preset", "k3", "--profile", "mi355x-8", "--json"]).output)
    assert d["tp"] == 8 and d["fits"] is True
    assert "fits: yes" in run(["plan"]).output  # the embedded default, written into the private cache
    assert (cache / "k3-tiny-v1" / "config.json").is_file()


def test_kernels_isa_one_family():
    out = run(["kernels", "isa", "--target", "gfx950", "--family", "mx"]).output
    assert "gfx950" in out


def test_checkpoint_make_inspect_verify(tmp_path):
    d = tmp_path / "ck"
    assert "wrote k3-tiny" in run(["checkpoint", "make", "--out", d, "--seed", "3"]).output
    doc = json.loads(run(["checkpoint", "inspect", "--checkpoint", d, "--json"]).output)
    assert doc["tensors"] == doc["tensors_expected"] == 1492 and doc["official"] is False
    one_line_error(run(["checkpoint", "verify", "--checkpoint", d], code=2))  # no manifest yet
    run(["checkpoint", "verify", "--checkpoint", d, "--write-manifest"])
    assert "every file k3rocm-manifest.json lists matches it" in run(["checkpoint", "verify", "--checkpoint", d]).output
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.chmod(0o644)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert shard.name in one_line_error(run(["checkpoint", "verify", "--checkpoint", d], code=2))
    # --write-manifest never vouches for files its existing manifest says changed, unless --force
    before = (d / "k3rocm-manifest.json").read_bytes()
    line = one_line_error(run(["checkpoint", "verify", "--checkpoint", d, "--write-manifest"], code=2))
    assert "not replacing it" in line and "--force" in line and shard.name in line
    assert (d / "k3rocm-manifest.json").read_bytes() == before
    one_line_error(run(["checkpoint", "verify", "--checkpoint", d, "--force"], code=2))  # --force alone
    assert "no longer matched" in run(["checkpoint", "verify", "--checkpoint", d, "--write-manifest", "--force"]).output
    assert "every file k3rocm-manifest.json lists matches it" in run(["checkpoint", "verify", "--checkpoint", d]).output
    (d / "config.json").write_text("{")  # nor for a checkpoint whose config / headers do not parse
    one_line_error(run(["checkpoint", "verify", "--checkpoint", d, "--write-manifest", "--force"], code=2))
    one_line_error(run(["checkpoint", "make", "--out", d], code=2))  # refuses a non-empty directory


def test_expected_failures_are_one_line(golden_ckpt, tmp_path):
    out = tmp_path / "r"
    line = one_line_error(run(["load", "--checkpoint", tmp_path / "missing", "--out", out], code=2))
    assert "does not exist" in line
    line = one_line_error(run(["validate", "--profile", "nope", "--checkpoint", golden_ckpt, "--out", out], code=2))
    assert "mi355x-8" in line  # lists the known profiles
    one_line_error(run(["bench", "--concurrency", "0,x", "--checkpoint", golden_ckpt, "--out", out], code=2))
    one_line_error(run(["validate", "--golden", tmp_path / "nope.safetensors", "--checkpoint", golden_ckpt,
                        "--out", out], code=2))
    # a broken checkpoint: a shard cut short
    d = tmp_path / "broken"
    shutil.copytree(golden_ckpt, d)
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:1000])
    line = one_line_error(run(["load", "--checkpoint", d, "--out", out], code=2))
    assert shard.name in line
    # a config.json that is a directory is named as such (not "no config.json"), for load and --synthetic alike
    c = tmp_path / "cfgdir"
    shutil.copytree(golden_ckpt, c)
    (c / "config.json").unlink()
    (c / "config.json").mkdir()
    for args in (["load"], ["bench", "--synthetic"]):
        line = one_line_error(run([*args, "--checkpoint", c, "--out", out], code=2))
        assert f"{c / 'config.json'}: is a directory, not a file" in line, line
    # --debug shows the traceback of the same failure
    r = run(["load", "--checkpoint", d, "--out", out, "--debug"], code=2)
    assert "Traceback" in r.output
    # bad input is refused before any tier runs: no report is written (or an existing one overwritten)
    assert not (out / "report.json").exists()


@pytest.mark.skipif(not no_gpu(), reason="checks the CPU-only answer")
def test_triton_without_gpu_is_exit_3(golden_ckpt, tmp_path):
    line = one_line_error(run(["validate", "--level", "forward", "--kernels", "triton", "--checkpoint", golden_ckpt,
                               "--out", tmp_path], code=3))
    assert "GPU" in line


def test_commands_merge_into_one_report(golden_dir, tmp_path):
    ck, out = golden_dir / "checkpoint", tmp_path / "rep"
    run(["load", "--checkpoint", ck, "--out", out])
    run(["validate", "--level", "correctness", "--checkpoint", ck, "--out", out,
         "--golden", golden_dir / "golden.safetensors"])
    r = run(["bench", "--checkpoint", ck, "--out", out, "--concurrency", "1,2", "--input-len", "8",
             "--output-len", "4", "--num-prompts", "2", "--warmups", "1"])
    assert "median_tpot_ms" in r.output and "c=2" in r.output  # one table, a column per point
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema"] == "k3rocm.report/1" and rep["status"] == "passed"
    assert list(rep["stages"]) == ["env", "load", "forward", "correctness", "bench"]
    assert [h["stages"] for h in rep["history"]] == [["env", "load"], ["env", "load", "forward", "correctness"],
                                                     ["bench"]]
    assert rep["reproduction"]["kernel_selection"]["moe_experts"] == "torch"
    roof = rep["stages"]["bench"]["series"]["roofline"]
    assert roof["x"] == [1, 2] and {"all steps", "decode-only steps"} <= set(roof["y"])
    assert all(0.0 < v < 1.0 for v in roof["y"]["all steps"])
    ev = {e["name"]: e for e in rep["stages"]["bench"]["evidence"]}
    assert ev["c1.completed"]["value"] == 2 and ev["c2.completed"]["value"] == 2
    levels = rep["evidence_levels"]
    assert levels["measured"] > 0 and levels["projected"] > 0 and levels["external"] > 0
    html = (out / "report.html").read_text()
    assert html.count("<svg") >= 4 and "external" in html
    assert "| bench |" in (out / "report.md").read_text()


def test_wrong_kernel_fails_validate_with_exit_1(golden_ckpt, tmp_path, monkeypatch):
    good = registry.implementations("attn_res_norm")["torch"].fn
    saved = registry._REGISTRY.get("attn_res_norm", {}).get("torch")
    # an AttnRes kernel that drops the current block's prefix weight a little: a plausible softmax bug
    registry.register("attn_res_norm", "torch",
                      lambda bank, rows, pre, w, *a, **k: good(bank, rows, pre, w * 0.5, *a, **k))
    try:
        r = run(["validate", "--checkpoint", golden_ckpt, "--out", tmp_path], code=1)
    finally:
        if saved is None:
            registry._REGISTRY["attn_res_norm"].pop("torch")
        else:
            registry._REGISTRY["attn_res_norm"]["torch"] = saved
    line = one_line_error(r)
    assert line.startswith("error: correctness tier failed")
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["status"] == "failed" and rep["stages"]["correctness"]["status"] == "failed"


def test_bench_against_an_openai_endpoint(cache, tmp_path, fake_server):
    """`bench --endpoint` drives another server with the same load and labels its figures `external`."""
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    out = tmp_path / "r"
    run(["bench", "--endpoint", url, "--endpoint-gpus", "1", "--model", "k3", "--concurrency", "2", "--num-prompts", "4",
         "--warmups", "1", "--input-len", "16", "--output-len", "5", "--out", out])
    seen = FakeCompletions.seen
    assert len(seen) == 5 and all(p == "/v1/completions" for p, _ in seen)
    body = seen[-1][1]
    assert body["model"] == "k3" and body["stream"] and 4 <= body["max_tokens"] <= 5
    assert all(0 <= t < 163840 for t in body["prompt"]) and 12 <= len(body["prompt"]) <= 16
    rep = json.loads((out / "report.json").read_text())
    rows = rep["stages"]["bench"]["evidence"]
    assert rows and {e["level"] for e in rows if e["name"].startswith("c2.")} == {"external"}
    done = [e for e in rows if e["name"] == "c2.completed"]
    assert done and done[0]["value"] == 4


def test_bench_endpoint_failures_say_why(cache, tmp_path):
    """A server that answers every request with HTTP 500: exit 3, and the line and the report say why."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Broken(BaseHTTPRequestHandler):
        def do_GET(self):  # the reachability probe
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"model overloaded")

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "r"
        r = run(["bench", "--endpoint", f"http://127.0.0.1:{srv.server_address[1]}", "--endpoint-gpus", "1",
                 "--concurrency", "1", "--num-prompts", "2", "--warmups", "0", "--input-len", "8", "--output-len", "2",
                 "--out", out], code=3)
    finally:
        srv.shutdown()
        srv.server_close()
    line = one_line_error(r)
    assert "none of 2 requests" in line and "HTTP 500" in line and "model overloaded" in line
    rows = json.loads((out / "report.json").read_text())["stages"]["bench"]["evidence"]
    assert any(e["name"] == "c1.failed" and "2 x" in e["detail"] and "HTTP 500" in e["detail"] for e in rows)


def test_bench_endpoint_bad_url_is_one_line(cache, tmp_path):
    one_line_error(run(["bench", "--endpoint", "ftp://nowhere", "--out", tmp_path / "r"], code=2))


def test_bad_sizes_and_unwritable_out_fail_before_any_work(cache, tmp_path, golden_ckpt):
    """One line, exit 2, and an existing report left as it was."""
    out = tmp_path / "r"
    run(["load", "--checkpoint", golden_ckpt, "--out", out])
    before = (out / "report.json").read_text()
    for args in (["bench", "--output-len", "-5"], ["bench", "--input-len", "0"], ["bench", "--concurrency", ""]):
        one_line_error(run([*args, "--checkpoint", golden_ckpt, "--out", out], code=2))
    assert (out / "report.json").read_text() == before
    assert oct((out / "report.json").stat().st_mode & 0o777) == oct(0o644)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = one_line_error(run(["load", "--checkpoint", golden_ckpt, "--out", blocker / "sub"], code=2))
    assert "--out" in line
    one_line_error(run(["plan", "--preset", "k3", "--profile", "mi355x-8", "--context-len", "-5"], code=2))
    one_line_error(run(["checkpoint", "make", "--preset", "k3-tiny", "--out", blocker / "ck"], code=2))


def test_plan_of_a_broken_checkpoint_is_refused(tmp_path, golden_ckpt):
    d = tmp_path / "broken"
    shutil.copytree(golden_ckpt, d)
    (d / "model-00002-of-000002.safetensors").unlink()
    line = one_line_error(run(["plan", "--checkpoint", d, "--profile", "cpu"], code=2))
    assert "model-00002-of-000002.safetensors" in line


def test_load_prints_the_plan_before_loading_and_the_proof_after(golden_ckpt, tmp_path):
    out = run(["load", "--checkpoint", golden_ckpt, "--out", tmp_path / "r"]).output
    plan_at, tiers_at, proof_at = out.find("plan: k3-tiny"), out.find("tier"), out.find("tensors match the files read")
    assert 0 <= plan_at < tiers_at < proof_at, out
    assert "per-rank weight bytes" in out and "1,492/1,492" in out and "load / raw" in out


def test_load_without_a_manifest_says_the_files_are_not_checked(golden_ckpt, tmp_path):
    # the load's checksums compare the device copy with the files as read: without a manifest a corrupted file
    # passes them, and the run must say so (console and report), never suggest the files were proven intact
    d = tmp_path / "ck"
    shutil.copytree(golden_ckpt, d)
    (d / "k3rocm-manifest.json").unlink(missing_ok=True)
    out = run(["load", "--checkpoint", d, "--out", tmp_path / "r"]).output
    assert "no k3rocm-manifest.json" in out and "not checked against known hashes" in out
    ev = {e["name"]: e for e in json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["load"]["evidence"]}
    assert ev["manifest.sha256"]["value"] == "absent" and "NOT checked" in ev["manifest.sha256"]["detail"]


@pytest.mark.parametrize("text", ["{not json", '{"format": "other", "files": {}}'])
def test_a_broken_manifest_stops_before_anything_is_printed(golden_ckpt, tmp_path, text):
    """It was found in the load tier, after the plan tables had printed; now the pre-flight check refuses it: one
    line naming the file, exit 2, nothing on stdout, no report."""
    d = tmp_path / "ck"
    shutil.copytree(golden_ckpt, d)
    (d / "k3rocm-manifest.json").write_text(text)
    r = run(["load", "--checkpoint", d, "--out", tmp_path / "r"], code=2)
    line = one_line_error(r)
    assert "k3rocm-manifest.json" in line, line
    # names the command that re-creates it (--force: the broken one cannot be checked against the files)
    assert line.endswith(f"re-create it with `k3rocm checkpoint verify --checkpoint {d} --write-manifest --force` on "
                         "a trusted copy"), line
    assert "plan:" not in r.output and not (tmp_path / "r").exists()
    out = run(["checkpoint", "verify", "--checkpoint", d, "--write-manifest", "--force"]).output
    assert "which could not be read: --force" in out
    assert "every file k3rocm-manifest.json lists matches it" in run(["checkpoint", "verify", "--checkpoint", d]).output


@pytest.mark.parametrize("args,what", [
    (["--input-len", "1000000000"], "sum to at most"),
    (["--concurrency", "1000000", "--num-prompts", "1000000", "--warmups", "0"], "of cache per GPU"),
    (["--num-prompts", "1000000000000000000000"], "--num-prompts"),
    (["--warmups", "100000000"], "--warmups"),
])
def test_bench_loads_the_plan_cannot_hold_are_refused_up_front(cache, tmp_path, args, what):
    line = one_line_error(run(["bench", *args, "--out", tmp_path / "r"], code=2))
    assert what in line
    assert not (tmp_path / "r" / "report.json").exists()


@pytest.mark.parametrize("lens", [("1", "2"), ("3", "2")])
def test_bench_of_a_few_tokens_keeps_its_measurement(cache, tmp_path, lens):
    # a context of a few tokens is too short for the per-step breakdown's requests: the point is measured and
    # reported all the same (it used to fail after measuring: "request of 1 + 6 tokens exceeds max_model_len 4")
    r = run(["bench", "--input-len", lens[0], "--output-len", lens[1], "--concurrency", "1", "--num-prompts", "1",
             "--warmups", "0", "--out", tmp_path / "r"])
    assert "error" not in r.output.lower()
    ev = {e["name"]: e for e in json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["bench"]["evidence"]}
    assert ev["c1.completed"]["value"] == 1 and ev["c1.output_throughput"]["value"] > 0


def test_bench_points_carry_their_budget_and_a_c1_breakdown(cache, tmp_path):
    # each point records the engine's tokens per step; at concurrency 1 the decode step is profiled per op family
    # and the missing mixed step says why (one sequence: no decode row beside a chunk)
    out = run(["bench", "--concurrency", "1,2", "--input-len", "12", "--output-len", "4", "--num-prompts", "2",
               "--warmups", "0", "--max-num-batched-tokens", "24", "--out", tmp_path / "r"]).output
    ev = {e["name"]: e for e in json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["bench"]["evidence"]}
    # the console table: the outputs' digest cut short (the report keeps it whole), the missing mixed step explained
    assert re.fullmatch(r"[0-9a-f]{64}", ev["c1.outputs_sha256"]["value"])
    assert ev["c1.outputs_sha256"]["value"][:12] + "…" in out and ev["c1.outputs_sha256"]["value"] not in out
    assert "note: c=1 breakdown.mixed.wall_ms: not formed (at concurrency 1" in out
    bench = json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["bench"]
    st = {x["name"]: x for x in bench["settings"]}  # the step budget is a setting of the point, not a claim
    assert st["c1.max_num_batched_tokens"]["value"] == 24 and st["c2.max_num_batched_tokens"]["value"] == 24
    assert "c1.max_num_batched_tokens" not in ev and "level" not in st["c1.max_num_batched_tokens"]
    assert ev["c1.breakdown.decode.wall_ms"]["value"] > 0
    assert "1 decode row," in ev["c1.breakdown.decode.wall_ms"]["detail"]
    assert "not comparable with TPOT" in ev["c1.breakdown.decode.wall_ms"]["detail"]
    assert ev["c1.breakdown.mixed.wall_ms"]["value"] == "not formed" and "concurrency 1" in ev["c1.breakdown.mixed.wall_ms"]["detail"]
    assert ev["c2.breakdown.mixed.wall_ms"]["value"] > 0  # a chunk beside one decode row


def test_default_budget_follows_a_larger_concurrency(cache, tmp_path, monkeypatch):
    # without --max-num-batched-tokens, a concurrency above the engine's default budget raises the point's budget
    # to it (every running request's decode row fits a step), and the setting row says what it is; the default
    # is shrunk to 2 here so that concurrency 3 is above it
    import k3rocm.validation.tiers.performance as perf

    monkeypatch.setattr(perf, "MAX_NUM_BATCHED_TOKENS", 2)
    run(["bench", "--concurrency", "2,3", "--input-len", "6", "--output-len", "3", "--num-prompts", "3",
         "--warmups", "0", "--out", tmp_path / "r"])
    bench = json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["bench"]
    st = {x["name"]: x for x in bench["settings"]}
    assert st["c3.max_num_batched_tokens"]["value"] == 3
    assert st["c2.max_num_batched_tokens"]["value"] == 512  # at or below the default: the engine's own
    assert "or the concurrency where that is larger" in st["c3.max_num_batched_tokens"]["detail"]


def test_points_are_reported_in_ascending_concurrency_whatever_the_order_given(cache, tmp_path):
    run(["bench", "--concurrency", "2,1", "--input-len", "6", "--output-len", "3", "--num-prompts", "2",
         "--warmups", "0", "--out", tmp_path / "r"])
    bench = json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["bench"]
    assert bench["series"]["throughput"]["x"] == [1, 2]
    names = [e["name"] for e in bench["evidence"] if e["name"].endswith(".failed")]
    assert names == ["c1.failed", "c2.failed"]
    assert "| c=1 | c=2 |" in (tmp_path / "r" / "report.md").read_text()


def test_min_fraction_makes_speed_a_check(cache, tmp_path):
    # validate --min-fraction F: each concurrency point's fraction of the roofline is a check (the CPU run is far
    # below 0.99 of it: the performance tier fails, naming the row); bad values and levels are one line up front
    r = run(["validate", "--level", "performance", "--min-fraction", "0.99", "--out", tmp_path / "r"], code=1)
    assert "roofline.fraction_min" in r.output and "--min-fraction 0.99" in r.output
    ev = json.loads((tmp_path / "r" / "report.json").read_text())["stages"]["performance"]["evidence"]
    rows = [e for e in ev if e["name"].endswith("roofline.fraction_min")]
    assert rows and all(not e["passed"] and e["level"] == "projected" for e in rows)
    for args in (["--level", "performance", "--min-fraction", "0"], ["--level", "performance", "--min-fraction", "1.5"],
                 ["--min-fraction", "0.5"]):
        one_line_error(run(["validate", *args, "--out", tmp_path / "bad"], code=2))
    assert not (tmp_path / "bad").exists()


def test_an_interrupted_validate_keeps_its_finished_tiers(cache, tmp_path, monkeypatch):
    # Ctrl-C during a tier: the finished tiers and the interrupted one (status error, saying so) are written,
    # exit 130 with one line naming them; an interrupt held while the report is written says it was written whole
    import k3rocm.validation.tiers as T
    from k3rocm.validation.evidence import Stage, info

    def fake(session, level, progress=None, on_stage=None, on_start=None):
        on_start("env")
        st = Stage("env")
        st.add(info("env", "python", "3"))
        on_stage(st)
        on_start("load")
        raise KeyboardInterrupt

    real_tiers = T.run_tiers
    monkeypatch.setattr(T, "run_tiers", fake)
    r = run(["validate", "--out", tmp_path / "r"], code=130)
    assert "interrupted (Ctrl-C) during tier load" in r.output and "1 finished tier(s)" in r.output
    stages = json.loads((tmp_path / "r" / "report.json").read_text())["stages"]
    assert stages["env"]["status"] == "passed"
    assert stages["load"]["status"] == "error" and "interrupted" in stages["load"]["error"]

    import k3rocm.cli.common as C

    real = C.update_report

    def held(*a, **k):  # what render.DeferSignals does: the write completes, then the held Ctrl-C is raised
        real(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "run_tiers", real_tiers)
    monkeypatch.setattr(C, "update_report", held)
    r = run(["load", "--out", tmp_path / "r2"], code=130)
    assert "it was written whole first" in r.output
    assert json.loads((tmp_path / "r2" / "report.json").read_text())["stages"]["load"]["status"] == "passed"


def test_an_early_ctrl_c_says_nothing_was_written(cache, tmp_path, monkeypatch):
    # Ctrl-C before any tier ran (here during the pre-flight check): exit 130, the line says nothing was written,
    # and no --out is left behind (as SIGTERM's line does, below)
    from k3rocm.validation.session import Session

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "preflight", stop)
    line = one_line_error(run(["load", "--out", tmp_path / "a" / "r"], code=130))
    assert line == "error: interrupted (Ctrl-C); nothing was written", line
    assert not (tmp_path / "a").exists()


def test_sigterm_says_where_the_report_is_only_when_one_was_written(cache, tmp_path, monkeypatch):
    """SIGTERM before anything is written: "nothing was written" and no --out left behind; after the report was
    written: the line names it; while it is being written (from creating --out on): held until it is whole."""
    import os
    import signal

    import k3rocm.cli.common as C
    from k3rocm.errors import Terminated
    from k3rocm.validation.session import Session

    def term(*a, **k):
        raise Terminated()

    with monkeypatch.context() as m:  # ended during the pre-flight check: no report, no --out
        m.setattr(Session, "preflight", term)
        line = one_line_error(run(["load", "--out", tmp_path / "a" / "r"], code=143))
    assert line == "error: terminated (SIGTERM); nothing was written", line
    assert not (tmp_path / "a").exists()

    with monkeypatch.context() as m:  # ended after the report was written: the line says where it is
        m.setattr(C, "finish", term)
        line = one_line_error(run(["load", "--out", tmp_path / "b"], code=143))
    assert line == f"error: terminated (SIGTERM); what finished before it is in the report {tmp_path / 'b' / 'report.html'}"

    real = C.reproduction_block

    def signalled(*a, **k):  # SIGTERM after --out was created, before the report is written: held until it is
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(C, "reproduction_block", signalled)
        line = one_line_error(run(["load", "--out", tmp_path / "c"], code=143))
    assert "interrupted (SIGTERM) while the report was written; it was written whole first" in line, line
    assert json.loads((tmp_path / "c" / "report.json").read_text())["stages"]["load"]["status"] == "passed"


def test_sigterm_during_checkpoint_make_leaves_nothing_and_says_so(tmp_path, monkeypatch):
    """checkpoint make writes no report: a SIGTERM while it writes removes the partial files and the parent
    directories it created, and says so (not "what finished is in the report")."""
    import k3rocm.checkpoint.writer as W
    from k3rocm.errors import Terminated

    calls = []

    def tensor(*a, **k):
        calls.append(1)
        if len(calls) > 20:
            raise Terminated()
        return real(*a, **k)

    real = W.random_tensor
    monkeypatch.setattr(W, "random_tensor", tensor)
    line = one_line_error(run(["checkpoint", "make", "--out", tmp_path / "new" / "deeper" / "ck"], code=143))
    assert "report" not in line and "nothing was written (the partial files were removed)" in line, line
    assert len(calls) > 20 and not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []


def test_profile_paths_and_platform_say_what_is_wrong(cache, tmp_path):
    # a profile path that does not exist says so (not "is a path but not a .toml file"); one that exists but is
    # not .toml keeps that line; --platform without a deployment check is refused instead of ignored
    line = one_line_error(run(["plan", "--profile", str(tmp_path / "mi300x-8.toml.bak")], code=2))
    assert "does not exist" in line
    (tmp_path / "p.txt").write_text("x")
    assert "not a .toml file" in one_line_error(run(["plan", "--profile", str(tmp_path / "p.txt")], code=2))
    assert "--deployment-env" in one_line_error(run(["env", "--platform", "cuda"], code=2))


def test_golden_and_kernels_are_checked_before_any_tier(cache, tmp_path):
    bad = tmp_path / "golden.txt"
    bad.write_text("not safetensors")
    one_line_error(run(["validate", "--golden", bad, "--out", tmp_path / "r"], code=2))
    if not torch.cuda.is_available():
        one_line_error(run(["validate", "--kernels", "triton", "--out", tmp_path / "r"], code=3))
    assert not (tmp_path / "r" / "report.json").exists()


def test_no_command_is_a_usage_error():
    """`k3rocm` (or a group such as `k3rocm checkpoint`) with no command prints the help on stderr and exits 2, as
    click does: a script that forgot its command must not pass."""
    for args in ([], ["checkpoint"]):
        r = subprocess.run([sys.executable, "-c", "from k3rocm.cli.main import main; main()", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (args, r.returncode, r.stdout[-300:])
        assert r.stderr.startswith(f"Usage: k3rocm{' ' + args[0] if args else ''} [OPTIONS] COMMAND"), r.stderr[:300]


def test_usage_errors_are_one_line_through_the_console_script(tmp_path):
    """The installed entry point turns click's usage errors into one `error:` line, exit 2."""
    import subprocess
    import sys

    def script(*args):
        return subprocess.run([sys.executable, "-c", "from k3rocm.cli.main import main; main()", *args],
                              capture_output=True, text=True, timeout=120)

    for args in (["validate", "--level", "nosuch"], ["kernels", "isa", "--target", "gfx1234"], ["--bogus"]):
        r = script(*args)
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and "--help" in err[0], r.stderr
    r = script("kernels")  # a group without its command: the help (on stderr), a usage error as click has it
    assert r.returncode == 2 and "isa" in r.stderr and r.stdout == ""
    # an option's missing value points to the subcommand's help, as every other usage error does (it named
    # `k3rocm --help`: click raises it before the subcommand has a context)
    for args, want in ((["load", "--checkpoint"], "`k3rocm load --help`"),
                       (["kernels", "isa", "--target"], "`k3rocm kernels isa --help`")):
        r = script(*args)
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(err) == 1 and "requires an argument" in err[0] and want in err[0], r.stderr


def test_unreachable_endpoint_is_exit_3_one_line(cache, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bind, then close
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = one_line_error(run(["bench", "--endpoint", f"http://127.0.0.1:{port}", "--endpoint-gpus", "1", "--concurrency", "1",
                               "--num-prompts", "1", "--out", tmp_path / "r"], code=3))
    assert "cannot connect" in line and not (tmp_path / "r" / "report.json").exists()


def _tiny_disk(monkeypatch, free: int) -> None:
    """``shutil.disk_usage`` (what the up-front space checks read) reports ``free`` bytes free everywhere."""
    import shutil as sh
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10**12, 10**12 - free, free))


def test_checkpoint_make_refuses_what_the_disk_cannot_hold(tmp_path, monkeypatch):
    """Too little space is the environment's (exit 3, README's exit codes), checked before anything is written,
    with sizes that show the numbers (it said "k3-tiny needs 0.0 GB but ... has 0.0 GB free", exit 2)."""
    _tiny_disk(monkeypatch, 10**6)  # 1 MB free
    line = one_line_error(run(["checkpoint", "make", "--preset", "k3-tiny", "--out", tmp_path / "ck"], code=3))
    assert re.fullmatch(rf"error: {re.escape(str(tmp_path / 'ck'))}: k3-tiny needs \d+\.\d MB but "
                        rf"{re.escape(str(tmp_path))} has 1\.0 MB free; free space there or write it to another disk",
                        line), line
    assert "0.0 GB" not in line and "preset" not in line  # k3-tiny is the smallest: no "smaller preset"
    assert not (tmp_path / "ck").exists() and not list(tmp_path.glob(".ck.tmp-*"))
    line = one_line_error(run(["checkpoint", "make", "--preset", "k3-prefix-1", "--out", tmp_path / "ck"], code=3))
    assert "k3-prefix-1 needs" in line and line.endswith("or choose a smaller preset"), line


def test_embedded_checkpoint_on_a_full_disk_names_the_cache(tmp_path, monkeypatch):
    """No --checkpoint, a cache on a tiny disk: the line names the cache and K3ROCM_CACHE, not the private build
    directory inside it nor a preset the user never gave; exit 3; nothing is created."""
    cache = tmp_path / "small" / "c"
    monkeypatch.setenv("K3ROCM_CACHE", str(cache))
    _tiny_disk(monkeypatch, 2048)
    line = one_line_error(run(["load", "--out", tmp_path / "r"], code=3))
    assert re.fullmatch(rf"error: {re.escape(str(cache))}: the default k3-tiny checkpoint \(written once into the "
                        rf"k3rocm cache\) needs \d+\.\d MB but {re.escape(str(tmp_path))} has 2\.0 KB free; free "
                        rf"space there or set K3ROCM_CACHE to a directory on a disk with room", line), line
    assert ".build-" not in line and "preset" not in line
    assert not (tmp_path / "small").exists() and not (tmp_path / "r" / "report.json").exists()


def test_embedded_checkpoint_running_out_of_space_while_writing(tmp_path, monkeypatch):
    """The disk fills up while the embedded k3-tiny is written: exit 3, the cache named, nothing left behind."""
    import errno

    from k3rocm.checkpoint import writer

    def full(t):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    cache = tmp_path / "cache"
    monkeypatch.setenv("K3ROCM_CACHE", str(cache))
    monkeypatch.setattr(writer, "_bytes_of", full)
    line = one_line_error(run(["checkpoint", "inspect"], code=3))
    assert line == (f"error: {cache}: writing the default k3-tiny checkpoint into the k3rocm cache failed (No space "
                    "left on device); free space there or set K3ROCM_CACHE to a directory on a disk with room"), line
    assert list(cache.iterdir()) == []  # the build directory went


def test_size_text_shows_small_sizes():
    from k3rocm.errors import size_text

    assert [size_text(n) for n in (0, 999, 2048, 6_475_776, 17.2e9, 3.5e12)] == [
        "0 bytes", "999 bytes", "2.0 KB", "6.5 MB", "17.2 GB", "3.5 TB"]


def test_space_check_sizes_that_would_read_the_same_show_bytes(tmp_path, monkeypatch):
    from k3rocm.checkpoint.writer import require_free_space
    from k3rocm.errors import HardwareError

    _tiny_disk(monkeypatch, 1_000_000)
    with pytest.raises(HardwareError, match=r"^x needs 1,040,000 bytes but .* has 1,000,000 bytes free; do y$"):
        require_free_space(1_040_000, tmp_path / "a" / "b", "x", "do y")
    require_free_space(1_000_000, tmp_path, "x", "do y")  # fits exactly: nothing raised


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(golden_ckpt, tmp_path):
    """A long command in a log (CI, batch job) says which tier runs and how far the load got."""
    r = run(["validate", "--checkpoint", golden_ckpt, "--level", "load", "--out", tmp_path])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("k3rocm: ")]
    assert "k3rocm: tier env ..." in lines and "k3rocm: tier load ..." in lines
    assert any(ln.startswith("k3rocm: loading: ") and "(100%)" in ln for ln in lines), r.stderr


def test_plain_progress_is_throttled():
    from k3rocm.cli.common import Progress

    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        with Progress(interval_s=3600) as bar:
            cb = bar.callback("loading")
            for i in range(1, 101):
                cb(i, 100)
            cb(100, 100)
    lines = buf.getvalue().splitlines()
    assert lines == ["k3rocm: loading: 1/100 (1%), 0 s", "k3rocm: loading: 100/100 (100%), 0 s"]


def test_plain_progress_says_a_second_phase_on_the_same_bar():
    # a bar that finished one total and is handed another (a tier's next phase) prints the new phase again
    import contextlib
    import io

    from k3rocm.cli.common import Progress

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        with Progress(interval_s=3600) as bar:
            cb = bar.callback("benchmarking")
            cb(0, 1)
            cb(1, 1)
            cb(0, 4)
            cb(4, 4)
            cb(4, 4)
    assert buf.getvalue().splitlines() == ["k3rocm: benchmarking: 0/1 (0%), 0 s", "k3rocm: benchmarking: 1/1 (100%), 0 s",
                                           "k3rocm: benchmarking: 0/4 (0%), 0 s", "k3rocm: benchmarking: 4/4 (100%), 0 s"]


def test_plain_progress_names_the_loads_verification_pass():
    # after the bytes land, the loader's verification pass reports with text VERIFY_TEXT from 0 again: the log
    # names the phase instead of sitting at 100%; the text is the loader's own constant
    import contextlib
    import io

    from k3rocm.cli.common import VERIFY_TEXT, Progress
    from k3rocm.runtime.load import VERIFY_TEXT as LOADER_TEXT

    assert VERIFY_TEXT == LOADER_TEXT
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        with Progress(interval_s=3600) as bar:
            cb = bar.callback("loading")
            cb(100, 100, "shard-1")
            cb(0, 100, VERIFY_TEXT)
            cb(100, 100, VERIFY_TEXT)
    assert buf.getvalue().splitlines() == ["k3rocm: loading: 100/100 (100%), 0 s",
                                           "k3rocm: loading: verifying: 0/100 (0%), 0 s",
                                           "k3rocm: loading: verifying: 100/100 (100%), 0 s"]


def test_empty_or_orphan_options_are_refused(cache, tmp_path):
    for args in (["validate", "--kernels", ""], ["validate", "--kernels", "kda_prefill=torch,,moe_experts=torch"],
                 ["bench", "--model", "k3"]):
        line = one_line_error(run([*args, "--out", tmp_path / "r"], code=2))
        assert "--kernels" in line or "--model" in line


@pytest.mark.skipif(not no_gpu(), reason="checks a fallback (CPU) load against a GPU profile")
def test_load_for_another_profile_shows_both_plans(golden_ckpt, tmp_path):
    """`load --profile mi355x-8` on a CPU machine prints the profile's plan as projected, then the plan it loads
    with; the report carries both (plan.* projected, run_plan.* measured on the fallback)."""
    r = run(["load", "--profile", "mi355x-8", "--checkpoint", golden_ckpt, "--out", tmp_path])
    assert "projected: not this machine" in r.output and "loads with this plan" in r.output
    assert r.output.index("projected: not this machine") < r.output.index("loads with this plan")
    ev = {e["name"]: e for e in json.loads((tmp_path / "report.json").read_text())["stages"]["load"]["evidence"]}
    assert ev["plan.tp"]["level"] == "projected" and ev["plan.tp"]["value"] > 1
    assert ev["run_plan.tp"]["value"] == 1 and ev["run_plan.tp"]["level"] != "projected"


def test_empty_options_and_kernel_specs_are_one_line(golden_ckpt, tmp_path):
    """An empty --out / --profile / --golden never falls back to a default; --kernels mistakes say what to write;
    a refused run leaves no report directory behind."""
    out = tmp_path / "never" / "made"
    for args in (["load", "--out", ""], ["plan", "--profile", " "], ["bench", "--profile", ""]):
        r = run(args, code=2)  # click usage errors (one `error:` line through the console entry point)
        assert "is empty" in r.stderr and "Traceback" not in r.output
    for args, needle in ((["validate", "--golden", "", "--out", out], "--golden is empty"),
                         (["bench", "--concurrency", "2,4,2", "--out", out], "2 given twice"),
                         (["load", "--kernels", "triton", "--out", out], "no effect on load"),
                         (["validate", "--kernels", "kda_prefill", "--out", out], "kda_prefill=triton"),
                         (["validate", "--kernels", "aiter", "--out", out], "not part of k3rocm"),
                         (["validate", "--level", "load", "--golden", golden_ckpt / "config.json", "--out", out],
                          "correctness tier"),
                         (["validate", "--kernels", "moe_experts=fast", "--out", out],
                          "unknown implementation 'fast' for moe_experts")):
        line = one_line_error(run([*args, "--checkpoint", golden_ckpt], code=2))
        assert needle in line, (args, line)
    assert not (tmp_path / "never").exists()
    # `kernels list` reports an implementation this machine cannot run instead of failing
    if no_gpu():
        r = run(["kernels", "list", "--kernels", "kda_prefill=triton"])
        assert "unavailable" in r.output and "needs a GPU" in r.output


def test_load_of_a_checkpoint_with_nan_weights_fails_the_tier_naming_the_tensor(golden_ckpt, tmp_path):
    """NaN weights are a failed load tier (exit 1) whose one line names the tensor, not a tier that 'could not
    run'."""
    import struct

    from k3rocm.checkpoint.reader import open_checkpoint
    ck = tmp_path / "ck"
    shutil.copytree(golden_ckpt, ck)
    for f in ck.iterdir():
        f.chmod(0o644)
    idx = open_checkpoint(ck)
    name = next(n for n, e in idx.entries.items() if e.dtype == "BF16" and n.endswith("q_proj.weight"))
    e = idx.entries[name]
    with open(ck / e.shard, "r+b") as f:
        f.seek(e.start)
        f.write(struct.pack("<8H", *([0xFFFF] * 8)))  # bf16 NaNs
    line = one_line_error(run(["load", "--checkpoint", ck, "--out", tmp_path / "r"], code=1))
    assert "load.problems" in line and name in line and "NaN" in line


def test_a_closed_pipe_does_not_cut_the_run_short(golden_ckpt, tmp_path):
    """`k3rocm load ... | head -1`: the reader goes away after one line; the command still finishes, writes its
    report and exits 0 without a traceback."""
    import subprocess
    import sys

    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "k3rocm.cli.main", "load", "--checkpoint", str(golden_ckpt),
                          "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**__import__("os").environ, "COLUMNS": "120"})
    assert p.stdout.readline()
    p.stdout.close()  # the reader is gone
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert (out / "report.json").is_file()


def test_extra_files_beside_a_checkpoint_are_extra_not_corruption(tmp_path):
    d = tmp_path / "ck"
    run(["checkpoint", "make", "--out", d, "--seed", "3"])
    run(["checkpoint", "verify", "--checkpoint", d, "--write-manifest"])
    (d / "README.md").write_text("notes")
    shutil.copyfile(sorted(d.glob("*.safetensors"))[0], d / "adapter.safetensors")  # no index entry names it
    out = run(["checkpoint", "verify", "--checkpoint", d]).output
    assert "2 file(s) not in k3rocm-manifest.json" in out and "README.md" in out
    doc = json.loads(run(["checkpoint", "inspect", "--checkpoint", d, "--json"]).output)
    assert [x["file"] for x in doc["shards"]] == ["model-00001-of-000002.safetensors",
                                                  "model-00002-of-000002.safetensors"]


def test_out_inside_the_checkpoint_or_the_cache_is_refused(cache, tmp_path):
    d = tmp_path / "ck"
    run(["checkpoint", "make", "--out", d, "--seed", "3"])
    for out in (d, d / "reports"):
        line = one_line_error(run(["load", "--checkpoint", d, "--out", out], code=2))
        assert "lies inside the checkpoint directory" in line
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model-00001-of-000002.safetensors",
                                                   "model-00002-of-000002.safetensors", "model.safetensors.index.json"]
    line = one_line_error(run(["load", "--checkpoint", d, "--out", cache / "mine"], code=2))
    assert "lies inside the k3rocm cache" in line


def test_a_fallback_run_says_nothing_ran_on_the_profiles_hardware(cache, tmp_path):
    if not no_gpu():
        pytest.skip("on a GPU machine the CPU profile is not a fallback of this kind")
    r = run(["validate", "--level", "env", "--profile", "mi355x-8", "--out", tmp_path / "a"])
    line = next(ln for ln in r.output.splitlines() if ln.startswith("note: nothing ran on"))
    assert "mi355x-8's hardware (8 x AMD Instinct MI355X, gfx950)" in line and "measured-fallback" in line
    assert "nothing ran on" not in run(["validate", "--level", "env", "--out", tmp_path / "b"]).output


def test_small_honesty_items():
    assert "--kernels" not in run(["load", "--help"]).output  # load runs no kernels and refuses the option
    assert "None" not in run(["env"]).output
    out = run(["plan", "--preset", "k3", "--profile", "mi355x-8"]).output
    assert "2,779,484,478,208 parameters" in out and "104,189,614,848 active per token" in out


def test_env_checks_a_deployments_environment_on_its_own(tmp_path):
    f = tmp_path / "node.env"
    f.write_text("AITER_SITUV2_A8W4=1\nAITER_BF16_FP8_MOE_BOUND=0\n")
    r = run(["env", "--deployment-env", f], code=3)
    line = one_line_error(r)
    assert "a8w4_layout_flags" in line and "fix: set VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4=1" in line
    assert "MATCH" in r.output and "vLLM issue #52442" in r.output
    f.write_text("AITER_SITUV2_A8W4=1\nVLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4=1\nAITER_BF16_FP8_MOE_BOUND=0\n")
    out = run(["env", "--deployment-env", f, "--server-args", "vllm serve m --kda-prefill-backend auto"]).output
    assert "MATCH" not in out and "3 checked" in out
    one_line_error(run(["env", "--server-args", "vllm serve m --kda-prefill-backend flashkda"], code=3))


@pytest.mark.parametrize("kind", ["loop", "broken"])
def test_a_checkpoint_path_that_is_a_loop_or_broken_symlink_says_so(tmp_path, kind):
    """Every command that takes a checkpoint path names a link that does not resolve as such (not as "does not
    exist"), with the path and what to do."""
    a = tmp_path / "a"
    if kind == "loop":
        b = tmp_path / "b"
        a.symlink_to(b)
        b.symlink_to(a)
        why = f"(a loop: it points to {b}"
    else:
        a.symlink_to(tmp_path / "nowhere")
        why = f"(broken: its target {tmp_path / 'nowhere'} does not exist)"
    out = tmp_path / "r"
    for args in (["load", "--checkpoint", a, "--out", out], ["validate", "--checkpoint", a, "--out", out],
                 ["plan", "--checkpoint", a], ["checkpoint", "inspect", "--checkpoint", a],
                 ["checkpoint", "verify", "--checkpoint", a],
                 ["validate", "--synthetic", "--checkpoint", a, "--level", "forward", "--out", out]):
        line = one_line_error(run(args, code=2))
        assert f"--checkpoint {a}: is a symbolic link that does not resolve {why}" in line, (args, line)
        assert "does not exist;" not in line and "point the link at the checkpoint directory" in line, line
    line = one_line_error(run(["checkpoint", "make", "--out", a], code=2))
    assert f"--out {a}: is a symbolic link that does not resolve {why}" in line and "free space" not in line, line


@pytest.mark.parametrize("name", ["k3-prefix-0", "k3-prefix-94", "k3-prefix--1"])
def test_a_prefix_preset_out_of_range_names_the_flag_and_the_range(tmp_path, cache, name):
    want = f"--preset {name}: N must be in 1..93 (the official K3 has 93 layers)"
    for args in (["checkpoint", "make", "--preset", name, "--out", tmp_path / "ck"], ["plan", "--preset", name],
                 ["validate", "--synthetic", "--preset", name, "--level", "forward", "--out", tmp_path / "r"]):
        line = one_line_error(run(args, code=2))
        assert want in line and "k3-prefix-1 to k3-prefix-93" in line, (args, line)
    assert not (tmp_path / "ck").exists()


def test_nan_weights_in_several_tensors_keep_each_remedy_whole(golden_ckpt, tmp_path):
    """Several NaN tensors: the error line and the report's row show whole problem lines (the remedy at their
    end included) and count the rest, instead of cutting the text mid-word."""
    from safetensors.torch import load_file, save_file

    from k3rocm.checkpoint.reader import open_checkpoint
    ck = tmp_path / "ck"
    shutil.copytree(golden_ckpt, ck)
    for f in ck.iterdir():
        f.chmod(0o644)
    idx = open_checkpoint(ck)
    names = [n for n, e in idx.entries.items() if e.dtype == "BF16" and n.endswith("norm.weight")][:6]
    by_shard: dict = {}
    for n in names:
        by_shard.setdefault(idx.entries[n].shard, []).append(n)
    for shard, ns in by_shard.items():
        t = load_file(str(ck / shard))
        for n in ns:
            t[n] = torch.full_like(t[n], float("nan"))
        save_file(t, str(ck / shard), metadata={"format": "pt"})
    remedy = "the file is corrupt: re-download or re-make it"
    out = tmp_path / "r"
    line = one_line_error(run(["validate", "--level", "forward", "--checkpoint", ck, "--out", out], code=1))
    assert "load.problems = 6" in line and names[0] in line, line
    assert f"{remedy}; … and 5 more; see {out}" in line, line
    row = next(ln for ln in (out / "report.md").read_text().splitlines() if "| load.problems |" in ln)
    assert f"{remedy}; … and " in row and row.rstrip().endswith("more |"), row


def test_a_seed_out_of_range_is_refused_in_one_line(tmp_path):
    """--seed takes 0 .. 2^63 - 1 (torch's generator range); anything else: one `error:` line through the console
    script, exit 2, nothing written; `load` (which generates nothing) does not offer it."""
    import subprocess
    import sys

    out = tmp_path / "rep"
    for seed in ("-1", str(2**63), "abc"):
        r = subprocess.run([sys.executable, "-c", "from k3rocm.cli.main import main; main()", "bench", "--seed", seed,
                            "--out", str(out)], capture_output=True, text=True, timeout=120)
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and "--seed" in err[0], r.stderr
        assert seed == "abc" or "0 .. 2^63 - 1" in err[0], err[0]
        assert not out.exists()
    assert "--seed" not in run(["load", "--help"]).output


@pytest.mark.parametrize("seed", ["5", "0"])
def test_load_refuses_a_seed_it_would_ignore(tmp_path, seed):
    """load generates nothing, so a --seed (any value, the default's included) is refused in one line, as
    --kernels is, instead of being accepted and ignored; nothing is written."""
    line = one_line_error(run(["load", "--seed", seed, "--out", tmp_path / "r"], code=2))
    assert line.startswith(f"error: --seed {seed} has no effect on load") and "drop --seed" in line, line
    assert not (tmp_path / "r").exists()
