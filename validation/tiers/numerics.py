"""Numeric comparisons of the tiers: relative RMS error, logits agreement, an engine's rounding size."""

from __future__ import annotations

import math

import torch

from k3rocm.model.probe import rel_rms

__all__ = ["rel_rms", "logits_compare", "engine_rounding"]


def logits_compare(test, ref) -> dict:
    """KL(ref || test) mean per position (nats), top-1 agreement, max |diff|, on ``[..., V]`` logits.

    Returns ``{"kl", "kl_max", "top1", "max_abs", "finite"}`` (computed in fp64 on the CPU)."""
    test, ref = test.detach().double().cpu(), ref.detach().double().cpu()
    lt, lr = torch.log_softmax(test, -1), torch.log_softmax(ref, -1)
    kl = (lr.exp() * (lr - lt)).sum(-1)
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((test.argmax(-1) == ref.argmax(-1)).double().mean()),
            "max_abs": float((test - ref).abs().max()),
            "finite": bool(torch.isfinite(test).all())}


def engine_rounding(engine, hidden_size: int) -> float:
    """Relative size of the rounding error one projection of ``engine`` makes: 2^-9 (half a bf16/fp16 ulp,
    2^-12 for fp16) when it computes or stores in reduced precision (weights, matmuls or cache), else the fp32
    dot-product error sqrt(hidden_size) x 2^-24 (accumulation-order differences between batch shapes)."""
    f32 = torch.float32
    dts = [getattr(engine, a, f32) for a in ("dtype", "kv_dtype", "matmul_dtype")]
    low = [d for d in dts if d is not None and d != f32]
    if not low:
        return math.sqrt(hidden_size) * 2.0 ** -24
    return 2.0 ** -9 if any(d != torch.float16 for d in low) else 2.0 ** -12
