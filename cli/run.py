"""The three jobs: ``load``, ``validate``, ``bench``. Each adds its stages to the report in ``--out``."""

from __future__ import annotations

import click

from k3rocm.cli.common import (Progress, common_options, finish, handle_errors, make_session, not_empty,
                               print_stages, write_stages)
from k3rocm.errors import ConfigError


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
    if kernels != "auto":
        raise ConfigError(f"--kernels {kernels!r} has no effect on load (it streams and checks weights and runs no "
                          "kernels); drop --kernels, or give it to validate / bench")
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
                   "logits_top1_margin, greedy_prompt, greedy_tokens, greedy_margins) to compare the fp32 oracle "
                   "against; checked tensor by tensor before any tier runs.")
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
    if golden is not None and level in ("env", "load", "forward"):
        raise ConfigError(f"--golden is compared in the correctness tier, which --level {level} does not reach; "
                          "use --level correctness (the default) or performance, or drop --golden")
    s = make_session(checkpoint, profile, out, kernels, seed, debug, golden=golden)
    s.preflight()
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
    dup = sorted({v for v in vals if vals.count(v) > 1})
    if dup:
        raise ConfigError(f"--concurrency {text!r}: {', '.join(map(str, dup))} given twice (each point is one "
                          "row set of the report); list each concurrency once")
    return vals


@click.command("bench", epilog="""\b
Examples:
  k3rocm bench                                         # embedded k3-tiny, small defaults on CPU
  k3rocm bench --concurrency 1,8,64 --input-len 1024 --output-len 1024 --profile mi355x-8 \\
               --checkpoint /models/Kimi-K3
  k3rocm bench --concurrency 4 --num-prompts 20 --warmups 2 --out reports/demo
  k3rocm bench --endpoint http://localhost:8000 --model moonshotai/Kimi-K3 --endpoint-gpus 8 \\
               --concurrency 64 --input-len 1024 --output-len 1024   # hold a vLLM/SGLang deployment to the same load

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
@click.option("--concurrency", default=None, metavar="N[,N...]", help="Concurrency, or a list: 1,8,64.")
@click.option("--input-len", type=int, default=None, help="Prompt length L (drawn in [ratio*L, L]).")
@click.option("--output-len", type=int, default=None,
              help="Output length L, at least 2 (drawn in [max(2, ratio*L), L]; EOS ignored): with one output "
                   "token there is no TPOT or ITL.")
@click.option("--num-prompts", type=int, default=None,
              help="Measured requests per point (default 10 x concurrency); at least the largest concurrency.")
@click.option("--range-ratio", type=float, default=0.8, show_default=True, help="Lower end of the length draws.")
@click.option("--warmups", type=int, default=None, help="Warm-up requests per point (default 2 x concurrency).")
@click.option("--endpoint", default=None, metavar="URL",
              help="Run the same load against an OpenAI-compatible server (/v1/completions, streaming) instead "
                   "of the built-in engine; the prompts use the checkpoint's vocabulary (default: K3's).")
@click.option("--model", "model_name", default=None, help="The 'model' field sent to --endpoint.",
              callback=not_empty("pass the model name the server serves, or omit --model"))
@click.option("--endpoint-gpus", type=int, default=None, metavar="N",
              help="GPUs serving --endpoint: the divisor of its tok/s/GPU figures. Default: the device count of "
                   "--profile; with neither, an --endpoint run is refused.")
@common_options
@handle_errors
def bench_cmd(concurrency, input_len, output_len, num_prompts, range_ratio, warmups, endpoint, model_name,
              endpoint_gpus, checkpoint, profile, out, kernels, seed, debug):
    """Benchmark serving: TTFT, TPOT, ITL, E2EL percentiles, tok/s and tok/s/GPU, fraction of roofline.

    Every point's results go into the report's `bench` stage with plots of latency percentiles and
    throughput against concurrency.
    """
    from k3rocm.validation.evidence import Stage
    from k3rocm.validation.tiers.performance import bench_rows, run_bench_point
    # every refusal that needs no checkpoint comes first: a run that cannot happen creates nothing
    cs_given = parse_concurrency(concurrency) if concurrency is not None else None
    _check_bench_options(input_len, output_len, num_prompts, range_ratio, warmups, endpoint, model_name,
                         endpoint_gpus, kernels, cs_given)
    gpus = _endpoint_gpus(endpoint_gpus, profile) if endpoint is not None else None

    s = make_session(checkpoint, profile, out, kernels, seed, debug)
    s.preflight()
    from k3rocm.checkpoint import layout
    big = endpoint is not None or (s.profile.backend != "cpu" and layout.counts(s.config)["bytes"] >= 1e9)
    cs = cs_given if cs_given is not None else [64 if big else 4]
    if cs_given is None:  # the default concurrency is known only now (preflight leaves no directory behind)
        _check_prompts_cover(num_prompts, cs, "the default --concurrency")
    il = input_len if input_len is not None else (1024 if big else 64)
    ol = output_len if output_len is not None else (1024 if big else 16)

    if endpoint is None:
        check_bench_capacity(s, cs, il, ol, num_prompts)
    else:
        return _bench_endpoint(s, endpoint, model_name, checkpoint, cs, il, ol, num_prompts, range_ratio, warmups,
                               debug, gpus)

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


def _check_bench_options(input_len, output_len, num_prompts, range_ratio, warmups, endpoint, model_name,
                         endpoint_gpus, kernels, concurrencies: list[int] | None) -> None:
    """The ``bench`` options that are wrong whatever the checkpoint: lengths (tokens), counts, ratio, and options
    that would have no effect on the chosen target. ``concurrencies`` is the parsed ``--concurrency`` or None.

    Raises:
        ConfigError: one line naming the option, why, and what to pass instead.
    """
    if input_len is not None and input_len < 1:
        raise ConfigError(f"--input-len {input_len} must be >= 1 (tokens)")
    if output_len is not None and output_len < 2:
        raise ConfigError(f"--output-len {output_len} must be >= 2 (tokens): with fewer than 2 output tokens there is "
                          "no TPOT or ITL to measure; pass --output-len 2 or more")
    if num_prompts is not None and num_prompts < 1:
        raise ConfigError(f"--num-prompts {num_prompts} must be >= 1")
    if num_prompts is not None and num_prompts > MAX_PROMPTS:
        raise ConfigError(f"--num-prompts {num_prompts} is more than {MAX_PROMPTS:,}; run several benchmarks")
    if not 0.0 < range_ratio <= 1.0:
        raise ConfigError(f"--range-ratio {range_ratio} must be in (0, 1]")
    if warmups is not None and not 0 <= warmups <= MAX_PROMPTS:
        raise ConfigError(f"--warmups {warmups} must be in 0..{MAX_PROMPTS:,}")
    if model_name is not None and endpoint is None:
        raise ConfigError("--model names the model an --endpoint serves; without --endpoint the built-in engine "
                          "runs the checkpoint: drop --model or add --endpoint URL")
    if endpoint_gpus is not None and endpoint is None:
        raise ConfigError("--endpoint-gpus counts the GPUs serving an --endpoint; the built-in engine's per-GPU "
                          "figures use the GPUs it runs on: drop --endpoint-gpus or add --endpoint URL")
    if endpoint_gpus is not None and endpoint_gpus < 1:
        raise ConfigError(f"--endpoint-gpus {endpoint_gpus} must be >= 1 (GPUs serving --endpoint)")
    if endpoint is not None and kernels != "auto":
        raise ConfigError(f"--kernels {kernels!r} has no effect on an --endpoint run (the server runs its own "
                          "kernels); drop --kernels")
    if concurrencies is not None:
        _check_prompts_cover(num_prompts, concurrencies, "--concurrency")


def _check_prompts_cover(num_prompts: int | None, concurrencies: list[int], what: str) -> None:
    """Refuse ``--num-prompts`` below the largest concurrency: fewer requests than the concurrency never put
    that many in flight, so the point would be labelled with a load it did not carry.

    Raises:
        ConfigError: the numbers and the smallest ``--num-prompts`` that works.
    """
    c = max(concurrencies)
    if num_prompts is not None and num_prompts < c:
        raise ConfigError(f"--num-prompts {num_prompts} is fewer than {what} {c}: at most {num_prompts} "
                          f"request{'s' if num_prompts != 1 else ''} would be in flight, not {c}; pass --num-prompts {c} or more (default 10 x concurrency)")


def _endpoint_gpus(endpoint_gpus: int | None, profile: str | None) -> tuple[int, str]:
    """How many GPUs serve ``--endpoint`` (the divisor of its tok/s/GPU figures) and where that number comes from:
    ``--endpoint-gpus``, else the device count of an explicitly given ``--profile``. The server does not say, and
    a silent 1 would make an 8-GPU deployment look 8 times better per GPU.

    Raises:
        ConfigError: neither is given, the profile is unknown, or it describes no GPU.
    """
    if endpoint_gpus is not None:
        return int(endpoint_gpus), "from --endpoint-gpus"
    if not profile:
        raise ConfigError("--endpoint: the number of GPUs serving it is unknown, so tok/s/GPU cannot be computed; "
                          "pass --endpoint-gpus N (or --profile NAME of the serving hardware)")
    from k3rocm.hw import load_profile
    p = load_profile(profile)
    if p.backend == "cpu" or int(p.device_count) < 1:
        raise ConfigError(f"--profile {profile} describes no GPU, so it cannot tell how many GPUs serve --endpoint; "
                          "pass --endpoint-gpus N")
    return int(p.device_count), f"the device count of --profile {profile}"


def _bench_endpoint(s, endpoint, model_name, checkpoint, cs, il, ol, num_prompts, range_ratio, warmups, debug,
                    gpus: tuple[int, str]):
    """``bench --endpoint``: the same load generator and metrics against another engine's server.

    Its figures are evidence about that server, so they carry the level ``external``. Prompt ids come from
    the given checkpoint's vocabulary, or K3's (163,840, special ids excluded) when none is given. ``gpus`` is
    ``(count, source)`` from :func:`_endpoint_gpus`; every tok/s/GPU row says both.

    A point where no request succeeded measured nothing: its latency and throughput rows are absent, its
    ``failed`` row says why, the sweep stops there and the stage ends as an error of the endpoint (exit 3).

    Raises:
        HardwareError: the server cannot be reached (before anything is timed).
    """
    from k3rocm.bench import run_bench
    from k3rocm.bench.client import OpenAIClient
    from k3rocm.config import preset
    from k3rocm.errors import HardwareError
    from k3rocm.validation.evidence import Stage, info
    from k3rocm.validation.tiers.performance import bench_rows
    n_gpus, source = gpus
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
                              seed=s.opts.seed, progress=(lambda phase, done, total, cb=cb: cb(done, total)),
                              num_gpus=n_gpus)
                d = r.to_dict(per_request=False)
                d["target"] = client.describe()
                d["num_gpus_source"] = source
                results.append(d)
                if not d.get("completed"):
                    break  # the server answers nothing usefully: do not run the larger points against it
        gpu_detail = f"{n_gpus} GPU{'s' if n_gpus != 1 else ''} serving the endpoint, {source}"
        # the report's header must say what was measured: the server, not this machine or the checkpoint
        s.opts.extra["endpoint"] = {"url": endpoint, "gpus": n_gpus, "gpus_source": source}
        stage.add(info("bench", "endpoint.gpus", n_gpus, "GPU", level="external",
                       detail=f"the tok/s/GPU figures assume {gpu_detail}"))
        bench_rows(s, stage, results, tier="bench", level="external")
        for e in stage.evidence:
            if e.name.endswith(".output_throughput_per_gpu"):
                e.detail = f"output tok/s / {gpu_detail}"
        last = results[-1] if results else {}
        if not last.get("completed"):
            raise HardwareError(_nothing_measured(endpoint, last))

    _finish_bench(s, body, debug)


def _nothing_measured(endpoint: str, r: dict) -> str:
    """The one line for a point where no request succeeded: how many were sent and the most frequent reason."""
    n = int(r.get("completed", 0)) + int(r.get("failed", 0))
    errs = r.get("errors") or []
    hang = r.get("hang")
    if errs:
        why = errs[0]["error"]
    elif hang:
        why = (f"a {hang.get('phase', '')} request outlived the watchdog ({float(hang.get('elapsed_s', 0)):.1f} s "
               f"> {float(hang.get('threshold_s', 0)):.1f} s)")
    else:
        why = "no request finished"
    return (f"--endpoint {endpoint}: none of {n} requests at concurrency {r.get('concurrency')} succeeded, so "
            f"nothing was measured ({why}); is it an OpenAI-compatible server streaming /v1/completions?")


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
