"""Serving benchmark: InferenceX-style load on an in-process :class:`~k3rocm.runtime.engine.Engine` or an
OpenAI-compatible endpoint (:mod:`k3rocm.bench.client`), vLLM-named metrics, fraction of roofline.

:func:`run_bench` issues ``warmups`` then ``num_prompts`` random requests (:mod:`k3rocm.bench.loadgen`)
with at most ``concurrency`` in flight, records each request's token arrival times and aggregates
them (:mod:`k3rocm.bench.metrics`). A watchdog stops the run cleanly when an in-flight request has taken
longer than ``watchdog_factor`` x the running median E2EL of completed requests: that request is
marked as a hang with where it was (phase, tokens done, seconds), every other in-flight request is
aborted, and the result holds what completed.

With an engine, the watchdog runs between engine steps (a step that never returns cannot be
interrupted in-process; the endpoint client checks it while streaming). An engine is first warmed up
(``engine.warm_up()``: every graph captured and every kernel specialisation serving can meet compiled, in
seconds and compiles it reports); the measured phase
runs under a :class:`~k3rocm.kernels.compile_watch.CompileWatch` (Triton compilations and autotune runs, per
kernel: both must be 0 for a serving engine), and after it :func:`k3rocm.bench.breakdown.step_breakdown` times
one decode and one mixed step per op family.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from k3rocm.bench.loadgen import DEFAULT_RANGE_RATIO, BenchRequest, plan_load
from k3rocm.bench.metrics import RequestRecord, aggregate
from k3rocm.bench.roofline import fraction_of_roofline
from k3rocm.errors import ConfigError
from k3rocm.runtime.sizing import StepRoofline

__all__ = ["BenchResult", "PointInterrupted", "run_bench", "sweep"]


@dataclass
class BenchResult:
    """One benchmark point.

    Attributes:
        concurrency, input_len, output_len, num_prompts, num_warmups, range_ratio, seed: the load.
        metrics: :func:`k3rocm.bench.metrics.aggregate` fields (``mean_ttft_ms``, ``output_throughput``, ...).
        records: per-request :class:`RequestRecord` (measured requests only).
        hang: None, or ``{"request_id", "elapsed_s", "threshold_s", "median_e2el_s", "where": {...}}``.
        target: the engine's ``describe()`` or the endpoint's description.
        roofline: fraction of roofline over the measured steps (engine with a roofline model), else None.
        collectives: :func:`collective_summary` of the measured steps (a rank of a TP/EP layout), else ``{}``.
        outputs_sha256: :func:`outputs_digest` of the measured requests (engines), else None.
        warmup: ``{"sent", "completed", "failed", "errors": [{"error", "count"}]}`` of the warm-up phase; when
            warm-ups were asked for and none succeeded, no measured request was sent (``records`` is empty).
            With an engine also ``"ladder"``: what ``engine.warm_up()`` compiled and captured.
        compiles: :meth:`CompileWatch.summary` of the measured phase (engines), else ``{}``.
        breakdown: :func:`k3rocm.bench.breakdown.step_breakdown` after the measured phase (engines), else ``{}``.
    """

    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int
    num_warmups: int
    range_ratio: float
    seed: int
    metrics: dict
    records: list[RequestRecord]
    hang: dict | None = None
    target: dict = field(default_factory=dict)
    roofline: dict | None = None
    warmup: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    outputs_sha256: str | None = None
    compiles: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)

    @property
    def completed_cleanly(self) -> bool:
        return self.hang is None and self.metrics.get("failed", 0) == 0

    def to_dict(self, per_request: bool = True, per_step: bool = False) -> dict:
        d = {"concurrency": self.concurrency, "input_len": self.input_len, "output_len": self.output_len,
             "num_prompts": self.num_prompts, "num_warmups": self.num_warmups, "range_ratio": self.range_ratio,
             "seed": self.seed, **self.metrics, "hang": self.hang, "target": self.target, "warmup": self.warmup}
        if self.collectives:
            d["collectives"] = self.collectives
        if self.outputs_sha256 is not None:
            d["outputs_sha256"] = self.outputs_sha256
        if self.compiles:
            d["compiles"] = self.compiles
        if self.breakdown:
            d["breakdown"] = self.breakdown
        errs = _reasons(r.error for r in self.records if not r.success and r.error)
        if errs:  # why requests failed: each distinct reason with its count, most frequent first
            d["errors"] = errs
        dis = _reasons(r.usage_disagreement for r in self.records if r.success and r.usage_disagreement)
        if dis:
            d["usage_disagreement_examples"] = dis
        if self.roofline is not None:
            r = dict(self.roofline)
            if not per_step:
                r.pop("per_step", None)
            d["roofline"] = r
        if per_request:
            d["requests"] = [r.to_dict() for r in self.records]
        return d


def wall_ms(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Median wall-clock milliseconds of ``repeats`` calls of ``fn`` after one warm call: the CPU stand-in for
    ``triton.testing.do_bench`` in the ``gpu-runs/`` benchmark scripts' CPU smoke runs (their timings there mean
    nothing; the scripts' code paths are what is checked)."""
    fn()
    ts = []
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def outputs_digest(engine: Any, records: Sequence[RequestRecord], ids: dict[int, int]) -> str:
    """sha256 of the greedy output tokens of ``records`` (in request-id order) as ``engine`` produced them: two
    runs of the same seeded load served the same tokens exactly when their digests are equal (e.g. a TP/EP run
    against one process). ``ids``: load request id -> the engine's request id."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.request_id):
        seq = engine.seqs.get(ids.get(r.request_id, -1)) if hasattr(engine, "seqs") else None
        h.update(f"{r.request_id}:{','.join(map(str, seq.output)) if seq is not None else '-'};".encode())
    return h.hexdigest()


def collective_summary(steps: Sequence[Any]) -> dict:
    """Per collective over engine steps (their ``comm`` field): calls and bytes per step, host seconds and their
    share of the steps' time (measured only where collectives run on the host: gloo), and the mean step time;
    ``{}`` without any."""
    if not steps:
        return {}
    total = sum(float(st.seconds) for st in steps) or 1e-12
    acc: dict[str, list[float]] = {}
    for st in steps:
        for name, calls, nbytes, secs in getattr(st, "comm", ()) or ():
            a = acc.setdefault(name, [0, 0, 0.0])
            a[0] += calls
            a[1] += nbytes
            a[2] += secs
    n = len(steps)
    return {name: {"calls_per_step": a[0] / n, "bytes_per_step": a[1] / n, "seconds": a[2],
                   "share_of_step_time": a[2] / total, "mean_step_s": total / n} for name, a in sorted(acc.items())}


def _reasons(lines) -> list[dict]:
    """``[{"error": line (<= 300 chars), "count": n}]`` of the 5 most frequent lines."""
    return [{"error": e[:300], "count": n} for e, n in Counter(lines).most_common(5)]


def _warmup_summary(recs: list[RequestRecord], asked: int) -> dict:
    ok = sum(1 for r in recs if r.success)
    return {"asked": asked, "sent": len(recs), "completed": ok, "failed": len(recs) - ok,
            "errors": _reasons(r.error for r in recs if not r.success and r.error)}


class _Watchdog:
    def __init__(self, factor: float, min_completed: int = 1):
        self.factor = factor
        self.min_completed = min_completed
        self.e2els: list[float] = []

    def add(self, e2el: float | None) -> None:
        if e2el is not None:
            self.e2els.append(e2el)

    def threshold(self) -> float | None:
        if not self.factor or len(self.e2els) < self.min_completed:
            return None
        return self.factor * statistics.median(self.e2els)


def progress_ticker(progress: Callable | None, label: str, total: int, done: list[RequestRecord],
                    active: Callable[[], Any], every_s: float = 0.5):
    """A generator for a phase's progress, reporting 0 finished at once (the phase starts): ``send(True)`` after a
    request finished (always reported),
    ``send(False)`` as tokens arrive (reported at most every ``every_s`` seconds). It calls
    ``progress(label, finished, total, failed=..., tokens=...)``; ``active()`` gives the in-flight records."""
    def gen():
        last = -1e9
        while True:
            force = yield
            now = time.monotonic()
            if progress is None or (not force and now - last < every_s):
                continue
            last = now
            recs = list(done) + list(active())
            progress(label, len(done), total, failed=sum(1 for r in done if not r.success),
                     tokens=sum(r.output_tokens for r in recs))
    g = gen()
    next(g)
    g.send(True)  # the phase starts: 0 of its requests (a bar's clock starts here, not at the first token)
    return g


def _is_engine(target: Any) -> bool:
    return hasattr(target, "add_request") and hasattr(target, "step")


def _drive_engine(engine: Any, reqs: list[BenchRequest], conc: int, dog: _Watchdog, progress: Callable | None,
                  label: str) -> tuple[list[RequestRecord], dict | None, float, float, dict[int, int]]:
    pending = deque(reqs)
    engine_ids: dict[int, int] = {}  # load request id -> engine request id
    active: dict[int, RequestRecord] = {}
    done: list[RequestRecord] = []
    tick = progress_ticker(progress, label, len(reqs), done, lambda: active.values())
    t_start = time.perf_counter()
    t_end = t_start
    hang = None
    while pending or active:
        while pending and len(active) < conc:
            r = pending.popleft()
            now = time.perf_counter()
            rid = engine.add_request(list(r.prompt_ids), r.output_len, ignore_eos=True)
            active[rid] = RequestRecord(r.request_id, r.input_len, r.output_len, now)
            engine_ids[r.request_id] = rid
        events = engine.step()
        for ev in events:
            rec = active.get(ev.request_id)
            if rec is None:
                continue
            rec.token_times.append(ev.time)
            rec.output_tokens += 1
            if ev.finished:
                rec.success = True
                del active[ev.request_id]
                done.append(rec)
                dog.add(rec.e2el)
                t_end = max(t_end, ev.time)
                if progress:
                    tick.send(True)
        if progress:  # every step, tokens or not (a long prefill step still moves the clock), at most every 0.5 s
            tick.send(False)
        thr = dog.threshold()
        now = time.perf_counter()
        if thr is not None:
            for rid, rec in active.items():
                if now - rec.issue_time > thr:
                    where = engine.where(rid) if hasattr(engine, "where") else {}
                    hang = {"request_id": rec.request_id, "elapsed_s": now - rec.issue_time, "threshold_s": thr,
                            "median_e2el_s": thr / dog.factor, "where": where, "phase": label}
                    rec.error = "hang"
                    rec.where = where
                    break
        if hang is not None:
            for rid, rec in list(active.items()):
                engine.abort(rid)
                if not rec.error:
                    rec.error = "aborted after a hang"
                done.append(rec)
            active.clear()
            pending.clear()
            t_end = now
            break
        if not events and not engine.has_unfinished() and (pending or active):
            raise ConfigError("engine made no progress with requests outstanding; check its scheduler limits")
    return done, hang, t_start, t_end, engine_ids


def run_bench(target: Any, concurrency: int, input_len: int, output_len: int, num_prompts: int | None = None,
              range_ratio: float = DEFAULT_RANGE_RATIO, warmups: int | None = None, seed: int = 0,
              progress: Callable[[str, int, int], None] | None = None, watchdog_factor: float = 10,
              num_gpus: int = 1, roofline: StepRoofline | None = None, vocab_size: int | None = None,
              special_ids: Sequence[int] | None = None, breakdown: bool = True) -> BenchResult:
    """Benchmark one concurrency on an engine (``add_request``/``step``/``abort``) or an endpoint client
    (:class:`k3rocm.bench.client.OpenAIClient`).

    Args:
        target: the engine or client.
        concurrency: requests in flight at most (>= 1).
        input_len, output_len: upper ends of the uniform length draws (``[range_ratio * L, L]``, tokens;
            output lengths start at 2, so ``output_len >= 2``: TPOT and ITL need a second token).
        num_prompts: measured requests (default ``10 * concurrency``); warmups: default ``2 * concurrency``.
        seed: load generator seed.
        progress: ``progress(phase, done, total, failed=n, tokens=n)`` called as requests complete and, at most
            every 0.5 s, as tokens stream (phase "warmup" / "measure"; ``failed`` requests of the phase so far,
            ``tokens`` output tokens received in the phase so far, in-flight requests included).

    When warm-ups were asked for and none of them succeeded, no measured request is sent: the result has no
    records, and ``warmup`` says how many failed and why (a server that answers nothing would otherwise cost
    every measured request its timeout too).
        watchdog_factor: hang threshold as a multiple of the running median E2EL (0 = off).
        num_gpus: GPUs serving the target (>= 1), the divisor of the ``*_per_gpu`` throughputs; for an endpoint
            the caller must know it (the server does not say).
        roofline: a :class:`StepRoofline` to report the fraction of roofline of the measured engine steps.
        vocab_size, special_ids: for prompt ids (default from ``target.cfg`` / the client).
        breakdown: time one decode and one mixed step per op family after the measured phase (engines).

    Raises:
        ConfigError: bad load parameters (including ``num_gpus < 1``) or a target of neither kind.
    """
    if int(num_gpus) < 1:
        raise ConfigError(f"benchmark num_gpus {num_gpus} must be >= 1 (GPUs serving the load, for tok/s/GPU)")
    cfg = getattr(target, "cfg", None)
    vocab = vocab_size or (cfg.vocab_size if cfg is not None else getattr(target, "vocab_size", None))
    if vocab is None:
        raise ConfigError("run_bench: pass vocab_size (the target does not tell its vocabulary)")
    if special_ids is None:
        special_ids = (tuple(x for x in (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) if x is not None)
                       if cfg is not None else tuple(getattr(target, "special_ids", ())))
    plan = plan_load(concurrency, input_len, output_len, vocab, num_prompts, range_ratio, warmups, seed,
                     tuple(special_ids))
    dog = _Watchdog(watchdog_factor)
    compiles: dict = {}
    parts: dict = {}
    cut = False  # Ctrl-C during the step breakdown, after the measured phase
    if _is_engine(target):
        # imported here: both import torch and Triton, which `k3rocm --help` and `plan` never load (tests/cli)
        from k3rocm.bench.breakdown import step_breakdown
        from k3rocm.kernels.compile_watch import CompileWatch

        ladder = target.warm_up() if hasattr(target, "warm_up") else None
        wrecs, hang, _, _, _ = _drive_engine(target, plan.warmups, concurrency, dog, progress, "warmup")
        go = hang is None and (not plan.warmups or any(r.success for r in wrecs))
        step0 = len(getattr(target, "step_log", []))
        with CompileWatch() as watch:
            recs, hang2, t0, t1, eids = (_drive_engine(target, plan.requests, concurrency, dog, progress, "measure")
                                         if go else ([], None, 0.0, 1e-9, {}))
        compiles = watch.summary()
        hang = hang or hang2
        steps = getattr(target, "step_log", [])[step0:]
        if breakdown and go and hang is None and hasattr(target, "dec") and not target.has_unfinished():
            try:
                parts = step_breakdown(target, rows=concurrency)
            except KeyboardInterrupt:  # the point is measured: keep it (without its breakdown) for the caller
                cut, parts = True, {}
        desc = target.describe() if hasattr(target, "describe") else {}
    elif hasattr(target, "drive"):
        wrecs, hang, _, _ = target.drive(plan.warmups, concurrency, dog, progress, "warmup")
        go = hang is None and (not plan.warmups or any(r.success for r in wrecs))
        recs, hang2, t0, t1 = (target.drive(plan.requests, concurrency, dog, progress, "measure")
                               if go else ([], None, 0.0, 1e-9))
        hang = hang or hang2
        steps = []
        desc = target.describe() if hasattr(target, "describe") else {}
    else:
        raise ConfigError(f"run_bench: {type(target).__name__} is neither an engine nor an endpoint client")
    recs.sort(key=lambda r: r.request_id)
    metrics = aggregate(recs, t1 - t0, num_gpus)
    roof = fraction_of_roofline(roofline, steps) if (roofline is not None and steps) else None
    wsum = _warmup_summary(wrecs, len(plan.warmups))
    if _is_engine(target) and ladder is not None:
        wsum["ladder"] = ladder
    res = BenchResult(concurrency, input_len, output_len, len(plan.requests), len(plan.warmups), range_ratio, seed,
                      metrics, recs, hang, desc, roof, wsum, collective_summary(steps),
                      outputs_digest(target, recs, eids) if _is_engine(target) else None, compiles, parts)
    if cut:
        raise PointInterrupted(res)
    return res


class PointInterrupted(KeyboardInterrupt):
    """Ctrl-C after a point's measured phase, during its step breakdown: ``result`` is the measured point (a
    :class:`BenchResult`, or the caller's dict of it) without the breakdown, for the sweep to keep."""

    def __init__(self, result: Any):
        super().__init__()
        self.result = result


def sweep(target: Any, concurrencies: Sequence[int], input_len: int, output_len: int, stop_on_hang: bool = True,
          **kw) -> list[BenchResult]:
    """:func:`run_bench` at each concurrency in order; stops after a point that hung when ``stop_on_hang``."""
    out = []
    for c in concurrencies:
        r = run_bench(target, c, input_len, output_len, **kw)
        out.append(r)
        if stop_on_hang and r.hang is not None:
            break
    return out
