"""The three jobs: ``load``, ``validate``, ``bench``. Each adds its stages to the report in ``--out``."""

from __future__ import annotations

import click

from k3rocm.cli.common import (Progress, common_options, finish, handle_errors, make_session, print_stages,
                               write_stages)
from pathlib import Path

from k3rocm.errors import CheckpointError, ConfigError


@click.command("load", epilog="""\b
Examples:
  k3rocm load                                            # embedded k3-tiny on this machine
  k3rocm load --profile mi355x-8 --checkpoint /models/Kimi-K3
  k3rocm load --checkpoint ./k3-tiny --out reports/tiny  # then open reports/tiny/report.html""")
@common_options
@handle_errors
def load_cmd(checkpoint, profile, out, kernels, seed, debug):
    """Plan, place and stream the weights, and prove they landed (tiers env + load).

    Checks the index and every shard header before any device work, streams the tensors to the
    devices of the plan (MXFP4 experts stay packed) and records bytes per device, GB/s and scale
    sanity in the report.
    """
    from k3rocm.cli.info import print_plan
    from k3rocm.validation.tiers import run_tiers
    s = make_session(checkpoint, profile, out, kernels, seed, debug)
    s.preflight()
    # the layout and per-rank bytes, before anything loads
    pl = s.run_placement
    if not s.hardware_matches:
        # the profile's plan (projected: what the target hardware would hold), then the one this machine loads with
        print_plan(s.placement, s.config.name, f"{s.profile.name} (projected: not this machine)")
    where = s.profile.name if s.hardware_matches else f"{pl.profile_name} (this machine; loads with this plan)"
    print_plan(pl, s.config.name, where)
    with Progress() as bar:
        stages = run_tiers(s, "load", progress=bar.callback("loading"), on_start=lambda t: bar.stage(f"tier {t}"))
    print_stages(stages)
    _print_load(s)
    finish(stages, write_stages(s, stages))


def _print_load(session) -> None:
    """One table per rank after a load: bytes planned / loaded / on the device, GB/s; the raw-read ratio."""
    from rich.table import Table

    from k3rocm.cli.common import console
    from k3rocm.errors import K3Error
    try:
        rep = session.load_report
    except K3Error:
        return  # the load tier already reported why
    t = Table(title=f"load: {rep.tensors_verified:,}/{rep.tensors_planned:,} tensors verified by checksum")
    for col in ("rank", "planned GB", "loaded GB", "device GB", "s", "GB/s"):
        t.add_column(col)
    for r in rep.ranks:
        t.add_row(str(r), f"{rep.bytes_planned.get(r, 0) / 1e9:.3f}", f"{rep.bytes_loaded.get(r, 0) / 1e9:.3f}",
                  f"{rep.device_bytes_used.get(r, 0) / 1e9:.3f}", f"{rep.seconds.get(r, 0.0):.2f}",
                  f"{rep.gbps.get(r, 0.0):.2f}")
    c = console()
    c.print(t)
    c.print(f"aggregate {rep.aggregate_gbps:.2f} GB/s; raw sequential read of the same files "
            f"{rep.raw_read_gbps:.2f} GB/s (load / raw = {rep.load_vs_raw:.2f})")


@click.command("validate", epilog="""\b
Examples:
  k3rocm validate                                  # every tier up to correctness, embedded k3-tiny
  k3rocm validate --level performance --out reports/demo
  k3rocm validate --level correctness --profile mi355x-8 --checkpoint /models/Kimi-K3
  k3rocm validate --checkpoint ckpt/ --golden golden.safetensors   # + external golden logits
  k3rocm validate --kernels moe_experts=torch,kda_prefill=triton  # choose implementations per op""")
@click.option("--level", type=click.Choice(["env", "load", "forward", "correctness", "performance"]),
              default="correctness", show_default=True, help="Run every tier up to this one; stop at the first failure.")
@click.option("--golden", type=click.Path(path_type=str), default=None, metavar="FILE",
              help="External golden outputs (safetensors: input_ids, logits, layerNN.attn_out/mlp_out, "
                   "greedy_prompt, greedy_tokens, margins) to compare the fp32 oracle against.")
@common_options
@handle_errors
def validate_cmd(level, golden, checkpoint, profile, out, kernels, seed, debug):
    """Run the validation tiers env → load → forward → correctness → performance.

    Correctness compares the selected implementation path (the kernel registry's choice per op, see
    `k3rocm kernels list`) with the fp32 oracle layer by layer: per-layer error, logits KL,
    top-1 agreement, max error, decode-vs-prefill equality. With --golden, or on the official
    checkpoint (its known answers), it adds `external` evidence.
    """
    from k3rocm.validation.tiers import run_tiers
    s = make_session(checkpoint, profile, out, kernels, seed, debug, golden=golden)
    s.preflight()
    if golden and not Path(golden).is_file():
        raise CheckpointError(f"--golden {golden}: file not found; pass a safetensors file with input_ids and logits")
    with Progress() as bar:
        stages = run_tiers(s, level, progress=bar.callback("working"), on_start=lambda t: bar.stage(f"tier {t}"))
    print_stages(stages)
    finish(stages, write_stages(s, stages))


def parse_concurrency(text: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]``. Raises ConfigError for anything but positive integers."""
    parts = str(text).split(",")
    if any(not p.strip() for p in parts):
        raise ConfigError(f"--concurrency {text!r}: an empty entry; give positive integers, e.g. 8 or 1,8,64")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        raise ConfigError(f"--concurrency {text!r}: give positive integers, e.g. 8 or 1,8,64") from None
    if not vals or any(v < 1 for v in vals):
        raise ConfigError(f"--concurrency {text!r}: give positive integers, e.g. 8 or 1,8,64")
    return vals


@click.command("bench", epilog="""\b
Examples:
  k3rocm bench                                         # embedded k3-tiny, small defaults on CPU
  k3rocm bench --concurrency 1,8,64 --input-len 1024 --output-len 1024 --profile mi355x-8 \\
               --checkpoint /models/Kimi-K3
  k3rocm bench --concurrency 4 --num-prompts 20 --warmups 2 --out reports/demo
  k3rocm bench --endpoint http://localhost:8000 --model moonshotai/Kimi-K3 --concurrency 64 \\
               --input-len 1024 --output-len 1024      # hold a vLLM/SGLang deployment to the same load

\b
Defaults follow InferenceX's random dataset: lengths uniform in [0.8 L, L], num-prompts = 10 x
concurrency, warm-ups = 2 x concurrency. Without --input-len/--output-len/--concurrency: 1024/1024
at concurrency 64 for a real checkpoint on a GPU profile; 64/16 at concurrency 4 for a small
checkpoint (k3-tiny) or on the CPU.""")
@click.option("--concurrency", default=None, metavar="N[,N...]", help="Concurrency, or a list: 1,8,64.")
@click.option("--input-len", type=int, default=None, help="Prompt length L (drawn in [ratio*L, L]).")
@click.option("--output-len", type=int, default=None, help="Output length L (drawn in [ratio*L, L]; EOS ignored).")
@click.option("--num-prompts", type=int, default=None, help="Measured requests per point (default 10 x concurrency).")
@click.option("--range-ratio", type=float, default=0.8, show_default=True, help="Lower end of the length draws.")
@click.option("--warmups", type=int, default=None, help="Warm-up requests per point (default 2 x concurrency).")
@click.option("--endpoint", default=None, metavar="URL",
              help="Run the same load against an OpenAI-compatible server (/v1/completions, streaming) instead "
                   "of the built-in engine; the prompts use the checkpoint's vocabulary (default: K3's).")
@click.option("--model", "model_name", default=None, help="The 'model' field sent to --endpoint.")
@common_options
@handle_errors
def bench_cmd(concurrency, input_len, output_len, num_prompts, range_ratio, warmups, endpoint, model_name,
              checkpoint, profile, out, kernels, seed, debug):
    """Benchmark serving: TTFT, TPOT, ITL, E2EL percentiles, tok/s and tok/s/GPU, fraction of roofline.

    Every point's results go into the report's `bench` stage with plots of latency percentiles and
    throughput against concurrency.
    """
    from k3rocm.validation.evidence import Stage
    from k3rocm.validation.tiers import bench_rows, run_bench_point
    s = make_session(checkpoint, profile, out, kernels, seed, debug)
    s.preflight()
    from k3rocm.checkpoint import layout
    big = endpoint is not None or (s.profile.backend != "cpu" and layout.counts(s.config)["bytes"] >= 1e9)
    cs = parse_concurrency(concurrency) if concurrency is not None else [64 if big else 4]
    for opt, v in (("--input-len", input_len), ("--output-len", output_len)):
        if v is not None and v < 1:
            raise ConfigError(f"{opt} {v} must be >= 1 (tokens)")
    il = input_len if input_len is not None else (1024 if big else 64)
    ol = output_len if output_len is not None else (1024 if big else 16)
    if num_prompts is not None and num_prompts < 1:
        raise ConfigError(f"--num-prompts {num_prompts} must be >= 1")
    if not 0.0 < range_ratio <= 1.0:
        raise ConfigError(f"--range-ratio {range_ratio} must be in (0, 1]")
    if warmups is not None and not 0 <= warmups <= MAX_PROMPTS:
        raise ConfigError(f"--warmups {warmups} must be in 0..{MAX_PROMPTS:,}")

    if model_name is not None and endpoint is None:
        raise ConfigError("--model names the model an --endpoint serves; without --endpoint the built-in engine "
                          "runs the checkpoint: drop --model or add --endpoint URL")
    if endpoint is None:
        check_bench_capacity(s, cs, il, ol, num_prompts)
    elif num_prompts is not None and num_prompts > MAX_PROMPTS:
        raise ConfigError(f"--num-prompts {num_prompts} is more than {MAX_PROMPTS:,}; run several benchmarks")
    if endpoint is not None:
        return _bench_endpoint(s, endpoint, model_name, checkpoint, cs, il, ol, num_prompts, range_ratio, warmups,
                               debug)

    def body(stage: Stage) -> None:
        results = []
        with Progress() as bar:
            s.load(progress=bar.callback("loading"))
            for c in cs:
                results.append(run_bench_point(s, concurrency=c, input_len=il, output_len=ol,
                                               num_prompts=num_prompts, range_ratio=range_ratio, warmups=warmups,
                                               progress=bar.callback(f"bench c={c}")))
        bench_rows(s, stage, results, tier="bench")

    _finish_bench(s, body, debug)


def _bench_endpoint(s, endpoint, model_name, checkpoint, cs, il, ol, num_prompts, range_ratio, warmups, debug):
    """``bench --endpoint``: the same load generator and metrics against another engine's server.

    Its figures are evidence about that server, so they carry the level ``external``. Prompt ids come from
    the given checkpoint's vocabulary, or K3's (163,840, special ids excluded) when none is given.
    """
    from k3rocm.bench import run_bench
    from k3rocm.bench.client import OpenAIClient
    from k3rocm.config import preset
    from k3rocm.validation.evidence import Stage
    from k3rocm.validation.tiers import bench_rows
    cfg = s.config if checkpoint else preset("k3")
    client = OpenAIClient(endpoint, model=model_name, vocab_size=cfg.vocab_size,
                          special_ids=(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id))
    client.check_reachable()

    def body(stage: Stage) -> None:
        results = []
        with Progress() as bar:
            for c in cs:
                cb = bar.callback(f"bench c={c}")
                r = run_bench(client, c, il, ol, num_prompts=num_prompts, range_ratio=range_ratio, warmups=warmups,
                              seed=s.opts.seed, progress=(lambda phase, done, total, cb=cb: cb(done, total)))
                d = r.to_dict(per_request=False)
                d["target"] = client.describe()
                results.append(d)
        bench_rows(s, stage, results, tier="bench", level="external")

    _finish_bench(s, body, debug)


MAX_PROMPTS = 1_000_000


def check_bench_capacity(s, concurrencies: list[int], input_len: int, output_len: int,
                         num_prompts: int | None) -> None:
    """Refuse, before any memory is taken, a load the plan's cache cannot hold.

    Per sequence the engine keeps ``(input_len + output_len)`` tokens of MLA latent cache plus one KDA state
    (``Placement.cache``: ``mla_bytes_per_token``, ``kda_state_bytes_per_seq``); ``concurrency`` sequences must
    fit the plan's cache budget, and a sequence must fit ``max_position_embeddings``.

    Raises:
        ConfigError: the numbers, and what to lower.
    """
    if num_prompts is not None and num_prompts > MAX_PROMPTS:
        raise ConfigError(f"--num-prompts {num_prompts} is more than {MAX_PROMPTS:,}; run several benchmarks")
    text = s.config.raw.get("text_config", s.config.raw)
    max_pos = int(text.get("max_position_embeddings") or 0)
    L = input_len + output_len
    if max_pos and L > max_pos:
        raise ConfigError(f"--input-len + --output-len = {L:,} tokens exceeds the model's max_position_embeddings "
                          f"{max_pos:,}")
    pl = s.run_placement
    c = pl.cache
    per_seq = L * c.mla_bytes_per_token + c.kda_state_bytes_per_seq
    fit = c.budget_bytes // max(per_seq, 1)
    conc = max(concurrencies)
    if conc > fit:
        raise ConfigError(f"--concurrency {conc} at {L:,} tokens per sequence needs {conc * per_seq / 1e9:.2f} GB "
                          f"of cache per GPU; the plan on {pl.profile_name} leaves {c.budget_bytes / 1e9:.2f} GB "
                          f"({fit:,} such sequences): lower --concurrency or the lengths")


def _finish_bench(s, body, debug) -> None:
    """Run the bench stage ``body(stage)``, print it, merge it into the report and exit with its status."""
    from k3rocm.validation.evidence import now_iso
    from k3rocm.validation.tiers import run_stage
    stage = run_stage("bench", body, s.opts.command, debug)
    stage.started = stage.started or now_iso()
    stages = [stage]
    print_stages(stages)
    _print_bench(stage)
    finish(stages, write_stages(s, stages))


def _print_bench(stage) -> None:
    from rich.table import Table

    from k3rocm.cli.common import console
    rows = [e for e in stage.evidence if e.passed is None]
    if not rows:
        return
    t = Table()
    for col in ("metric", "value", "unit", "level"):
        t.add_column(col)
    for e in rows:
        t.add_row(e.name, str(e.value), e.unit, e.level)
    console().print(t)


def register(cli: click.Group) -> None:
    for cmd in (load_cmd, validate_cmd, bench_cmd):
        cli.add_command(cmd)
