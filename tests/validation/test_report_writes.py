"""Writing reports safely: one writer at a time per --out, the three files as one set, OS errors as one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import click
import pytest

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.cli.common import handle_errors
from k3rocm.errors import CheckpointError, ConfigError, HardwareError, os_error
from k3rocm.validation import evidence
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


#: how each report file's text starts (render_json / render_markdown / render_html)
_STARTS = {"json": "{", "md": "# k3rocm report", "html": "<!DOCTYPE html>"}


def _failing_fill(monkeypatch, kind: str, code: int = errno.ENOSPC) -> None:
    """The disk fills up while report.<kind> is written: part of its text reaches its temporary file, then the
    write raises ``OSError(code)`` (the other files are written whole)."""
    real = evidence._fill

    def fill(f, text):
        if text.startswith(_STARTS[kind]):
            f.write(text[:64])
            raise OSError(code, os.strerror(code))
        return real(f, text)
    monkeypatch.setattr(evidence, "_fill", fill)


def _previous_report(out) -> dict:
    """A good report of an earlier run in ``out``; returns each file's bytes."""
    st = Stage("forward")
    st.add(info("forward", "earlier", 1))
    update_report(out, {"command": "k3rocm validate"}, [st])
    return {n: (out / n).read_bytes() for n in ("report.json", "report.md", "report.html")}


@pytest.mark.parametrize("kind", ["json", "md", "html"])
def test_no_space_for_any_report_file_leaves_the_previous_report_whole(tmp_path, monkeypatch, kind):
    """The three files are one set: the disk filling up while any of them is written (report.html is the last)
    replaces none of them, the previous run's three files stay byte for byte, no temporary file is left, and the
    line says exit 3, what was being written and that the previous report is unchanged."""
    before = _previous_report(tmp_path)
    _failing_fill(monkeypatch, kind)
    with pytest.raises(HardwareError) as ei:
        update_report(tmp_path, {"command": "k3rocm load"}, [_stage()])
    msg = str(ei.value)
    assert ei.value.exit_code == 3 and "\n" not in msg
    assert f"writing {tmp_path / ('report.' + kind)}" in msg and "No space left on device" in msg, msg
    assert "nothing of this run was saved; the previous report there is unchanged" in msg, msg
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]


def test_no_space_in_an_empty_out_writes_no_report_file(tmp_path, monkeypatch):
    _failing_fill(monkeypatch, "html")
    with pytest.raises(HardwareError, match="nothing of this run was saved; no report was written"):
        update_report(tmp_path, {"command": "k3rocm load"}, [_stage()])
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rename_says_which_files_hold_this_run(tmp_path, monkeypatch):
    """A rename cannot run out of space, but should one fail after report.json was replaced, the line says which
    file holds this run's results, and no temporary file is left."""
    _previous_report(tmp_path)
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("report.md"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst)
    monkeypatch.setattr(evidence.os, "replace", replace)
    with pytest.raises(HardwareError, match=r"report\.json holds this run's results, the others the previous run's"):
        update_report(tmp_path, {"command": "k3rocm load"}, [_stage()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]
    assert "bytes" in (tmp_path / "report.json").read_text() and "bytes" not in (tmp_path / "report.md").read_text()


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
