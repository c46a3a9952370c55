"""Triton kernels of Kimi K3's ops, one sub-package per op family.

Each family lists the ``triton`` implementations it provides in ``TRITON_IMPLS`` (``(op, fn, supports,
note)``; op names and signatures are those of :data:`k3rocm.model.ops.ORACLE_OPS`) and the kernels of the
ahead-of-time ISA check in ``isa_cases()``. Shared pieces: :mod:`.target` (which backend), :mod:`.tune`
(configs and the pick-by-shape tuner), :mod:`._interp` (interpreter launches), :mod:`.isa`.
This package imports nothing from :mod:`k3rocm.model`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["FAMILIES", "import_families"]

FAMILIES = ("kda", "mla", "attnres", "moe", "mx", "dense")


def import_families(families: tuple[str, ...] | None = None) -> tuple[dict[str, ModuleType], dict[str, str]]:
    """Import kernel families (default: all of :data:`FAMILIES`).

    Returns ``(modules, errors)``: ``{family: module}`` for those that imported and
    ``{family: "ImportError: ..."}`` for those that did not (Triton missing or a broken family), so one
    failing family leaves the others usable. Imported by name in a loop for that reason, and only when asked
    (the registry on first use, ``kernels isa`` for the families it checks): the five families cost ~0.07 s to
    import on top of Triton (measured).
    """
    mods: dict[str, ModuleType] = {}
    errors: dict[str, str] = {}
    for fam in families or FAMILIES:
        try:
            mods[fam] = importlib.import_module(f"k3rocm.kernels.{fam}")
        except ImportError as e:
            errors[fam] = f"{type(e).__name__}: {e}"
    return mods, errors
