"""Backend detection and a small explicit autotuner shared by the MLA and AttnRes kernels.

Configs are plain dicts: kernel meta-parameters (``BLOCK_*``) plus launch options (``num_warps``,
``num_stages``; on HIP also ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``). Each kernel keeps one
list per backend (``"cuda"``, ``"hip"``, ``"interp"``); this is the only place vendor knobs live
(DESIGN.md §5). Unlike ``triton.autotune`` the lists are public, so tests can run every config, and the
choice is cached per (kernel, shape key). ``K3ROCM_TUNE=0`` disables timing and takes each list's first
config.
"""

from __future__ import annotations

import os
from typing import Callable

from k3rocm.kernels._interp import interpreting, kjit, launch  # noqa: F401  (re-exported)

_CACHE: dict[tuple, dict] = {}

LAUNCH_KEYS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack")


def backend() -> tuple[str, str]:
    """``(backend, arch)``: ``("interp", "cpu")`` under ``TRITON_INTERPRET=1``, else the active driver's target
    (``("cuda", "90")``, ``("hip", "gfx950")``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interp", "cpu"
    import triton

    t = triton.runtime.driver.active.get_current_target()
    return t.backend, str(t.arch)


def config_list(table: dict[str, list[dict]]) -> list[dict]:
    """The config list of the current backend from ``{"cuda": [...], "hip": [...], "interp": [...]}``."""
    return table[backend()[0]]


def split(cfg: dict) -> tuple[dict, dict]:
    """``cfg`` -> (meta-parameters, launch options) for ``kernel[grid](..., **meta, **opts)``."""
    meta = {k: v for k, v in cfg.items() if k not in LAUNCH_KEYS}
    opts = {k: v for k, v in cfg.items() if k in LAUNCH_KEYS}
    if backend()[0] == "interp":
        opts = {}
    return meta, opts


def pick(name: str, key: tuple, configs: list[dict], run: Callable[[dict], None]) -> dict:
    """Choose the fastest of ``configs`` for ``(name, key)`` by timing ``run(cfg)`` (median of
    ``triton.testing.do_bench``), cached for the process. One config, the interpreter, or ``K3ROCM_TUNE=0``
    returns ``configs[0]``. Configs that fail to compile/launch are skipped."""
    if len(configs) == 1 or backend()[0] == "interp" or os.environ.get("K3ROCM_TUNE") == "0":
        return configs[0]
    ck = (name, key)
    if ck in _CACHE:
        return _CACHE[ck]
    import triton.testing

    best, best_t = None, float("inf")
    for cfg in configs:
        try:
            t = triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=20)
        except Exception:  # an out-of-resources config on this device: try the next one
            continue
        if t < best_t:
            best, best_t = cfg, t
    _CACHE[ck] = best if best is not None else configs[0]
    return _CACHE[ck]


def pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())
