"""The fp32 oracle of Kimi K3 (and the Kimi-Linear family): ops, layers and the whole model.

Public entry points:

* :class:`~k3rocm.model.model.K3Model` — ``forward``, ``new_cache`` / ``prefill`` / ``decode``,
  ``generate_greedy`` and the layer-by-layer ``embed`` / ``run_layer`` / ``final``;
* :class:`~k3rocm.model.kimi_linear.KimiLinearModel` — the same for Kimi-Linear checkpoints;
* :class:`~k3rocm.model.layer.K3Cache`, :class:`~k3rocm.model.layer.Batch`,
  :func:`~k3rocm.model.layer.resolve_ops`;
* op oracles in ``kda``, ``mla``, ``attnres``, ``moe`` and shared fp32 functions in ``common``.
"""

from __future__ import annotations

from k3rocm.model.decoder import LayerState
from k3rocm.model.kimi_linear import KimiLinearModel
from k3rocm.model.layer import Batch, K3Cache, WeightView, resolve_ops
from k3rocm.model.model import K3Model

__all__ = ["Batch", "K3Cache", "K3Model", "KimiLinearModel", "LayerState", "WeightView", "resolve_ops"]
