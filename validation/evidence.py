"""Evidence model of the staged validation report (schema ``k3rocm.report/1``, see docs/REPORT_SCHEMA.md).

A :class:`Report` holds one :class:`Stage` per tier (``env``, ``load``, ``forward``, ``correctness``,
``performance``) plus ``bench`` (written by ``k3rocm bench``). Each stage holds :class:`Evidence` rows.
Every row carries a level of proof (DESIGN.md §4), never mixed up:

* ``measured`` — measured here, on the hardware the profile names;
* ``measured-fallback`` — measured here, but on other hardware than the profile names (CPU, or CUDA for
  an MI355X profile);
* ``projected`` — computed from a model (roofline, memory plan), not measured;
* ``external`` — compared against results another system produced (golden logits, known answers).

Reports merge: a command that writes into an ``--out`` directory that already holds a report of the
same checkpoint (same config hash) replaces only the stages it ran and keeps the others.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from k3rocm.checkpoint.verify import shard_fingerprints
from k3rocm.errors import ConfigError
from k3rocm.hw import declared_commit, package_version, relevant_env, torch_build

SCHEMA = "k3rocm.report/1"
LEVELS = ("measured", "measured-fallback", "projected", "external")
TIERS = ("env", "load", "forward", "correctness", "performance")
STAGE_ORDER = TIERS + ("bench",)
STATUSES = ("passed", "failed", "error", "skipped")



def _jsonable(v: Any) -> Any:
    """Convert numpy / torch scalars, tuples and non-finite floats to plain JSON values."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)  # "nan" / "inf" stay visible, JSON stays valid
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "tolist"):  # numpy / torch
        return _jsonable(v.tolist())
    if hasattr(v, "item"):
        return _jsonable(v.item())
    return str(v)


@dataclass
class Evidence:
    """One fact in the report.

    Attributes:
        tier: the tier that produced it (one of :data:`TIERS` or ``"bench"``).
        name: short identifier, e.g. ``"logits.kl"`` or ``"ttft.p50"``.
        value: number, string, bool or small list (JSON-serialisable after :func:`_jsonable`).
        unit: unit of ``value`` (``"ms"``, ``"GB/s"``, ``"nats"``, ``""``).
        threshold: the pass condition as text (``"<= 1e-3"``) or None for informational rows.
        passed: True / False against the threshold; None when informational.
        level: one of :data:`LEVELS`.
        detail: one line of context (what was compared with what).

    Raises:
        ConfigError: ``level`` is not one of :data:`LEVELS`.
    """

    tier: str
    name: str
    value: Any
    unit: str = ""
    threshold: str | None = None
    passed: bool | None = None
    level: str = "measured"
    detail: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(f"evidence {self.name!r}: level {self.level!r} is not one of {', '.join(LEVELS)}")
        self.value = _jsonable(self.value)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Evidence":
        return cls(**{k: d.get(k) for k in ("tier", "name", "value", "unit", "threshold", "passed", "level",
                                            "detail")})


def listed(items, sep: str = "; ", limit: int = 300) -> str:
    """``items`` (strings) joined by ``sep``, whole items only, as many as fit in about ``limit`` characters,
    then ``"… and N more"`` for those left out: a detail that can be long is shortened in its variable part,
    so each item shown keeps its end (a remedy at the end of a problem line survives). The first item is
    always shown (cut with "…" only when it alone exceeds ``limit``). ``""`` for no items. Raises nothing.
    """
    items = [str(x) for x in items]
    if not items:
        return ""
    shown = [items[0] if len(items[0]) <= limit else items[0][:limit - 1].rstrip() + "…"]
    size = len(shown[0])
    for it in items[1:]:
        if size + len(sep) + len(it) > limit:
            break
        shown.append(it)
        size += len(sep) + len(it)
    left = len(items) - len(shown)
    return sep.join(shown) + (f"{sep}… and {left} more" if left else "")


def check(tier: str, name: str, value: Any, *, le: float | None = None, ge: float | None = None,
          eq: Any = None, unit: str = "", level: str = "measured", detail: str = "") -> Evidence:
    """Build an :class:`Evidence` row with a numeric pass condition.

    Exactly one of ``le`` (value <= le), ``ge`` (value >= ge) or ``eq`` (value == eq) should be given.
    A non-finite numeric value always fails. Returns the row (``passed`` set).
    """
    if le is not None:
        thr, ok = f"<= {le:g}", _finite(value) and value <= le
    elif ge is not None:
        thr, ok = f">= {ge:g}", _finite(value) and value >= ge
    else:
        thr, ok = f"== {eq}", value == eq
    return Evidence(tier, name, value, unit, thr, bool(ok), level, detail)


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def info(tier: str, name: str, value: Any, unit: str = "", level: str = "measured", detail: str = "") -> Evidence:
    """An informational row (no threshold, ``passed`` None)."""
    return Evidence(tier, name, value, unit, None, None, level, detail)


@dataclass
class Setting:
    """One setting of the run in a stage: an input the run was given or chose (the prompt lengths of a benchmark
    point, the requests sent, the hardware profile), not a claim about what happened. It carries no level of
    proof and no threshold (levels grade evidence; a setting is not evidence): the renderers show settings in
    their own table beside the evidence, and ``evidence_levels`` does not count them.

    Attributes:
        tier: the stage it belongs to.
        name: identifier, e.g. ``"c4.input_len"`` or ``"profile"``.
        value: number, string or bool (JSON-serialisable after :func:`_jsonable`).
        unit: unit of ``value`` (``"tokens"``, ``"requests"``, ``""``).
        detail: one line: what the setting means and where it came from.
    """

    tier: str
    name: str
    value: Any
    unit: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        self.value = _jsonable(self.value)

    def to_dict(self) -> dict:
        """``{tier, name, value, unit, detail}`` (the report's setting object)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Setting":
        """A setting from its report object (missing keys: None). Raises nothing."""
        return cls(**{k: d.get(k) for k in ("tier", "name", "value", "unit", "detail")})


def setting(tier: str, name: str, value: Any, unit: str = "", detail: str = "") -> Setting:
    """A :class:`Setting` row (an input of the run, no level). Raises nothing."""
    return Setting(tier, name, value, unit or "", detail or "")


@dataclass
class Stage:
    """The result of one tier (or of ``bench``).

    Attributes:
        tier: stage key (one of :data:`STAGE_ORDER`).
        status: ``passed`` | ``failed`` (a threshold was missed) | ``error`` (the tier could not run;
            ``error`` holds the one-line reason) | ``skipped``.
        started: ISO-8601 UTC start time.
        seconds: wall time of the stage in seconds.
        evidence: the rows.
        settings: the run's inputs shown with the stage (:class:`Setting`: no level, not evidence).
        series: plot data, ``{name: {"x": [...], "y": {label: [...]}, "xlabel", "ylabel", "log"}}``.
        command: the command line that produced the stage.
        error: one-line reason when ``status == "error"``.
        level: evidence level the stage's measurements carry (``measured`` / ``measured-fallback``).
    """

    tier: str
    status: str = "passed"
    started: str = ""
    seconds: float = 0.0
    evidence: list[Evidence] = field(default_factory=list)
    series: dict = field(default_factory=dict)
    command: str = ""
    error: str | None = None
    settings: list[Setting] = field(default_factory=list)

    def add(self, *rows: Evidence) -> None:
        """Append rows; a row whose ``passed`` is False turns the stage ``failed``."""
        for r in rows:
            self.evidence.append(r)
            if r.passed is False and self.status == "passed":
                self.status = "failed"

    def add_settings(self, *rows: Setting) -> None:
        """Append settings (inputs of the run: no level, never pass or fail)."""
        self.settings.extend(rows)

    @property
    def failures(self) -> list[Evidence]:
        return [e for e in self.evidence if e.passed is False]

    def to_dict(self) -> dict:
        return {"tier": self.tier, "status": self.status, "started": self.started,
                "seconds": round(float(self.seconds), 4), "command": self.command, "error": self.error,
                "settings": [x.to_dict() for x in self.settings],
                "evidence": [e.to_dict() for e in self.evidence], "series": _jsonable(self.series)}

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        return cls(tier=d["tier"], status=d.get("status", "passed"), started=d.get("started", ""),
                   seconds=float(d.get("seconds", 0.0)), command=d.get("command", ""), error=d.get("error"),
                   evidence=[Evidence.from_dict(e) for e in d.get("evidence", [])], series=d.get("series", {}),
                   settings=[Setting.from_dict(x) for x in d.get("settings", [])])


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Report:
    """The whole report: reproduction block + stages (keyed and ordered by :data:`STAGE_ORDER`).

    ``to_dict()`` is the JSON document (docs/REPORT_SCHEMA.md); ``status`` is ``passed`` when every
    stage passed, ``failed`` when any failed or errored.
    """

    reproduction: dict = field(default_factory=dict)
    stages: dict[str, Stage] = field(default_factory=dict)
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    history: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        if not self.stages:
            return "empty"
        if any(s.status in ("failed", "error") for s in self.stages.values()):
            return "failed"
        return "passed"

    def put(self, stage: Stage) -> None:
        """Add or replace a stage (a later run of the same tier wins)."""
        self.stages[stage.tier] = stage
        self.stages = {k: self.stages[k] for k in sorted(self.stages, key=_stage_rank)}
        self.updated = now_iso()

    def ordered(self) -> list[Stage]:
        return [self.stages[k] for k in sorted(self.stages, key=_stage_rank)]

    def level_counts(self) -> dict[str, int]:
        out = {lv: 0 for lv in LEVELS}
        for s in self.stages.values():
            for e in s.evidence:
                out[e.level] = out.get(e.level, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "status": self.status, "created": self.created, "updated": self.updated,
                "reproduction": _jsonable(self.reproduction), "history": _jsonable(self.history),
                "evidence_levels": self.level_counts(),
                "stages": {s.tier: s.to_dict() for s in self.ordered()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        """Parse a report document. Raises ConfigError when the schema is not ``k3rocm.report/1``."""
        if d.get("schema") != SCHEMA:
            raise ConfigError(f"report schema {d.get('schema')!r} is not {SCHEMA!r}; use a fresh --out directory")
        r = cls(reproduction=d.get("reproduction", {}), created=d.get("created", now_iso()),
                updated=d.get("updated", now_iso()), history=list(d.get("history", [])))
        for k, s in d.get("stages", {}).items():
            r.stages[k] = Stage.from_dict(s)
        return r

    def merge_run(self, reproduction: dict, stages: list[Stage]) -> None:
        """Record one command's run: update the reproduction block, replace its stages, log the command.

        The reproduction block keeps per-stage timings and the union of thresholds; scalar fields
        (versions, device, command) describe the latest run, and ``history`` lists every run.
        """
        timings = dict(self.reproduction.get("stage_seconds", {}))
        thresholds = dict(self.reproduction.get("thresholds", {}))
        self.reproduction = dict(reproduction)
        for s in stages:
            self.put(s)
            timings[s.tier] = round(float(s.seconds), 4)
        bad = [s for s in stages if s.status != "passed"]
        if bad:  # earlier runs' stages after a tier that now fails were measured on what no longer holds
            cut = min(_stage_rank(s.tier) for s in bad)
            new = {s.tier for s in stages}
            for k in [k for k in self.stages if _stage_rank(k) > cut and k not in new]:
                del self.stages[k]
                timings.pop(k, None)
        thresholds.update(reproduction.get("thresholds", {}))
        self.reproduction["stage_seconds"] = {k: timings[k] for k in sorted(timings, key=_stage_rank)}
        self.reproduction["thresholds"] = thresholds
        self.history.append({"time": now_iso(), "command": reproduction.get("command", ""),
                             "git_sha": (reproduction.get("software") or {}).get("git_sha", "unknown"),
                             "stages": [s.tier for s in stages],
                             "status": {s.tier: s.status for s in stages}})


def _stage_rank(k: str) -> int:
    return STAGE_ORDER.index(k) if k in STAGE_ORDER else len(STAGE_ORDER)


# ---------------------------------------------------------------------------- reproduction block
def git_sha() -> str:
    """Git commit of the toolkit source (``-dirty`` appended when the tree has changes), or ``unknown``. Where
    ``$K3ROCM_SOURCE_COMMIT`` declares the commit of a copied tree: that commit with `` (declared)`` when git
    knows none (a copy without git metadata), with `` (declared; git says <sha>)`` when git names another one.

    Raises:
        ConfigError: ``$K3ROCM_SOURCE_COMMIT`` is set but not a commit (``k3rocm.hw.declared_commit``).
    """
    declared = declared_commit()
    found = _git_head()
    if not declared or declared == found:
        return found
    if found == "unknown":
        return f"{declared} (declared)"
    return f"{declared} (declared; git says {found})"


def _git_head() -> str:
    src = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def software_versions() -> dict:
    """Versions and builds of python, torch (CUDA/HIP build), triton, aiter, safetensors, k3rocm."""
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "k3rocm": package_version("k3rocm") or "unknown", "git_sha": git_sha()}
    try:
        tb = torch_build()
        kit, ver = tb.toolkit
        out["torch"] = tb.version
        out["torch_build"] = f"{kit} {ver}" if ver else kit  # the report's spelling: hip 6.4.x / cuda 12.x / cpu
    except Exception as e:  # pragma: no cover
        out["torch"] = f"unavailable ({e.__class__.__name__})"
    for mod in ("triton", "aiter", "safetensors", "compressed-tensors"):
        out[mod.replace("-", "_")] = package_version(mod)
    return out


def reproduction_block(*, command: str, checkpoint: str | None, config_hash: str | None, seed: int,
                       device: dict | None = None, profile: str | None = None, kernels: str | None = None,
                       thresholds: dict | None = None, extra: dict | None = None) -> dict:
    """What is needed to reproduce a run (DESIGN.md §4): versions, command, config, shards, device, env.

    Args:
        command: the command line as typed (``k3rocm validate --level correctness ...``).
        checkpoint: checkpoint directory (absolute path), or None.
        config_hash: ``K3Config.config_hash()`` of the checkpoint's config.
        seed: the RNG seed used for generated inputs.
        device: ``{"sku", "arch", "count", "memory_bytes", "backend"}`` from hardware detection.
    """
    block = {"command": command, "cwd": os.getcwd(), "host": platform.node(),
             "software": software_versions(), "checkpoint": checkpoint, "config_hash": config_hash,
             "shards": shard_fingerprints(checkpoint) if checkpoint and Path(checkpoint).is_dir() else [],
             "profile": profile, "kernels": kernels or "auto", "device": device or {}, "env": relevant_env(),
             "seeds": {"seed": seed}, "thresholds": thresholds or {}}
    if extra:
        block.update(extra)
    return block


def command_line(argv: list[str] | None = None) -> str:
    """The command line as a shell would show it (``k3rocm ...``)."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = "k3rocm" if argv[0].endswith(("k3rocm", "main.py", "__main__.py")) else argv[0]
    return " ".join(shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------------- persistence
def _fill(f, text: str) -> None:
    """Write ``text`` into the open temporary file ``f`` and push it to the disk (where no space shows up)."""
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def write_temp(path: str | Path, text: str) -> Path:
    """Write ``text`` to a new temporary file beside ``path`` (``.<name>.*.tmp``, mode 0644, synced) and return
    its path; ``path`` itself is not touched. On any failure the temporary file is removed and the error raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            _fill(f, text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is meant to be read by others (CI, web)
    except BaseException:
        _unlink(tmp)
        raise
    return Path(tmp)


def _unlink(p) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def atomic_write(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory + ``os.replace`` (atomic)."""
    tmp = write_temp(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def atomic_write_set(files: dict[Path, str]) -> None:
    """Write several files as one set: each ``text`` to a temporary file beside its path first, and only when all
    of them are written, rename each into place (``os.replace``, in the order given).

    A failure while writing (no space, an I/O error, an interrupt) removes the temporaries written so far and
    leaves every path as it was: no file of the set is replaced (the error gets ``target``, the path whose file was
    being written). A rename cannot run out of space; should one fail anyway, the temporaries not yet renamed are removed and the error is raised with ``replaced`` (the paths
    already replaced, in order) set on it.
    """
    tmps: list[tuple[Path, Path]] = []
    try:
        for path, text in files.items():
            tmps.append((Path(path), write_temp(path, text)))
    except BaseException as e:
        for _, tmp in tmps:
            _unlink(tmp)
        if isinstance(e, OSError):
            e.target = Path(path)  # type: ignore[attr-defined]  # the file being written (the OS error may name none)
        raise
    replaced: list[Path] = []
    try:
        for path, tmp in tmps:
            os.replace(tmp, path)
            replaced.append(path)
    except BaseException as e:
        for _, tmp in tmps[len(replaced):]:
            _unlink(tmp)
        if isinstance(e, OSError):
            e.replaced = replaced  # type: ignore[attr-defined]
        raise


LOCK_NAME = ".report.lock"


@contextlib.contextmanager
def report_lock(out_dir: str | Path, timeout_s: float = 300.0, poll_s: float = 0.05):
    """Hold an exclusive lock on ``out_dir`` while its report is read, merged and written.

    Two commands writing into one ``--out`` at once would each read the old report.json and the later write
    would drop the other's stages and history entry; under this lock the second waits for the first and then
    merges into what the first wrote. The lock is ``fcntl.flock`` on ``out_dir/.report.lock`` (released by the
    kernel when the process dies, so a killed run never leaves a stale lock). The holder removes the file before
    it releases the lock, so a finished run leaves no empty lock file in the report folder; a waiter that then
    gets the lock on the removed file sees that the path no longer names the file it locked and locks the
    current one instead (the usual lock-file protocol), so removing it never lets two writers in at once. A
    file left by a process that was killed stays until the next writer removes it (it is not a stale lock: the
    kernel released that one). After 1 s of waiting a one-line note on stderr says so.

    Raises:
        ConfigError: another process held the lock for more than ``timeout_s`` seconds.
        OSError: the lock file cannot be created (the caller turns it into one line).
    """
    path = Path(out_dir) / LOCK_NAME
    t0, noted = time.monotonic(), False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = time.monotonic() - t0
                    if waited > timeout_s:
                        raise ConfigError(f"--out {out_dir}: another k3rocm has been writing its report there for "
                                          f"{timeout_s:.0f} s; wait for it or choose another --out") from None
                    if waited > 1.0 and not noted:
                        print(f"note: waiting for another k3rocm writing the report in {out_dir}", file=sys.stderr)
                        noted = True
                    time.sleep(poll_s)
            if _same_file(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the holder before us removed the file we locked: lock the one the path names now
    try:
        yield path
    finally:
        try:
            os.unlink(path)  # ours, and still locked: a waiter re-checks the path and locks a fresh file
        except OSError:
            pass
        os.close(fd)  # closing the descriptor releases the lock


def _same_file(fd: int, path: Path) -> bool:
    """True when ``path`` still names the open file ``fd`` (same device and inode). Raises nothing."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def load_report(out_dir: str | Path, config_hash: str | None = None, checkpoint: str | None = None,
                profile: str | None = None) -> Report:
    """Open ``out_dir/report.json`` for merging, or a new :class:`Report`.

    A report of another checkpoint (different ``config_hash``, or the same config at another ``checkpoint``
    path: two random-weight checkpoints share a config), of another hardware ``profile`` (its evidence levels
    and ceilings were decided against that profile) or an unreadable/old-schema file is not merged into:
    a fresh report starts, and the old ``report.json`` is kept as ``report.previous-<time>.json`` (a one-line
    note on stderr says so), so no measurement is lost without a word.
    """
    p = Path(out_dir) / "report.json"
    if not p.is_file():
        return Report()
    try:
        rep = Report.from_dict(json.loads(p.read_text()))
        if not isinstance(rep.reproduction, dict):
            raise TypeError("reproduction is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError):  # any malformed structure
        return _fresh(p, "it is not a k3rocm.report/1 file")
    old = rep.reproduction.get("config_hash")
    if config_hash and old and old != config_hash:
        return _fresh(p, "it is a report of another checkpoint config")
    old_ck = rep.reproduction.get("checkpoint")
    if checkpoint and old_ck and str(old_ck) != str(checkpoint):
        return _fresh(p, f"it is a report of the checkpoint at {old_ck}")
    old_prof = rep.reproduction.get("profile")
    if profile and old_prof and str(old_prof) != str(profile):
        return _fresh(p, f"it is a report for the profile {old_prof}")
    return rep


def keep_previous(p: Path) -> Path:
    """Copy the report ``p`` to ``report.previous-<time>[-n].json`` beside it (never over an earlier copy) and
    return the copy's path."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    keep = p.with_name(f"report.previous-{stamp}.json")
    n = 1
    while keep.exists():  # never overwrite an earlier kept report
        keep = p.with_name(f"report.previous-{stamp}-{n}.json")
        n += 1
    shutil.copyfile(p, keep)
    return keep


def _fresh(p: Path, why: str) -> Report:
    keep = keep_previous(p)
    print(f"note: {p} not merged into ({why}); starting a new report, the old one is kept as {keep.name}",
          file=sys.stderr)
    return Report()


def replaced_passing_stages(rep: "Report", stages: list[Stage]) -> list[str]:
    """Tiers whose passed stage in ``rep`` the failed or interrupted ``stages`` would replace (their measurements
    would be lost from the merged report)."""
    return [s.tier for s in stages if s.status != "passed" and s.tier in rep.stages
            and rep.stages[s.tier].status == "passed"]


class Timer:
    """Context manager measuring wall time in seconds (``time.perf_counter``)."""

    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
