"""Which Triton target the kernels run on: the one place that answers it.

:func:`current_target` says the backend — ``"cuda"`` (NVIDIA), ``"hip"`` (AMD ROCm) or ``"interpreter"``
(``TRITON_INTERPRET=1``: Triton's CPU interpreter) — and the architecture. Config tables
(:mod:`k3rocm.kernels.tune`) are keyed by these backend names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
except ImportError:  # the registry asks for the target where Triton may be missing (the torch oracle then serves)
    triton = None

__all__ = ["BACKENDS", "Target", "current_target", "interpreting", "multiprocessors"]

BACKENDS = ("cuda", "hip", "interpreter")


@dataclass(frozen=True)
class Target:
    """A Triton target.

    Attributes:
        backend: ``"cuda"``, ``"hip"`` or ``"interpreter"``.
        arch: the driver's architecture: ``"90"`` (sm_90), ``"gfx950"``, ``"gfx942"``; ``"cpu"`` under the
            interpreter; ``""`` when no GPU driver is active.
    """

    backend: str
    arch: str


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` at launch time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def current_target() -> Target:
    """The target kernels launched now would run on.

    ``Target("interpreter", "cpu")`` under ``TRITON_INTERPRET=1``; else the active Triton driver's target
    (``Target("cuda", "90")``, ``Target("hip", "gfx950")``). Without an active driver (no GPU, or no Triton)
    the torch build decides: ``"hip"`` for a ROCm build (``torch.version.hip``), else ``"cuda"``; ``arch=""``.
    ``TRITON_INTERPRET`` is read at every call (tests switch it within one process); the driver's answer is
    remembered per device.
    """
    if interpreting():
        return Target("interpreter", "cpu")
    dev = torch.cuda.current_device() if torch.cuda.is_available() else -1
    hit = _DRIVER_TARGETS.get(dev)
    if hit is not None:
        return hit
    try:
        t = triton.runtime.driver.active.get_current_target()
    except Exception:  # no GPU driver on this machine (or no Triton)
        return Target("hip" if getattr(torch.version, "hip", None) else "cuda", "")
    _DRIVER_TARGETS[dev] = out = Target(t.backend, str(t.arch))
    return out


#: device index -> the driver's target: asked once per device (the driver query reads the device's capability;
#: ~750 calls per mixed step of the K3 rank cost ~9 ms of host time on the H200 host, 2026-12-02)
_DRIVER_TARGETS: dict[int, Target] = {}


#: device index -> its multiprocessor (CU) count, asked once per device
_N_SM: dict[int, int] = {}


def multiprocessors(device: torch.device) -> int:
    """Multiprocessors (SMs on NVIDIA, CUs on AMD) of the GPU ``device``, remembered per device: the size of a
    persistent grid, read at every launch of one (the callers pick their own count under the interpreter)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _N_SM.get(idx)
    if n is None:
        n = _N_SM[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n
