"""The known environment traps of K3 on ROCm, as data: each one matches its reported condition and nothing else."""

from __future__ import annotations

import json

import pytest

from k3rocm.envtraps import TRAPS, match_traps, read_env_file, server_options
from k3rocm.errors import ConfigError
from k3rocm.validation.evidence import Stage
from k3rocm.validation.tiers.env import trap_rows


def names(settings, platform="rocm"):
    return [t.name for t in match_traps(settings, platform)]


def test_every_trap_is_a_complete_row():
    for t in TRAPS:
        assert t.variables and t.when and t.condition and t.consequence and t.fix and t.source.startswith("vLLM")
        assert {v for var, _ in t.when for v in (var if isinstance(var, tuple) else (var,))} <= set(t.variables)


def test_the_a8w4_traps():
    assert names({"AITER_SITUV2_A8W4": "1"}) == ["a8w4_layout_flags", "a8w4_decode_bound"]
    assert names({"AITER_SITUV2_A8W4": "1", "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4": "1"}) == ["a8w4_decode_bound"]
    assert names({"AITER_SITUV2_A8W4": "1", "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4": "true",
                  "AITER_BF16_FP8_MOE_BOUND": "0"}) == []
    assert names({"VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4": "1", "AITER_BF16_FP8_MOE_BOUND": "256"}) == \
        ["a8w4_decode_bound"]
    assert names({"AITER_SITUV2_A8W4": "0"}) == [] and names({}) == []
    assert names({"AITER_SITUV2_A8W4": "1"}, platform="cuda") == []  # a ROCm trap


def test_the_kda_backend_trap_reads_the_server_command_line():
    opts = server_options("vllm serve moonshotai/Kimi-K3 -tp 8 --kda_prefill_backend=FlashKDA --enforce-eager")
    assert opts["--kda-prefill-backend"] == "FlashKDA" and opts["--enforce-eager"] == "1"
    assert names(opts) == ["kda_cuda_backend_on_rocm"]
    assert names(server_options("vllm serve m --kda-prefill-backend auto")) == []
    with pytest.raises(ConfigError, match="cannot split"):
        server_options("vllm serve 'unclosed")
    for empty in ("", "   "):  # nothing to check: every trap would read "clear"
        with pytest.raises(ConfigError, match="empty"):
            server_options(empty)


def test_env_files_of_every_common_shape(tmp_path):
    f = tmp_path / "a.env"
    f.write_text("# vllm node\nexport AITER_SITUV2_A8W4=1\nVLLM_X=\"quoted value\"\n\n")
    assert read_env_file(f) == {"AITER_SITUV2_A8W4": "1", "VLLM_X": "quoted value"}
    g = tmp_path / "environ"
    g.write_bytes(b"A=1\0B=x=y\0")
    assert read_env_file(g) == {"A": "1", "B": "x=y"}
    (tmp_path / "bad.env").write_text("not a variable\n")
    with pytest.raises(ConfigError, match="entry 1 is not KEY=VALUE"):
        read_env_file(tmp_path / "bad.env")
    with pytest.raises(ConfigError, match="cannot read"):
        read_env_file(tmp_path / "missing.env")


def test_the_env_tier_fails_on_a_trap_with_reason_and_fix():
    st = Stage("env")
    trap_rows(st, {"AITER_SITUV2_A8W4": "1", "AITER_BF16_FP8_MOE_BOUND": "0"}, "rocm")
    rows = {e.name: e for e in st.evidence}
    assert st.status == "failed" and rows["traps"].value == 1 and rows["traps"].passed is False
    row = rows["trap.a8w4_layout_flags"]
    assert row.passed is False and "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4 unset" in row.value
    assert "fix: set VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4=1" in row.detail and "#52442" in row.detail
    clear = Stage("env")
    trap_rows(clear, {}, "rocm")
    assert clear.status == "passed" and [e.name for e in clear.evidence] == ["traps"]


def test_a_trap_whose_source_was_not_given_is_unchecked_not_clear():
    """Only server args given: the environment-variable traps were not seen, so they are not "clear" (and vice
    versa for an environment file alone)."""
    from k3rocm.envtraps import ENVIRONMENT, SERVER_ARGS, check_traps
    opts = server_options("vllm serve x --kda-prefill-backend flashkda")
    by = {r.trap.name: r for r in check_traps(opts, "rocm", [SERVER_ARGS])}
    assert by["a8w4_layout_flags"].status == by["a8w4_decode_bound"].status == "unchecked"
    assert "no environment given" in by["a8w4_layout_flags"].settings and "unset" not in by["a8w4_layout_flags"].settings
    assert by["kda_cuda_backend_on_rocm"].status == "match"
    by = {r.trap.name: r for r in check_traps({"AITER_SITUV2_A8W4": "1"}, "rocm", [ENVIRONMENT])}
    assert by["kda_cuda_backend_on_rocm"].status == "unchecked" and by["a8w4_layout_flags"].status == "match"
    by = {r.trap.name: r.status for r in check_traps({}, "rocm", [ENVIRONMENT, SERVER_ARGS])}
    assert set(by.values()) == {"clear"}
    assert {r.status for r in check_traps(opts, "cuda", [SERVER_ARGS])} == {"n/a"}


def _env(args, code):
    from click.testing import CliRunner
    from k3rocm.cli.main import cli
    r = CliRunner().invoke(cli, ["env", *map(str, args)], env={"COLUMNS": "200"})
    assert r.exit_code == code, (args, r.exit_code, r.output, r.exception)
    return r.output


def test_env_with_only_server_args_does_not_call_environment_traps_clear(monkeypatch):
    # even with a trap set in this process's environment: the command reads no environment but the file given
    monkeypatch.setenv("AITER_SITUV2_A8W4", "1")
    out = _env(["--server-args", "vllm serve x --kda-prefill-backend flashkda"], 3)
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in out.splitlines() if ln.startswith("│")}
    assert rows == {"a8w4_layout_flags": "unchecked", "a8w4_decode_bound": "unchecked",
                    "kda_cuda_backend_on_rocm": "MATCH"}
    assert "clear" not in out.split("note:")[0] and "(1 of 3 checked)" in out and "AITER_SITUV2_A8W4 unset" not in out
    assert "2 trap(s) not checked" in out
    data = json.loads(_env(["--server-args", "vllm serve x", "--json"], 0))
    assert data["checked"] == ["kda_cuda_backend_on_rocm"] and data["matched"] == []
    assert [u["name"] for u in data["unchecked"]] == ["a8w4_layout_flags", "a8w4_decode_bound"]


def test_env_on_another_platform_counts_no_na_row_as_checked(tmp_path):
    out = _env(["--server-args", "vllm serve x --kda-prefill-backend flashkda", "--platform", "cuda"], 0)
    assert "(0 of 3 checked)" in out and "(3 checked)" not in out and out.count("n/a (rocm)") == 3
    f = tmp_path / "node.env"
    f.write_text("AITER_SITUV2_A8W4=1\nVLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4=1\nAITER_BF16_FP8_MOE_BOUND=0\n")
    out = _env(["--deployment-env", f], 0)
    assert "(2 of 3 checked)" in out and "1 trap(s) not checked (kda_cuda_backend_on_rocm)" in out
    assert "(3 of 3 checked)" in _env(["--deployment-env", f, "--server-args", "vllm serve m"], 0)
