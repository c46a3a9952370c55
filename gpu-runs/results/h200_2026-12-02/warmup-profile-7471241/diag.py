"""Where the bench's time goes: wraps engine phases, tune.pick timing and Triton compiles with timestamps."""
import os, sys, time, json, functools
LOG = open(os.environ.get("DIAG_LOG", "/tmp/diag.log"), "w", buffering=1)
T0 = time.perf_counter()
def log(*a):
    LOG.write(f"{time.perf_counter()-T0:8.2f} " + " ".join(str(x) for x in a) + "\n")
import torch, triton
from k3rocm.runtime import engine as E
from k3rocm.kernels import tune
kn = triton.knobs.runtime
prev = kn.jit_post_compile_hook
def hook(*a, **k):
    fn = k.get("fn"); name = getattr(getattr(fn, "fn", fn), "__name__", str(fn))
    log("COMPILE", name)
    return prev(*a, **k) if prev else None
kn.jit_post_compile_hook = hook
def wrap(obj, name, label, show=lambda a, k: ""):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k)
        torch.cuda.synchronize()
        log(label, show(a, k), f"{(time.perf_counter()-t)*1e3:.1f} ms"); return r
    setattr(obj, name, g)
wrap(E.Engine, "_capture", "CAPTURE", lambda a, k: a[1])
if hasattr(E.Engine, "_capture_mixed"): wrap(E.Engine, "_capture_mixed", "CAPTURE_MIXED", lambda a, k: a[1])
wrap(E.Engine, "warm_up", "WARM_UP")
def stepshow(a, k):
    e = a[0]; s = e.step_log[-1] if e.step_log else None
    return f"nd={s.num_decode} pre={s.num_prefill_tokens} graph={s.graph}" if s else ""
wrap(E.Engine, "step", "STEP", stepshow)
pick = tune.pick
def pick2(name, key, candidates, run=None, **kw):
    t = time.perf_counter(); hit = (name, key) in tune._CACHE
    r = pick(name, key, candidates, run, **kw)
    dt = time.perf_counter() - t
    if dt > 0.05: log("PICK", name, key, f"{dt*1e3:.0f} ms", "cached" if hit else "")
    return r
tune.pick = pick2
from k3rocm.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    log("exit", e.code)
