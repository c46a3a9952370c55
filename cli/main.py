"""The ``k3rocm`` command: plan, load, validate and benchmark Kimi K3 on a node of GPUs.

Thin: every command parses its options, calls the library and renders with rich. Command groups live
in their own modules (:mod:`.run`: load/validate/bench; :mod:`.info`: profiles/env/plan;
:mod:`.ckpt`: checkpoint make|inspect|verify; :mod:`.kern`: kernels isa|list). The library modules that import
torch (~1.2 s, measured) or Triton are imported inside the commands that use them, so that ``k3rocm --help``,
``plan --preset`` and ``profiles`` start in ~0.3 s.
"""

from __future__ import annotations

import os
import signal
import sys

import click

from k3rocm.cli import ckpt, info, kern, run

HELP = """Plan, load, validate and benchmark Kimi K3 (and the embedded k3-tiny) on ROCm / CUDA / CPU.

\b
The three jobs:
  k3rocm load     --profile mi355x-8 --checkpoint /models/Kimi-K3
  k3rocm validate --level correctness --profile mi355x-8 --checkpoint /models/Kimi-K3
  k3rocm bench    --concurrency 1,8,64 --profile mi355x-8 --checkpoint /models/Kimi-K3

\b
Without --checkpoint every command uses the embedded k3-tiny checkpoint (written once into the
user cache); without --profile the hardware is detected (`cpu` when there is no GPU). Reports go to
--out (default reports/latest): report.json, report.md, report.html, merged across commands.

\b
Exit codes: 0 ok, 1 a validation tier failed, 2 bad input or usage, 3 environment/hardware problem
(a rank of a multi-GPU run that failed, died or hung included), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).

\b
Across GPUs: the profile's [parallel] tp/ep decide the processes (one per GPU; gloo processes on a
cpu profile); this process is rank 0. Across nodes: torchrun ... -m k3rocm.cli <command> on every
node. K3ROCM_DIST_TIMEOUT (seconds, default 300) bounds every collective. See README "Across GPUs".
K3ROCM_SOURCE_COMMIT names the commit of a source copy without git metadata; reports mark it "(declared)".
"""


@click.group(help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="k3rocm", prog_name="k3rocm")
def cli() -> None:
    pass


for mod in (run, info, ckpt, kern):
    mod.register(cli)


class _PipeSafeStdout:
    """``sys.stdout`` that outlives a closed pipe (``k3rocm plan | head -1``): after the reader is gone, output
    is dropped and the command runs on to its end, so its report is still written and its exit code still
    means what it says. The real stream's descriptor is pointed at /dev/null so Python's exit-time flush stays
    quiet."""

    def __init__(self, stream):
        self._s = stream
        self._dead = False

    def _die(self) -> None:
        self._dead = True
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, self._s.fileno())
            os.close(fd)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text):
        if not self._dead:
            try:
                return self._s.write(text)
            except BrokenPipeError:
                self._die()
        return len(text)

    def flush(self) -> None:
        if not self._dead:
            try:
                self._s.flush()
            except BrokenPipeError:
                self._die()

    def __getattr__(self, name):  # encoding, isatty, fileno, buffer, ...
        return getattr(self._s, name)


def _command_path(args: list[str]) -> str:
    """``k3rocm`` plus the (sub)command names that lead ``args`` (``["load", "--checkpoint"]`` ->
    ``"k3rocm load"``), for the ``--help`` a usage error points to."""
    path, grp = ["k3rocm"], cli
    for a in args:
        sub = grp.commands.get(a) if isinstance(grp, click.Group) else None
        if sub is None:
            break
        path.append(a)
        grp = sub
    return " ".join(path)


def main(argv=None) -> None:
    """Console-script entry point (``k3rocm = k3rocm.cli.main:main``).

    Usage errors (unknown option, a value outside a choice) print one ``error:`` line naming the command's
    ``--help``, exit 2, as every other expected failure does. SIGTERM (a job scheduler, ``timeout``) ends
    the run like Ctrl-C, so temporary directories are removed on the way out.
    """
    def _term(signum, frame):  # raise in the main thread: the writers' cleanup handlers run, a sweep keeps its points
        from k3rocm.errors import Terminated
        raise Terminated()

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread (embedded use): leave the handler alone
        pass
    if "RANK" in os.environ and os.environ.get("RANK") != "0":
        # a torchrun rank other than 0 runs no command: it follows rank 0 (k3rocm.runtime.serve). Imported only
        # here: it pulls in torch (~1.3 s), which commands like `plan --help` never need
        from k3rocm.runtime.serve import follow, torchrun_follower
        if torchrun_follower():
            follow()
            sys.exit(0)
    from k3rocm.errors import ConfigError
    from k3rocm.hw import declared_commit, dist_timeout, tune_env
    try:  # checked before any work, so a malformed value never surfaces only when the report is written
        declared_commit()
        dist_timeout()  # (every command: a junk value is refused even where one process serves)
        tune_env()
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if not isinstance(sys.stdout, _PipeSafeStdout):
        sys.stdout = _PipeSafeStdout(sys.stdout)
    if not isinstance(sys.stderr, _PipeSafeStdout):  # `2>&1 | head`: progress lines go to a closed pipe too
        sys.stderr = _PipeSafeStdout(sys.stderr)
    try:
        cli.main(args=argv, prog_name="k3rocm", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as e:
        # a group with no command (`k3rocm`, `k3rocm checkpoint`): a usage error, as click itself treats it: the
        # help on stderr, exit 2, so a script that forgot its command does not pass
        click.echo(e.ctx.get_help() if e.ctx else e.format_message(), err=True)
        sys.exit(2)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "k3rocm"
        if cmd == "k3rocm":  # an option's missing value is raised before the subcommand has a context
            cmd = _command_path(sys.argv[1:] if argv is None else list(argv))
        click.echo(f"error: {e.format_message()} (see `{cmd} --help`)", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
