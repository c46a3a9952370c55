"""Shared CLI plumbing: common options, one-line errors with exit codes, report writing, progress bars.

Exit codes (DESIGN.md §7): 0 ok, 1 a tier failed, 2 bad input or usage, 3 environment / hardware.
Expected failures (:class:`k3rocm.errors.K3Error`) print ONE line ``error: ...`` on stderr and no
traceback, unless ``--debug``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
from rich.table import Table

from k3rocm.config import PRESETS
from k3rocm.errors import Interrupted, K3Error, Terminated, os_error
from k3rocm.validation.evidence import command_line, reproduction_block
from k3rocm.validation.render import DeferSignals, update_report

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENV = 0, 1, 2, 3


def console(stderr: bool = False):
    """A rich console bound to the current stdout/stderr at call time (works under click's test runner)."""
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    # into a file or pipe: wide enough that tables are not cut (COLUMNS still wins when set)
    width = None if tty or os.environ.get("COLUMNS") else 200
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def fail(msg: str, code: int) -> None:
    """Print ``error: msg`` (one line) on stderr and exit with ``code``."""
    click.echo(f"error: {msg}", err=True)
    raise SystemExit(code)


#: what the running command has written and kept so far, as the clause its SIGTERM line ends with (None: nothing)
_KEPT: dict[str, str | None] = {"kept": None}


def kept(clause: str) -> None:
    """Record what the running command has written and kept (``"what finished before it is in <report>"``), so a
    SIGTERM that ends it later says where that is; the latest call wins. Raises nothing."""
    _KEPT["kept"] = clause


def terminated_line() -> str:
    """The one line of a command ended by SIGTERM: where what it kept is (:func:`kept`), or that nothing was
    written (every writer removes its partial output: reports are written whole or not at all, a checkpoint in
    a temporary directory, an ``--out`` this command created is removed again)."""
    return f"terminated (SIGTERM); {_KEPT['kept'] or 'nothing was written'}"


def handle_errors(fn: Callable) -> Callable:
    """Turn a :class:`K3Error` into its one-line message and exit code; ``--debug`` adds the traceback.

    An :class:`OSError` that reaches here (no space, a path that is a directory, a symlink loop) is one line
    too, with the exit code of its class (:func:`k3rocm.errors.os_error`: 3 environment, 2 bad input). SIGTERM
    exits 143 with :func:`terminated_line`: where the report is only when one was written."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool(kwargs.get("debug"))
        _KEPT["kept"] = None  # a command starts with nothing written (several commands may run in one process)
        try:
            return fn(*args, **kwargs)
        except K3Error as e:
            if debug:
                traceback.print_exc()
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__, e.exit_code)
        except OSError as e:
            if debug:
                traceback.print_exc()
            err = os_error(e)
            fail(str(err), err.exit_code)
        except Terminated:
            fail(terminated_line(), 143)
        except KeyboardInterrupt:
            fail(f"interrupted (Ctrl-C); {_KEPT['kept'] or 'nothing was written'}", 130)
    return wrapper


def checkpoint_option(f):
    return click.option("--checkpoint", "checkpoint", type=click.Path(path_type=str), default=None,
                        metavar="DIR", help="Checkpoint directory (config.json + index + shards). "
                        "Default: the embedded k3-tiny, written once into the user cache.")(f)


def not_empty(what: str):
    """A click callback refusing an empty (or blank) value with one usage line: an empty string must never
    fall back to a default silently."""
    def cb(ctx, param, value):
        if value is not None and not str(value).strip():
            raise click.BadParameter(f"is empty; {what}")
        return value
    return cb


def profile_option(f):
    return click.option("--profile", default=None, metavar="NAME|FILE",
                        callback=not_empty("pass a profile name (see `k3rocm profiles`) or omit it to detect"),
                        help="Hardware profile (see `k3rocm profiles`), or a profile file (*.toml in the "
                             "format of hwprofiles/, e.g. a copy with another device count). Default: detected.")(f)


def out_option(f):
    return click.option("--out", default="reports/latest", show_default=True, metavar="DIR",
                        callback=not_empty("pass a report directory or omit it for reports/latest"),
                        help="Report directory; report.json/md/html are merged with what is already there.")(f)


def kernels_option(f, hidden: bool = False):
    return click.option("--kernels", default="auto", show_default=True, metavar="SPEC", hidden=hidden,
                        help="Kernel choice: auto | torch | triton, or per op: "
                             "'kda_prefill=triton,moe_experts=torch'.")(f)


def debug_option(f):
    return click.option("--debug", is_flag=True, help="Show tracebacks for expected errors.")(f)


def _seed(ctx, param, value):
    """``--seed``: an integer in 0 .. 2^63 - 1 (torch's generator range), else one clear line."""
    if value is not None and not 0 <= value < 2**63:
        raise click.BadParameter(f"{value} is outside 0 .. 2^63 - 1; pass a non-negative integer such as 0 or 1234")
    return value


def seed_option(f, hidden: bool = False):
    return click.option("--seed", default=0, type=int, callback=_seed, metavar="N", hidden=hidden,
                        help="Seed of generated inputs: prompts, synthetic weights (default 0).")(f)


def common_options(f=None, *, kernels: bool = True):
    """``--checkpoint --profile --out --kernels --seed --debug`` (applied bottom-up). ``kernels=False`` (``load``,
    which runs no kernels and generates no inputs) keeps ``--kernels`` and ``--seed`` out of ``--help``; ``load``
    refuses either in one line when given anyway. Use as ``@common_options`` or ``@common_options(kernels=False)``."""
    def apply(f):
        for opt in (debug_option, functools.partial(seed_option, hidden=not kernels),
                    functools.partial(kernels_option, hidden=not kernels), out_option,
                    profile_option, checkpoint_option):
            f = opt(f)
        return f
    return apply if f is None else apply(f)


def synthetic_options(f):
    """``--synthetic --preset --tp --ep --rank`` (``validate`` and ``bench``): random weights of one rank of a
    layout, made on the device (no checkpoint); the values are checked by the session's pre-flight."""
    for opt in (
        click.option("--rank", type=int, default=None, metavar="R",
                     help="With --synthetic: the rank of the --tp/--ep layout this process runs (default 0)."),
        click.option("--ep", type=int, default=None,
                     help="With --synthetic: expert-parallel degree, a divisor of --tp (default: the profile's where it "
                          "divides --tp, else --tp)."),
        click.option("--tp", type=int, default=None,
                     help="With --synthetic: ranks of the layout (may exceed the profile's devices: as many "
                          "of the profile's GPUs as it needs; default: the profile's)."),
        click.option("--preset", default=None, metavar="NAME",
                     callback=not_empty("pass a preset name (k3, k3-tiny, k3-prefix-N, ...) or omit it"),
                     help=f"With --synthetic: the preset config ({', '.join(PRESETS)}; "
                          "default k3-tiny), or take it from --checkpoint's config.json."),
        click.option("--synthetic", is_flag=True,
                     help="Random weights made directly in device memory for one rank (--rank) of a layout "
                          "(--tp/--ep on --profile's GPU kind) instead of a checkpoint: times a model that is not "
                          "on disk. Outputs are of RANDOM weights (no correctness claim); collectives of the other "
                          "ranks are counted and their time projected from --profile's link bandwidth."),
    ):
        f = opt(f)
    return f


def make_session(checkpoint, profile, out, kernels, seed, debug, golden: str | None = None, synthetic: bool = False,
                 preset: str | None = None, tp: int | None = None, ep: int | None = None, rank: int | None = None,
                 min_fraction: float | None = None):
    """Build a :class:`k3rocm.validation.session.Session` from the common options (and ``validate``'s
    ``--golden``, the :func:`synthetic_options`)."""
    from k3rocm.validation.session import Options, Session  # torch: 1.2 s (measured); --help needs none

    opts = Options(checkpoint=checkpoint, profile=profile, out=out, kernels=kernels, seed=seed, debug=debug,
                   command=command_line(), golden=golden, synthetic=synthetic, preset=preset, tp=tp, ep=ep, rank=rank,
                   min_fraction=min_fraction)
    return Session(opts)


def synthetic_note(session) -> str | None:
    """The loud line of a ``--synthetic`` run (random weights: no correctness claim), else None."""
    if not getattr(session, "synthetic", False):
        return None
    from k3rocm.runtime.synthetic import RANDOM_WEIGHTS_NOTE  # torch: 1.2 s (measured); --help needs none

    return f"WARNING: {RANDOM_WEIGHTS_NOTE}"


def checkpoint_session(checkpoint: str | None):
    """A :class:`k3rocm.validation.session.Session` of ``--checkpoint`` alone (``checkpoint inspect`` / ``verify``,
    ``plan --checkpoint``): its ``checkpoint_dir`` resolves the directory (None: the embedded k3-tiny)."""
    from k3rocm.validation.session import Options, Session  # torch: 1.2 s (measured); --help needs none

    return Session(Options(checkpoint=checkpoint))


class Progress:
    """Progress of long work with a ``(done, total)`` callback: a rich bar on a terminal, plain lines otherwise.

    On a terminal (stderr is a TTY) a transient rich bar; when stderr is a file or a pipe (CI, batch jobs, a
    remote shell) one line ``k3rocm: <what>: <done>/<total> (<pct>%), <elapsed> s`` at most every
    ``interval_s`` seconds and at completion, so a long load or validation is never silent in a log.
    Use as a context manager; ``cb = bar.callback("loading")`` gives the function to pass down: ``cb(done, total,
    failed=n, tokens=n)`` (``failed`` requests are shown apart from the finished count, ``tokens`` streamed so far).
    """

    def __init__(self, enabled: bool = True, interval_s: float = 10.0):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.interval_s = interval_s
        self._p = None

    def __enter__(self) -> "Progress":
        if self.enabled and self.tty:
            self._p = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), console=console(stderr=True), transient=True)
            self._p.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)

    def callback(self, description: str) -> Callable:
        if not self.enabled:
            return lambda *a, **k: None
        if self._p is None:
            return self._plain(description)
        task = self._p.add_task(description, total=None)
        label = [description]

        def cb(done=None, total=None, text=None, *_, failed=0, tokens=None, **__):
            if text == VERIFY_TEXT and label[0] == description:  # the load's verification pass starts
                label[0] = f"{description}: {VERIFY_TEXT}"
            if total is not None:
                self._p.update(task, total=total)
            if done is not None:
                self._p.update(task, completed=done, description=label[0] + _extra(failed, tokens))
        return cb

    def note(self, text: str) -> None:
        """One line ``k3rocm: <text>`` on stderr (what a long run is about to do), above a bar on a terminal."""
        if not self.enabled:
            return
        if self._p is not None:
            self._p.console.print(f"k3rocm: {text}", highlight=False, markup=False)
        else:
            print(f"k3rocm: {text}", file=sys.stderr, flush=True)

    def stage(self, name: str) -> None:
        """Say that a tier / stage starts: a plain line when stderr is not a terminal (the bar says it otherwise)."""
        if self.enabled and self._p is None:
            print(f"k3rocm: {name} ...", file=sys.stderr, flush=True)

    def _plain(self, description: str) -> Callable:
        t0 = time.monotonic()
        state = {"last": -1e9, "total": None, "finished": False, "label": description}

        def cb(done=None, total=None, text=None, *_, failed=0, tokens=None, **__):
            if text == VERIFY_TEXT and state["label"] == description:  # the load's verification pass starts
                state.update(label=f"{description}: {VERIFY_TEXT}", finished=False, last=-1e9)
            if total is not None and total != state["total"] and state["finished"]:
                state.update(finished=False, last=-1e9)  # the next phase on this bar (another total): said again
            if total is not None:
                state["total"] = total
            if done is None:
                return
            now, tot = time.monotonic(), state["total"]
            finished = tot is not None and done >= tot
            if finished and state["finished"]:
                return
            # a new failure is always said (a log's counts then agree with the error that may follow)
            if not finished and now - state["last"] < self.interval_s and failed == state.get("failed", 0):
                return
            state["last"], state["finished"], state["failed"] = now, finished, failed
            pct = f" ({100.0 * done / tot:.0f}%)" if tot else ""
            of = f"/{tot:,}" if tot is not None else ""
            print(f"k3rocm: {state['label']}: {done:,}{of}{pct}{_extra(failed, tokens)}, {now - t0:.0f} s",
                  file=sys.stderr, flush=True)
        return cb


#: the text a load's progress callback gets once its verification pass starts (``k3rocm.runtime.load.VERIFY_TEXT``,
#: not imported: the loader imports torch, which ``--help`` never loads)
VERIFY_TEXT = "verifying"


def _extra(failed: int = 0, tokens: int | None = None) -> str:
    """``", 2 failed, 1,234 tokens"``: failed requests counted apart from the finished ones, tokens so far."""
    return (f", {failed:,} failed" if failed else "") + (f", {tokens:,} token{'' if tokens == 1 else 's'}" if tokens else "")


def write_stages(session, stages) -> Path:
    """Merge ``stages`` into ``--out``'s report (same checkpoint config) and write json/md/html.

    Ctrl-C / SIGTERM from the moment ``--out`` is created until the report is written whole is held and acted on
    afterwards (exit 130 / 143, one line naming the report), so an interrupt never leaves an ``--out`` without
    the report of the stages that finished."""
    out = Path(session.opts.out)
    try:
        with DeferSignals():
            out, paths = _write_stages(session, stages)
    except KeyboardInterrupt as e:  # held until the report was written whole (render.DeferSignals), then raised
        how, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("Ctrl-C", 130)
        fail(f"interrupted ({how}) while the report was written; it was written whole first: {out / 'report.html'}",
             code)
    kept(f"what finished before it is in the report {paths['html']}")
    return paths["html"]


def _write_stages(session, stages) -> tuple[Path, dict[str, Path]]:
    """:func:`write_stages` without the signal handling: ``(out directory, paths of report.json/md/html)``."""
    from k3rocm.validation.session import require_dir_for_output  # torch: 1.2 s (measured); --help needs none
    from k3rocm.validation.tiers.thresholds import THRESHOLDS  # torch and triton, as above

    out = require_dir_for_output(session.opts.out)
    cfg_hash = ckpt = dev = prof = None
    try:
        cfg_hash = session.config.config_hash()
    except K3Error:
        pass
    try:
        ckpt = str(session.checkpoint_dir)
    except K3Error:
        ckpt = session.opts.checkpoint
    try:
        dev = session.device_block()
        prof = session.profile.name
    except K3Error:
        pass
    extra = {}
    sel = session.kernel_selection()
    if sel:
        extra["kernel_selection"] = sel
    eng = session._cache.get("engine")
    if eng is not None and hasattr(eng, "describe"):
        d = eng.describe()
        extra["engine"] = d if isinstance(d, dict) else str(d)
    if session.opts.golden:
        extra["golden"] = str(Path(session.opts.golden).resolve())
    if session.opts.endpoint is not None:
        extra["endpoint"] = session.opts.endpoint.to_dict()
    line = fallback_line(session)
    if line:  # the console's last line, in the written report too
        extra["fallback_note"] = line
    note = synthetic_note(session)
    if note:
        pl = session.run_placement
        extra["synthetic"] = {"note": note, "preset": session.config.name, "tp": pl.tp, "ep": pl.ep,
                              "rank": session.rank}
    block = reproduction_block(command=session.opts.command, checkpoint=ckpt, config_hash=cfg_hash,
                               seed=session.opts.seed, device=dev, profile=prof, kernels=session.opts.kernels,
                               thresholds=THRESHOLDS, extra=extra)
    return out, update_report(out, block, stages, config_hash=cfg_hash, checkpoint=ckpt, profile=prof)


def print_stages(stages, session=None) -> None:
    """A rich table of the stages just run, then the failing rows; with ``session``, on a fallback run (the profile's
    hardware is not here) a last line saying that nothing ran on the profile's hardware."""
    c = console()
    t = Table(title=None, show_lines=False)
    for col in ("tier", "status", "seconds", "evidence", "failures"):
        t.add_column(col)
    colors = {"passed": "green", "failed": "red", "error": "red", "skipped": "dim"}
    for s in stages:
        t.add_row(s.tier, f"[{colors.get(s.status, 'white')}]{s.status}[/]", f"{s.seconds:.2f}",
                  str(len(s.evidence)), str(len(s.failures)))
    c.print(t)
    for s in stages:
        for e in s.failures:
            c.print(f"  [red]FAIL[/] {s.tier}.{e.name} = {e.value} {e.unit} (needs {e.threshold}; {e.level})")
    line = fallback_line(session) if session is not None else None
    if line:
        c.print(f"[yellow]{line}[/]", markup=True, highlight=False, soft_wrap=True)
    note = synthetic_note(session) if session is not None else None
    if note:
        c.print(f"[bold red]{note}[/]", markup=True, highlight=False, soft_wrap=True)


def fallback_line(session) -> str | None:
    """``"note: nothing ran on <profile>'s hardware (...): every measurement is measured-fallback, taken on ..."``
    when the session's profile names other hardware than this machine's; on its hardware, for ``--synthetic``, why
    the measurements are measured-fallback all the same; else None. Raises nothing."""
    try:
        if session.hardware_matches:
            if getattr(session, "synthetic", False):
                return ("note: --synthetic: every measurement is measured-fallback even on the profile's hardware: "
                        "one process with random weights standing for one rank of a layout is not the layout")
            return None
        p, d = session.profile, session.device_block()
    except K3Error:
        return None
    want = f"{p.device_count} x {p.device_name}, {p.arch}"
    have = d["sku"] if d["backend"] == "cpu" else f"{d['count']} x {d['sku']}, {d['arch']}"
    return (f"note: nothing ran on {p.name}'s hardware ({want}): every measurement is measured-fallback, "
            f"taken on this machine's {have}")


def run_tiers_kept(session, level: str, what: str = "working") -> list:
    """``run_tiers(session, level)`` under a progress bar, keeping what finished when interrupted.

    On Ctrl-C / SIGTERM during a tier: the tiers that finished and an ``error`` stage for the interrupted one
    ("interrupted (Ctrl-C) during this tier") are written to the report, then :class:`Interrupted` is raised
    (exit 130, 143 for SIGTERM) naming them. Returns the stages when every tier ran.
    """
    from k3rocm.validation.evidence import Stage, now_iso  # (with render: imported at module load already)
    from k3rocm.validation.tiers import run_tiers  # torch: 1.2 s (measured); --help needs none

    done: list = []
    current = {"tier": None}
    # each tier that reports progress gets its own bar, named for its work ("working" only for another tier)
    labels = {"load": "generating random weights" if getattr(session, "synthetic", False) else "loading",
              "performance": "benchmarking"}
    try:
        with Progress() as bar:
            bars: dict = {}

            def start(t):
                current["tier"] = t
                bar.stage(f"tier {t}")

            def progress(*a, phase=None, **k):
                key = (current["tier"], phase)  # a bench's warm-up and measured phases: a bar each, named
                if key not in bars:
                    name = labels.get(key[0], what) if what == "working" else what
                    bars[key] = bar.callback(name + {"warmup": " warm-up", "measure": " measured"}.get(phase, ""))
                bars[key](*a, **k)
            return run_tiers(session, level, progress=progress, on_start=start, on_stage=done.append)
    except KeyboardInterrupt as e:
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        tier = current["tier"]
        stages = list(done)
        if tier is not None and not any(st.tier == tier for st in done):
            stages.append(Stage(tier, status="error", started=now_iso(), command=session.opts.command,
                                error=f"interrupted ({how}) during this tier: it did not finish"))
        html = write_stages(session, stages) if stages else None
        err = Interrupted(f"interrupted ({how}) during tier {tier}; " + (
            f"{len(done)} finished tier(s) and the interrupted one are in {html}" if html else "nothing was written"))
        if how == "SIGTERM":
            err.exit_code = 143
        raise err from None


def report_and_finish(session, stages, html: Path, extra: Callable | None = None) -> None:
    """Print the stage tables (and ``extra()``), then :func:`finish`; the report is already written, so a Ctrl-C
    while printing says so (exit 130) instead of a bare "interrupted"."""
    try:
        print_stages(stages, session)
        if extra is not None:
            extra()
    except KeyboardInterrupt as e:
        how, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("Ctrl-C", 130)
        fail(f"interrupted ({how}) while printing the tables; the report is complete: {html}", code)
    finish(stages, html)


#: the longest failure detail :func:`finish` shows whole (the tiers' listed details stay under it)
WHY_MAX = 360


def finish(stages, report_html: Path) -> None:
    """Print where the report is and exit: 0 all passed, else the first failing stage's code, one line."""
    click.echo(f"report: {report_html}")
    for s in stages:
        if s.status == "error":
            # an interruption is not a tier that could not run: it ran and was stopped (its text says how far)
            what = "was stopped" if str(s.error or "").startswith("interrupted") else "could not run"
            fail(f"{s.tier} tier {what}: {s.error}", getattr(s, "exit_code", EXIT_USAGE))
        if s.status == "failed":
            f = s.failures[0]
            why = " ".join(str(getattr(f, "detail", "") or "").split())  # one line, whatever the detail holds
            # the tiers keep their details short by listing whole items ("… and N more", evidence.listed), so
            # the detail is shown whole; only a runaway one is cut, at a word and marked
            if len(why) > WHY_MAX:
                why = why[:WHY_MAX].rsplit(" ", 1)[0] + " … (the rest in the report)"
            why = f" — {why}" if why else ""
            fail(f"{s.tier} tier failed: {f.name} = {f.value} {f.unit}".rstrip()
                 + f" (needs {f.threshold}){why}; see {report_html}", EXIT_FAILED)
