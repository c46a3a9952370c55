"""Counting what a serving engine must never do while it serves: Triton kernel compilations and autotune runs.

:class:`CompileWatch` is a context manager. Inside it,

* every Triton JIT compilation is counted per kernel name, through ``triton.knobs.runtime.jit_post_compile_hook``
  (Triton >= 3.4: ``JITFunction._do_compile`` calls it once after each new specialisation is compiled; a hook set
  before the watch is chained, not replaced). A Triton without ``triton.knobs`` leaves the watch ``available =
  False`` (its compile counts then mean nothing, and reports say so);
* every timing run of :func:`k3rocm.kernels.tune.pick` (a shape key seen for the first time with several
  candidates) is counted per kernel name, through :data:`k3rocm.kernels.tune.LISTENERS`.

The interpreter (``TRITON_INTERPRET=1``) compiles nothing, so the counts are 0 there by construction.
"""

from __future__ import annotations

from collections import Counter

from k3rocm.kernels import tune

try:
    import triton
    _KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
except ImportError:  # no Triton: the torch oracle serves, nothing can compile
    _KNOBS = None

__all__ = ["CompileWatch"]


class CompileWatch:
    """Counts Triton compilations and ``tune.pick`` timing runs while active (re-entrant-safe: one hook each).

    Attributes:
        compiles: ``Counter`` kernel name -> compilations seen.
        autotunes: ``Counter`` kernel name (the ``tune.pick`` name) -> timing runs seen.
        available: False when this Triton has no ``knobs.runtime.jit_post_compile_hook`` (compiles not counted).
    """

    def __init__(self):
        self.compiles: Counter = Counter()
        self.autotunes: Counter = Counter()
        self.available = _KNOBS is not None and hasattr(_KNOBS, "jit_post_compile_hook")
        self._prev = None
        self._active = False

    # the hook Triton calls: keyword arguments (key, repr, fn, compile, is_manual_warmup, already_compiled)
    def _on_compile(self, *args, **kw):
        fn = kw.get("fn")
        name = getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[", 1)[0]
        self.compiles[str(name)] += 1
        return self._prev(*args, **kw) if self._prev is not None else None

    def _on_tune(self, name: str, key: tuple) -> None:
        self.autotunes[str(name)] += 1

    def __enter__(self) -> "CompileWatch":
        if self._active:
            return self
        self._active = True
        if self.available:
            self._prev = _KNOBS.jit_post_compile_hook
            _KNOBS.jit_post_compile_hook = self._on_compile
        tune.LISTENERS.append(self._on_tune)
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        if self.available:
            _KNOBS.jit_post_compile_hook = self._prev
            self._prev = None
        if self._on_tune in tune.LISTENERS:
            tune.LISTENERS.remove(self._on_tune)

    @property
    def total(self) -> int:
        """Compilations + autotune runs seen."""
        return sum(self.compiles.values()) + sum(self.autotunes.values())

    def summary(self) -> dict:
        """``{"compiles": n, "autotune_runs": n, "compiled": {kernel: n}, "tuned": {kernel: n}, "available"}``."""
        return {"compiles": sum(self.compiles.values()), "autotune_runs": sum(self.autotunes.values()),
                "compiled": dict(sorted(self.compiles.items())), "tuned": dict(sorted(self.autotunes.items())),
                "available": self.available}
