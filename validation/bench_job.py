"""The ``bench`` job: its options, their defaults and checks, and the run itself (the built-in engine or an
``--endpoint``), producing the report's ``bench`` stage.

Order of refusals (a run that cannot happen creates nothing): :func:`parse_concurrency` and
:func:`check_options` need no checkpoint and come first; then the session's pre-flight; then :func:`run_bench_job`
resolves the defaults that depend on the checkpoint and the profile (:func:`resolve_points`), refuses a load the
plan's cache cannot hold (:func:`check_capacity`) or an endpoint that cannot be reached, and only then runs.

Defaults follow InferenceX's random dataset (:mod:`k3rocm.bench.loadgen`): lengths uniform in ``[0.8 L, L]``,
prompts = 10 x concurrency, warm-ups = 2 x concurrency. Without lengths or concurrency: 1024/1024 tokens at
concurrency 64 for a real checkpoint (>= 1 GB) on a GPU profile run on a GPU, or an endpoint; 64/16 at concurrency 4
otherwise (the engine on the CPU, whatever the profile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from k3rocm.bench import run_bench
from k3rocm.bench.client import DEFAULT_TIMEOUT_S, OpenAIClient
from k3rocm.bench.loadgen import DEFAULT_RANGE_RATIO, request_counts
from k3rocm.checkpoint import layout
from k3rocm.config import preset
from k3rocm.errors import ConfigError, HardwareError, Interrupted, Terminated
from k3rocm.profiles import load_profile
from k3rocm.validation.evidence import Stage, info, now_iso, setting
from k3rocm.validation.session import EndpointTarget, Session
from k3rocm.validation.tiers import run_stage
from k3rocm.validation.tiers.performance import bench_rows, run_bench_point

MAX_PROMPTS = 1_000_000  # --num-prompts / --warmups above this are refused: run several benchmarks
MAX_BATCHED_TOKENS = 16_384  # --max-num-batched-tokens above this is refused (activation buffers per step bucket)


@dataclass(frozen=True)
class BenchOptions:
    """The ``bench`` options (see ``k3rocm bench --help``); None means the default.

    Attributes:
        concurrency: concurrencies of the points (parsed ``--concurrency``, see :func:`parse_concurrency`).
        input_len: prompt length L in tokens (drawn in ``[range_ratio * L, L]``).
        output_len: output length L in tokens, at least 2 (drawn in ``[max(2, range_ratio * L), L]``).
        num_prompts: measured requests per point (default 10 x concurrency).
        range_ratio: lower end of the length draws, in (0, 1].
        warmups: warm-up requests per point (default 2 x concurrency).
        endpoint: URL of an OpenAI-compatible server to run the load against instead of the built-in engine.
        model_name: the ``model`` field sent to ``endpoint``.
        endpoint_gpus: GPUs serving ``endpoint`` (the divisor of its tok/s/GPU figures).
        max_num_batched_tokens: the built-in engine's tokens per step (decode rows + prefill chunk tokens; vLLM's
            name); None: the engine's default (:data:`k3rocm.runtime.engine.MAX_NUM_BATCHED_TOKENS`).
        endpoint_timeout: seconds ``endpoint`` may stay silent before a request fails (None: 60).
    """

    concurrency: list[int] | None = None
    input_len: int | None = None
    output_len: int | None = None
    num_prompts: int | None = None
    range_ratio: float = DEFAULT_RANGE_RATIO
    warmups: int | None = None
    endpoint: str | None = None
    model_name: str | None = None
    endpoint_gpus: int | None = None
    max_num_batched_tokens: int | None = None
    endpoint_timeout: float | None = None


@dataclass(frozen=True)
class BenchPoints:
    """The points a run measures, defaults resolved: ``concurrencies`` and the lengths in tokens."""

    concurrencies: list[int]
    input_len: int
    output_len: int


class ProgressBar(Protocol):
    """Where a run reports progress: a context manager whose ``callback(description)`` returns a
    ``(done, total)`` function (the CLI's :class:`k3rocm.cli.common.Progress`)."""

    def __enter__(self) -> "ProgressBar": ...

    def __exit__(self, *exc) -> None: ...

    def callback(self, description: str) -> Callable: ...

    def note(self, text: str) -> None: ...


def phase_progress(bar: ProgressBar, concurrency: int) -> Callable:
    """``fn(done, total, phase="warmup"|"measure", failed=, tokens=)`` feeding one bar per phase of a point, labelled
    ``bench c=N warm-up`` and ``bench c=N measured``, so warm-ups are never read as measured requests."""
    bars: dict[str, Callable] = {}

    def fn(done, total, *_, phase: str = "measure", **kw):
        if phase not in bars:
            bars[phase] = bar.callback(f"bench c={concurrency} {'warm-up' if phase == 'warmup' else 'measured'}")
        bars[phase](done, total, **kw)
    return fn


def sweep_work(bench: BenchOptions, pts: BenchPoints) -> str:
    """One line stating a sweep's total work before it starts: points, requests (warm-up + measured), lengths."""
    counts = [request_counts(c, bench.num_prompts, bench.warmups) for c in pts.concurrencies]
    n, w = sum(x[0] for x in counts), sum(x[1] for x in counts)
    k = len(pts.concurrencies)
    return (f"bench: {k} point{'s' if k != 1 else ''} (concurrency {', '.join(map(str, pts.concurrencies))}), "
            f"{n + w:,} requests ({w:,} warm-up + {n:,} measured), up to {pts.input_len:,} prompt + "
            f"{pts.output_len:,} output tokens each")


def run_sweep(stage: Stage, concurrencies: list[int], point: Callable[[int], dict],
              stop_after: Callable[[dict], bool] = lambda r: False) -> tuple[list[dict], bool]:
    """Run ``point(c)`` for each concurrency in order; Ctrl-C ends the sweep and keeps the finished points.

    Returns ``(results, interrupted)``: ``interrupted`` False, or ``"Ctrl-C"`` / ``"SIGTERM"``. On an interrupt a ``sweep.interrupted`` row names how many points
    finished (the caller adds their rows, then raises :class:`k3rocm.errors.Interrupted`). ``stop_after(result)``
    True ends the sweep after that point.
    """
    results: list[dict] = []
    try:
        for c in concurrencies:
            results.append(point(c))
            if stop_after(results[-1]):
                break
    except KeyboardInterrupt as e:
        c = concurrencies[len(results)]
        kept = isinstance(getattr(e, "result", None), dict)  # PointInterrupted: measured, breakdown cut
        if kept:
            results.append(e.result)
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        stage.add(info("bench", "sweep.interrupted", True, level="measured",
                       detail=f"interrupted ({how}) during concurrency {c}"
                              f"{' after its measured phase (its step breakdown was cut)' if kept else ''}: "
                              f"{len(results)} of {len(concurrencies)} points finished and are kept"))
        return results, how
    return results, False


def _interrupted(results: list[dict], total: int, how: str = "Ctrl-C") -> Interrupted:
    if results:
        e = Interrupted(f"interrupted ({how}) after {len(results)} of {total} points; the finished points are in "
                        "the report, marked interrupted")
    else:
        e = Interrupted(f"interrupted ({how}) before any of the {total} points finished: nothing was measured (the "
                        "report keeps the rows of what ran before the sweep, marked interrupted)")
    if how == "SIGTERM":
        e.exit_code = 143
    return e


def parse_concurrency(text: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]``. Raises ConfigError for anything but distinct positive integers."""
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


def check_options(bench: BenchOptions, kernels: str, profile: str | None) -> tuple[int, str] | None:
    """The ``bench`` options that are wrong whatever the checkpoint: lengths (tokens), counts, ratio, and options
    that would have no effect on the chosen target (``kernels`` is ``--kernels``, ``profile`` ``--profile``).

    Returns:
        ``(gpus, source)`` serving ``bench.endpoint`` (see :func:`endpoint_gpus`), or None without an endpoint.

    Raises:
        ConfigError: one line naming the option, why, and what to pass instead.
    """
    b = bench
    if b.input_len is not None and b.input_len < 1:
        raise ConfigError(f"--input-len {b.input_len} must be >= 1 (tokens per prompt); pass --input-len 1 or more")
    if b.output_len is not None and b.output_len < 2:
        raise ConfigError(f"--output-len {b.output_len} must be >= 2 (tokens): with fewer than 2 output tokens "
                          "there is no TPOT or ITL to measure; pass --output-len 2 or more")
    if b.num_prompts is not None and b.num_prompts < 1:
        raise ConfigError(f"--num-prompts {b.num_prompts} must be >= 1; pass --num-prompts 1 or more")
    if b.num_prompts is not None and b.num_prompts > MAX_PROMPTS:
        raise ConfigError(f"--num-prompts {b.num_prompts} is more than {MAX_PROMPTS:,}; run several benchmarks")
    if not 0.0 < b.range_ratio <= 1.0:
        raise ConfigError(f"--range-ratio {b.range_ratio} must be in (0, 1]: lengths are drawn from [ratio x length, "
                          "length]; pass e.g. --range-ratio 1 for fixed lengths")
    if b.warmups is not None and not 0 <= b.warmups <= MAX_PROMPTS:
        raise ConfigError(f"--warmups {b.warmups} must be in 0..{MAX_PROMPTS:,}; leave it out for 2 x concurrency, "
                          "or pass 0 to measure from the first request")
    if b.model_name is not None and b.endpoint is None:
        raise ConfigError("--model names the model an --endpoint serves; without --endpoint the built-in engine "
                          "runs the checkpoint: drop --model or add --endpoint URL")
    if b.endpoint_gpus is not None and b.endpoint is None:
        raise ConfigError("--endpoint-gpus counts the GPUs serving an --endpoint; the built-in engine's per-GPU "
                          "figures use the GPUs it runs on: drop --endpoint-gpus or add --endpoint URL")
    if b.endpoint_gpus is not None and b.endpoint_gpus < 1:
        raise ConfigError(f"--endpoint-gpus {b.endpoint_gpus} must be >= 1 (GPUs serving --endpoint)")
    if b.endpoint_timeout is not None and b.endpoint is None:
        raise ConfigError("--endpoint-timeout bounds the waits on an --endpoint server; the built-in engine has its "
                          "own watchdog: drop --endpoint-timeout or add --endpoint URL")
    if b.endpoint_timeout is not None and not 0 < b.endpoint_timeout <= 86400:  # NaN fails the comparison too
        raise ConfigError(f"--endpoint-timeout {b.endpoint_timeout} must be a number of seconds in (0, 86400]")
    if b.max_num_batched_tokens is not None and b.endpoint is not None:
        raise ConfigError("--max-num-batched-tokens sizes the built-in engine's steps; an --endpoint server schedules "
                          "its own: drop --max-num-batched-tokens or --endpoint")
    if b.max_num_batched_tokens is not None and not 1 <= b.max_num_batched_tokens <= MAX_BATCHED_TOKENS:
        raise ConfigError(f"--max-num-batched-tokens {b.max_num_batched_tokens} must be in 1..{MAX_BATCHED_TOKENS:,} "
                          "(tokens per engine step)")
    if b.endpoint is not None and kernels != "auto":
        raise ConfigError(f"--kernels {kernels!r} has no effect on an --endpoint run (the server runs its own "
                          "kernels); drop --kernels")
    if b.concurrency is not None:
        check_prompts_cover(b.num_prompts, b.concurrency, "--concurrency")
        check_budget_covers(b.max_num_batched_tokens, b.concurrency, "--concurrency")
    return endpoint_gpus(b.endpoint_gpus, profile) if b.endpoint is not None else None


def check_budget_covers(budget: int | None, concurrencies: list[int], what: str) -> None:
    """Refuse ``--max-num-batched-tokens`` below the largest concurrency (``what`` names where it came from): a step
    could not carry every running request's decode row, so the point would run at a lighter load than it says.

    Raises:
        ConfigError: one line naming both values and the least budget that fits.
    """
    if budget is not None and budget < max(concurrencies):
        raise ConfigError(f"--max-num-batched-tokens {budget} is below {what} {max(concurrencies)}: a step could not "
                          f"carry every running request's decode row; pass at least {max(concurrencies)}")


def check_prompts_cover(num_prompts: int | None, concurrencies: list[int], what: str) -> None:
    """Refuse ``--num-prompts`` below the largest concurrency: fewer requests than the concurrency never put
    that many in flight, so the point would be labelled with a load it did not carry.

    Raises:
        ConfigError: the numbers and the smallest ``--num-prompts`` that works.
    """
    c = max(concurrencies)
    if num_prompts is not None and num_prompts < c:
        raise ConfigError(f"--num-prompts {num_prompts} is fewer than {what} {c}: at most {num_prompts} "
                          f"request{'s' if num_prompts != 1 else ''} would be in flight, not {c}; pass --num-prompts {c} or more (default 10 x concurrency)")


def endpoint_gpus(endpoint_gpus: int | None, profile: str | None) -> tuple[int, str]:
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
    p = load_profile(profile)
    if p.backend == "cpu" or int(p.device_count) < 1:
        raise ConfigError(f"--profile {profile} describes no GPU, so it cannot tell how many GPUs serve --endpoint; "
                          "pass --endpoint-gpus N")
    return int(p.device_count), f"the device count of --profile {profile}"


def resolve_points(session: Session, bench: BenchOptions) -> BenchPoints:
    """The concurrencies and lengths of the run, defaults resolved (see the module docstring): the large ones for
    an endpoint or a checkpoint of at least 1 GB on a GPU profile run on a GPU, else the small ones (a small
    checkpoint, or the engine on the CPU whatever the profile).

    Raises:
        ConfigError: ``--num-prompts`` below the default concurrency (:func:`check_prompts_cover`), or
            ``--max-num-batched-tokens`` below it.
    """
    # "on the CPU" is where the engine runs: a GPU profile named on a CPU machine (a projection) still steps on
    # the CPU, where a 1024/1024 load at concurrency 64 would take hours
    big = bench.endpoint is not None or (session.profile.backend != "cpu" and session.device != "cpu"
                                         and layout.counts(session.config)["bytes"] >= 1e9)
    cs = bench.concurrency if bench.concurrency is not None else [64 if big else 4]
    if bench.concurrency is None:  # the default concurrency is known only now (preflight leaves no directory behind)
        check_prompts_cover(bench.num_prompts, cs, "the default --concurrency")
        check_budget_covers(bench.max_num_batched_tokens, cs, "the default --concurrency")
    il = bench.input_len if bench.input_len is not None else (1024 if big else 64)
    ol = bench.output_len if bench.output_len is not None else (1024 if big else 16)
    return BenchPoints(cs, il, ol)


def check_capacity(session: Session, concurrencies: list[int], input_len: int, output_len: int) -> None:
    """Refuse, before any memory is taken, a load the plan's cache cannot hold (the counts were checked by
    :func:`check_options`).

    Per sequence the engine keeps ``(input_len + output_len)`` tokens of MLA latent cache plus one KDA state
    (``Placement.cache``: ``mla_bytes_per_token``, ``kda_state_bytes_per_seq``); ``concurrency`` sequences must
    fit the plan's cache budget, and a sequence must fit ``max_position_embeddings``.

    Raises:
        ConfigError: the numbers, and what to lower.
    """
    text = session.config.raw.get("text_config", session.config.raw)
    max_pos = int(text.get("max_position_embeddings") or 0)
    L = input_len + output_len
    if max_pos and L > max_pos:
        raise ConfigError(f"--input-len + --output-len = {input_len:,} + {output_len:,} = {L:,} tokens exceeds the "
                          f"model's max_position_embeddings {max_pos:,} (config.json); pass --input-len and "
                          f"--output-len that sum to at most {max_pos:,}")
    pl = session.run_placement
    c = pl.cache
    per_seq = L * c.mla_bytes_per_token + c.kda_state_bytes_per_seq
    fit = c.budget_bytes // max(per_seq, 1)
    conc = max(concurrencies)
    if conc > fit:
        raise ConfigError(f"--concurrency {conc} at {L:,} tokens per sequence needs {conc * per_seq / 1e9:.2f} GB "
                          f"of cache per GPU; the plan on {pl.profile_name} leaves {c.budget_bytes / 1e9:.2f} GB "
                          f"({fit:,} such sequences): lower --concurrency or the lengths")


#: host memory the load generator and the engine's request records take per request and per token (token ids as
#: Python ints, per-token timestamps, output lists), an upper estimate; a sweep point whose requests would take
#: more than HOST_MEMORY_SHARE of the memory available is refused before anything is built
HOST_BYTES_PER_REQUEST = 16 << 10
HOST_BYTES_PER_TOKEN = 128
HOST_MEMORY_SHARE = 0.5


def host_memory_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (what can be taken without swapping), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(bench: BenchOptions, pts: BenchPoints, available: int | None = None) -> None:
    """Refuse a sweep whose largest point's requests (warm-up + measured, each up to ``input_len + output_len``
    tokens) would take more than ``HOST_MEMORY_SHARE`` of the host memory available (``--concurrency 100000`` on
    a laptop used to grow until the kernel killed the run, with no line and no report).

    Raises:
        ConfigError: the estimate, what is available, and what to lower.
    """
    avail = host_memory_available() if available is None else available
    if not avail:
        return
    L = pts.input_len + pts.output_len
    worst = max(pts.concurrencies, key=lambda c: sum(request_counts(c, bench.num_prompts, bench.warmups)))
    n = sum(request_counts(worst, bench.num_prompts, bench.warmups))
    need = n * (HOST_BYTES_PER_REQUEST + L * HOST_BYTES_PER_TOKEN)
    if need > HOST_MEMORY_SHARE * avail:
        measured, warm = request_counts(worst, bench.num_prompts, bench.warmups)
        # name the options that set the counts: the explicit ones, and --concurrency whose defaults scale with it
        knobs = [f for f, v in (("--num-prompts", bench.num_prompts), ("--warmups", bench.warmups)) if v is not None]
        lower = " or ".join(["--concurrency"] * (len(knobs) < 2) + knobs)
        raise ConfigError(f"--concurrency {worst}: {n:,} requests ({warm:,} warm-up + {measured:,} measured) of up to "
                          f"{L:,} tokens would take about {need / 1e9:.1f} GB of host memory, more than half of the "
                          f"{avail / 1e9:.1f} GB available; lower {lower}")


def run_bench_job(session: Session, bench: BenchOptions, gpus: tuple[int, str] | None, bar: ProgressBar) -> Stage:
    """Run ``bench`` on a pre-flighted session: the points of :func:`resolve_points` through the built-in engine
    (:func:`~k3rocm.validation.tiers.performance.run_bench_point`) or against ``bench.endpoint``; ``gpus`` is
    :func:`check_options`' answer. Returns the ``bench`` stage (a K3Error during the run becomes its error).

    Raises:
        ConfigError: a default that does not fit (:func:`resolve_points`, :func:`check_capacity`), or a load the
            host memory cannot hold (:func:`check_host_memory`).
        HardwareError: the endpoint cannot be reached (before anything is timed).
    """
    pts = resolve_points(session, bench)
    if bench.endpoint is None:
        check_capacity(session, pts.concurrencies, pts.input_len, pts.output_len)
    check_host_memory(bench, pts)  # after the model's own limits, whose lines name the cause more exactly
    if bench.endpoint is None:
        body = _engine_body(session, bench, pts, bar)
    else:
        body = _endpoint_body(session, bench, pts, gpus, bar)
    stage = run_stage("bench", body, session.opts.command, session.opts.debug)
    stage.started = stage.started or now_iso()
    return stage


def _engine_body(session: Session, bench: BenchOptions, pts: BenchPoints, bar: ProgressBar):
    """The stage body of a run on the built-in engine: load, then one point per concurrency."""
    def body(stage: Stage) -> None:
        with bar:
            # --synthetic makes the weights on the device; nothing is read from a checkpoint
            session.load(progress=bar.callback("generating random weights" if session.synthetic else "loading"))
            bar.note(sweep_work(bench, pts))
            results, stopped = run_sweep(stage, pts.concurrencies, lambda c: run_bench_point(
                session, concurrency=c, input_len=pts.input_len, output_len=pts.output_len,
                num_prompts=bench.num_prompts, range_ratio=bench.range_ratio, warmups=bench.warmups,
                max_num_batched_tokens=bench.max_num_batched_tokens, progress=phase_progress(bar, c)))
        bench_rows(session, stage, results, tier="bench")
        session.synthetic_rows(stage, results, tier="bench")
        if stopped:
            raise _interrupted(results, len(pts.concurrencies), stopped)
    return body


def _endpoint_body(session: Session, bench: BenchOptions, pts: BenchPoints, gpus: tuple[int, str],
                   bar: ProgressBar):
    """``bench --endpoint``: the same load generator and metrics against another engine's server.

    Its figures are evidence about that server, so they carry the level ``external``. Prompt ids come from
    the given checkpoint's vocabulary, or K3's (163,840, special ids excluded) when none is given. ``gpus`` is
    ``(count, source)`` from :func:`endpoint_gpus`; every tok/s/GPU row says both.

    A point where no request succeeded measured nothing: its latency and throughput rows are absent, its
    ``failed`` row says why, the sweep stops there and the stage ends as an error of the endpoint (exit 3).

    Raises:
        HardwareError: the server cannot be reached (before anything is timed).
    """
    endpoint = bench.endpoint
    n_gpus, source = gpus
    cfg = session.config if session.opts.checkpoint else preset("k3")
    client = OpenAIClient(endpoint, model=bench.model_name, vocab_size=cfg.vocab_size,
                          special_ids=(cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id),
                          timeout=bench.endpoint_timeout or DEFAULT_TIMEOUT_S)
    client.check_reachable()

    def point(c: int) -> dict:
        cb = phase_progress(bar, c)
        r = run_bench(client, c, pts.input_len, pts.output_len, num_prompts=bench.num_prompts,
                      range_ratio=bench.range_ratio, warmups=bench.warmups, seed=session.opts.seed,
                      progress=lambda phase, done, total, **kw: cb(done, total, phase=phase, **kw), num_gpus=n_gpus)
        d = r.to_dict(per_request=False)
        d["target"] = client.describe()
        d["num_gpus_source"] = source
        return d

    def body(stage: Stage) -> None:
        with bar:
            bar.note(sweep_work(bench, pts))
            # a point where nothing completed ends the sweep: the server answers nothing usefully
            results, stopped = run_sweep(stage, pts.concurrencies, point, lambda d: not d.get("completed"))
        gpu_detail = f"{n_gpus} GPU{'s' if n_gpus != 1 else ''} serving the endpoint, {source}"
        # the report's header must say what was measured: the server, not this machine or the checkpoint
        session.opts.endpoint = EndpointTarget(endpoint, n_gpus, source, client.timeout)
        stage.add_settings(setting("bench", "endpoint.gpus", n_gpus, "GPU",
                                   detail=f"the tok/s/GPU figures assume {gpu_detail}"))
        bench_rows(session, stage, results, tier="bench", level="external")
        for e in stage.evidence:
            if e.name.endswith(".output_throughput_per_gpu"):
                e.detail = f"output tok/s / {gpu_detail}"
        if stopped:
            raise _interrupted(results, len(pts.concurrencies), stopped)
        last = results[-1] if results else {}
        if not last.get("completed"):
            raise HardwareError(_nothing_measured(endpoint, last))
    return body


def _nothing_measured(endpoint: str, r: dict) -> str:
    """The one line for a point where no request succeeded: how many were sent and the most frequent reason
    (of the warm-ups when every one of them failed and no measured request was sent)."""
    n = int(r.get("completed", 0)) + int(r.get("failed", 0))
    errs = r.get("errors") or []
    hang = r.get("hang")
    wu = r.get("warmup") or {}
    if n == 0 and wu.get("sent") and not wu.get("completed"):
        why = (wu.get("errors") or [{"error": "no warm-up finished"}])[0]["error"]
        sent, asked = int(wu["sent"]), int(wu.get("asked") or wu["sent"])
        # the counts the progress line showed: the sending stops once every warm-up sent so far has failed
        which = f"all {sent}" if sent >= asked else f"the first {sent} of {asked}"
        rest = "no measured request was sent" if sent >= asked else \
            f"the other {asked - sent} and every measured request were not sent"
        return (f"--endpoint {endpoint}: {which} warm-up requests at concurrency {r.get('concurrency')} failed "
                f"({why}), so {rest}; is it an OpenAI-compatible server streaming /v1/completions?")
    if errs:
        why = errs[0]["error"]
    elif hang:
        why = (f"a {hang.get('phase', '')} request outlived the watchdog ({float(hang.get('elapsed_s', 0)):.1f} s "
               f"> {float(hang.get('threshold_s', 0)):.1f} s)")
    else:
        why = "no request finished"
    return (f"--endpoint {endpoint}: none of {n} requests at concurrency {r.get('concurrency')} succeeded, so "
            f"nothing was measured ({why}); is it an OpenAI-compatible server streaming /v1/completions?")
