"""Checkpoint I/O: tensor layout (``layout``), validating lazy reader (``reader``), random-weight writer
(``writer``) and sha256 manifests / shard fingerprints (``verify``).

The common entry points are re-exported here (imported on first use):
``open_checkpoint``, ``CheckpointIndex``, ``TensorEntry``, ``write_checkpoint``, ``make_manifest``,
``verify_manifest``, ``shard_fingerprints``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "open_checkpoint": "reader", "CheckpointIndex": "reader", "TensorEntry": "reader",
    "write_checkpoint": "writer", "make_manifest": "verify", "verify_manifest": "verify",
    "shard_fingerprints": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'k3rocm.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"k3rocm.checkpoint.{mod}"), name)
