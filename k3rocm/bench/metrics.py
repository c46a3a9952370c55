"""Serving metrics: per-request TTFT / TPOT / ITL / E2EL and their aggregates, with vLLM's field names.

Definitions (vLLM ``benchmarks/benchmark_serving.py``, the ones InferenceX reports):

* **TTFT** — time to first token: first output token's arrival − request issue time;
* **ITL** — inter-token latencies: the gaps between consecutive output tokens' arrivals
  (``output_tokens − 1`` values per request; all requests' ITLs are pooled before aggregating);
* **E2EL** — end-to-end latency: last token's arrival − request issue time;
* **TPOT** — time per output token after the first: ``(E2EL − TTFT) / (output_tokens − 1)``,
  defined only for requests with more than one output token;
* throughputs over the benchmark ``duration`` (first issue → last completion, seconds):
  ``request_throughput`` = completed / duration, ``output_throughput`` = output tokens / duration,
  ``total_token_throughput`` = (input + output tokens) / duration; ``*_per_gpu`` divides by the GPU count.

Aggregates: ``mean_*``, ``median_*``, ``std_*``, ``p90_*``, ``p99_*`` in milliseconds, percentiles with
linear interpolation (``numpy.percentile``'s default, as vLLM).

No measurement, no number: where vLLM writes 0 for an empty set, :func:`aggregate` leaves the fields out —
the latency fields of a metric no completed request defines (TPOT and ITL need two output tokens), and the
duration and throughputs when no request completed. A 0 ms latency or 0 tok/s would read as a result.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from k3rocm.errors import ConfigError

PERCENTILES = (90, 99)


@dataclass
class RequestRecord:
    """One request's timeline. Times are seconds on one monotonic clock (``time.perf_counter``).

    Attributes:
        request_id: index of the request in the benchmark (warm-ups excluded).
        input_len: prompt tokens.
        output_len_target: requested output tokens (``max_tokens``).
        issue_time: when the request was sent / added to the engine.
        token_times: arrival time of each output token (or streamed chunk carrying tokens), in order.
        output_tokens: output tokens received (may exceed ``len(token_times)`` when a chunk holds several).
        success: finished normally.
        error: one line of text when it did not.
        where: for a hung or failed request, where it was (phase, tokens done) when it was stopped.
        usage_disagreement: "" or one line: the server's reported token count disagreed with the stream or
            ``max_tokens`` (:func:`k3rocm.bench.client.usage_check`); ``output_tokens`` then counts the events.
    """

    request_id: int
    input_len: int
    output_len_target: int
    issue_time: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    where: dict = field(default_factory=dict)
    usage_disagreement: str = ""

    @property
    def ttft(self) -> float | None:
        """Seconds from issue to the first token (None before any token)."""
        return self.token_times[0] - self.issue_time if self.token_times else None

    @property
    def e2el(self) -> float | None:
        """Seconds from issue to the last token (None before any token)."""
        return self.token_times[-1] - self.issue_time if self.token_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps (s) between consecutive token arrivals."""
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]

    @property
    def tpot(self) -> float | None:
        """(E2EL − TTFT) / (output_tokens − 1) in seconds; None when fewer than 2 output tokens."""
        if self.output_tokens < 2 or not self.token_times:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2el=self.e2el)
        return d


def _stats(name: str, values_s: list[float], out: dict) -> None:
    """Write mean/median/std/p90/p99 of ``values_s`` (seconds) into ``out`` as ``*_{name}_ms``; nothing when
    ``values_s`` is empty (vLLM writes 0 there, which reads as a measurement)."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if a.size == 0:
        return
    out[f"mean_{name}_ms"] = float(a.mean())
    out[f"median_{name}_ms"] = float(np.median(a))
    out[f"std_{name}_ms"] = float(a.std())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(a, p))


def aggregate(records: list[RequestRecord], duration: float, num_gpus: int = 1) -> dict:
    """Aggregate request records into vLLM's result fields (plus tok/s/GPU).

    Args:
        records: measured requests (warm-ups excluded); failed ones count in ``failed`` only.
        duration: benchmark wall time in seconds (first issue → last completion); must be > 0 when a request
            completed.
        num_gpus: GPUs serving the load (>= 1), for ``output_throughput_per_gpu`` /
            ``total_token_throughput_per_gpu``.

    Returns:
        dict with ``completed``, ``failed``, ``short_outputs`` (completed with fewer output tokens than
        requested), ``usage_disagreements`` (completed requests whose server-reported usage disagreed with
        the stream), ``total_input_tokens``, ``total_output_tokens``, ``num_gpus``; when at
        least one request completed also ``duration`` (s), ``request_throughput`` (req/s), ``output_throughput``,
        ``total_token_throughput`` and the ``*_per_gpu`` pair (tok/s), and ``{mean,median,std,p90,p99}_{m}_ms``
        for each metric ``m`` in ttft, tpot, itl, e2el that some completed request defines (absent otherwise).

    Raises:
        ConfigError: ``num_gpus < 1``.
    """
    if int(num_gpus) < 1:
        raise ConfigError(f"benchmark num_gpus {num_gpus} must be >= 1 (GPUs serving the load, for tok/s/GPU)")
    ok = [r for r in records if r.success]
    tin = sum(r.input_len for r in ok)
    tout = sum(r.output_tokens for r in ok)
    out: dict = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        # completed requests that returned fewer output tokens than asked for (a server that stopped at EOS or a
        # length limit): the load was lighter than the one requested
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.output_len_target),
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "num_gpus": num_gpus,
        # completed requests whose reported usage disagreed with the stream or max_tokens (endpoint runs)
        "usage_disagreements": sum(1 for r in ok if r.usage_disagreement),
    }
    if not ok:  # nothing was measured: no duration, no throughput, no latency
        return out
    duration = max(float(duration), 1e-12)
    out.update({
        "duration": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": tout / duration,
        "total_token_throughput": (tin + tout) / duration,
        "output_throughput_per_gpu": tout / duration / num_gpus,
        "total_token_throughput_per_gpu": (tin + tout) / duration / num_gpus,
    })
    _stats("ttft", [r.ttft for r in ok if r.ttft is not None], out)
    _stats("tpot", [r.tpot for r in ok if r.tpot is not None], out)
    _stats("itl", [x for r in ok for x in r.itls], out)
    _stats("e2el", [r.e2el for r in ok if r.e2el is not None], out)
    return out
