"""Where an engine step's time goes, kernel by kernel and on the host: wraps a ``k3rocm`` CLI run.

After each ``Engine.warm_up`` returns, every step is logged to ``$PROF_OUT/steps.jsonl`` (decode rows, prefill
tokens, graphed or not, step ms). Steps ``PROF_AFTER .. PROF_AFTER + PROF_N - 1`` (counted from the warm-up's
end) are profiled:

* default: ``torch.profiler`` (CUDA activity, graph replays included) per step; device time per kernel is
  summed per step kind (decode-only / carrying prefill) into ``$PROF_OUT/kernels_<n>.txt`` (ms per step,
  calls per step, µs per call);
* ``PROF_MODE=syncs``: each step under ``torch.cuda.set_sync_debug_mode("warn")``: every call that makes the host
  wait for the device, counted by message and k3rocm call site, with the caching allocator's retries and device
  allocations of the step, in ``$PROF_OUT/syncs_<i>.txt`` (the step's one expected sync is the sampled tokens'
  ``tolist``);
* ``PROF_MODE=host``: each step's host time split without a profiler (``time.perf_counter`` around every graph
  piece's ``replay`` and every eager chunk half, ``Engine._fill_chunks``): sums, counts and the longest single
  call, in ``$PROF_OUT/host.jsonl`` (a replay that takes long on the host is the launch queue pushing back: the
  device is behind; chunk halves that take long are Python and launch cost);
* ``PROF_MODE=cprofile``: ``cProfile`` of each step, host functions by own and cumulative time, in
  ``$PROF_OUT/cprof_<i>.txt`` (profiling inflates the host time ~2x; the shares are the evidence).

Usage (on the GPU machine, the package importable)::

    PROF_OUT=out/k3 PROF_AFTER=15 PROF_N=110 python gpu-runs/prof_steps.py bench --synthetic --preset k3 \
        --profile mi355x-8 --tp 16 --ep 16 --rank 0 --concurrency 64 --input-len 256 --output-len 64 \
        --num-prompts 64 --warmups 4 --out out/k3

``PROF_AFTER`` past the run's last step only logs the steps. The bench's own figures are disturbed inside the
profiled window; use a separate run for them.

``DENSE_GEMM=auto``: the faster of the two per shape (``k3rocm.kernels.dense.fastest_gemm``, a timed pick at warm-up).
``DENSE_GEMM=triton`` runs the engine's fp32-output dense projections of at most ``DENSE_ROWS`` (default 64) rows
through the Triton skinny GEMM (``k3rocm.kernels.dense``; ``k3rocm.model.common.DENSE_GEMM``) instead of the vendor
GEMM, to time the engine with it before anything serves it. Its config is the tune mode's pick (serving's default
mode: the first entry whose row band fits). The switch holds for the whole process.
``ROUTER_OVERLAP=0``: the MoE routing on the main stream instead of beside the shared experts (A/B);
``SHARED_ON_SIDE=0``: the routing alone on the side stream, the shared experts on the main one.
``ROUTER_SMALL=N``: the one-program routing up to N tokens (``kernels.moe.configs.ROUTER_SMALL_TOKENS``, 1 on CUDA;
N=0 turns it off).
``ROUTER_GROUPING=fused|experts``: how the fused routing groups the pairs, whatever the rank's expert count
(``kernels.moe.configs.ROUTER_GROUPING``: the per-expert launch up to 128 local experts on CUDA).
``MOE_REDUCE_ILP=0|1``: the MoE reduction looped / unrolled (``configs.REDUCE_LAUNCH``; unrolled is served on
CUDA).
"""
import os, sys, time, json, functools, collections
import torch
from torch.profiler import profile, ProfilerActivity
from k3rocm.runtime import engine as E
from k3rocm.model import layer as _layer
if os.environ.get("ROUTER_OVERLAP", "1") == "0":  # the MoE routing on the main stream (A/B of the side stream)
    _layer.ROUTER_OVERLAP[:] = [False]
    print("prof_steps: MoE routing on the main stream (ROUTER_OVERLAP=0)", flush=True)
if os.environ.get("ROUTER_SMALL"):  # the one-program routing of small batches on / off
    from k3rocm.kernels.moe import configs as _mc
    from k3rocm.kernels.target import current_target as _ct

    _b = _ct().backend
    _mc.ROUTER_SMALL_TOKENS[_b] = int(os.environ["ROUTER_SMALL"])
    print(f"prof_steps: one-program routing up to {_mc.ROUTER_SMALL_TOKENS[_b]} tokens", flush=True)
if os.environ.get("ROUTER_GROUPING"):  # the routing's grouping inside the top-k launch or one program per expert
    from k3rocm.kernels.moe import configs as _mc4
    from k3rocm.kernels.target import current_target as _ct4

    if os.environ["ROUTER_GROUPING"] not in ("fused", "experts"):
        sys.exit(f"prof_steps: ROUTER_GROUPING={os.environ['ROUTER_GROUPING']!r} is not 'fused' or 'experts'")
    _mc4.ROUTER_GROUPING[_ct4().backend] = 1 << 30 if os.environ["ROUTER_GROUPING"] == "experts" else 0
    print(f"prof_steps: routing grouping {os.environ['ROUTER_GROUPING']}", flush=True)
if os.environ.get("MOE_REDUCE_ILP") in ("0", "1"):  # the MoE reduction looped / unrolled (configs.REDUCE_LAUNCH ILP)
    from k3rocm.kernels.moe import configs as _mc3
    from k3rocm.kernels.target import current_target as _ct3

    _mc3.REDUCE_LAUNCH[_ct3().backend]["ILP"] = os.environ["MOE_REDUCE_ILP"] == "1"
    print(f"prof_steps: MoE reduction {'unrolled' if _mc3.REDUCE_LAUNCH[_ct3().backend]['ILP'] else 'looped'}", flush=True)
if os.environ.get("SHARED_ON_SIDE", "1") == "0":  # the shared experts on the main stream, before the join
    _layer.SHARED_ON_SIDE[:] = [False]
    print("prof_steps: shared experts on the main stream (SHARED_ON_SIDE=0)", flush=True)
if os.environ.get("DENSE_GEMM", "vendor") == "triton":
    from k3rocm.kernels.dense import skinny_gemm
    from k3rocm.model import common as _common
    _common.DENSE_GEMM[:] = [skinny_gemm, int(os.environ.get("DENSE_ROWS", "64"))]
    print(f"prof_steps: dense projections of <= {_common.DENSE_GEMM[1]} rows on the Triton skinny GEMM", flush=True)
elif os.environ.get("DENSE_GEMM", "vendor") == "auto":
    from k3rocm.kernels.dense import fastest_gemm
    from k3rocm.model import common as _common
    _vendor = lambda a, w: torch.mm(a, w.t(), out_dtype=torch.float32)  # noqa: E731 (linear's vendor path)
    _common.DENSE_GEMM[:] = [lambda a, w: fastest_gemm(a, w, _vendor), int(os.environ.get("DENSE_ROWS", "64"))]
    print(f"prof_steps: dense projections of <= {_common.DENSE_GEMM[1]} rows on the faster of the vendor and the "
          "skinny GEMM per shape (timed pick)", flush=True)
elif os.environ.get("DENSE_GEMM", "vendor") != "vendor":
    sys.exit(f"prof_steps: DENSE_GEMM={os.environ['DENSE_GEMM']!r} is not 'vendor', 'triton' or 'auto'")
OUTD = os.environ.get("PROF_OUT", "/tmp/prof"); os.makedirs(OUTD, exist_ok=True)
AFTER = int(os.environ.get("PROF_AFTER", "30")); N = int(os.environ.get("PROF_N", "24"))
state = {"warm": 0, "n": 0}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()

agg = {"decode": collections.defaultdict(lambda: [0.0, 0]), "mixed": collections.defaultdict(lambda: [0.0, 0])}
steps = {"decode": [], "mixed": []}
LOG = open(os.path.join(OUTD, "steps.jsonl"), "w", buffering=1)
wu = E.Engine.warm_up
def warm_up(self, *a, **k):
    r = wu(self, *a, **k); state["warm"] += 1; state["n"] = 0; return r
E.Engine.warm_up = warm_up
st = E.Engine.step
def step(self, *a, **k):
    i = state["n"]; state["n"] += 1
    on = state["warm"] and AFTER <= i < AFTER + N
    if not on:
        t = time.perf_counter(); r = st(self, *a, **k)
        if state["warm"]:
            s = self.step_log[-1]
            LOG.write(json.dumps({"i": i, "nd": s.num_decode, "pre": s.num_prefill_tokens, "graph": s.graph, "ms": round(s.seconds*1e3, 3) if hasattr(s, "seconds") else None, "wall_ms": round((time.perf_counter()-t)*1e3, 3), "issue_ms": round(s.issue_seconds*1e3, 3) if getattr(s, "issue_seconds", None) is not None else None}) + "\n")
        return r
    if os.environ.get("PROF_MODE") == "syncs":
        import warnings, traceback
        seen = collections.Counter()
        show = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                fr = [f"{os.path.relpath(f.filename, os.path.dirname(os.path.dirname(E.__file__)))}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()[:-2] if "k3rocm" in f.filename or "kernels" in f.filename]
                seen[(str(message).split(".")[0][:90], " <- ".join(reversed(fr[-5:])))] += 1
            else:
                show(message, category, filename, lineno, file, line)
        mem_keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
        mem0 = torch.cuda.memory_stats()
        sync(); t = time.perf_counter()
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = note
                r = st(self, *a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = show
        sync()
        s = self.step_log[-1]
        mem1 = torch.cuda.memory_stats()
        # the caching allocator's own waits: a retry frees the cached blocks (cudaFree drains the device), and
        # every cudaMalloc / cudaFree of the step is one the cache did not serve
        mem = ", ".join(f"{k} +{mem1.get(k, 0) - mem0.get(k, 0)}" for k in mem_keys)
        with open(os.path.join(OUTD, f"syncs_{i}.txt"), "w") as f:
            f.write(f"== step {i} nd={s.num_decode} pre={s.num_prefill_tokens} graph={s.graph} wall "
                    f"{(time.perf_counter() - t) * 1e3:.1f} ms: {sum(seen.values())} synchronising calls; "
                    f"allocator: {mem}\n")
            for (msg, where), c in seen.most_common():
                f.write(f"{c:6d}  {msg}  {where}\n")
        return r
    if os.environ.get("PROF_MODE") == "host":
        acc = collections.defaultdict(lambda: [0.0, 0, 0.0])  # seconds, calls, longest call

        def timed(name, fn):
            def run(*a_, **k_):
                t_ = time.perf_counter()
                try:
                    return fn(*a_, **k_)
                finally:
                    d_ = time.perf_counter() - t_
                    c_ = acc[name]; c_[0] += d_; c_[1] += 1; c_[2] = max(c_[2], d_)
            return run
        fill, rep = E.Engine._fill_chunks, torch.cuda.CUDAGraph.replay
        E.Engine._fill_chunks = timed("chunk_halves", fill)
        torch.cuda.CUDAGraph.replay = timed("graph_replays", rep)
        sync(); t = time.perf_counter()
        try:
            r = st(self, *a, **k)
        finally:
            E.Engine._fill_chunks, torch.cuda.CUDAGraph.replay = fill, rep
        issued = getattr(self.step_log[-1], "issue_seconds", None)
        sync()
        s = self.step_log[-1]
        rec = {"i": i, "nd": s.num_decode, "pre": s.num_prefill_tokens, "graph": s.graph,
               "wall_ms": round((time.perf_counter() - t) * 1e3, 3),
               "issue_ms": None if issued is None else round(issued * 1e3, 3)}
        for name, (sec, calls, top) in acc.items():
            rec[name] = {"ms": round(sec * 1e3, 3), "calls": calls, "longest_ms": round(top * 1e3, 3)}
        with open(os.path.join(OUTD, "host.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        return r
    if os.environ.get("PROF_MODE") == "cprofile":
        import cProfile, pstats, io
        sync(); t = time.perf_counter()
        pr = cProfile.Profile(); pr.enable()
        r = st(self, *a, **k)
        pr.disable(); sync()
        s = self.step_log[-1]
        buf = io.StringIO(); ps = pstats.Stats(pr, stream=buf)
        buf.write(f"== step {i} nd={s.num_decode} pre={s.num_prefill_tokens} graph={s.graph} wall {(time.perf_counter()-t)*1e3:.1f} ms\n")
        ps.sort_stats("tottime").print_stats(45); ps.sort_stats("cumulative").print_stats(60)
        open(os.path.join(OUTD, f"cprof_{i}.txt"), "w").write(buf.getvalue())
        return r
    sync()
    with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as p:
        r = st(self, *a, **k); sync()
    s = self.step_log[-1]
    kind = "mixed" if s.num_prefill_tokens else "decode"
    tot = 0.0
    for ev in p.key_averages():
        dt = getattr(ev, "self_device_time_total", None)
        if dt is None: dt = ev.self_cuda_time_total
        if dt <= 0: continue
        a_ = agg[kind][ev.key]; a_[0] += dt; a_[1] += ev.count; tot += dt
    steps[kind].append({"i": i, "nd": s.num_decode, "pre": s.num_prefill_tokens, "graph": s.graph, "gpu_us": round(tot, 1)})
    LOG.write(json.dumps(steps[kind][-1] | {"kind": kind, "profiled": True}) + "\n")
    if i == AFTER + N - 1: dump()
    return r
E.Engine.step = step
def dump():
    if not any(steps.values()):  # nothing profiled since the last dump: never overwrite a written table
        return
    with open(os.path.join(OUTD, f"kernels_{state['warm']}.txt"), "w") as f:
        for kind in ("decode", "mixed"):
            n = len(steps[kind])
            if not n: continue
            tot = sum(v[0] for v in agg[kind].values())
            f.write(f"== {kind}: {n} steps, device time per step {tot/n/1e3:.3f} ms; steps {steps[kind][:6]}\n")
            for k, (t, c) in sorted(agg[kind].items(), key=lambda kv: -kv[1][0])[:45]:
                f.write(f"{t/n/1e3:9.3f} ms/step {100*t/tot:5.1f}%  {c/n:7.1f} calls/step  {t/max(c,1):8.1f} us/call  {k[:110]}\n")
    for kind in agg: agg[kind].clear(); steps[kind].clear()
if N > 0:  # profiled steps run several times slower than the warm-up's: the hang watchdog would stop the run
    import k3rocm.bench as _B
    _B._Watchdog.threshold = lambda self: None
from k3rocm.cli.main import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:  # the CLI's own exit status is this script's
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
dump()
sys.exit(code)
