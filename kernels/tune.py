"""The one tuner of every kernel family: the config type, per-backend tables, and pick-by-shape.

A config (:data:`Config`) is a plain dict with three kinds of keys:

* kernel meta-parameters: the kernel's constexpr names, upper case (``BLOCK_M``, ``BV``, ``PREC``);
* launch options, :data:`LAUNCH_KEYS`: ``num_warps``, ``num_stages``; on HIP also ``waves_per_eu``,
  ``matrix_instr_nonkdim``, ``kpack``; on CUDA also ``maxnreg`` (registers per thread at most: more programs per SM,
  at the price of spills the ISA tests count) (all dropped under the interpreter);
* selection keys, :data:`SELECT_KEYS`: ``max_rows`` (use this config while the shape's row count is at most
  this; default unbounded), ``max_pairs`` (only while the caller's work count — the MoE GEMMs: the rank's
  expected local (token, expert) pairs — is at most this; a config carrying it is skipped when no count is
  given) and ``kind`` (which kernel variant runs; the MoE GEMMs), ``split_k`` and ``w2`` (the MoE GEMMs' K
  splits and the second GEMM's own tile / launch: ``k3rocm.kernels.moe.configs.gemm_config``), and
  ``candidate`` (True: not yet run on a GPU — tested in the interpreter and compiled ahead of time like every
  entry, timed by the kernel benchmarks, but left out of :func:`configs` unless asked, so neither a tuned pick nor
  serving can choose it before a GPU has run it).

Each family keeps, per kernel, one table ``{"cuda": [...], "hip": [...], "interpreter": [...]}`` keyed by
the backend names of :func:`k3rocm.kernels.target.current_target`; these tables are the only place vendor
knobs live (DESIGN.md §5). The lists are public, so tests run every config; each list is ordered best-first
(by the family's kernel benchmark). :func:`pick` chooses one config of a list for a shape.

How :func:`pick` chooses is the process's tune **mode** (:func:`mode`, a context manager):

* ``"time"`` (default: kernel benchmarks and tests): a key seen for the first time is timed over its candidates;
* ``"first"`` (the serving engine's default): each list's first fitting config, never timed and never cached, so
  a kernel compiles one config per specialisation however many shape keys serving meets;
* ``"frozen"`` (a serving engine after a timed warm-up): the choice timed earlier for the key, else the first
  fitting config; never times.

``K3ROCM_TUNE=0`` turns timing off in every mode; ``K3ROCM_TUNE=1`` asks the engine for a timed warm-up
(``"time"`` while warming up, ``"frozen"`` while serving) instead of ``"first"``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable

import torch
import triton.testing

from k3rocm.errors import ConfigError
from k3rocm.hw import tune_env
from k3rocm.kernels.target import current_target, interpreting

__all__ = ["Config", "LAUNCH_KEYS", "SELECT_KEYS", "MODES", "configs", "split", "pick", "mode", "current_mode",
           "pow2", "pow2_ladder", "spec_cover", "LISTENERS", "TIMINGS"]

#: a launch configuration (see the module docstring for its keys)
Config = dict[str, Any]

LAUNCH_KEYS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack", "maxnreg")
SELECT_KEYS = ("max_rows", "max_pairs", "kind", "split_k", "w2", "candidate", "persist")

_CACHE: dict[tuple, Config] = {}
#: per ``(name, key)`` timed by :func:`pick`: ``[(config, ms)]`` of every candidate that ran, in table order
#: (benchmarks report them beside the pick)
TIMINGS: dict[tuple, list[tuple[Config, float]]] = {}
_FIT: dict[tuple, Config] = {}  # per (name, key): the first candidate that launched (see _first_fit)

#: the tune modes (see the module docstring)
MODES = ("time", "first", "frozen")
_MODE = ["time"]

#: ``fn(name, key)`` called each time :func:`pick` times the candidates of kernel ``name`` at shape ``key`` (an
#: autotune run; :class:`k3rocm.kernels.compile_watch.CompileWatch` counts them)
LISTENERS: list[Callable[[str, tuple], None]] = []


def configs(table: dict[str, list[Config]], backend: str | None = None, candidates: bool = False) -> list[Config]:
    """Copies of the configs of ``backend`` (default: the current target's) from a per-backend table; entries
    marked ``candidate`` (not yet run on a GPU) only with ``candidates=True`` (tests, benchmarks)."""
    return [dict(c) for c in table[backend or current_target().backend] if candidates or not c.get("candidate")]


def split(cfg: Config, interp: bool | None = None) -> tuple[dict, dict]:
    """``cfg`` -> ``(meta-parameters, launch options)`` for ``kernel[grid](..., **meta, **opts)``.

    Launch options are dropped under the interpreter (``interp``; default: :func:`interpreting`).

    Raises:
        ConfigError: a lower-case key that is neither a launch option nor a selection key (a typo).
    """
    bad = [k for k in cfg if not k.isupper() and k not in LAUNCH_KEYS and k not in SELECT_KEYS]
    if bad:
        raise ConfigError(f"config {cfg} has unknown key(s) {bad}; meta-parameters are upper case, launch options "
                          f"are {', '.join(LAUNCH_KEYS)}")
    meta = {k: v for k, v in cfg.items() if k.isupper()}
    opts = {k: v for k, v in cfg.items() if k in LAUNCH_KEYS}
    if interpreting() if interp is None else interp:
        opts = {}
    return meta, opts


@contextlib.contextmanager
def mode(m: str):
    """Within: :func:`pick` chooses in tune mode ``m`` (``"time"``, ``"first"`` or ``"frozen"``; module
    docstring); the previous mode is restored on exit. Raises ConfigError for another name."""
    if m not in MODES:
        raise ConfigError(f"tune mode {m!r} is not one of {', '.join(MODES)}")
    prev = _MODE[0]
    _MODE[0] = m
    try:
        yield m
    finally:
        _MODE[0] = prev


def current_mode() -> str:
    """The tune mode :func:`pick` chooses in now (see :func:`mode`)."""
    return _MODE[0]


def pick(name: str, key: tuple, candidates: list[Config], run: Callable[[Config], None] | None = None,
         rows: float | None = None, can_time: bool = True, graphed: bool = False,
         pairs: float | None = None) -> Config:
    """Choose the config of ``candidates`` for kernel ``name`` at the shape ``key``.

    1. ``rows`` given: the first candidate whose ``max_rows`` (default unbounded) is >= ``rows`` — and, where it
       has ``max_pairs``, ``pairs`` is given and at most that — else the last one, is the only candidate.
       ``key`` must then tell apart the ``pairs`` buckets that choose differently.
    2. Tune mode ``"first"`` (:func:`mode`): the first candidate that launches on this device (not timed;
       :func:`_first_fit`).
    3. A choice already timed for ``(name, key)`` in this process is returned.
    4. Without ``run``, with one candidate, under the interpreter, with ``K3ROCM_TUNE=0``, in tune mode
       ``"frozen"``, during CUDA/HIP graph capture or when ``can_time`` is False: the first candidate that
       launches (:func:`_first_fit`; under the interpreter or during capture simply the first).
    5. Else each candidate is timed by ``run(cfg)`` (``triton.testing.do_bench``'s mean; configs that fail
       to compile or launch are skipped) and the fastest is cached for ``(name, key)``. ``run`` must be safe to
       repeat (no in-place side effects). ``graphed``: timed as a captured CUDA / HIP graph replays it
       (``triton.testing.do_bench_cudagraph``, no L2 flush between calls), for a kernel the engine runs inside
       its step graphs, where a config of several launches pays no host launch gaps; a candidate whose capture
       fails is timed eagerly instead.
    """
    if rows is not None:
        fits = [c for c in candidates if "max_pairs" not in c or (pairs is not None and pairs <= c["max_pairs"])]
        candidates = [next((c for c in fits if rows <= c.get("max_rows", math.inf)), (fits or candidates)[-1])]
    ck = (name, key)
    if _MODE[0] == "first":
        return _first_fit(ck, candidates, run if can_time else None)
    if ck in _CACHE:
        return _CACHE[ck]
    if (run is None or len(candidates) == 1 or not can_time or interpreting() or _MODE[0] == "frozen"
            or tune_env() == "0" or _capturing()):
        return _first_fit(ck, candidates, run if can_time else None)
    for fn in list(LISTENERS):
        fn(name, key)
    _spin_up()
    best, best_t = None, math.inf
    timed = TIMINGS[ck] = []
    for cfg in candidates:
        try:
            t = None
            if graphed:
                run(cfg)  # compiled (and a config that cannot launch here found) outside the capture
                try:
                    t = triton.testing.do_bench_cudagraph(lambda cfg=cfg: run(cfg), rep=20)
                except Exception:  # not capturable here: timed eagerly below rather than dropped
                    torch.cuda.synchronize()
            if t is None:
                t = triton.testing.do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20)
        except Exception:  # an out-of-resources config on this device: try the next one
            continue
        timed.append((cfg, t))
        if t < best_t:
            best, best_t = cfg, t
    _CACHE[ck] = best if best is not None else candidates[0]
    return _CACHE[ck]


def _first_fit(ck: tuple, candidates: list[Config], run: Callable[[Config], None] | None) -> Config:
    """The first of ``candidates`` that compiles and launches on this device (``run(cfg)`` once each, in order;
    a config over the device's shared memory or registers raises at launch and is passed over), remembered per
    ``ck``. Without ``run``, under the interpreter or during graph capture (nothing may launch outside the
    graph): the remembered fit, else the first candidate. Not a timing run (:data:`LISTENERS` are not told)."""
    if len(candidates) == 1:
        return candidates[0]
    fit = _FIT.get(ck)
    if fit is not None:
        return fit
    if run is None or interpreting() or _capturing():
        return candidates[0]
    for cfg in candidates:
        try:
            run(cfg)
        except Exception:  # out of resources on this device (or a config this backend cannot build): next
            continue
        _FIT[ck] = cfg
        return cfg
    return candidates[0]  # none launches: the caller's own launch raises the first config's error


_SPUN: set[int] = set()
#: seconds of matrix work that bring an idle GPU to its working clocks before a process's first timing
SPIN_UP_S = 0.25


def _spin_up() -> None:
    """Keep the current GPU busy for :data:`SPIN_UP_S` before the first timed pick in this process: an idle GPU
    runs its first milliseconds at low clocks, so the first candidates of the first key would look slower than
    they are (seen on the H200: the first MLA decode row picked a 2 x slower config than the same row tuned
    later). Once per device per process; nothing outside a GPU."""
    if not torch.cuda.is_available():
        return
    dev = torch.cuda.current_device()
    if dev in _SPUN:
        return
    _SPUN.add(dev)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < SPIN_UP_S:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_ladder(limit: int) -> list[int]:
    """The power-of-two buckets ``1, 2, 4, ...`` up to the first one >= ``limit`` (>= 1): every length
    ``1..limit`` maps through :func:`pow2` onto one of them, so ``1 + ceil(log2(limit))`` buckets cover it."""
    out = [1]
    while out[-1] < int(limit):
        out.append(out[-1] * 2)
    return out


def spec_cover(limit: int) -> list[int]:
    """Counts ``1..limit`` that meet every way a kernel can specialise on a count ``n`` of ``1..limit`` and every
    :func:`pow2` bucket of it: ``{min(b, limit), min(b, limit) - 1}`` over :func:`pow2_ladder` (``b >= 1``).

    Triton specialises an integer argument on ``== 1`` and on divisibility by 16; an argument ``c * n`` (a
    stride, ``rows = Tq * H``) therefore only on ``n == 1`` and on ``min(v2(n), 4)`` (``v2``: the exponent of 2
    in ``n``). The powers of two ``2^k <= limit`` give every ``v2`` that ``1..limit`` holds, their
    predecessors the odd counts; so running a kernel at the counts of the cover compiles every
    specialisation that any count up to ``limit`` needs. At most ``2 * (1 + ceil(log2(limit)))`` counts.
    """
    out: set[int] = set()
    for b in pow2_ladder(limit):
        top = min(b, int(limit))
        out.update(x for x in (top, top - 1) if x >= 1)
    return sorted(out)
