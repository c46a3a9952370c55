"""The three jobs: ``load``, ``validate``, ``bench``. Each adds its stages to the report in ``--out``."""

from __future__ import annotations

import re

from pathlib import Path

import click
from rich.table import Table

from k3rocm.bench.loadgen import DEFAULT_RANGE_RATIO
from k3rocm.checkpoint.verify import MANIFEST_NAME
from k3rocm.cli.common import (Progress, common_options, console, handle_errors, make_session, not_empty,
                               report_and_finish, run_tiers_kept, synthetic_options, write_stages)
from k3rocm.cli.info import print_plan
from k3rocm.errors import ConfigError, K3Error
from k3rocm.validation.render import fmt_value, point_levels, point_table, stage_settings


@click.command("load", epilog="""\b
Examples:
  k3rocm load                                            # embedded k3-tiny on this machine
  k3rocm load --profile mi355x-8 --checkpoint /models/Kimi-K3
  k3rocm load --checkpoint ./k3-tiny --out reports/tiny  # then open reports/tiny/report.html""")
@common_options(kernels=False)
@handle_errors
def load_cmd(checkpoint, profile, out, kernels, seed, debug):
    """Plan, place and stream the weights, and prove they landed (tiers env + load).

    Checks the index and every shard header before any device work, streams the tensors to the
    devices of the plan (MXFP4 experts stay packed) and records bytes per device, GB/s and scale
    sanity in the report.
    """
    if kernels != "auto":
        raise ConfigError(f"--kernels {kernels!r} has no effect on load (it streams and checks weights and runs no "
                          "kernels); drop --kernels, or give it to validate / bench")
    if click.get_current_context().get_parameter_source("seed") != click.core.ParameterSource.DEFAULT:
        # any value given, 0 included: load generates no inputs and makes no weights, so no seed changes it
        raise ConfigError(f"--seed {seed} has no effect on load (it streams and checks the checkpoint's weights and "
                          "generates nothing); drop --seed, or give it to validate / bench")
    s = make_session(checkpoint, profile, out, kernels, seed, debug)
    s.preflight()
    # the layout and per-rank bytes, before anything loads
    pl = s.run_placement
    if not s.hardware_matches:
        # the profile's plan (projected: what the target hardware would hold), then the one this machine loads with
        print_plan(s.placement, s.config.name, f"{s.profile.name} (projected: not this machine)")
    where = s.profile.name if s.hardware_matches else f"{pl.profile_name} (this machine; loads with this plan)"
    print_plan(pl, s.config.name, where)
    stages = run_tiers_kept(s, "load", "loading")  # a Ctrl-C keeps the finished tiers in the report
    # the report is written before the tables print: a Ctrl-C while they print loses nothing
    html = write_stages(s, stages)
    report_and_finish(s, stages, html, extra=lambda: _print_load(s))


def _print_load(session) -> None:
    """One table per rank after a load: bytes planned / loaded / on the device, GB/s; the raw-read ratio."""
    try:
        rep = session.load_report
    except K3Error:
        return  # the load tier already reported why
    t = Table(title=f"load: {rep.tensors_verified:,}/{rep.tensors_planned:,} tensors match the files read (checksum)")
    for col in ("rank", "planned GB", "loaded GB", "device GB", "s", "GB/s"):
        t.add_column(col)
    for r in rep.ranks:
        t.add_row(str(r), f"{rep.bytes_planned.get(r, 0) / 1e9:.3f}", f"{rep.bytes_loaded.get(r, 0) / 1e9:.3f}",
                  f"{rep.device_bytes_used.get(r, 0) / 1e9:.3f}", f"{rep.seconds.get(r, 0.0):.2f}",
                  f"{rep.gbps.get(r, 0.0):.2f}")
    c = console()
    c.print(t)
    c.print(f"aggregate {rep.aggregate_gbps:.2f} GB/s; raw sequential read of the same files "
            f"{rep.raw_read_gbps:.2f} GB/s (load / raw = {rep.load_vs_raw:.2f})"
            + ("" if rep.page_cache_dropped else "; the page cache could not be bypassed here (no O_DIRECT), so the raw "
               "figure may come from memory"), highlight=False)
    ck = getattr(session, "checkpoint_dir", None)
    if ck is not None and not getattr(session, "synthetic", False) and not (Path(ck) / MANIFEST_NAME).is_file():
        c.print(f"note: no {MANIFEST_NAME} in {ck}: the files themselves are not checked against known hashes "
                f"(write one from a trusted copy: k3rocm checkpoint verify --write-manifest)", highlight=False)


@click.command("validate", epilog="""\b
Examples:
  k3rocm validate                                  # every tier up to correctness, embedded k3-tiny
  k3rocm validate --level performance --out reports/demo
  k3rocm validate --level performance --min-fraction 0.5 --profile mi355x-8 --checkpoint /models/Kimi-K3
                                                   # fail unless every point reaches 0.5 of its roofline
  k3rocm validate --level correctness --profile mi355x-8 --checkpoint /models/Kimi-K3
  k3rocm validate --checkpoint ckpt/ --golden golden.safetensors   # + external golden logits
  k3rocm validate --kernels moe_experts=torch,kda_prefill=triton  # choose implementations per op
  k3rocm validate --level forward --synthetic --preset k3 --profile h200-8 --tp 16 --ep 16 --rank 0
                                                   # random weights of one rank of K3 (no checkpoint)""")
@click.option("--level", type=click.Choice(["env", "load", "forward", "correctness", "performance"]),
              default=None, help="Run every tier up to this one; stop at the first failure. Default: correctness "
                                 "(forward with --synthetic).")
@click.option("--golden", type=click.Path(path_type=str), default=None, metavar="FILE",
              help="External golden outputs (safetensors: input_ids, logits, layerNN.attn_out/mlp_out, "
                   "logits_top1_margin, greedy_prompt, greedy_tokens, greedy_margins) to compare the fp32 oracle "
                   "against; checked tensor by tensor before any tier runs.")
@click.option("--min-fraction", type=float, default=None, metavar="F",
              help="Make speed a pass/fail check: the performance tier fails unless every concurrency point reaches "
                   "this fraction of the roofline over all steps (0 < F <= 1; the floor is projected from the "
                   "profile's ceilings, so the check is too). Default: the fraction is reported, not judged.")
@synthetic_options
@common_options
@handle_errors
def validate_cmd(level, golden, min_fraction, synthetic, preset, tp, ep, rank, checkpoint, profile, out, kernels, seed,
                 debug):
    """Run the validation tiers env → load → forward → correctness → performance.

    Correctness compares the selected implementation path (the kernel registry's choice per op, see
    `k3rocm kernels list`) with the fp32 oracle layer by layer: per-layer error, logits KL,
    top-1 agreement, max error, decode-vs-prefill equality. With --golden, or on the official
    checkpoint (its known answers), it adds `external` evidence. With --synthetic (random weights) only env,
    load and forward mean anything: higher levels are refused.
    """
    if golden is not None and level in ("env", "load", "forward"):
        raise ConfigError(f"--golden is compared in the correctness tier, which --level {level} does not reach; "
                          "use --level correctness (the default) or performance, or drop --golden")
    level = level or ("forward" if synthetic else "correctness")
    if min_fraction is not None:
        if not 0 < min_fraction <= 1:
            raise ConfigError(f"--min-fraction {min_fraction} must be in (0, 1] (a fraction of the roofline, e.g. 0.5)")
        if synthetic:  # said before --level: the level that would check it is refused with --synthetic as well
            raise ConfigError("--min-fraction with --synthetic: the fraction is judged in the performance tier, which "
                              "runs only after the correctness tier passes, and random weights have no correct "
                              "answer; drop --min-fraction (`k3rocm bench --synthetic` reports the fraction of the "
                              "roofline unjudged)")
        if level != "performance":
            raise ConfigError(f"--min-fraction is checked in the performance tier, which --level {level} does not "
                              "reach; add --level performance, or drop --min-fraction")
    if synthetic and level == "correctness":
        raise ConfigError("--level correctness with --synthetic: random weights have no correct answer to compare "
                          "with; use --level forward, or `k3rocm bench --synthetic` for timings")
    if synthetic and level == "performance":
        # run_tiers runs every tier up to --level and stops at the first that does not pass: performance comes
        # after correctness, which random weights cannot pass
        raise ConfigError("--level performance with --synthetic: the performance tier runs only after the "
                          "correctness tier passes, and random weights have no correct answer to pass it with; use "
                          "`k3rocm bench --synthetic` for timings, or --level forward")
    s = make_session(checkpoint, profile, out, kernels, seed, debug, golden=golden, synthetic=synthetic,
                     preset=preset, tp=tp, ep=ep, rank=rank, min_fraction=min_fraction)
    s.preflight()
    stages = run_tiers_kept(s, level)  # a Ctrl-C keeps the finished tiers in the report
    if stages:  # --synthetic: the random-weights row in the report (no-op otherwise)
        s.synthetic_rows(stages[-1], [], stages[-1].tier)
    # the report is written before the tables print: a Ctrl-C while they print loses nothing
    html = write_stages(s, stages)
    report_and_finish(s, stages, html)


@click.command("bench", epilog="""\b
Examples:
  k3rocm bench                                         # embedded k3-tiny, small defaults on CPU
  k3rocm bench --concurrency 1,8,64 --input-len 1024 --output-len 1024 --profile mi355x-8 \\
               --checkpoint /models/Kimi-K3
  k3rocm bench --concurrency 4 --num-prompts 20 --warmups 2 --out reports/demo
  k3rocm bench --synthetic --preset k3-prefix-4 --concurrency 64 --input-len 256 --output-len 64 \\
               --max-num-batched-tokens 1024   # on a GPU of >= 80 GB (58 GB of random weights); larger
                                               # steps: more tok/s and shorter TTFT, a longer ITL tail
  k3rocm bench --endpoint http://localhost:8000 --model moonshotai/Kimi-K3 --endpoint-gpus 8 \\
               --concurrency 64 --input-len 1024 --output-len 1024   # hold a vLLM/SGLang deployment to the same load
  k3rocm bench --synthetic --preset k3 --profile mi355x-8 --tp 16 --ep 16 --rank 0 --concurrency 1,64
                                     # one rank of K3 at TP16/EP16 with random weights (no checkpoint):
                                     # step measured here, collectives and TPOT on mi355x-8 projected
                                     # (~108 GB on one GPU; an 80 GB card: --preset k3-prefix-48)

\b
Defaults follow InferenceX's random dataset: lengths uniform in [0.8 L, L], num-prompts = 10 x
concurrency, warm-ups = 2 x concurrency. Without --input-len/--output-len/--concurrency: 1024/1024
at concurrency 64 for a real checkpoint on a GPU profile or an --endpoint; 64/16 at concurrency 4
for a small checkpoint (k3-tiny) or on the CPU. --output-len is at least 2 (TPOT and ITL need a
second output token; output draws start at 2) and --num-prompts at least the largest concurrency.

\b
With --endpoint the server runs its own kernels (--kernels is refused) and the tok/s/GPU figures
divide by the GPUs that serve it: --endpoint-gpus N, else the device count of --profile; with
neither the run is refused rather than assume 1.""")
@click.option("--concurrency", default=None, metavar="N[,N...]",
              help="Concurrent requests, or a list: 1,8,64. Default: 64 for an endpoint or a checkpoint of >= 1 GB "
                   "on a GPU profile, else 4.")
@click.option("--input-len", type=int, default=None, metavar="TOKENS",
              help="Prompt length L in tokens (drawn in [ratio*L, L]). Default: 1024 (large runs, as above), else 64.")
@click.option("--output-len", type=int, default=None, metavar="TOKENS",
              help="Output length L in tokens, at least 2 (drawn in [max(2, ratio*L), L]; EOS ignored): with one "
                   "output token there is no TPOT or ITL. Default: 1024 (large runs), else 16.")
@click.option("--num-prompts", type=int, default=None,
              help="Measured requests per point (default 10 x concurrency); at least the largest concurrency.")
@click.option("--range-ratio", type=float, default=DEFAULT_RANGE_RATIO, show_default=True,
              help="Lower end of the length draws, in (0, 1]: each request's input and output lengths are drawn "
                   "uniformly from [ratio x length, length]; 1 for fixed lengths.")
@click.option("--warmups", type=int, default=None, help="Warm-up requests per point (default 2 x concurrency).")
@click.option("--endpoint", default=None, metavar="URL",
              help="Run the same load against an OpenAI-compatible server (/v1/completions, streaming) instead "
                   "of the built-in engine; the prompts use the checkpoint's vocabulary (default: K3's).")
@click.option("--model", "model_name", default=None, help="The 'model' field sent to --endpoint.",
              callback=not_empty("pass the model name the server serves, or omit --model"))
@click.option("--endpoint-gpus", type=int, default=None, metavar="N",
              help="GPUs serving --endpoint: the divisor of its tok/s/GPU figures. Default: the device count of "
                   "--profile; with neither, an --endpoint run is refused.")
@click.option("--endpoint-timeout", type=float, default=None, metavar="SECONDS",
              help="How long --endpoint may stay silent (no response, or no new stream data) before a request "
                   "counts as failed. Default: 60. Raise it for a queued server whose TTFT can be longer.")
@click.option("--max-num-batched-tokens", type=int, default=None, metavar="TOKENS",
              help="Tokens per engine step: decode rows plus prefill chunk tokens (vLLM's name). Larger steps cut "
                   "the number of steps a prompt's prefill takes (each step's fixed cost is paid fewer times) and "
                   "lengthen each of them (the decode rows riding along wait longer). At least the largest "
                   "--concurrency, at most 16,384. Default: the engine's, 512. Built-in engine only.")
@synthetic_options
@common_options
@handle_errors
def bench_cmd(concurrency, input_len, output_len, num_prompts, range_ratio, warmups, endpoint, model_name,
              endpoint_gpus, endpoint_timeout, max_num_batched_tokens, synthetic, preset, tp, ep, rank, checkpoint, profile, out, kernels,
              seed, debug):
    """Benchmark serving: TTFT, TPOT, ITL, E2EL percentiles, tok/s and tok/s/GPU, fraction of roofline.

    Every point's results go into the report's `bench` stage with plots of latency percentiles and
    throughput against concurrency.
    """
    # torch: 1.2 s (measured); --help needs none
    from k3rocm.validation.bench_job import BenchOptions, check_options, parse_concurrency, run_bench_job

    # every refusal that needs no checkpoint comes first: a run that cannot happen creates nothing
    bench = BenchOptions(concurrency=parse_concurrency(concurrency) if concurrency is not None else None,
                         input_len=input_len, output_len=output_len, num_prompts=num_prompts,
                         range_ratio=range_ratio, warmups=warmups, endpoint=endpoint, model_name=model_name,
                         endpoint_gpus=endpoint_gpus, max_num_batched_tokens=max_num_batched_tokens,
                         endpoint_timeout=endpoint_timeout)
    if synthetic and endpoint is not None:
        raise ConfigError("--synthetic makes random weights for the built-in engine; --endpoint measures another "
                          "server: drop one")
    gpus = check_options(bench, kernels, profile)
    s = make_session(checkpoint, profile, out, kernels, seed, debug, synthetic=synthetic, preset=preset, tp=tp,
                     ep=ep, rank=rank)
    s.preflight()
    stage = run_bench_job(s, bench, gpus, Progress())
    stages = [stage]
    # the report is written before the tables print: a Ctrl-C while they print loses nothing
    html = write_stages(s, stages)
    report_and_finish(s, stages, html, extra=lambda: _print_bench(stage))


def _short(text: str, field: str) -> str:
    """A digest cell of the console table cut to 12 hex digits and an ellipsis (the 64 made the table 130-190
    columns wide); the report files keep it whole."""
    return text[:12] + "…" if field.endswith("sha256") and len(text) > 13 else text


def _print_bench(stage) -> None:
    """The bench stage's figures: the load of each point (its settings), then one table, a column per concurrency
    point (vLLM's result fields, in its order, at a precision that fits each unit), then the stage's other settings
    and informational rows."""
    c = console()
    others, sconcs, srows = stage_settings(stage)
    if sconcs:  # the load each point was given: settings, shown apart from what was measured
        t = Table(title="load of each point (settings)")
        t.add_column("setting")
        t.add_column("unit")
        for x in sconcs:
            t.add_column(f"c={x}", justify="right")
        for f, u, vals in srows:
            t.add_row(f, u, *(fmt_value(vals[x], u) if x in vals else "" for x in sconcs))
        c.print(t)
    concs, rows = point_table(stage)
    if concs:
        lv = point_levels(stage)
        t = Table(title="per concurrency point")
        t.add_column("field")
        t.add_column("unit")
        t.add_column("level")
        for x in concs:
            t.add_column(f"c={x}", justify="right")
        for f, u, vals in rows:
            t.add_row(f, u, lv.get(f, ""), *(_short(fmt_value(vals[x], u), f) if x in vals else "" for x in concs))
        c.print(t)
    for e in stage.evidence:  # a point row without a figure says why on the console too, not only in the report
        m = re.fullmatch(r"c(\d+)\.(.+)", e.name)
        if m and e.value == "not formed":
            c.print(f"note: c={m.group(1)} {m.group(2)}: not formed ({e.detail})", highlight=False)
    for e in stage.evidence:  # a lighter load than asked is said on the console too, not only in a report row
        m = re.fullmatch(r"c(\d+)\.short_outputs", e.name)
        if m and e.value:
            c.print(f"note: at concurrency {m.group(1)}, {e.value} completed request(s) returned fewer output "
                    "tokens than asked (the server stopped early: EOS or a length limit); the load was lighter "
                    "than asked, and a request with one token has no TPOT / ITL", highlight=False)
    if others:
        t = Table(title="settings")
        for col in ("setting", "value", "unit"):
            t.add_column(col)
        for x in others:
            t.add_row(x.name, fmt_value(x.value, x.unit), x.unit)
        c.print(t)
    other = [e for e in stage.evidence if e.passed is None and not re.fullmatch(r"c\d+\..+", e.name)]
    if other:
        t = Table()
        for col in ("metric", "value", "unit", "level"):
            t.add_column(col)
        for e in other:
            t.add_row(e.name, fmt_value(e.value, e.unit), e.unit, e.level)
        c.print(t)


def register(cli: click.Group) -> None:
    for cmd in (load_cmd, validate_cmd, bench_cmd):
        cli.add_command(cmd)
