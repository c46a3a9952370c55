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
    """Console-script entry point (``k3rocm = k3rocm.cli.main:main``)."""
    cli.main(args=argv, prog_name="k3rocm")


if __name__ == "__main__":  # pragma: no cover
    main()
