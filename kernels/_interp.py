"""Interpreter switching shared by every kernel family.

Kernels are always built as compiled-mode ``JITFunction`` objects (:func:`kjit`), so the ahead-of-time
ISA check (``kernels/isa.py``) can compile them in any process. :func:`launch` runs a kernel, and when
``TRITON_INTERPRET=1`` is set at launch time it runs it in Triton's interpreter instead, swapping the
kernel module's jitted helpers (and Triton's own jitted standard library) for interpreted ones for the
duration of the call. That lets interpreter tests and AOT compiles share one pytest process.
"""

from __future__ import annotations

import triton.language as tl
import triton.language.core as tlc
import triton.language.math as tlm
import triton.language.standard as tls
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from k3rocm.kernels.target import interpreting


def kjit(fn):
    """``@triton.jit`` that always builds a compiled-mode JITFunction, whatever ``TRITON_INTERPRET`` says at
    import time: the ISA check needs compiled-mode kernels, and :func:`launch` switches to the interpreter at
    launch time, so both can live in one process."""
    return JITFunction(fn)


_INTERP: dict = {}


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, run by the Triton interpreter when ``TRITON_INTERPRET=1`` now.

    Under the interpreter, the module's jitted helpers are swapped for interpreted ones for the duration of
    the call (and restored after), so the same objects still compile ahead of time elsewhere.
    """
    if not interpreting():
        return kernel[grid](*args, **kwargs)
    # The kernel module's helpers and Triton's own jitted standard library (tl.sum, tl.sigmoid, tl.cumsum, ...)
    # become interpreted functions for the call. The interpreter also patches triton.language modules and the
    # tensor class when it enters a nested (device) function and does not undo that; everything is restored
    # after the call so later compiles in this process see the real language again.
    spaces = [kernel.fn.__globals__, vars(tl), vars(tls)]
    saved = [{k: v for k, v in d.items() if isinstance(v, JITFunction)} for d in spaces]
    objs = [tl, tlc, tlm, tls, tlc.tensor]
    snap = [dict(vars(o)) for o in objs]
    try:
        for d, sv in zip(spaces, saved):
            for k, v in sv.items():
                d[k] = _INTERP.setdefault(v.fn, InterpretedFunction(v.fn))
        return _INTERP.setdefault(kernel.fn, InterpretedFunction(kernel.fn))[grid](*args, **kwargs)
    finally:
        for d, sv in zip(spaces, saved):
            d.update(sv)
        for o, sn in zip(objs, snap):  # names the interpreter added (its own helpers) stay: rewritten code uses them
            for k, v in sn.items():
                if vars(o).get(k, _MISSING) is not v:
                    try:
                        setattr(o, k, v)
                    except (AttributeError, TypeError):
                        pass


_MISSING = object()
