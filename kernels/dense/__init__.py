"""Triton dense projections for the decode step: the skinny GEMM (few token rows against a weight stream).

No ``ORACLE_OPS`` name is implemented here (``TRITON_IMPLS`` is empty): the projections run through
:func:`k3rocm.model.common.linear`, and this kernel is a candidate against the vendor GEMM until a GPU has timed
it (``gpu-runs/bench_dense.py``). Oracle: ``x.float() @ W.float().T``.
"""

from __future__ import annotations

from .gemm import SKINNY_CONFIGS, VENDOR, fastest_gemm, isa_case, skinny_gemm

__all__ = ["skinny_gemm", "fastest_gemm", "VENDOR", "SKINNY_CONFIGS", "isa_cases", "TRITON_IMPLS"]

#: the ``triton`` implementations of this family (none of an oracle op)
TRITON_IMPLS: tuple = ()


def isa_cases() -> list[tuple]:
    """The skinny GEMM at 16 and 64 token rows, split 1, 2 and 16 (the most :func:`~.gemm.auto_split` takes), for ``kernels isa``: matrix instructions expected
    (wgmma / mma on sm_90, bf16 MFMA on gfx942 / gfx950)."""
    return [isa_case(16, 2), isa_case(64, 1), isa_case(64, 2), isa_case(64, 16)]
