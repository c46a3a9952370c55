"""The known environment traps of K3 on ROCm, as data: each one matches its reported condition and nothing else."""

from __future__ import annotations

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
