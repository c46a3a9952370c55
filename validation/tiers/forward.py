"""Tier ``forward``: does a prefill + decode run? Finite outputs, shapes, per-layer activation max |h|,
timings."""

from __future__ import annotations

import math

import torch

from k3rocm.validation.evidence import Stage, Timer, check, info
from k3rocm.validation.session import Session
from k3rocm.validation.tiers.adapters import layer_absmax, model_forward, random_ids
from k3rocm.validation.tiers.performance import ran_alone
from k3rocm.validation.tiers.thresholds import THRESHOLDS


def tier_forward(session: Session, stage: Stage) -> None:
    """Does a prefill + decode run? Finite outputs, shapes, per-layer activation max |h|, timings."""
    cfg, lv = session.config, session.measured_level
    eng = session.engine
    model = session.engine_model(eng)
    B, T, steps = 2, 16, 4
    ids = random_ids(session, B, T)
    # the first call pays kernel compilation / autotuning (minutes at full width on a cold cache); the timed
    # figure is the second call
    with Timer() as t1:
        model_forward(model, ids, cfg.num_hidden_layers)
    with Timer() as tp:
        logits, layers = model_forward(model, ids, cfg.num_hidden_layers)
    pl = session.run_placement
    if ran_alone(session):  # --synthetic: one rank of a larger layout ran here; the others are not running
        stage.add(info("forward", "dist.world", pl.world, "ranks", level="projected",
                       detail=f"ranks of the TP{pl.tp}/EP{pl.ep} layout; only rank {session.rank} ran, alone in "
                              "this process (--synthetic)"))
    else:
        stage.add(info("forward", "dist.world", pl.world, "ranks", level=lv,
                       detail=f"TP{pl.tp}/EP{pl.ep}: processes the engine and its model ran on (rank 0 here)"))
    stage.add(check("forward", "prefill.shape", list(logits.shape), eq=[B, T, cfg.vocab_size], level=lv),
              check("forward", "prefill.finite", bool(torch.isfinite(logits).all()), eq=True, level=lv),
              info("forward", "prefill.ms", round(tp.seconds * 1e3, 3), "ms", level=lv,
                   detail=f"B={B}, T={T}, layer by layer with the engine's ops, second call"),
              info("forward", "prefill.first_call_ms", round(t1.seconds * 1e3, 3), "ms", level=lv,
                   detail="the same, first call: includes kernel compilation and autotuning"))
    am = [layer_absmax(x) for x in layers]
    if am:
        worst = max(am) if all(math.isfinite(a) for a in am) else float("inf")
        stage.add(check("forward", "layers.max_abs_h", worst, le=THRESHOLDS["forward.max_abs_h"], level=lv,
                        detail=f"max over {len(am)} layers of max |h|"))
        stage.series["absmax"] = {"title": "per-layer activation max |h|", "x": list(range(len(am))),
                                  "y": {"max |h|": am}, "xlabel": "layer", "ylabel": "max |h|", "log": True,
                                  "levels": {"max |h|": lv}}
    def serve():
        if hasattr(eng, "generate") and hasattr(eng, "add_request"):
            return torch.tensor(eng.generate([r.tolist() for r in ids], steps))
        return torch.as_tensor(eng.generate_greedy(ids, steps))

    serve()  # warm-up: decode kernels compile, graphs are captured
    with Timer() as td:
        toks = serve()
    stage.add(check("forward", "decode.shape", list(toks.shape), eq=[B, steps], level=lv,
                    detail="served prompts produced the requested number of tokens"),
              check("forward", "decode.in_vocab", bool(((toks >= 0) & (toks < cfg.vocab_size)).all()),
                    eq=True, level=lv),
              info("forward", "serve.ms_per_token", round(td.seconds * 1e3 / steps, 3), "ms", level=lv,
                   detail=f"{B} requests of {T} prompt tokens, {steps} output tokens each, prefill included "
                          "(after one warm-up run of the same)"))
