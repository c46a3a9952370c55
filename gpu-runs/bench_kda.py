"""Benchmark the KDA Triton kernels against fla-core (chunk_kda / fused_recurrent_kda) on one GPU.

Rows (bf16, K = V = 128), issue 3: prefill B1 T8192 H96; B1 T32768 H12; B4 T8192 H12; B1 T131072 H12;
decode B64 H12; B64 H96; B256 H12. Times: ``triton.testing.do_bench`` (mean) after warm-up, fresh random data.
Floors: bytes / 4.2 TB/s (measured H200 copy; ``--bw measure`` times this GPU's copy instead) and FLOPs / 682 TFLOP/s
(measured bf16 GEMM); fraction = floor / time. Decode rows time every config eagerly and graph-replayed.
Also the accuracy of both against the fp32 oracle on a smaller prefill (relative RMS error), and per prefill row
each of our launches (gate, intra, state, out) timed alone plus the q/k/v short conv (a second table).

Usage: ``python gpu-runs/bench_kda.py --out DIR [--decode 64x96] [--prefill 1x8192x96] [--bw measure]`` (writes
``kda_bench.json`` and ``kda_bench.md``);
``--warm I/N`` only compiles (share I of N of the kernel variants) to fill Triton's cache in parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

BW = 4.2e12
PEAK = 682e12
D = 128
PREFILL_ROWS = [(1, 8192, 96), (1, 32768, 12), (4, 8192, 12), (1, 131072, 12)]
DECODE_ROWS = [(64, 12), (64, 96), (256, 12)]
FLA_REF_MS = {"prefill B1 T8192 H96": 2.75, "prefill B1 T32768 H12": 1.95, "prefill B4 T8192 H12": 1.58,
              "prefill B1 T131072 H12": 7.63, "decode B64 H12": 0.049, "decode B64 H96": 0.209,
              "decode B256 H12": 0.110}


def prefill_inputs(B, T, H, dtype=torch.bfloat16, seed=0, dt_shift=0.0):
    """Random prefill inputs on the GPU; ``dt_shift`` moves ``dt_bias`` (-12: decay near 1, nothing forgotten)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    return dict(q=r(B, T, H, D).to(dtype), k=r(B, T, H, D).to(dtype), v=r(B, T, H, D).to(dtype),
                decay_raw=(r(B, T, H * D) * 2).to(dtype), beta_raw=r(B, T, H).to(dtype),
                A_log=r(H) * 0.5, dt_bias=r(H * D) * 0.5 + dt_shift)


def fla_prefill_fn(a, precomputed: bool):
    from fla.ops.kda import chunk_kda
    B, T, H, _ = a["q"].shape
    if precomputed:
        from k3rocm.model.kda import kda_gate
        g = kda_gate(a["decay_raw"], a["A_log"], a["dt_bias"], H)  # fp32 [B,T,H,K]
        beta = torch.sigmoid(a["beta_raw"].float()).to(a["q"].dtype)
        return lambda: chunk_kda(a["q"], a["k"], a["v"], g, beta, scale=D ** -0.5, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
    return lambda: chunk_kda(a["q"], a["k"], a["v"], a["decay_raw"].view(B, T, H, D), a["beta_raw"], scale=D ** -0.5,
                             output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=a["A_log"],
                             dt_bias=a["dt_bias"])


def prefill_cost(B, T, H):
    th = B * T * H
    byts = th * D * 2 * 5 + th * 2 + B * H * D * D * 4  # q,k,v,decay_raw in, o out (bf16), beta, final state
    flops = th * (11.5e6 / 64)  # chunked WY form per 64-token chunk and head: A, Aqk, w, u, w h, q h, A v', k^T v'
    return byts, flops


def decode_cost(N, H):
    state = N * H * D * D * 4 * 2
    other = N * H * D * (2 * 6 + 3 * 3 * 4 * 2)  # 6 bf16 inputs per channel, conv state r/w
    return state, state + other


def decode_inputs(N, H, S=None, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = H * D
    S = S or N
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    b = torch.bfloat16
    xs = [r(N, C).to(b), r(N, C).to(b), r(N, C).to(b), (r(N, C) * 2).to(b), r(N, H).to(b), r(N, C).to(b)]
    ws = tuple(r(C, 1, 4) * 0.5 for _ in range(3))
    return xs, ws, r(H) * 0.5, r(C) * 0.5, torch.rand(D, device="cuda", generator=g) + 0.5, r(S, 3, C, 3), \
        r(S, H, D, D) * 0.1, torch.randperm(S, device="cuda")[:N].to(torch.int32)


#: ``--products`` names: the prefill's precision forms the rows can time (``kda_prefill(products=...)``)
#: ("default" is the kernel's own choice for bf16 inputs: the fp16 form from 2026-12-06 16:30 UTC, split-bf16 before)
PRODUCT_FORMS = {"default": None, "split": "split", "pre": dict(pre=("kg", "w")), "pre3": dict(pre=("kg", "qg", "w")),
                 "fp16": "fp16"}


def prefill_kernel_ms(a, products=None, tag="") -> dict:
    """Each prefill launch timed alone on the row's inputs (its tuned config), and the short conv of q, k and v
    (three [B, T, H*D] calls, as the layer runs them before the prefill): where the time goes. With ``tag`` the
    keys read ``{tag}:{launch}_ms`` and the conv is left out."""
    import triton.testing as tt

    from k3rocm.kernels.kda import conv as CV
    from k3rocm.kernels.kda import prefill as P
    launches, _, _ = P.prefill_launches(**a, out_dtype=torch.bfloat16, products=products)
    if tag:
        return {f"{tag}:{nm}_ms": tt.do_bench(fn, warmup=20, rep=100) for nm, fn in launches}
    res = {f"{nm}_ms": tt.do_bench(fn, warmup=20, rep=100) for nm, fn in launches}
    B, T, H, _ = a["q"].shape
    wt = torch.randn(H * D, 1, 4, device="cuda") * 0.5
    xs = [a[n].reshape(B, T, H * D) for n in ("q", "k", "v")]
    conv = lambda: [CV.short_conv(x, wt, out_dtype=torch.bfloat16) for x in xs]  # noqa: E731
    conv()
    res["conv_qkv_ms"] = tt.do_bench(conv, warmup=20, rep=100)
    return res


def kernel_breakdown(fn, iters: int = 5, top: int = 12) -> list[dict]:
    """Device time per kernel of ``fn()`` (torch.profiler, ``iters`` calls after one warm call): the ``top``
    kernels by time, each ``{"kernel", "us_per_call", "launches_per_call"}`` (us of device time per ``fn()``)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
        if us > 0:
            out.append(dict(kernel=e.key[:90], us_per_call=us / iters, launches_per_call=e.count / iters))
    out.sort(key=lambda r: -r["us_per_call"])
    return out[:top]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """This GPU's device-to-device copy rate (bytes/s: read + write of ``nbytes``, do_bench mean): the floors'
    bandwidth on the machine that runs the rows (the 4.2 TB/s default was measured on an H200)."""
    import triton.testing as tt
    a = torch.empty(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), warmup=20, rep=100)
    del a, b
    return 2 * nbytes / (ms * 1e-3)


def bench_rows(out_dir, with_fla=True, only=("decode", "prefill"), prefill_rows=None, kernels=False,
               decode_rows=None, forms=("default",)):
    import triton.testing as tt

    from k3rocm.kernels import tune
    from k3rocm.kernels.kda import decode as DE
    from k3rocm.kernels.kda import prefill as P
    rows = []
    for B, T, H in ((prefill_rows or PREFILL_ROWS) if "prefill" in only else []):
        name = f"prefill B{B} T{T} H{H}"
        a = prefill_inputs(B, T, H)
        prod = PRODUCT_FORMS[forms[0]]
        ours = lambda prod=prod: P.kda_prefill(**a, out_dtype=torch.bfloat16, products=prod)  # noqa: E731
        seen = set(tune._CACHE)
        ours()
        t_ours = tt.do_bench(ours, warmup=50, rep=200)
        row = dict(row=name, ours_ms=t_ours, ours_form=forms[0])
        # the tuner's picks for this row (gate and solve take their tables' first entries)
        row["picks"] = {nm: cfg for (nm, key), cfg in tune._CACHE.items() if (nm, key) not in seen}
        # every candidate's time in those picks (ms; the intra pick's include the gate, and the solve and w / u
        # where an LC entry competes; the state pick's the output launch a non-FO entry needs)
        row["timed"] = {nm: [[json.dumps(c, sort_keys=True), round(t, 4)] for c, t in tune.TIMINGS.get((nm, key), [])]
                        for (nm, key) in tune._CACHE if (nm, key) not in seen}
        row.update(prefill_kernel_ms(a, prod))
        for form in forms[1:]:  # the other precision forms, timed whole and launch by launch
            f = lambda p2=PRODUCT_FORMS[form]: P.kda_prefill(**a, out_dtype=torch.bfloat16, products=p2)  # noqa
            f()
            row[f"ours_ms[{form}]"] = tt.do_bench(f, warmup=50, rep=200)
            row.update(prefill_kernel_ms(a, PRODUCT_FORMS[form], tag=form))
        byts, flops = prefill_cost(B, T, H)
        floor = max(byts / BW, flops / PEAK) * 1e3
        row.update(floor_ms=floor, frac_of_floor=floor / t_ours)
        if with_fla:
            for tag, pre in (("fla_fused_gate_ms", False), ("fla_precomputed_gate_ms", True)):
                try:
                    f = fla_prefill_fn(a, pre)
                    f()
                    row[tag] = tt.do_bench(f, warmup=50, rep=200)
                except Exception as e:  # report, keep going
                    row[tag + "_error"] = f"{type(e).__name__}: {e}"[:200]
            ref = row.get("fla_fused_gate_ms") or row.get("fla_precomputed_gate_ms")
            if ref:
                row["ratio_ours_over_fla"] = t_ours / ref
        row["fla_ref_brief_ms"] = FLA_REF_MS.get(name)
        if kernels:  # where each implementation's time goes, kernel by kernel
            row["ours_kernels"] = kernel_breakdown(ours)
            if with_fla:
                try:
                    row["fla_kernels"] = kernel_breakdown(fla_prefill_fn(a, False))
                except Exception as e:
                    row["fla_kernels_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a
        torch.cuda.empty_cache()
    for N, H in ((decode_rows or DECODE_ROWS) if "decode" in only else []):
        name = f"decode B{N} H{H}"
        xs, ws, A_log, dt, onw, cp, sp, sid = decode_inputs(N, H)
        out = torch.empty(N, H * D, device="cuda", dtype=torch.bfloat16)
        row = dict(row=name)
        best = None
        from k3rocm.kernels import tune
        from k3rocm.kernels.kda import configs as KC
        best_graph = None
        for c in tune.configs(KC.DECODE, candidates=True):
            f = lambda c=c: DE.kda_decode(*xs, ws, A_log, dt, onw, cp, sp, sid, 1e-5, out=out, config=c)  # noqa: E731
            f()
            t = tt.do_bench(f, warmup=50, rep=200)
            tag = ",".join(f"{k}={v}" for k, v in c.items() if k != "num_stages")
            row["ours_ms[" + tag + "]"] = t
            if best is None or t < best[0]:
                best = (t, c)
            # graph-replayed, as the engine runs it (the eager time of a multi-launch config includes host gaps)
            try:
                tg = tt.do_bench_cudagraph(f, rep=100)
                row["ours_graph_ms[" + tag + "]"] = tg
                if best_graph is None or tg < best_graph[0]:
                    best_graph = (tg, c)
            except Exception as e:
                row["ours_graph_error[" + tag + "]"] = f"{type(e).__name__}: {e}"[:200]
        row["ours_ms"] = best[0]
        if best_graph:
            row["ours_best_graph_ms"], row["ours_best_graph_config"] = best_graph[0], best_graph[1]
        splits = [c for c in tune.configs(KC.DECODE, candidates=True) if c.get("SPLIT")]
        if splits:  # where a three-launch config's time goes
            c = min(splits, key=lambda c: row.get("ours_graph_ms[" + ",".join(
                f"{k}={v}" for k, v in c.items() if k != "num_stages") + "]", 1e9))
            row["split_kernels"] = kernel_breakdown(
                lambda: DE.kda_decode(*xs, ws, A_log, dt, onw, cp, sp, sid, 1e-5, out=out, config=c))
        # the engine's call: no config, the kernel's own tuned pick (timed once per pow2(N) key on scratch pools)
        f = lambda: DE.kda_decode(*xs, ws, A_log, dt, onw, cp, sp, sid, 1e-5, out=out)  # noqa: E731
        f()
        row["ours_default_path_ms"] = tt.do_bench(f, warmup=50, rep=200)
        # the same call captured in a CUDA graph (what a serving engine replays)
        try:
            f = lambda: DE.kda_decode(*xs, ws, A_log, dt, onw, cp, sp, sid, 1e-5, out=out, config=best[1])  # noqa
            row["ours_graph_ms"] = tt.do_bench_cudagraph(f, rep=200)
        except Exception as e:
            row["ours_graph_error"] = f"{type(e).__name__}: {e}"[:200]
        st_bytes, all_bytes = decode_cost(N, H)
        row.update(state_floor_ms=st_bytes / BW * 1e3, all_bytes_floor_ms=all_bytes / BW * 1e3)
        row["frac_of_state_floor"] = row["state_floor_ms"] / min(row["ours_ms"], row.get("ours_graph_ms", 1e9),
                                                                 row.get("ours_best_graph_ms", 1e9))
        if with_fla:
            try:
                from fla.ops.kda import fused_recurrent_kda
                from k3rocm.model.kda import kda_gate
                q = xs[0].view(N, 1, H, D)
                k = xs[1].view(N, 1, H, D)
                v = xs[2].view(N, 1, H, D)
                g = kda_gate(xs[3], A_log, dt, H).view(N, 1, H, D)
                beta = torch.sigmoid(xs[4].float()).to(torch.bfloat16).view(N, 1, H)
                h0 = sp[sid.long()].contiguous()
                f = lambda: fused_recurrent_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=h0,  # noqa: E731
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
                f()
                row["fla_recurrent_precomputed_gate_ms"] = tt.do_bench(f, warmup=50, rep=200)
                try:
                    row["fla_recurrent_graph_ms"] = tt.do_bench_cudagraph(f, rep=100)
                except Exception as e:
                    row["fla_graph_error"] = f"{type(e).__name__}: {e}"[:200]
                row["ratio_ours_over_fla"] = row["ours_ms"] / row["fla_recurrent_precomputed_gate_ms"]
            except Exception as e:
                row["fla_error"] = f"{type(e).__name__}: {e}"[:200]
        row["fla_ref_brief_ms"] = FLA_REF_MS.get(name)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


#: precision variants the sweep times and checks (``kda_prefill(products=...)``; prefill.PRODUCTS)
#: ("w in bf16", w / wh single bf16 with w stored in bf16, is refused by the kernel since 2026-12-06: it faulted on
#: the H100; its accuracy was past the 3e-3 bound near decay 1 in the runs before)
SWEEP_VARIANTS = {"split": "split", "split+pre": dict(pre=("kg", "w")), "split+pre3": dict(pre=("kg", "qg", "w")),
                  "fp16": "fp16", "split+hbuf-bf16": dict(store=("hbuf",)),
                  "w, wh in bf16": dict(w="bf16", wh="bf16")}


def gate_sweep(a) -> dict:
    """The prefill's gate kernel alone on the row's inputs at each ``num_warps`` (fp32 and fp16 outputs); the
    entries of ``configs.GATE`` are timed by :func:`sweep` through the prefill's own gate launch."""
    import triton.testing as tt

    from k3rocm.kernels import _interp
    from k3rocm.kernels.kda import prefill as P
    B, T, H, K = a["q"].shape
    TT = B * T
    ct, cl, _ = P.chunk_table([b * T for b in range(B + 1)], "cuda")
    NC = ct.numel()
    f32 = dict(dtype=torch.float32, device="cuda")
    g, qg, kg = (torch.empty(TT, H, K, **f32) for _ in range(3))
    gl = torch.empty(NC, H, K, **f32)
    q, k = (a[n].reshape(TT, H, K) for n in ("q", "k"))
    dr = a["decay_raw"].reshape(TT, H * K)
    res = {}
    qh, kh = (torch.empty(TT, H, K, dtype=torch.float16, device="cuda") for _ in range(2))  # the "fp16" form's
    for nw in (1, 2, 4, 8, 16):
        for tag, qq, kk in (("", qg, kg), ("fp16 ", qh, kh)):
            fn = lambda nw=nw, qq=qq, kk=kk: _interp.launch(  # noqa: E731
                P._gate_kernel, (NC, H), q, k, dr, a["A_log"], a["dt_bias"], ct, cl, g, qq, kk, gl, K ** -0.5, -5.0,
                H, K=K, BT=P.BT, num_warps=nw)
            try:
                fn()
                res[f"gate_ms[{tag}num_warps={nw}]"] = tt.do_bench(fn, warmup=10, rep=50)
            except Exception as e:
                res[f"gate_error[{tag}num_warps={nw}]"] = f"{type(e).__name__}: {e}"[:200]
    return res


def sweep(rows=None, kinds=("gate", "intra", "wu", "state", "out"), variants=None, forms=("split", "fp16")) -> list[dict]:
    """Where each launch could go: per row (default B1 T8192 H96 and B1 T131072 H12), every config of the intra, wu, state and out kernels timed alone, the gate
    kernel at each ``num_warps``, and each :data:`SWEEP_VARIANTS` entry timed launch by launch (first intra
    config, tuned state / out) with its relative RMS error on the accuracy input (B1 T4096 H12)."""
    import triton.testing as tt

    from k3rocm.kernels import tune
    from k3rocm.kernels.kda import configs as KC
    from k3rocm.kernels.kda import prefill as P
    from k3rocm.model import kda as O
    rows = rows or ((1, 8192, 96), (1, 131072, 12))  # --prefill picks others
    out = []
    acc_in = prefill_inputs(1, 4096, 12, seed=7)
    acc_in["initial_state"] = torch.randn(1, 12, D, D, device="cuda") * 0.1
    want_o, want_s = O.kda_prefill(**acc_in)
    acc_d1 = dict(prefill_inputs(1, 4096, 12, seed=7, dt_shift=-12.0), initial_state=acc_in["initial_state"])
    want_o1, want_s1 = O.kda_prefill(**acc_d1)
    rr = lambda x, y: ((x.float() - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt()).item()  # noqa: E731
    for B, T, H in rows:
        a = prefill_inputs(B, T, H)
        res = dict(row=f"prefill B{B} T{T} H{H}")
        first = {"intra": tune.configs(KC.INTRA)[0]}
        for kind, table, pre in (("intra", KC.INTRA, ()), ("wu", KC.WU, ()), ("state", KC.STATE, ()),
                                 ("state", KC.STATE, ("kg", "qg", "w")), ("out", KC.OUT, ()),
                                 ("intra", KC.INTRA, "fp16"), ("wu", KC.WU, "fp16"), ("state", KC.STATE, "fp16"),
                                 ("out", KC.OUT, "fp16"), ("gate", KC.GATE, "fp16")):
            if kind not in kinds:
                continue
            f16 = pre == "fp16"
            if ("fp16" if f16 else "split") not in forms:
                continue
            for c in tune.configs(table, candidates=True):
                if c.get("FO") and (f16 or not pre):
                    continue  # the output in the state loop needs qg / kg / w stored split
                tag = ("f16:" if f16 else "pre:" if pre else "") + kind
                cj = json.dumps(c, sort_keys=True)
                try:
                    launches, _, _ = P.prefill_launches(**a, out_dtype=torch.bfloat16,
                                                        config=dict(first, **{kind: c}),
                                                        products="fp16" if f16 else dict(pre=pre))
                    fns = dict(launches)
                    if "local" in fns:  # an LC intra entry: gate, intra, solve and w / u in one launch
                        res[f"{tag}:local_ms[{cj}]"] = tt.do_bench(fns["local"], warmup=10, rep=50)
                        continue
                    res[f"{tag}_ms[{cj}]"] = tt.do_bench(fns[kind], warmup=10, rep=50)
                    if kind == "state":  # with the output launch it needs (none for FO: the loop wrote o)
                        res[f"{tag}+out_ms[{cj}]"] = (res[f"{tag}_ms[{cj}]"]
                                                      + (tt.do_bench(fns["out"], warmup=10, rep=50) if "out" in fns
                                                         else 0.0))
                except Exception as e:  # e.g. out of shared memory on this GPU: report, keep going
                    res[f"{tag}_error[{cj}]"] = f"{type(e).__name__}: {e}"[:200]
        if "gate" in kinds:
            res.update(gate_sweep(a))
        for name, prod in SWEEP_VARIANTS.items():
            if variants is not None and name not in variants:
                continue
            print(f"variant {name} ({res['row']})", flush=True)  # a fault's log names the variant it hit
            launches, _, _ = P.prefill_launches(**a, out_dtype=torch.bfloat16, config=first, products=prod)
            for nm, fn in launches:
                res[f"{name}:{nm}_ms"] = tt.do_bench(fn, warmup=10, rep=50)
            res[f"{name}:total_ms"] = sum(res[f"{name}:{nm}_ms"] for nm, _ in launches)
            if (B, T, H) == rows[0]:
                o, st = P.kda_prefill(**acc_in, products=prod)
                res[f"{name}:rel_rms_o"] = rr(o, want_o)
                res[f"{name}:rel_rms_state"] = rr(st, want_s)
                o, st = P.kda_prefill(**acc_d1, products=prod)
                res[f"{name}:rel_rms_o_decay1"] = rr(o, want_o1)
                res[f"{name}:rel_rms_state_decay1"] = rr(st, want_s1)
        print(json.dumps(res), flush=True)
        out.append(res)
        del a
        torch.cuda.empty_cache()
    return out


def accuracy(with_fla=True, forms=("default",)):
    """Relative RMS error of ours (each precision form of ``forms``) and fla's against the fp32 oracle (bf16
    inputs, B1 T4096 H12)."""
    from k3rocm.kernels.kda import prefill as P
    from k3rocm.model import kda as O
    a = prefill_inputs(1, 4096, 12, seed=7)
    a["initial_state"] = torch.randn(1, 12, D, D, device="cuda") * 0.1
    want_o, want_s = O.kda_prefill(**a)
    rr = lambda x, y: ((x.float() - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt()).item()  # noqa: E731
    o, s = P.kda_prefill(**a, products=PRODUCT_FORMS[forms[0]])
    res = dict(ours_o=rr(o, want_o), ours_state=rr(s, want_s))
    for form in forms[1:]:
        o, s = P.kda_prefill(**a, products=PRODUCT_FORMS[form])
        res[f"ours_o[{form}]"], res[f"ours_state[{form}]"] = rr(o, want_o), rr(s, want_s)
    # near decay 1 (dt_bias - 12: nothing forgotten, the inter-chunk term carries o), each form
    d1 = dict(prefill_inputs(1, 4096, 12, seed=7, dt_shift=-12.0), initial_state=a["initial_state"])
    w1o, w1s = O.kda_prefill(**d1)
    for form in forms:
        o, s = P.kda_prefill(**d1, products=PRODUCT_FORMS[form])
        res[f"ours_o_decay1[{form}]"], res[f"ours_state_decay1[{form}]"] = rr(o, w1o), rr(s, w1s)
    if with_fla:
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda
            B, T, H, _ = a["q"].shape
            fo, fs = chunk_kda(a["q"], a["k"], a["v"], a["decay_raw"].view(B, T, H, D), a["beta_raw"], scale=D ** -0.5,
                               initial_state=a["initial_state"].clone(), output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               safe_gate=True, lower_bound=-5.0, A_log=a["A_log"], dt_bias=a["dt_bias"])
            res.update(fla_chunk_o=rr(fo, want_o), fla_chunk_state=rr(fs, want_s))
            fo, fs = chunk_kda(d1["q"], d1["k"], d1["v"], d1["decay_raw"].view(B, T, H, D), d1["beta_raw"],
                               scale=D ** -0.5, initial_state=d1["initial_state"].clone(), output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                               safe_gate=True, lower_bound=-5.0, A_log=d1["A_log"], dt_bias=d1["dt_bias"])
            res.update(fla_chunk_o_decay1=rr(fo, w1o), fla_chunk_state_decay1=rr(fs, w1s))
            g = O.kda_gate(a["decay_raw"], a["A_log"], a["dt_bias"], H)
            beta = torch.sigmoid(a["beta_raw"].float())
            fo, fs = fused_recurrent_kda(a["q"], a["k"], a["v"], g, beta.to(a["q"].dtype), scale=D ** -0.5,
                                         initial_state=a["initial_state"].clone(), output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
            res.update(fla_recurrent_o=rr(fo, want_o), fla_recurrent_state=rr(fs, want_s))
        except Exception as e:
            res["fla_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(res), flush=True)
    return res


def warm(share: str):
    """Compile a share of the kernel variants (tiny inputs) to fill Triton's on-disk cache."""
    from k3rocm.kernels import tune
    from k3rocm.kernels.kda import configs as KC
    from k3rocm.kernels.kda import prefill as P
    i, n = (int(x) for x in share.split("/"))
    # every config at H = 12 (bf16), the first configs at H = 96 (a multiple of 16: another specialisation) and
    # with fp32 inputs: what tests/kernels/test_kda_gpu.py compiles
    groups = [(torch.bfloat16, 12, ci, True) for ci in range(len(tune.configs(KC.INTRA)))]
    groups += [(torch.bfloat16, 96, 0, False), (torch.float32, 12, 0, False)]
    for dtype, H, ci, every in groups[i::n]:  # one intra variant per process: no duplicate compiles
        ns, no = len(tune.configs(KC.STATE)), len(tune.configs(KC.OUT))
        for si in range(max(ns, no) if every else 1):  # every state and every output config
            for st in (True, False):
                a = prefill_inputs(1, 64, H, dtype)
                if st:
                    a["initial_state"] = torch.zeros(1, H, D, D, device="cuda")
                P.kda_prefill(**a, config={"intra": tune.configs(KC.INTRA)[ci],
                                           "state": tune.configs(KC.STATE)[si % ns],
                                           "out": tune.configs(KC.OUT)[si % no]})
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-runs/results")
    ap.add_argument("--warm", default=None)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--only", default="decode,prefill,accuracy",
                    help="comma list of parts among decode, prefill, accuracy, sweep, run in this order (decode first: "
                         "fla's prefill autotuning is slow)")
    ap.add_argument("--kernels", action="store_true",
                    help="also profile each prefill row kernel by kernel (ours and fla's chunk_kda, torch.profiler)")
    ap.add_argument("--candidates", action="store_true",
                    help="the tuned picks also time the tables' candidate entries (which serving never takes)")
    ap.add_argument("--sweep-kinds", default="gate,intra,wu,state,out", metavar="KIND,...",
                    help="the tables the sweep times config by config (default: gate,intra,wu,state,out; the gate on the fp16 form "
                         "through the prefill's own launch, its num_warps ladder beside)")
    ap.add_argument("--sweep-variants", default=None, metavar="NAME,...",
                    help=f"the precision variants the sweep times (default all: {', '.join(SWEEP_VARIANTS)}; '' none)")
    ap.add_argument("--sweep-forms", default="split,fp16", metavar="FORM,...",
                    help="the product forms whose tables the sweep times config by config (split and its stored-split "
                         "variant, fp16; default both)")
    ap.add_argument("--products", default="default", metavar="FORM,...",
                    help="prefill precision forms to time (the first fills ours_ms; the others ours_ms[FORM] and "
                         f"FORM:<launch>_ms): {', '.join(PRODUCT_FORMS)} (default: default)")
    ap.add_argument("--prefill", default=None, metavar="BxTxH,...",
                    help="prefill rows to run instead of the default four, e.g. 1x32768x12,4x8192x12")
    ap.add_argument("--decode", default=None, metavar="NxH,...",
                    help="decode rows to run instead of the default three, e.g. 64x96")
    ap.add_argument("--bw", default="4.2e12",
                    help="bytes/s of the floors, or 'measure': this GPU's copy rate, timed first (default 4.2e12, "
                         "an H200's measured copy)")
    args = ap.parse_args()
    global BW
    try:
        BW = copy_bandwidth() if args.bw == "measure" else float(args.bw)
        dsel = [tuple(int(v) for v in r.split("x")) for r in args.decode.split(",")] if args.decode else None
    except ValueError:
        ap.error(f"--decode {args.decode!r} / --bw {args.bw!r}: rows are NxH separated by commas, e.g. 64x96; "
                 "--bw is a number of bytes/s or 'measure'")
    if dsel and any(len(r) != 2 or min(r) < 1 for r in dsel):
        ap.error(f"--decode {args.decode!r}: each row needs two positive numbers N x H")
    try:
        sel = [tuple(int(v) for v in r.split("x")) for r in args.prefill.split(",")] if args.prefill else None
    except ValueError:
        ap.error(f"--prefill {args.prefill!r}: rows are BxTxH separated by commas, e.g. 1x32768x12")
    if sel and any(len(r) != 3 or min(r) < 1 for r in sel):
        ap.error(f"--prefill {args.prefill!r}: each row needs three positive numbers B x T x H")
    forms = tuple(args.products.split(","))
    if not forms or any(f not in PRODUCT_FORMS for f in forms):
        ap.error(f"--products {args.products!r}: names among {', '.join(PRODUCT_FORMS)}, separated by commas")
    if args.warm:
        warm(args.warm)
        return
    if args.candidates:
        from k3rocm.kernels import tune
        _configs = tune.configs
        tune.configs = lambda table, backend=None, candidates=True: _configs(table, backend, True)
    kinds = tuple(args.sweep_kinds.split(","))
    if any(k not in ("gate", "intra", "wu", "state", "out") for k in kinds):
        ap.error(f"--sweep-kinds {args.sweep_kinds!r}: names among gate, intra, wu, state, out")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    parts = args.only.split(",")
    rows = []
    for part in parts:
        if part in ("decode", "prefill"):
            rows += bench_rows(args.out, not args.no_fla, only=(part,), prefill_rows=sel, kernels=args.kernels,
                               decode_rows=dsel, forms=forms)
    acc = accuracy(not args.no_fla, forms) if "accuracy" in parts else {}
    variants = None if args.sweep_variants is None else [v for v in args.sweep_variants.split(",") if v]
    sw = (sweep(tuple(sel) if sel else None, kinds, variants, tuple(args.sweep_forms.split(",")))
          if "sweep" in parts else [])
    info = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, floor_bw_Bps=BW,
                triton=__import__("triton").__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                seconds=time.time() - t0)
    with open(os.path.join(args.out, "kda_bench.json"), "w") as f:
        json.dump(dict(info=info, accuracy=acc, rows=rows, sweep=sw), f, indent=1)
    lines = [f"device {info['device']}, torch {info['torch']}, triton {info['triton']}, {info['date']}, "
             f"floors at {BW / 1e12:.2f} TB/s", "",
             "| row | ours ms | fla ms (fused gate) | fla ms (precomputed gate) | ours/fla | floor ms | frac of floor |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = r.get("fla_fused_gate_ms") or r.get("fla_recurrent_precomputed_gate_ms")
        lines.append(f"| {r['row']} | {r['ours_ms']:.4f} | {fl if fl is None else round(fl, 4)} | "
                     f"{r.get('fla_precomputed_gate_ms', '-')} | {r.get('ratio_ours_over_fla', float('nan')):.3f} | "
                     f"{r.get('floor_ms', r.get('state_floor_ms')):.4f} | "
                     f"{r.get('frac_of_floor', r.get('frac_of_state_floor')):.3f} |")
    pre = [r for r in rows if "state_ms" in r]
    if pre:
        lines += ["", "prefill, each launch alone (ms; conv = short_conv of q, k, v, run before the prefill):", "",
                  "| row | gate | intra | solve | wu | local | state | out | sum | conv q,k,v |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in pre:
            # FO: no out; LC: local in place of gate, intra, solve and wu
            ks = [r.get(f"{n}_ms", 0.0) for n in ("gate", "intra", "solve", "wu", "local", "state", "out")]
            lines.append(f"| {r['row']} | " + " | ".join(f"{x:.3f}" for x in ks) + f" | {sum(ks):.3f} | "
                         f"{r['conv_qkv_ms']:.3f} |")
    for r in rows:
        for nm, lst in (r.get("timed") or {}).items():  # every candidate the tuner timed for this row, fastest first
            if lst:
                lines += ["", f"{r['row']}, `{nm}` tuned pick, each candidate timed (ms; what the time includes: "
                              "`tune.TIMINGS`):", "", "| config | ms |", "|---|---|"]
                lines += [f"| `{c}` | {t:.4f} |" for c, t in sorted(lst, key=lambda ct: ct[1])]
        for who in ("ours", "fla"):
            ks = r.get(f"{who}_kernels")
            if ks:
                lines += ["", f"{r['row']}, {who}, device time per call by kernel (torch.profiler):", "",
                          "| kernel | us per call | launches per call |", "|---|---|---|"]
                lines += [f"| `{k['kernel']}` | {k['us_per_call']:.1f} | {k['launches_per_call']:g} |" for k in ks]
    with open(os.path.join(args.out, "kda_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
