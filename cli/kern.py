"""``k3rocm kernels list | isa``."""

from __future__ import annotations

import json

import click
from rich.markup import escape
from rich.table import Table

from k3rocm.cli.common import console, debug_option, handle_errors, kernels_option
from k3rocm.errors import HardwareError


@click.group("kernels")
def kernels_group():
    """The kernel registry (which implementation runs each op) and ahead-of-time ISA checks."""


@kernels_group.command("list", epilog="""\b
Examples:
  k3rocm kernels list
  k3rocm kernels list --kernels torch
  k3rocm kernels list --kernels kda_prefill=triton""")
@kernels_option
@debug_option
@handle_errors
def list_cmd(kernels, debug):
    """Every op, its registered implementations and the one selected here (with --kernels applied).

    An implementation --kernels asks for that cannot run on this machine (triton without a GPU) is listed as
    unavailable with the reason, instead of failing: this command only reports (validate / bench refuse it).
    """
    from k3rocm.runtime import registry  # torch: 1.2 s (measured); --help needs none

    ov = registry.parse_override(kernels)
    t = Table(title="kernel registry")
    for col in ("op", "implementations", "selected", "note"):
        t.add_column(col)
    for op in registry.ORACLE_OPS:
        impls = registry.implementations(op)
        try:
            name, impl = registry.select(op, ov)
            t.add_row(op, ", ".join(sorted(impls)), name, impl.note)
        except HardwareError as e:
            t.add_row(op, ", ".join(sorted(impls)), "[red]unavailable[/]", str(e).split(";")[0])
    console().print(t)
    missing = [i for i in registry.IMPLS if not any(i in registry.implementations(op) for op in registry.ORACLE_OPS)]
    if missing:
        console().print(f"{', '.join(missing)}: a registry slot with no kernels wired in yet (--kernels "
                        f"{missing[0]} is refused); ops run on the implementations listed", highlight=False)


@kernels_group.command("isa", epilog="""\b
Examples:
  k3rocm kernels isa                          # every family, gfx950 + gfx942 + sm_90
  k3rocm kernels isa --target gfx950 --family moe
  k3rocm kernels isa --json""")
@click.option("--target", "targets", multiple=True, type=click.Choice(["gfx950", "gfx942", "sm_90"]),
              help="gfx950, gfx942, sm_90 (repeatable; default all three).")
@click.option("--family", "families", multiple=True, type=click.Choice(["kda", "mla", "attnres", "moe", "mx"]),
              help="Kernel family (repeatable; default all).")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as one JSON array (an object per kernel and target) instead of tables.")
@debug_option
@handle_errors
def isa_cmd(targets, families, as_json, debug):
    """Compile every Triton kernel ahead of time for gfx950 / gfx942 / sm_90 (no GPU needed) and report
    matrix instructions, registers, spills and LDS. Exit 1 when a kernel fails to compile, lacks the
    expected matrix instructions or spills on AMD."""
    from k3rocm.kernels.isa import TARGETS, run_isa  # triton: 0.1 s (measured); --help needs none

    reps = run_isa(tuple(targets) or TARGETS, tuple(families) or None)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in reps], indent=2))
    else:
        t = Table(title="ahead-of-time ISA")
        for col in ("kernel", "target", "matrix ops", "VGPR", "SGPR", "spills", "LDS B", "ok"):
            t.add_column(col)
        for r in reps:
            sp = "-" if r.vgpr_spill is None else f"{r.vgpr_spill}/{r.sgpr_spill}"
            t.add_row(escape(r.name), r.target, ", ".join(r.matrix_ops) or "-", str(r.vgpr if r.vgpr is not None else "-"),
                      str(r.sgpr if r.sgpr is not None else "-"), sp, str(r.lds_bytes if r.lds_bytes is not None else "-"),
                      "[green]ok[/]" if r.ok else "[red]" + "; ".join(r.problems()) + "[/]")
        console().print(t)
        if reps:
            ok = sum(r.ok for r in reps)
            kinds = len({r.name for r in reps})
            console().print(f"{ok}/{len(reps)} compilations ok ({kinds} kernel configs on "
                            f"{len({r.target for r in reps})} targets; a config that runs on one backend only is "
                            "compiled for its targets only)")
    if not reps:
        click.echo("no kernel family exposes isa_cases() yet")
    bad = [r for r in reps if not r.ok]
    if bad:
        click.echo(f"error: {len(bad)} of {len(reps)} kernel/target compilations have problems, first: "
                   f"{bad[0].name} on {bad[0].target}: {bad[0].problems()[0]}", err=True)
        raise SystemExit(1)


def register(cli: click.Group) -> None:
    cli.add_command(kernels_group)
