"""Benchmark the MoE routing of one K3 layer: router + dispatch, the two-step path against the fused one.

Problem (K3_FACTS §2, §5): router input hidden 7168 (fp32 as the engine passes it, or bf16: ``--x-dtype``), 896 experts, top-16, FP32 logits, sigmoid, biased
top-k, renormalised x 2.446; the pairs grouped by expert for the grouped GEMM (all 896 experts local, M
blocks of the ``BLOCK_M`` the expert GEMM picks at that size). Paths:

* old: ``moe_router`` (logits, top-k) then ``dispatch_gpu`` (one-program counting sort up to 8192 pairs);
* new: ``moe_route`` (logits, then the top-k kernel that also groups the pairs: the last program of each
  token group ranks its group, the last group places every pair): two launches — what the model's MoE block
  runs (``moe_router(..., experts=)``, the GEMM's ``BLOCK_M`` from ``ops.gemm_pick``).

``router graphed`` is ``moe_router`` alone (logits + top-k, no grouping) replayed from a graph: ``new graphed``
minus it is what the grouping costs. The JSON also has each router config forced (``cfg_*``) and the fused path
with its top-k + grouping launch at 1 / 2 / 4 / 8 warps (``warps*``: graph-replayed time, same tensors or not),
and up to 8 tokens the whole routing in one program at 4 / 8 warps (``small*``, ``configs.ROUTER_SMALL_TOKENS``).

Each is timed eagerly (``triton.testing.do_bench``, median after warm-up) and replayed from a CUDA graph
(``do_bench_cudagraph``: what the serving engine runs). ``same`` says the new path's ids, weights and every
dispatch tensor equal the old path's. Floor: the gate read once (12.8 MB) at the measured copy bandwidth.
Goal (issue 14): <= 15 us per layer at 64 tokens on an H200.

Usage: ``python gpu-runs/bench_route.py --out DIR`` (writes ``route_bench.json`` and ``route_bench.md``; ~30 s
on an H200). ``--small --device cpu`` (with ``TRITON_INTERPRET=1``) checks the script at k3-tiny sizes; its
timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.testing as tt

from k3rocm.kernels.moe.ops import dispatch_gpu, gemm_pick, moe_route, moe_router
from k3rocm.bench import wall_ms
from k3rocm.kernels.target import current_target
from k3rocm.validation.evidence import git_sha

E_K3, H_K3, K_K3, SCALING = 896, 7168, 16, 2.446
COPY_BW = 4.2e12  # B/s, measured copy bandwidth (H200)
GOAL_US_AT_64 = 15.0
FIELDS = ("sorted_pair", "pos", "counts", "offsets", "block_expert", "block_start")




def bench_row(T, E, H, K, dev, graphs: bool, x_dtype: str = "fp32", num_local: int | None = None) -> dict:
    """One token count: times in microseconds, equality of the two paths, the goal at 64 tokens."""
    eager = (lambda f: tt.do_bench(f, warmup=25, rep=100)) if dev == "cuda" else wall_ms
    g = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, H, device=dev, generator=g)
    if x_dtype == "bf16":
        x = x.bfloat16()
    gate = (torch.randn(E, H, device=dev, generator=g) * H ** -0.5).bfloat16()
    bias = torch.rand(E, device=dev, generator=g) * 0.01
    if dev != "cuda":  # the interpreter's bf16 tl.dot is not trustworthy: the router's fp32 path
        x, gate = x.float(), gate.float()
    r0 = dict(x_dtype=str(x.dtype).replace("torch.", ""))
    L = num_local or E  # local experts 0 .. L-1 (a rank of EP E/L)
    bm = gemm_pick(T * K, L, num_experts=E)["BLOCK_M"]  # the BLOCK_M the expert GEMM runs (and the model routes for)

    def old():
        ids, w = moe_router(x, gate, bias, K, scaling=SCALING)
        return ids, w, dispatch_gpu(ids, 0, L, bm)

    def new(**kw):
        return moe_route(x, gate, bias, K, 0, L, bm, scaling=SCALING, **kw)

    a, b = old(), new()
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(
        torch.equal(getattr(a[2], f), getattr(b[2], f)) for f in FIELDS)
    ids = a[0]
    r = dict(tokens=T, block_m=bm, local_experts=L, same=same, **r0,
             floor_us=E * H * x.element_size() / COPY_BW * 1e6,
             old_router_us=eager(lambda: moe_router(x, gate, bias, K, scaling=SCALING)) * 1e3,
             old_dispatch_us=eager(lambda: dispatch_gpu(ids, 0, L, bm)) * 1e3,
             old_us=eager(old) * 1e3, new_us=eager(new) * 1e3)
    if graphs and dev == "cuda":
        router = lambda: moe_router(x, gate, bias, K, scaling=SCALING)  # noqa: E731
        for name, fn in (("old", old), ("new", new), ("router", router)):
            try:
                r[f"{name}_graph_us"] = tt.do_bench_cudagraph(fn, rep=100) * 1e3
            except Exception as e:  # noqa: BLE001 - a failed capture is a result to report
                r[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:200]
    if graphs and dev == "cuda":  # the parts: logits alone; each grouping; the logits' program target
        from k3rocm.kernels.moe import ops as _ops
        from k3rocm.kernels.moe.configs import ROUTER_LOGIT_PROGRAMS

        def same_as_b(got):
            return torch.equal(got[0], b[0]) and torch.equal(got[1], b[1]) and all(
                torch.equal(getattr(got[2], f), getattr(b[2], f)) for f in FIELDS)

        def timed(name, fn, check=True):
            """``name``_graph_us (graph-replayed), ``name``_same (fn's tensors equal the served path's, with
            ``check``), or ``name``_error: a failure is a result to report."""
            try:
                if check:
                    r[f"{name}_same"] = same_as_b(fn())
                r[f"{name}_graph_us"] = tt.do_bench_cudagraph(fn, rep=100) * 1e3
            except Exception as e:  # noqa: BLE001
                r[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]

        logits = lambda: _ops._router_logits(x, gate, K, None)  # noqa: E731
        timed("logits", logits, check=False)
        for grouping in ("fused", "experts"):
            timed(f"grouping_{grouping}", lambda gr=grouping: new(grouping=gr))
        # the per-expert grouping after a top-k that picks by tl.topk (a partial sort), not 16 max rounds
        timed("sort", lambda: new(grouping="experts", topk_sort=True))
        backend = current_target().backend
        served = ROUTER_LOGIT_PROGRAMS[backend]
        try:
            for n in (66, 132, 264, 528):
                ROUTER_LOGIT_PROGRAMS[backend] = n
                for grouping in ("fused", "experts"):
                    timed(f"programs{n}_{grouping}", lambda gr=grouping: new(grouping=gr))
                timed(f"programs{n}_logits", logits, check=False)
        finally:
            ROUTER_LOGIT_PROGRAMS[backend] = served
    if graphs and dev == "cuda":  # every router config of the backend's table forced, graph-replayed: the pick
        from k3rocm.kernels import tune as _tune
        from k3rocm.kernels.moe.configs import ROUTER_CONFIGS

        for cfg in _tune.configs(ROUTER_CONFIGS):
            name = f"t{cfg['BLOCK_T']}e{cfg['BLOCK_E']}k{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}"
            try:
                got = moe_router(x, gate, bias, K, scaling=SCALING, config=cfg)
                r[f"cfg_{name}_same"] = bool(torch.equal(got[0], ids))
                r[f"cfg_{name}_graph_us"] = tt.do_bench_cudagraph(
                    lambda c=cfg: moe_router(x, gate, bias, K, scaling=SCALING, config=c), rep=100) * 1e3
            except Exception as e:  # noqa: BLE001 - a config that fails is a result to report
                r[f"cfg_{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    if graphs and dev == "cuda":  # the fused top-k + grouping launch at 1 / 2 / 4 / 8 warps: same tensors, timed
        for wp in (1, 2, 4, 8):
            try:
                got = new(topk_warps=wp)
                r[f"warps{wp}_same"] = torch.equal(got[0], b[0]) and torch.equal(got[1], b[1]) and all(
                    torch.equal(getattr(got[2], f), getattr(b[2], f)) for f in FIELDS)
                r[f"warps{wp}_graph_us"] = tt.do_bench_cudagraph(
                    lambda wp=wp: new(topk_warps=wp), rep=100) * 1e3
            except Exception as e:  # noqa: BLE001 - a warp count that fails is a result to report
                r[f"warps{wp}_error"] = f"{type(e).__name__}: {e}"[:200]
    if graphs and dev == "cuda" and T <= 8:  # the whole routing in one program (router_topk_small_kernel)
        for wp in (4, 8):
            try:
                got = new(topk_warps=wp, small_tokens=8)
                r[f"small{wp}_same"] = torch.equal(got[0], b[0]) and torch.equal(got[1], b[1]) and all(
                    torch.equal(getattr(got[2], f), getattr(b[2], f)) for f in FIELDS)
                r[f"small{wp}_graph_us"] = tt.do_bench_cudagraph(
                    lambda wp=wp: new(topk_warps=wp, small_tokens=8), rep=100) * 1e3
            except Exception as e:  # noqa: BLE001 - a failure is a result to report
                r[f"small{wp}_error"] = f"{type(e).__name__}: {e}"[:200]
    best_new = min(r["new_us"], r.get("new_graph_us", float("inf")))
    r["speedup"] = r["old_us"] / r["new_us"]
    if T == 64:
        r["goal_us"] = GOAL_US_AT_64
        r["goal_met"] = best_new <= GOAL_US_AT_64
    return r


def markdown(meta, rows) -> str:
    def f(v):
        return "—" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    out = [f"router input {rows[0].get('x_dtype', '?') if rows else '?'}; device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
           f"commit {meta['commit']}", "",
           f"### Routing per MoE layer (hidden {meta['hidden']}, {meta['experts']} experts, top-{meta['top_k']}), µs",
           "",
           "| tokens | BLOCK_M | old router | old dispatch | old total | old graphed | new (fused) | new graphed | "
           "router graphed | speed-up | gate floor | same | goal ≤ 15 µs at 64 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = ("met" if r["goal_met"] else "missed") if "goal_met" in r else ""
        out.append(f"| {r['tokens']} | {r['block_m']} | {f(r['old_router_us'])} | {f(r['old_dispatch_us'])} | "
                   f"{f(r['old_us'])} | {f(r.get('old_graph_us'))} | {f(r['new_us'])} | {f(r.get('new_graph_us'))} | "
                   f"{f(r.get('router_graph_us'))} | "
                   f"{r['speedup']:.2f}× | {f(r['floor_us'])} | {'yes' if r['same'] else 'NO'} | {goal} |")
    out += ["", "### The parts, graph-replayed, µs (grouping: fused = inside the top-k launch, experts = a launch of one "
            "program per local expert; programs N: the logits' program target)", "",
            "| local experts | tokens | logits | fused | experts | experts + tl.topk | " + " | ".join(
                f"{n}: logits / fused / experts" for n in (66, 132, 264, 528)) + " | all same |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sames = [v for k, v in r.items() if k.endswith("_same") and (k.startswith("grouping") or k == "sort_same")]
        out.append(f"| {r.get('local_experts')} | {r['tokens']} | {f(r.get('logits_graph_us'))} | "
                   f"{f(r.get('grouping_fused_graph_us'))} | {f(r.get('grouping_experts_graph_us'))} | "
                   f"{f(r.get('sort_graph_us'))} | " + " | ".join(
                       f"{f(r.get(f'programs{n}_logits_graph_us'))} / {f(r.get(f'programs{n}_fused_graph_us'))} / "
                       f"{f(r.get(f'programs{n}_experts_graph_us'))}" for n in (66, 132, 264, 528)) +
                   f" | {'yes' if all(sames) else 'NO'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 64, 512])
    ap.add_argument("--out", default="gpu-runs/results")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays")
    ap.add_argument("--x-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="router input: fp32 (what the engine passes: fp32 activations, split into bf16 parts in "
                         "the kernel) or bf16")
    ap.add_argument("--small", action="store_true", help="smoke run: 64 experts, hidden 128, top-4")
    ap.add_argument("--local", type=int, nargs="+", default=[0],
                    help="local experts of the grouping, from expert 0 (0: all, EP1; 56: a K3 rank of EP16); one "
                         "row set per value")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton interpreter, TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    E, H, K = (64, 128, 4) if args.small else (E_K3, H_K3, K_K3)
    rows = []
    for L in args.local:
        for T in args.tokens:
            r = bench_row(T, E, H, K, args.device, not args.no_graphs, args.x_dtype, min(L, E) or None)
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), backend=current_target().backend,
                commit=git_sha()[:12], experts=E, hidden=H, top_k=K)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "route_bench.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    md = markdown(meta, rows)
    with open(os.path.join(args.out, "route_bench.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
