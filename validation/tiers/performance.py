"""Tier ``performance``: a short benchmark and the fraction of the roofline it reaches; and the benchmark
points and evidence rows that ``k3rocm bench`` (:mod:`k3rocm.validation.bench_job`) shares with it."""

from __future__ import annotations

import re
from typing import Callable

import torch

from k3rocm.bench import PointInterrupted, run_bench
from k3rocm.bench.loadgen import DEFAULT_RANGE_RATIO
from k3rocm.runtime.engine import MAX_NUM_BATCHED_TOKENS
from k3rocm.runtime.sizing import StepRoofline
from k3rocm.validation.evidence import Stage, check, info, listed, setting
from k3rocm.validation.session import Session
from k3rocm.validation.tiers.env import figure_kind


def tier_performance(session: Session, stage: Stage, progress: Callable | None = None) -> None:
    """A short benchmark (concurrency 2) and the fraction of the roofline it reaches."""
    res = run_bench_point(session, concurrency=2, input_len=32, output_len=8, num_prompts=4, warmups=1,
                          progress=progress)
    bench_rows(session, stage, [res], tier="performance")


def run_bench_point(session: Session, *, concurrency: int, input_len: int, output_len: int,
                    num_prompts: int | None = None, range_ratio: float = DEFAULT_RANGE_RATIO,
                    warmups: int | None = None, max_num_batched_tokens: int | None = None,
                    progress: Callable | None = None) -> dict:
    """One benchmark point through :func:`k3rocm.bench.run_bench` on an engine sized for it.

    The roofline model is :class:`k3rocm.runtime.sizing.StepRoofline` with the ceilings of the hardware
    the run is on (the run profile's datasheet bandwidth and bf16 peak) and the engine's weight and cache
    dtypes (with several ranks: rank 0's step under the plan's split rules, bf16 trunk); ``run_bench`` evaluates it on every measured engine step. Returns a plain dict: vLLM metric
    fields, ``concurrency``, ``hang``, ``target`` and ``roofline`` (``total_floor_s``, ``total_measured_s``,
    ``fraction``) when the ceilings are known. ``max_num_batched_tokens``: the engine's tokens per step (None: its
    default, ``MAX_NUM_BATCHED_TOKENS``, or the concurrency where that is larger, so every decode row fits a step).
    """
    if max_num_batched_tokens is None and concurrency > MAX_NUM_BATCHED_TOKENS:
        # the default budget could not carry every running request's decode row in one step (the point would run a
        # lighter load than its concurrency): the budget follows the concurrency, as the settings row then says
        max_num_batched_tokens = concurrency
    eng = session.engine_for(max_batch=max(concurrency, 1), max_model_len=input_len + output_len + 1,
                             max_num_batched_tokens=max_num_batched_tokens)
    prof = session.run_profile
    roof = None
    bw, peak = float(prof.hbm_bandwidth or 0), float(prof.peak("bf16") or 0)
    if bw > 0 and peak > 0 and session.world > 1:
        roof = session.run_placement.roofline  # rank 0's slices under the plan's split rules (bf16 trunk)
    elif bw > 0 and peak > 0:
        wbytes = torch.tensor([], dtype=eng.dtype).element_size()
        kvbytes = torch.tensor([], dtype=eng.kv_dtype).element_size()
        roof = StepRoofline.from_config(session.config, bw, peak, kv_bytes=kvbytes,
                                        trunk_dtype_bytes=None if wbytes == 2 else wbytes)
    ngpu = session.world  # the ranks (one GPU each; gloo processes on a cpu profile) that serve the load
    cut = False
    try:
        res = run_bench(eng, concurrency, input_len, output_len, num_prompts=num_prompts, range_ratio=range_ratio,
                        warmups=warmups, seed=session.opts.seed,
                        progress=(lambda phase, done, total, **kw: progress(done, total, phase=phase, **kw))
                        if progress else None,
                        num_gpus=ngpu, roofline=roof)
    except PointInterrupted as e:  # Ctrl-C after the measured phase: the point goes to the sweep as measured
        res, cut = e.result, True
    d = res.to_dict(per_request=False)
    d["max_num_batched_tokens"] = int(eng.scheduler.max_num_batched_tokens)
    d["roofline_ceilings"] = {"profile": prof.name, "hbm_bandwidth": bw, "peak_bf16": peak,
                              "kind": figure_kind(prof, "device.hbm_bandwidth_source")}
    if cut:
        raise PointInterrupted(d) from None
    return d


#: The rows of one benchmark point, in vLLM's ``benchmark_serving`` result names and order: the load it carried
#: (settings, :data:`POINT_SETTINGS`), then duration, token totals, throughputs and mean / median / p99 of each latency (``(field, unit, detail)``).
POINT_FIELDS = (
    ("input_len", "tokens", "upper end L of the prompt-length draw [range_ratio x L, L]"),
    ("output_len", "tokens", "upper end L of the output-length draw [max(2, range_ratio x L), L], EOS ignored"),
    ("range_ratio", "", "lower end of the length draws, as a fraction of L"),
    ("num_prompts", "requests", "measured requests"),
    ("num_warmups", "requests", "warm-up requests before them (not measured)"),
    ("max_num_batched_tokens", "tokens", "the built-in engine's tokens per step: decode rows plus prefill chunk tokens "
                                         "(bench --max-num-batched-tokens; default 512, or the concurrency where "
                                         "that is larger, so every running request's decode row fits a step)"),
    ("duration", "s", "first measured issue to last completion"),
    ("total_input_tokens", "tokens", "prompt tokens of the completed requests"),
    ("total_output_tokens", "tokens", "output tokens of the completed requests"),
    ("request_throughput", "req/s", "completed requests / duration"),
    ("output_throughput", "tok/s", "output tokens / duration"),
    ("total_token_throughput", "tok/s", "(input + output tokens) / duration"),
    ("output_throughput_per_gpu", "tok/s/GPU", "output tok/s / GPUs serving the load"),
    *((f"{stat}_{m}_ms", "ms", f"{stat} {m.upper()}") for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "p99")),
)


#: the :data:`POINT_FIELDS` that are the point's settings (the load it was asked to carry and the engine's step
#: budget): inputs of the run, so they go to the stage's settings (no level), not to its evidence
POINT_SETTINGS = frozenset({"input_len", "output_len", "range_ratio", "num_prompts", "num_warmups",
                            "max_num_batched_tokens"})


def ran_alone(session: Session) -> bool:
    """True when one rank of a larger layout ran alone in this process (``--synthetic``, with ``--rank``, default 0,
    of a ``--tp/--ep`` layout of several ranks): the other ranks' work is counted and projected, never run. False
    for every other run, one process or several (a multi-rank run starts all its ranks). Raises nothing beyond
    what :attr:`Session.run_placement` raises."""
    return bool(getattr(session, "synthetic", False)) and session.run_placement.world > 1


def layout_rows(session: Session, tier: str, lv: str) -> list:
    """``dist.world`` and ``dist.layout`` of the built-in engine: the ranks and the TP/EP layout that served the
    load, at the run's level ``lv`` (``measured`` / ``measured-fallback``: the layout that ran is what this run
    measured on). Only when one rank of a larger layout ran alone (:func:`ran_alone`) are they ``projected``,
    saying which rank ran."""
    pl = session.run_placement
    per_rank = f"{pl.ranks[0].weights_bytes / 1e9:.3f} GB of weights per rank (plan)"
    if ran_alone(session):
        r = session.rank
        return [info(tier, "dist.world", pl.world, "ranks", level="projected",
                     detail=f"ranks of the TP{pl.tp}/EP{pl.ep} layout; only rank {r} ran, alone in this process "
                            "(--synthetic)"),
                info(tier, "dist.layout", f"TP{pl.tp}/EP{pl.ep}", level="projected",
                     detail=f"{per_rank}; rank {r} alone ran, the others are projected")]
    where = "GPU" if session.device != "cpu" else "gloo rank on this host"
    return [info(tier, "dist.world", pl.world, "ranks", level=lv,
                 detail=f"processes serving the load: TP{pl.tp}/EP{pl.ep}, one per {where}; rank 0 schedules"),
            info(tier, "dist.layout", f"TP{pl.tp}/EP{pl.ep}", level=lv,
                 detail=f"{per_rank}; every rank of the layout ran")]


def bench_rows(session: Session, stage: Stage, results: list[dict], tier: str, level: str | None = None) -> None:
    """Evidence rows + plots for bench results (latency percentiles, throughput, roofline fraction).

    ``level`` overrides the session's measurement level (``external`` for a benchmark of another server). The
    points' rows, tables and plots go in ascending concurrency, whatever order ``--concurrency`` ran them in.
    """
    results = sorted(results, key=lambda r: int(r.get("concurrency") or 0))
    lv = level or session.measured_level
    if level is None:  # the built-in engine: the layout it ran
        stage.add(*layout_rows(session, tier, lv))
    for r in results:
        c = r.get("concurrency")
        tag = f"c{c}"
        n = r.get("completed", 0)
        errs = r.get("errors") or []
        why = listed(f"{e['count']} x {e['error']}" for e in errs)
        stage.add(check(tier, f"{tag}.failed", int(r.get("failed", 0)), eq=0, level=lv,
                        detail=f"failed requests: {why}" if why else "failed requests"),
                  check(tier, f"{tag}.completed", int(n), ge=1, level=lv))
        if r.get("usage_disagreements"):
            ex = listed((f"{e['count']} x {e['error']}" for e in r.get("usage_disagreement_examples") or []),
                        limit=180)
            stage.add(check(tier, f"{tag}.usage_disagreements", int(r["usage_disagreements"]), eq=0, unit="requests",
                            level=lv, detail=("the server's usage.completion_tokens disagreed with the streamed "
                                              "events or max_tokens; those requests' figures count the events: "
                                              + ex)))
        if r.get("short_outputs"):
            # a few early stops (EOS the server would not ignore) leave the point's load about as asked; most of
            # them mean the server did not honour max_tokens / ignore_eos and the point measured another load
            stage.add(check(tier, f"{tag}.short_outputs", int(r["short_outputs"]), le=n // 2, unit="requests",
                            level=lv,
                            detail=f"of {n} completed requests returned fewer output tokens than requested (the "
                                   "server stopped early: EOS or a length limit); the load was lighter than asked "
                                   "and requests with one token define no TPOT / ITL. Fails above half of them: "
                                   "the server did not honour max_tokens / ignore_eos, so the point is not the "
                                   "load it names"))
        wu = r.get("warmup") or {}
        if wu.get("failed"):
            sent, asked = int(wu.get("sent", 0)), int(wu.get("asked") or wu.get("sent", 0))
            unsent = (f"; {asked} were planned, the other {asked - sent} not sent once every one sent had failed"
                      if sent < asked else "")
            stage.add(info(tier, f"{tag}.warmup_failed", int(wu["failed"]), "requests", level=lv,
                           detail=f"of {sent} warm-up requests sent (not measured){unsent}: "
                                  + listed((f"{e['count']} x {e['error']}" for e in wu.get("errors") or []),
                                           limit=250)))
        for k, unit, what in POINT_FIELDS:
            if r.get(k) is not None:
                v = r[k]
                v = v if isinstance(v, int) and not isinstance(v, bool) else round(float(v), 4)
                if k in POINT_SETTINGS:  # the load the point was given: a setting, not a measurement
                    stage.add_settings(setting(tier, f"{tag}.{k}", v, unit, what))
                else:
                    stage.add(info(tier, f"{tag}.{k}", v, unit, level=lv, detail=what))
        if r.get("outputs_sha256"):
            stage.add(info(tier, f"{tag}.outputs_sha256", r["outputs_sha256"], level=lv,
                           detail="sha256 of the greedy tokens served to the measured requests (seeded load): equal "
                                  "digests, equal tokens — e.g. a TP/EP layout against one process"))
        _collective_rows(session, stage, tier, tag, r, lv)
        _compile_rows(stage, tier, tag, r, lv)
        _breakdown_rows(stage, tier, tag, r, lv, synthetic=bool(getattr(session, "synthetic", False)))
        failed = int(r.get("failed") or 0)
        stage.add(check(tier, f"{tag}.no_hang", r.get("hang") is None, eq=True, level=lv,
                        detail=f"watchdog: {r['hang']}" if r.get("hang") else
                        "no request outlived the watchdog" + (
                            f"; {failed} request{'s' if failed != 1 else ''} failed otherwise (an error, or an "
                            "endpoint silent past --endpoint-timeout): see the failed row" if failed else "")))
        roof = r.get("roofline") or {}
        if roof.get("total_floor_s"):
            ceil = r.get("roofline_ceilings", {})
            # a fraction above 1 says the steps beat the floor: the ceilings are not this machine's (e.g. the cpu
            # profile's assumed bandwidth), so the row must say so rather than read as a normal result
            above = (f"; above 1: the measured steps beat this floor, so {ceil.get('profile')}'s ceilings are below "
                     "what this machine does (assumed figures or another machine's), and the fraction is no "
                     "measure of efficiency here")
            stage.add(info(tier, f"{tag}.roofline.floor_s", round(float(roof["total_floor_s"]), 6), "s",
                           level="projected",
                           detail=f"sum over measured engine steps of max(bytes/bandwidth, FLOPs/peak); "
                                  f"ceilings of {ceil.get('profile')} ({ceil.get('kind', 'datasheet')})"),
                      info(tier, f"{tag}.roofline.measured_s", round(float(roof.get("total_measured_s", 0)), 6), "s",
                           level=lv, detail="sum of the same steps' measured times"),
                      # a ratio whose numerator is a projection is as strong as the projection
                      info(tier, f"{tag}.roofline.fraction", round(float(roof.get("fraction", 0)), 6), "",
                           level="projected",
                           detail="projected floor / measured time (1.0 = at the roofline), all steps"
                                  + (above if float(roof.get("fraction", 0)) > 1 else "")))
            dec = roof.get("decode_only") or {}
            if dec.get("steps"):
                stage.add(info(tier, f"{tag}.roofline.decode_fraction", round(float(dec["fraction"]), 6), "",
                               level="projected", detail=f"the same over the {dec['steps']} steps that carried no prefill "
                                                f"tokens (pure decode steps; median step "
                                                f"{float(dec['median_fraction']):.3f})"
                                                + (above if float(dec["fraction"]) > 1 else "")))
            for key, label in (("decode_only", "decode-only steps"), ("with_prefill", "steps with prefill chunks")):
                share = (roof.get(key) or {}).get("issue_share")
                if share is not None:
                    stage.add(info(tier, f"{tag}.host_issue_share.{key}", round(float(share), 4), "", level=lv,
                                   detail=f"{label}: host time from each step's start to its one synchronisation "
                                          "(planning, launches, eager chunk halves) over the step's time; near 1 "
                                          "the host bounds the step and the device waits on it"))
        mf = getattr(getattr(session, "opts", None), "min_fraction", None)
        if mf is not None:  # validate --min-fraction: speed judged, against a projected floor
            if roof.get("total_floor_s"):
                stage.add(check(tier, f"{tag}.roofline.fraction_min", round(float(roof.get("fraction", 0)), 6),
                                ge=float(mf), level="projected",
                                detail=f"--min-fraction {mf}: the fraction of the roofline over all steps must reach "
                                       "it (floor projected from the profile's ceilings)"))
            else:  # asked to judge speed and nothing to judge it by: a failure, not a silent pass
                stage.add(check(tier, f"{tag}.roofline.fraction_min", "no roofline", eq="a fraction", level=lv,
                                detail=f"--min-fraction {mf}: this point has no roofline (no engine steps were "
                                       "measured), so its speed cannot be judged"))
        for t in getattr(session.profile, "targets", ()):
            if lv in ("measured", "external") and t.metric in r and c == _target_conc(t.setting):
                ok = r[t.metric] <= t.value if t.metric.endswith("_ms") else r[t.metric] >= t.value
                stage.add(info(tier, f"target.{t.name}", r[t.metric], t.unit, level=lv,
                               detail=f"public figure {t.value} {t.unit} ({t.setting}; {t.source}): "
                                      f"{'meets' if ok else 'below'}"))
    cs = [r.get("concurrency") for r in results]
    pct = {}
    for m in ("ttft", "tpot", "itl", "e2el"):
        vals = [r.get(f"median_{m}_ms") for r in results]
        if all(v is not None for v in vals):
            pct[f"median {m.upper()}"] = vals
        vals = [r.get(f"p99_{m}_ms") for r in results]
        if all(v is not None for v in vals):
            pct[f"p99 {m.upper()}"] = vals
    if pct:
        stage.series["latency"] = {"title": "latency percentiles vs concurrency", "kind": "bar",
                                   "x": cs, "xlabel": "concurrency", "ylabel": "ms", "y": pct, "log": True,
                                   "levels": {k: lv for k in pct}}
    thr = {k: [r.get(k) for r in results] for k in ("output_throughput", "total_token_throughput")}
    thr = {k: v for k, v in thr.items() if all(x is not None for x in v)}
    if thr:
        stage.series["throughput"] = {"title": "throughput vs concurrency", "kind": "bar", "x": cs,
                                      "xlabel": "concurrency", "ylabel": "tok/s", "y": thr,
                                      "levels": {k: lv for k in thr}}
    # the serving trade-off (InferenceX's axes): output tok/s per GPU against tok/s per user, one point per
    # concurrency; tok/s/user = 1000 / median TPOT (ms)
    pts = sorted((1000.0 / r["median_tpot_ms"], r["output_throughput_per_gpu"], r.get("concurrency"))
                 for r in results if r.get("median_tpot_ms") and r.get("output_throughput_per_gpu") is not None)
    for u, _, c in sorted(pts, key=lambda p: p[2]):  # rows in concurrency order, the plot in x order
        stage.add(info(tier, f"c{c}.tok_s_per_user", round(u, 4), "tok/s/user", level=lv,
                       detail="1000 / median TPOT (ms): decode speed one user sees"))
    # fraction of roofline per concurrency: all steps, pure decode steps, steps carrying prefill chunks
    roofs = [r.get("roofline") or {} for r in results]
    if any(x.get("total_floor_s") for x in roofs):
        y = {"all steps": [float(x.get("fraction", 0.0)) for x in roofs]}
        for key, label in (("decode_only", "decode-only steps"), ("with_prefill", "steps with prefill")):
            vals = [float((x.get(key) or {}).get("fraction", 0.0)) for x in roofs]
            if any(vals):
                y[label] = vals
        stage.series["roofline"] = {"title": "fraction of the roofline vs concurrency (1.0 = at the floor)",
                                    "kind": "bar", "x": cs, "xlabel": "concurrency", "ylabel": "floor / measured",
                                    # a projected floor over a measured time: as strong as the projection (the
                                    # roofline.fraction rows say the same)
                                    "y": y, "levels": {k: "projected" for k in y}}
    bars = [(f"c{r.get('concurrency')} {kind}", part) for r in results
            for kind, part in sorted((r.get("breakdown") or {}).items())]
    if bars:
        fams = list(dict.fromkeys(f for _, part in bars for f in part["ms"]))
        stage.series["breakdown"] = {"title": "where a step goes (eager profiled step, ms per op family)",
                                     "kind": "stacked", "x": [b[0] for b in bars], "xlabel": "step",
                                     "ylabel": "ms", "y": {f: [part["ms"].get(f, 0.0) for _, part in bars]
                                                           for f in fams}, "levels": {f: lv for f in fams}}
    if pts:
        stage.series["tradeoff"] = {"title": "throughput per GPU vs speed per user (labels: concurrency)",
                                    "kind": "line", "x": [p[0] for p in pts], "xlabel": "tok/s/user",
                                    "ylabel": "output tok/s/GPU", "y": {"output tok/s/GPU": [p[1] for p in pts]},
                                    "labels": [f"c={p[2]}" for p in pts], "levels": {"output tok/s/GPU": lv}}


#: what each counted collective of the decoder is (k3rocm.model.decoder / runtime.dist.TPGroup)
COLLECTIVE_OPS = {"attn": "all-reduce of the token mixers' o_proj partial sums",
                  "mlp": "all-reduce of the dense MLP's partial sums",
                  "moe": "all-reduce of the latent MoE's routed + shared partial sums (before the latent norm)",
                  "embed": "all-reduce of the vocabulary-parallel embedding rows",
                  "greedy": "all-gather of each rank's (max, id) over its vocabulary slice",
                  "logits": "all-gather of whole-vocabulary logits (validation only)"}


def _collective_rows(session: Session, stage: Stage, tier: str, tag: str, r: dict, lv: str) -> None:
    """Per collective of a TP/EP step: bytes each rank puts in per step and its share of step time — measured
    where collectives run on the host (gloo), else projected from the profile's link bandwidth (ring: each rank
    moves ``2 (w-1)/w`` of the bytes) against the measured median step."""
    coll = r.get("collectives") or {}
    w = session.world
    if not coll or w <= 1:  # one rank (a --synthetic TP1 run counts its reduces for a projection): nothing moves
        return
    link = float(getattr(session.run_profile, "link_bandwidth", 0) or 0)
    for name, c in coll.items():
        op = COLLECTIVE_OPS.get(name, name)
        stage.add(info(tier, f"{tag}.collective.{name}.bytes_per_step", round(float(c["bytes_per_step"]), 1), "B",
                       level=lv, detail=f"{op}: {c['calls_per_step']:.1f} calls per step, bytes each rank puts in"))
        if c.get("seconds"):
            stage.add(info(tier, f"{tag}.collective.{name}.share", round(float(c["share_of_step_time"]), 4), "",
                           level=lv, detail="share of the measured steps' time spent in this collective (host clock)"))
        elif link > 0 and c.get("mean_step_s"):
            proj = c["bytes_per_step"] * 2 * (w - 1) / w / link
            stage.add(info(tier, f"{tag}.collective.{name}.share", round(proj / c["mean_step_s"], 4), "",
                           level="projected", detail=f"ring all-reduce time at {link / 1e9:.0f} GB/s link bandwidth "
                                                     "over the measured mean step time"))


def _compile_rows(stage: Stage, tier: str, tag: str, r: dict, lv: str) -> None:
    """Kernel compilations and autotune runs during the measured phase: each must be 0 (a serving engine
    compiles and tunes during warm-up only); a failure names the kernels."""
    c = r.get("compiles")
    if not c:
        return
    ladder = (r.get("warmup") or {}).get("ladder") or {}
    buckets = ladder.get("prefill_buckets") or []
    after = (f"after warm-up of {len(ladder.get('graphs', []))} decode graphs, "
             f"{len(ladder.get('mixed_graphs', []))} mixed-step graphs and "
             + (f"prefill buckets of {', '.join(map(str, buckets))} tokens" if buckets else "no prefill buckets")
             if ladder else "after the warm-up requests")
    if ladder.get("seconds") is not None:
        stage.add(info(tier, f"{tag}.warmup.seconds", round(float(ladder["seconds"]), 3), "s", level=lv,
                       detail=f"engine.warm_up(): graphs captured, the kernels of every step shape serving can meet "
                              f"compiled (tune mode {ladder.get('tune_mode', '?')})"))
        wc = ladder.get("compiles")
        stage.add(info(tier, f"{tag}.warmup.compiles", int(wc) if wc is not None else "not counted",
                       "kernels" if wc is not None else "", level=lv,
                       detail=f"Triton compilations during warm-up; {int(ladder.get('autotune_runs') or 0)} "
                              "tune.pick timing runs"))
    if c.get("available", True):
        names = listed((f"{k} x{v}" for k, v in c.get("compiled", {}).items()), ", ", limit=240)
        stage.add(check(tier, f"{tag}.measured.compiles", int(c["compiles"]), eq=0, unit="kernels", level=lv,
                        detail=(f"Triton compilations while measuring {after}"
                                + (f": {names}" if names else ""))))
    else:
        stage.add(info(tier, f"{tag}.measured.compiles", "not counted", level=lv,
                       detail="this Triton has no knobs.runtime.jit_post_compile_hook"))
    names = listed((f"{k} x{v}" for k, v in c.get("tuned", {}).items()), ", ", limit=240)
    stage.add(check(tier, f"{tag}.measured.autotune_runs", int(c["autotune_runs"]), eq=0, unit="runs", level=lv,
                    detail=(f"tune.pick timing runs while measuring {after}" + (f": {names}" if names else ""))))


#: why concurrency 1 has no mixed-step breakdown (the row's detail, and a console note)
NO_MIXED_AT_C1 = ("at concurrency 1 the engine holds one sequence, and a mixed step needs a decode row beside a "
                  "prefill chunk: the decode step alone is profiled")


def _breakdown_rows(stage: Stage, tier: str, tag: str, r: dict, lv: str, synthetic: bool = False) -> None:
    """Per op family of one decode and one mixed step (:func:`k3rocm.bench.breakdown.step_breakdown`): ms each
    and the step's wall time; the step is eager with a device sync per family, so shares are the reading (its
    wall time is not the served step's, and the rows say so). ``synthetic``: the collectives of a ``--synthetic``
    rank are counted, not run, and their row says what its time is then."""
    parts = r.get("breakdown") or {}
    for kind, part in sorted(parts.items()):
        wall = float(part.get("wall_ms") or 0.0)
        nd, npre = part.get("num_decode"), part.get("num_prefill_tokens")
        stage.add(info(tier, f"{tag}.breakdown.{kind}.wall_ms", round(wall, 4), "ms", level=lv,
                       detail=f"one profiled eager {kind} step: {nd} decode row{'' if nd == 1 else 's'}, "
                              f"{npre} prefill token{'' if npre == 1 else 's'} (synchronised per op family, not graphed: "
                              "not the served step's time, so not comparable with TPOT; read the shares)"))
        for fam, ms in part["ms"].items():
            share = float(ms) / wall if wall > 0 else 0.0
            extra = ("; a --synthetic rank counts its collectives without running them, so this is the counting "
                     "and the family's device sync, not link time (the projected rows give that)"
                     if synthetic and fam == "collectives" else "")
            stage.add(info(tier, f"{tag}.breakdown.{kind}.{fam.replace(' ', '_')}", round(float(ms), 4), "ms",
                           level=lv, detail=f"{share:.1%} of the profiled {kind} step{extra}"))
    if parts and "mixed" not in parts and r.get("concurrency") == 1:  # after the decode rows, in their unit
        stage.add(info(tier, f"{tag}.breakdown.mixed.wall_ms", "not formed", "ms", level=lv,
                       detail=NO_MIXED_AT_C1))


def _target_conc(setting: str) -> int | None:
    """The concurrency a public target's setting names (``"... concurrency 64 ..."``), or None."""
    m = re.search(r"concurrency\s*(\d+)", setting or "")
    return int(m.group(1)) if m else None
