"""Where a step's time goes: per op family, for one decode step and one mixed step of an engine.

:class:`StepProfiler` times one **eager** engine step (graphs off while it is set) with a device
synchronisation at every boundary of an op family, so each family's time is its own (exclusive: a family
called inside another — the router inside the channel mixer, an all-reduce inside a token mixer — is
subtracted from the outer one). The families:

* ``KDA`` / ``MLA``: the token mixers of KDA and MLA layers (projections, conv, recurrence / attention, cache
  writes), the engine's mixer callable per layer;
* ``router``: ``moe_router`` (scores, biased top-k); ``experts``: ``moe_experts`` (routed expert GEMMs);
* ``dense/shared MLP``: the rest of the channel mixers (dense SiTU-GLU layers, shared experts, LatentMoE
  down/up projections and norms);
* ``AttnRes``: the ``attn_res`` op (Block Attention Residual aggregation);
* ``lm_head``: this rank's logits slice; ``collectives``: the rank's reduce / greedy exchange / vocabulary
  gather (zero on one rank);
* ``host + other``: the step's wall time not in any family (host preparation, embedding, norms, launches).

A synchronised eager step is slower than a graphed one: the shares say where device time goes, the
absolute figures are an upper bound (reported with the step's wall time).

:func:`step_breakdown` drives an idle engine through one mixed step (decode rows + a prefill chunk) and one
decode step with the profiler set (the bench: at its point's concurrency), and returns both breakdowns.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable

import torch

__all__ = ["FAMILIES", "OP_FAMILY", "StepProfiler", "step_breakdown"]

FAMILIES = ("KDA", "MLA", "router", "experts", "dense/shared MLP", "AttnRes", "lm_head", "collectives",
            "host + other")
#: engine op -> family (ops not listed fall to the family they are called from)
OP_FAMILY = {"moe_router": "router", "moe_experts": "experts", "attn_res_norm": "AttnRes"}


class StepProfiler:
    """Exclusive per-family timing of the steps run while it is installed on an engine (see the module).

    Attributes:
        seconds: family -> exclusive seconds of the current step.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.seconds: dict[str, float] = {f: 0.0 for f in FAMILIES}
        self._stack: list[list] = []  # [family, start, child seconds]
        self._undo: list[Callable[[], None]] = []

    def sync(self) -> None:
        """Wait for the engine device's queued work (no-op on the CPU)."""
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    @contextlib.contextmanager
    def family(self, name: str):
        """Time the enclosed work as ``name`` (exclusive of nested families)."""
        self.sync()
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self.sync()
            self._stack.pop()
            el = time.perf_counter() - frame[1]
            self.seconds[name] += el - frame[2]
            if self._stack:
                self._stack[-1][2] += el

    def _wrap(self, name: str, fn: Callable) -> Callable:
        # wraps: callers that look at an op's signature (moe_block's fused-routing check) see the op's own, so a
        # profiled step takes the same path as a served one
        @functools.wraps(fn)
        def timed(*a, **k):
            with self.family(name):
                return fn(*a, **k)
        return timed

    def _patch(self, obj: Any, attr: str, new: Any, in_dict: bool = False) -> None:
        if in_dict:
            old = obj[attr]
            obj[attr] = new
            self._undo.append(lambda: obj.__setitem__(attr, old))
        else:
            had = attr in vars(obj)
            old = vars(obj).get(attr)
            setattr(obj, attr, new)
            self._undo.append(lambda: setattr(obj, attr, old) if had else delattr(obj, attr))

    def __enter__(self) -> "StepProfiler":
        eng = self.engine
        for op, fam in OP_FAMILY.items():
            if op in eng.ops:
                self._patch(eng.ops, op, self._wrap(fam, eng.ops[op]), in_dict=True)
        dec, par, cfg = eng.dec, eng.par, eng.cfg
        self._patch(dec, "channel", self._wrap("dense/shared MLP", dec.channel))
        self._patch(dec, "local_logits", self._wrap("lm_head", dec.local_logits))
        for m in ("reduce", "greedy", "gather_vocab"):
            self._patch(par, m, self._wrap("collectives", getattr(par, m)))
        mix_of = eng._mix

        def mix(*a, **k):
            inner = mix_of(*a, **k)

            def timed(i, x):
                with self.family("KDA" if cfg.layer_type(i) == "kda" else "MLA"):
                    return inner(i, x)
            return timed
        self._patch(eng, "_mix", mix)
        self._patch(eng, "profiler", self)
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def step(self) -> dict:
        """Run one engine step under the profiler: ``{"ms": {family: ms}, "wall_ms", "num_decode",
        "num_prefill_tokens"}`` (``host + other`` = wall time minus the families)."""
        self.seconds = {f: 0.0 for f in FAMILIES}
        self.sync()
        t0 = time.perf_counter()
        self.engine.step()
        self.sync()
        wall = time.perf_counter() - t0
        self.seconds["host + other"] = max(0.0, wall - sum(v for k, v in self.seconds.items() if k != "host + other"))
        st = self.engine.step_log[-1]
        return {"ms": {k: round(v * 1e3, 4) for k, v in self.seconds.items()}, "wall_ms": round(wall * 1e3, 4),
                "num_decode": st.num_decode, "num_prefill_tokens": st.num_prefill_tokens}


def step_breakdown(engine: Any, prompt_len: int = 32, rows: int = 2) -> dict:
    """Per-family breakdown of one mixed step (``rows - 1`` decode rows + a ``prompt_len``-token prefill chunk)
    and one decode step (``rows`` rows) of ``engine``, which must be idle. ``rows``: the decode rows (the bench
    passes its point's concurrency), at least 1 (one row: the decode step only — a mixed step needs a decode
    row beside the chunk), at most the engine's ``max_num_seqs``. Returns
    ``{"mixed": {...}, "decode": {...}}`` (each :meth:`StepProfiler.step`'s dict, with its row and token
    counts; a kind the engine could not form, e.g. a chunk budget below ``prompt_len + 1``, is absent, and both
    are when ``max_model_len`` cannot hold the profiled requests, ~8 tokens). The
    requests end (aborted, or run to completion) and leave the caches as they were. The sequence runs twice and
    the second pass is reported: eager steps at unbucketed token counts compile kernels serving never meets,
    and a compile is not the step's time."""
    sched = engine.scheduler
    rows = max(1, min(int(rows), sched.max_num_seqs))
    n = max(1, min(int(prompt_len), sched.max_num_batched_tokens - 1, engine.max_model_len - 8))
    vocab = max(1, engine.cfg.vocab_size - 3)
    prompt = [3 + (7 * j) % vocab for j in range(n)]
    short = max(1, min(8, n))  # the decode rows' own prompts: short, so their prefill is a few steps
    # enough tokens to stay in decode through their own prefill steps and the two profiled steps
    budget = max(6, min(256, engine.max_model_len - short - 2))
    if short + budget > engine.max_model_len or n + 4 > engine.max_model_len:
        return {}  # a context too short for the profiled requests (a bench of 1-3 tokens): no breakdown, no error

    def once() -> dict:
        out: dict = {}
        live = [engine.add_request([3 + (11 * j + 5 * i) % vocab for j in range(short)], budget, ignore_eos=True)
                for i in range(rows - 1)]

        def decoding() -> bool:
            return all(engine.where(a)["status"] == "decode" for a in live)

        while not decoding() and engine.has_unfinished():
            engine.step()
        b = engine.add_request(prompt[::-1], 4, ignore_eos=True)
        with StepProfiler(engine) as prof:
            r = prof.step()
            if r["num_decode"] and r["num_prefill_tokens"]:
                out["mixed"] = r
            while engine.where(b)["status"] == "prefill" and engine.has_unfinished():
                engine.step()
            if engine.where(b)["status"] == "decode" and decoding():
                r = prof.step()
                if r["num_decode"] and not r["num_prefill_tokens"]:
                    out["decode"] = r
        for a in live:
            engine.abort(a)  # a finished request is left as it is
        while engine.has_unfinished():
            engine.step()
        return out

    # the eager steps meet token counts that serving (graphed, bucketed) never does: the first pass compiles
    # their kernels, the second is the one reported
    once()
    return once()
