"""Fraction of roofline of measured engine steps: each step's floor (:class:`k3rocm.runtime.sizing.StepRoofline`, from
the bytes it moves and the FLOPs it does) over its measured time, per step, in total, and split into the
pure decode steps and the steps that carried prefill chunks.

Ceilings come from the hardware profile (datasheet, ``projected``) or from measured copy bandwidth and
GEMM rate (HARDWARE.md: H200 ~4.2 TB/s, ~682 TFLOP/s bf16).
"""

from __future__ import annotations

from typing import Sequence

from k3rocm.runtime.sizing import StepRoofline


def fraction_of_roofline(roof: StepRoofline, steps: Sequence) -> dict:
    """Fraction of roofline per step and in total for engine :class:`~k3rocm.runtime.engine.StepStats`.

    Returns ``{"per_step": [{"floor_s", "measured_s", "fraction", "bound", "decode", "prefill_tokens",
    "issue_s"}...], "total_floor_s", "total_measured_s", "fraction", "decode_only": {"steps", "floor_s",
    "measured_s", "fraction", "median_fraction", "issue_share"}, "with_prefill": {...the same}}`` (fraction =
    floor / measured; 0 when nothing ran; ``issue_s`` the step's host time up to its synchronisation, None where
    the engine did not log it; ``issue_share`` = summed ``issue_s`` / summed measured time of the steps that
    logged it, None when none did: near 1 the host bounds those steps, the device waits on its launches). ``decode_only`` covers the steps that carried no prefill tokens: the decode step the serving goals
    speak of, without the prefill chunks a continuous-batching engine mixes into other steps; ``with_prefill``
    the others.
    """
    rows = []
    for s in steps:
        pre = list(zip(_prefill_sizes(s), s.prefill_contexts))
        c = roof.step(s.decode_contexts, pre)
        rows.append({"floor_s": c.floor_s, "measured_s": s.seconds, "fraction": c.floor_s / s.seconds if s.seconds else 0.0,
                     "bound": c.bound, "decode": s.num_decode, "prefill_tokens": s.num_prefill_tokens,
                     "issue_s": getattr(s, "issue_seconds", None)})
    tf = sum(r["floor_s"] for r in rows)
    tmeas = sum(r["measured_s"] for r in rows)
    return {"per_step": rows, "total_floor_s": tf, "total_measured_s": tmeas,
            "fraction": tf / tmeas if tmeas else 0.0,
            "decode_only": _summary([r for r in rows if r["decode"] and not r["prefill_tokens"]]),
            "with_prefill": _summary([r for r in rows if r["prefill_tokens"]])}


def _summary(rows: list[dict]) -> dict:
    """``{"steps", "floor_s", "measured_s", "fraction" (sum floor / sum measured), "median_fraction",
    "issue_share"}`` of per-step rows; zeros (issue_share None) when there are none."""
    f, m = sum(r["floor_s"] for r in rows), sum(r["measured_s"] for r in rows)
    logged = [r for r in rows if r.get("issue_s") is not None]
    lm = sum(r["measured_s"] for r in logged)
    share = sum(r["issue_s"] for r in logged) / lm if lm else None
    fr = sorted(r["fraction"] for r in rows)
    med = (fr[len(fr) // 2] if len(fr) % 2 else (fr[len(fr) // 2 - 1] + fr[len(fr) // 2]) / 2) if fr else 0.0
    return {"steps": len(rows), "floor_s": f, "measured_s": m, "fraction": f / m if m else 0.0,
            "median_fraction": med, "issue_share": share}


def _prefill_sizes(s) -> list[int]:
    """Per-chunk token counts of a step (the engine logs them as ``prefill_sizes`` or only their sum)."""
    sizes = getattr(s, "prefill_sizes", None)
    if sizes is not None:
        return list(sizes)
    n = len(s.prefill_contexts)
    if n == 0:
        return []
    base, extra = divmod(s.num_prefill_tokens, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
