"""``gpu-runs/route_skew.py`` on the CPU: a synthetic rank of TP4/EP4 (k3-tiny shapes, random weights) routes its
prefill about uniformly over the experts, and the tool sees the skew the zero embedding rows of a rank run alone
used to cause (the projected group's stand-in rows, :meth:`k3rocm.runtime.dist.ProjectedGroup.embed_rows`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu-runs"))

import route_skew  # noqa: E402

import k3rocm.runtime.dist as dist  # noqa: E402
from k3rocm.model.common import f32  # noqa: E402

ARGS = dict(device="cpu", kernels=None, dtype="bf16", matmul_dtype="bf16", kv_dtype="bf16", checkpoint=None,
            synthetic=True, preset="k3-tiny", profile="cpu", tp=4, ep=4, rank=0, batch=16, prompt_len=16,
            max_model_len=128, steps=1, threads=None)


def _local_share(kind: str) -> float:
    rows = route_skew.summarise(route_skew.record(argparse.Namespace(**ARGS)))
    sel = [r for r in rows if r["kind"] == kind]
    assert sel and all(r["tokens"] > 0 for r in sel)
    return sum(r["local_pairs"] for r in sel) / sum(r["local_pairs_uniform"] for r in sel)


def test_summary_arithmetic():
    # 4 tokens, top-2 of 8 experts, 2 EP ranks: rank 0 holds experts 0..3
    ids = torch.tensor([[0, 1], [0, 5], [0, 6], [2, 7]])
    res = {"calls": [[0, 1, "prefill", ids, 0.5, 3.0, 2.0, 0.0]], "ep": 2, "rank": 0, "top_k": 2, "experts": 8}
    (row,) = route_skew.summarise(res)
    assert row["distinct"] == 6 and row["local_pairs"] == 5 and row["local_pairs_uniform"] == 4.0
    assert row["local_distinct"] == 3 and row["max_over_mean"] == pytest.approx(3 / (8 / 6), abs=0.01)
    assert row["distinct_uniform"] == pytest.approx(8 * (1 - (1 - 2 / 8) ** 4), abs=0.05)


def test_synthetic_prefill_routes_about_uniformly():
    assert 0.85 < _local_share("prefill") < 1.15


def test_zero_embedding_rows_skew_the_prefill(monkeypatch):
    def zero_rows(self, table, ids):  # what a rank run alone did before the stand-in rows
        mine = (ids >= self.vocab_start) & (ids < self.vocab_stop)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        return self.reduce(f32(table[local]) * mine.unsqueeze(1), "embed")
    monkeypatch.setattr(dist.ProjectedGroup, "embed_rows", zero_rows)
    assert _local_share("prefill") > 1.25
