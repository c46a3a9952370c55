"""The fp32 oracle of Kimi K3 (and the Kimi-Linear family): ops, layers and the whole model.

Public entry points (imported lazily, so that importing one op module does not pull in the others):

* :class:`~k3rocm.model.model.K3Model` — ``forward``, ``new_cache`` / ``prefill`` / ``decode``,
  ``generate_greedy`` and the layer-by-layer ``embed`` / ``run_layer`` / ``final``;
* :class:`~k3rocm.model.kimi_linear.KimiLinearModel` — the same for Kimi-Linear checkpoints;
* :class:`~k3rocm.model.layer.K3Cache`, :class:`~k3rocm.model.layer.Batch`,
  :func:`~k3rocm.model.layer.resolve_ops`;
* op oracles in ``kda``, ``mla``, ``attnres``, ``moe`` and shared fp32 functions in ``common``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "K3Model": "k3rocm.model.model",
    "LayerState": "k3rocm.model.model",
    "KimiLinearModel": "k3rocm.model.kimi_linear",
    "K3Cache": "k3rocm.model.layer",
    "Batch": "k3rocm.model.layer",
    "WeightView": "k3rocm.model.layer",
    "resolve_ops": "k3rocm.model.layer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'k3rocm.model' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
