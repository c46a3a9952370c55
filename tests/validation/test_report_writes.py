"""Writing reports safely: one writer at a time per --out, report.json first, OS errors as one line."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import textwrap

import click
import pytest

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.cli.common import handle_errors
from k3rocm.errors import CheckpointError, ConfigError, HardwareError, os_error
from k3rocm.validation import render
from k3rocm.validation.evidence import Stage, info
from k3rocm.validation.render import update_report
from k3rocm.validation.session import require_dir_for_output

_WRITER = textwrap.dedent("""
    import sys, time
    from k3rocm.validation.evidence import Report, Stage, info
    from k3rocm.validation.render import update_report
    orig = Report.merge_run
    def slow(self, *a, **k):  # widen the window between reading and writing the report
        time.sleep(0.15)
        return orig(self, *a, **k)
    Report.merge_run = slow
    out, tier = sys.argv[1], sys.argv[2]
    for i in range(3):
        st = Stage(tier)
        st.add(info(tier, f"run{i}", i))
        update_report(out, {"command": f"k3rocm {tier} {i}", "config_hash": "h"}, [st], config_hash="h")
""")


def test_processes_writing_one_out_keep_every_stage_and_history_entry(tmp_path):
    """Three writers at once, each writing three times: every stage and history entry is kept (the lock file is
    removed by each holder, so waiters must re-lock the current file), and no lock file is left at the end."""
    tiers = ("load", "forward", "bench")
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), tier]) for tier in tiers]
    assert [p.wait(timeout=90) for p in procs] == [0, 0, 0]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert set(doc["stages"]) == set(tiers)
    assert len(doc["history"]) == 9
    assert not (tmp_path / ".report.lock").exists()


def test_the_lock_file_is_removed_and_a_waiter_locks_the_current_one(tmp_path):
    """The holder removes .report.lock before releasing it; one waiting on the removed file must not proceed on
    it (a third writer would lock a new file at the same time) but lock the file the path names."""
    import fcntl
    import os
    import threading
    import time

    from k3rocm.validation.evidence import LOCK_NAME, report_lock

    order = []
    with report_lock(tmp_path):
        stale = os.open(tmp_path / LOCK_NAME, os.O_RDWR)  # a waiter that opened the file before it was removed

        def waiter():
            with report_lock(tmp_path, poll_s=0.01):
                # it holds the file the path names (it exists: the lock was taken on it), not the removed one
                p = tmp_path / LOCK_NAME
                order.append(("waiter", p.exists() and os.stat(p).st_ino != os.fstat(stale).st_ino))
        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.2)  # the waiter has opened the file and is polling its lock
        order.append("holder")
    th.join(timeout=10)
    assert order == ["holder", ("waiter", True)] and not (tmp_path / LOCK_NAME).exists()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the removed file is free: nobody relies on it
    os.close(stale)


def _stage() -> Stage:
    st = Stage("load")
    st.add(info("load", "bytes", 123))
    return st


def _failing_write(suffix: str, code: int = errno.ENOSPC):
    real = render.atomic_write

    def write(path, text):
        if str(path).endswith(suffix):
            raise OSError(code, "No space left on device", str(path))
        return real(path, text)
    return write


def test_no_space_for_markdown_keeps_report_json_and_no_stale_format(tmp_path, monkeypatch):
    (tmp_path / "report.html").write_text("an earlier run's page")
    (tmp_path / "report.md").write_text("an earlier run's summary")
    monkeypatch.setattr(render, "atomic_write", _failing_write(".md"))
    with pytest.raises(HardwareError) as ei:
        update_report(tmp_path, {"command": "k3rocm load"}, [_stage()])
    assert ei.value.exit_code == 3 and "\n" not in str(ei.value)
    assert "report.json holds this run's results" in str(ei.value)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["stages"]["load"]["evidence"][0]["value"] == 123
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "report.html").exists()


def test_no_space_for_html_keeps_json_and_the_matching_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(render, "atomic_write", _failing_write(".html"))
    with pytest.raises(HardwareError):
        update_report(tmp_path, {"command": "k3rocm load"}, [_stage()])
    assert (tmp_path / "report.json").is_file() and "bytes" in (tmp_path / "report.md").read_text()


def test_no_space_for_report_json_says_nothing_was_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(render, "atomic_write", _failing_write(".json"))
    with pytest.raises(HardwareError, match="nothing of this run was saved"):
        update_report(tmp_path, {"command": "k3rocm load"}, [_stage()])
    assert not any(tmp_path.glob("report.*"))


def test_report_json_that_is_a_directory_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "report.json").mkdir()
    with pytest.raises(ConfigError, match="report.json there is not a regular file"):
        require_dir_for_output(tmp_path, keep=False)


def test_a_shard_that_is_a_symlink_loop_is_one_line(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    shard = sorted(ck.glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to(shard.name)
    with pytest.raises(CheckpointError, match="symlink loop"):
        open_checkpoint(ck)


@pytest.mark.parametrize("code,exit_code", [(errno.ENOSPC, 3), (errno.EIO, 3), (errno.EISDIR, 2), (errno.ELOOP, 2),
                                            (errno.EACCES, 2)])
def test_os_errors_map_to_their_exit_class(code, exit_code):
    err = os_error(OSError(code, "why", "/x/y"), "writing")
    assert err.exit_code == exit_code and str(err).startswith("writing: /x/y: why")


def test_an_os_error_in_a_command_is_one_line_with_its_exit_code(capsys):
    @handle_errors
    def cmd(debug=False):
        raise OSError(errno.ENOSPC, "No space left on device", "/r/report.json")
    with pytest.raises(SystemExit) as ei:
        cmd()
    assert ei.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: /r/report.json: No space left on device")
