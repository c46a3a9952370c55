"""Load generator: InferenceX-style random prompts, issued under a concurrency limit.

InferenceX runs vLLM's ``benchmark_serving`` with the ``random`` dataset: prompt lengths drawn uniformly
from ``[range_ratio * input_len, input_len]``, output lengths from ``[range_ratio * output_len, output_len]``
(integers, both ends included; ``--random-range-ratio 0.8``), ``num_prompts = 10 * concurrency``, output
length enforced with ``ignore_eos``, requests issued as fast as the ``--max-concurrency`` limit allows.
We add ``2 * concurrency`` warm-up requests (not measured) before the measured set.

One departure: output lengths are never drawn below :data:`MIN_OUTPUT_LEN` (2), since TPOT and ITL are defined
only from the second output token on; a request of one output token would measure TTFT alone. This changes the
draw only where ``range_ratio * output_len < 2``.

Everything is drawn from one ``numpy`` generator seeded by ``seed``, so a run is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3rocm.errors import ConfigError

DEFAULT_RANGE_RATIO = 0.8
MIN_OUTPUT_LEN = 2  # tokens: TPOT / ITL need a second output token


@dataclass(frozen=True)
class BenchRequest:
    """One generated request.

    Attributes:
        request_id: index in its list (warm-ups and measured requests are numbered separately).
        prompt_ids: token ids (``list[int]``), length = ``input_len``.
        output_len: tokens to generate (``max_tokens``; EOS ignored).
        warmup: True for a warm-up request (not measured).
    """

    request_id: int
    prompt_ids: tuple[int, ...]
    output_len: int
    warmup: bool = False

    @property
    def input_len(self) -> int:
        return len(self.prompt_ids)


def length_bounds(length: int, range_ratio: float, minimum: int = 1) -> tuple[int, int]:
    """Inclusive bounds ``(max(minimum, floor(range_ratio * length)), length)`` of the uniform length draw,
    in tokens.

    Raises:
        ConfigError: ``length < minimum`` or ``range_ratio`` outside ``(0, 1]``.
    """
    if length < minimum:
        raise ConfigError(f"benchmark length {length} must be >= {minimum} (tokens)")
    if not 0.0 < range_ratio <= 1.0:
        raise ConfigError(f"--range-ratio {range_ratio} must be in (0, 1]: lengths are drawn from [ratio x length, "
                          "length]; pass e.g. --range-ratio 1 for fixed lengths")
    return max(minimum, int(np.floor(range_ratio * length))), length


def make_requests(
    n: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = DEFAULT_RANGE_RATIO,
    seed: int = 0,
    special_ids: tuple[int, ...] = (),
    warmup: bool = False,
) -> list[BenchRequest]:
    """Draw ``n`` random requests.

    Args:
        n: number of requests (>= 0).
        input_len, output_len: the upper ends L of the uniform length draws ``[range_ratio*L, L]`` (tokens;
            output lengths start at :data:`MIN_OUTPUT_LEN`, so ``output_len >= 2``).
        vocab_size: ids are drawn uniformly from ``[0, vocab_size)`` excluding ``special_ids``
            (BOS/EOS/pad, so a prompt never ends a request early or looks like padding).
        range_ratio: lower end as a fraction of L (InferenceX: 0.8).
        seed: generator seed; the same arguments give the same requests.
        warmup: mark the requests as warm-ups.

    Raises:
        ConfigError: bad lengths (``input_len < 1``, ``output_len < 2``), ratio, or a vocabulary with no
            ordinary ids.
    """
    lo_i, hi_i = length_bounds(input_len, range_ratio)
    if output_len < MIN_OUTPUT_LEN:
        raise ConfigError(f"output length {output_len} must be >= {MIN_OUTPUT_LEN} tokens: with one output token "
                          "there is no TPOT or ITL")
    lo_o, hi_o = length_bounds(output_len, range_ratio, MIN_OUTPUT_LEN)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ConfigError(f"vocab_size {vocab_size} leaves no ordinary token ids for random prompts")
    rng = np.random.default_rng(seed)
    ilens = rng.integers(lo_i, hi_i + 1, size=n)
    olens = rng.integers(lo_o, hi_o + 1, size=n)
    out = []
    for i in range(n):
        ids = allowed[rng.integers(0, allowed.size, size=int(ilens[i]))]
        out.append(BenchRequest(i, tuple(int(x) for x in ids), int(olens[i]), warmup))
    return out


@dataclass(frozen=True)
class LoadPlan:
    """The requests of one benchmark point: ``warmups`` then ``requests``, at ``concurrency``."""

    concurrency: int
    warmups: list[BenchRequest]
    requests: list[BenchRequest]


def request_counts(concurrency: int, num_prompts: int | None = None, warmups: int | None = None) -> tuple[int, int]:
    """``(measured, warm-up)`` request counts of one point: ``num_prompts`` (default ``10 * concurrency``) and
    ``warmups`` (default ``2 * concurrency``), InferenceX's random-dataset defaults. Raises nothing."""
    n = 10 * concurrency if num_prompts is None else int(num_prompts)
    w = 2 * concurrency if warmups is None else int(warmups)
    return n, w


def plan_load(
    concurrency: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    num_prompts: int | None = None,
    range_ratio: float = DEFAULT_RANGE_RATIO,
    warmups: int | None = None,
    seed: int = 0,
    special_ids: tuple[int, ...] = (),
) -> LoadPlan:
    """Requests for one concurrency: ``num_prompts`` (default ``10 * concurrency``) measured and
    ``warmups`` (default ``2 * concurrency``) warm-up requests; warm-ups use seed ``seed + 1``.

    Raises:
        ConfigError: ``concurrency < 1``, negative counts, or bad lengths.
    """
    if concurrency < 1:
        raise ConfigError(f"--concurrency {concurrency} must be >= 1")
    n, w = request_counts(concurrency, num_prompts, warmups)
    if n < 1 or w < 0:
        raise ConfigError(f"num_prompts {n} must be >= 1 and warmups {w} >= 0")
    reqs = make_requests(n, input_len, output_len, vocab_size, range_ratio, seed, special_ids)
    warm = make_requests(w, input_len, output_len, vocab_size, range_ratio, seed + 1, special_ids, warmup=True)
    return LoadPlan(concurrency, warm, reqs)
