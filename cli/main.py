"""The ``k3rocm`` command: plan, load, validate and benchmark Kimi K3 on a node of GPUs.

Thin: every command parses its options, calls the library and renders with rich. Command groups live
in their own modules (:mod:`.run`: load/validate/bench; :mod:`.info`: profiles/env/plan;
:mod:`.ckpt`: checkpoint make|inspect|verify; :mod:`.kern`: kernels isa|list).
"""

from __future__ import annotations

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
Exit codes: 0 ok, 1 a validation tier failed, 2 bad input or usage, 3 environment/hardware problem.
"""


@click.group(help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="k3rocm", prog_name="k3rocm")
def cli() -> None:
    pass


for mod in (run, info, ckpt, kern):
    mod.register(cli)


def main(argv=None) -> None:
    """Console-script entry point (``k3rocm = k3rocm.cli.main:main``).

    Usage errors (unknown option, a value outside a choice) print one ``error:`` line naming the command's
    ``--help``, exit 2, as every other expected failure does. SIGTERM (a job scheduler, ``timeout``) ends
    the run like Ctrl-C, so temporary directories are removed on the way out.
    """
    import signal
    import sys

    def _term(signum, frame):  # raise in the main thread: the writers' cleanup handlers run
        raise SystemExit(143)

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread (embedded use): leave the handler alone
        pass
    try:
        cli.main(args=argv, prog_name="k3rocm", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as e:  # a bare group: its help is the answer
        click.echo(e.ctx.get_help() if e.ctx else e.format_message())
        sys.exit(0)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "k3rocm"
        click.echo(f"error: {e.format_message()} (see `{cmd} --help`)", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
