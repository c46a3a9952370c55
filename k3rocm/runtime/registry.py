"""Kernel registry: op name -> implementations ``{"aiter", "triton", "torch"}``, and the choice between them.

Every op has a ``torch`` implementation, which is the fp32 oracle function of
:data:`k3rocm.model.ops.ORACLE_OPS`. The ``triton`` implementations are those each kernel family lists in
``k3rocm.kernels.<family>.TRITON_IMPLS``, registered here on first use. :func:`select` picks, per op
(DESIGN.md §5):

1. the explicit override (``--kernels triton`` / ``torch`` / ``aiter`` or ``op=impl,...``);
2. ``aiter`` where it is registered, we are on ROCm and its ``supports(**shape)`` says yes;
3. ``triton`` when a GPU is present (or ``TRITON_INTERPRET=1`` is set and ``allow_interpreter``);
4. ``torch``.

The validator compares whatever :func:`select` returns against the ``torch`` oracle, so a vendor
kernel is checked exactly like ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from k3rocm.errors import ConfigError, HardwareError
from k3rocm.kernels import import_families
from k3rocm.kernels.target import current_target, interpreting
from k3rocm.model.ops import ORACLE_OPS

IMPLS = ("aiter", "triton", "torch")

@dataclass
class Impl:
    """One registered implementation of an op.

    Attributes:
        fn: the callable, same signature as the oracle function of the op.
        supports: ``supports(**kwargs) -> bool`` for shape/dtype limits (default: always).
        note: short text for reports (e.g. "Triton chunked WY, BT=64").
    """

    fn: Callable
    supports: Callable[..., bool] = field(default=lambda **_: True)
    note: str = ""


_REGISTRY: dict[str, dict[str, Impl]] = {}
_loaded_families = False
_IMPORT_ERRORS: dict[str, str] = {}


def register(op: str, impl: str, fn: Callable, supports: Callable[..., bool] | None = None, note: str = "") -> None:
    """Register ``fn`` as implementation ``impl`` of ``op``. Raises ConfigError for unknown op / impl."""
    if op not in ORACLE_OPS:
        raise ConfigError(f"unknown op {op!r}; known: {', '.join(ORACLE_OPS)}")
    if impl not in IMPLS:
        raise ConfigError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")
    _REGISTRY.setdefault(op, {})[impl] = Impl(fn, supports or (lambda **_: True), note)


def _load_families() -> None:
    """Import the kernel families once and register their ``TRITON_IMPLS``. A family that fails to import
    (Triton missing, a broken family) leaves its ops on the torch oracle and is listed by :func:`import_errors`.
    On first use, not at import: the five families cost ~0.07 s to import on top of Triton (measured)."""
    global _loaded_families
    if _loaded_families:
        return
    _loaded_families = True
    mods, errors = import_families()
    _IMPORT_ERRORS.update(errors)
    for mod in mods.values():
        for op, fn, supports, note in mod.TRITON_IMPLS:
            register(op, "triton", fn, supports=supports, note=note)


def import_errors() -> dict[str, str]:
    """Kernel families that failed to import, ``{family: "ImportError: ..."}`` (their ops fall back to the
    torch oracle). The env tier fails on a GPU when this is not empty, so a fallback is never silent."""
    _load_families()
    return dict(_IMPORT_ERRORS)


def implementations(op: str) -> dict[str, Impl]:
    """All implementations of ``op`` (the ``torch`` oracle always included)."""
    _load_families()
    if op not in ORACLE_OPS:
        raise ConfigError(f"unknown op {op!r}; known: {', '.join(ORACLE_OPS)}")
    impls = dict(_REGISTRY.get(op, {}))
    if "torch" not in impls:
        impls["torch"] = Impl(ORACLE_OPS[op], note="fp32 oracle (k3rocm.model)")
    return impls


def gpu_available() -> bool:
    """True when torch sees a CUDA or ROCm device."""
    return torch.cuda.is_available()


def parse_override(spec: str | None) -> dict[str, str]:
    """Parse ``--kernels``: ``"triton"`` (all ops) or ``"kda_prefill=triton,moe_experts=torch"``.

    Returns ``{"*": impl}`` or ``{op: impl}``. Raises ConfigError naming the bad entry.
    """
    if spec is None or spec == "auto":
        return {}
    if not spec.strip():
        raise ConfigError("--kernels is empty; give auto (the default), torch, triton, or op=impl pairs")
    out: dict[str, str] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ConfigError(f"--kernels {spec!r}: an empty entry between commas; remove it")
        if "=" in part:
            op, impl = (s.strip() for s in part.split("=", 1))
            if op not in ORACLE_OPS:
                raise ConfigError(f"--kernels: unknown op {op!r}; known: {', '.join(ORACLE_OPS)}")
        else:
            op, impl = "*", part
        if impl == "auto":
            raise ConfigError(f"--kernels {spec!r}: 'auto' stands alone (it is the default); name implementations "
                              "per op instead, e.g. moe_experts=torch")
        if op == "*" and impl in ORACLE_OPS:
            raise ConfigError(f"--kernels {spec!r}: {impl} is an op, not an implementation; write {impl}=triton "
                              f"or {impl}=torch")
        if impl == "aiter":
            raise ConfigError(f"--kernels {spec!r}: aiter kernels are not part of k3rocm yet; use triton or torch")
        if impl not in IMPLS:
            where = f" for {op}" if op != "*" else ""
            raise ConfigError(f"--kernels: unknown implementation {impl!r}{where}; use triton, torch or auto")
        if op in out:
            raise ConfigError(f"--kernels {spec!r}: {'every op' if op == '*' else op} is given twice; keep one")
        out[op] = impl
    return out


def select(op: str, override: dict[str, str] | None = None, allow_interpreter: bool = False, **shape) -> tuple[str, Impl]:
    """Choose the implementation of ``op``; returns ``(impl_name, Impl)``.

    Raises:
        HardwareError: an override asks for ``triton``/``aiter`` where it cannot run (no GPU, not registered).
    """
    impls = implementations(op)
    override = override or {}
    want = override.get(op, override.get("*"))
    interp = allow_interpreter and interpreting()
    if want:
        if want not in impls:
            hint = (" (aiter kernels are not wired into k3rocm yet)" if want == "aiter" else "")
            raise HardwareError(f"--kernels asks for {want!r} for {op}, but no such implementation is registered"
                                f"{hint}; choose one of: {', '.join(sorted(impls))} (see `k3rocm kernels list`)")
        if want in ("triton", "aiter") and not (gpu_available() or interp):
            raise HardwareError(f"--kernels {want} for {op} needs a GPU (none visible); use --kernels torch")
        return want, impls[want]
    if "aiter" in impls and gpu_available() and current_target().backend == "hip" and impls["aiter"].supports(**shape):
        return "aiter", impls["aiter"]
    if "triton" in impls and (gpu_available() or interp) and impls["triton"].supports(**shape):
        return "triton", impls["triton"]
    return "torch", impls["torch"]
