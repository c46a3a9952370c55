"""The routed experts at decode batch sizes on one rank's expert slice, graph-replayed: which GEMM config wins
when a step routes only a handful of pairs to the rank.

Why: the K3 rank of TP16/EP16 (56 of 896 experts) at concurrency 1 routes 16 pairs per token, ~1 of them to a
local expert, so the w1|w3 GEMM runs 48 n-tile programs (6144 / 128) and w2 28, on a GPU of 132 SMs: one H100
profile (2026-12-07, k3-prefix-48 rank, step ``prof1``) shows 22.2 us per GEMM call at 1 row, where one expert's
17.5 MB read at 3.35 TB/s is ~5 us for both. Splitting K multiplies the programs; its fp32 partials cost one
more launch (the GLU after the sum) and a read of the partials.

For each token count: random router picks (top-16 of 896, ``moe_router`` on random hidden states), the rank's
slice = experts ``0 .. 896 / ep - 1`` in the tiled layout made at load; every decode-path config of the backend's
list (candidates too) and split-K 2 / 4 / 8 of the served tile, each timed replaying a CUDA graph of
``moe_experts`` with the pairs grouped beforehand (as the engine's fused routing hands them over), and its output's
relative max difference from the picked config's. Floor: the experts the slice's pairs touch, read once at
``--bw`` (default the H100's datasheet 3.35 TB/s).

Usage: ``python gpu-runs/bench_moe_decode.py --tokens 1 2 4 8 16 32 64 --ep-ranks 16 --out DIR`` (moe_decode.json,
moe_decode.md); ``--served-only`` times the served config alone (its first two GEMM launches are the ones step
``mncu`` of ``gpu_engine.sh`` profiles). ``--small --device cpu`` (TRITON_INTERPRET=1) checks the script at tiny
sizes; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import triton
import triton.testing as tt

from k3rocm.kernels import tune
from k3rocm.kernels.moe import GEMM_CONFIGS, gemm_name, moe_experts, moe_router
from k3rocm.kernels.moe.configs import DQ_KINDS, REDUCE_LAUNCH
from k3rocm.kernels.moe.ops import dispatch_gpu, gemm_pick, kernel_layout
from k3rocm.kernels.target import current_target
from k3rocm.validation.evidence import git_sha

E_K3, D_K3, I_K3, H_K3, K_K3 = 896, 3584, 3072, 7168, 16
EXPERT_BYTES = 3 * D_K3 * I_K3 // 2 + 3 * D_K3 * I_K3 // 32  # packed E2M1 values + E8M0 scales, one expert


def _configs(served: tune.Config) -> list[tune.Config]:
    """Every decode-kind config of the backend's list (candidates too), then split-K 2 / 4 / 8 of ``served``."""
    seen, out = set(), []
    for c in tune.configs(GEMM_CONFIGS, candidates=True) + [dict(served, split_k=s) for s in (2, 4, 8)]:
        if c.get("kind", "scaled") not in DQ_KINDS or c.get("persist"):
            continue
        c = {k: v for k, v in c.items() if k not in ("max_rows", "candidate")}
        name = gemm_name(c)
        if name not in seen:
            seen.add(name)
            out.append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--ep-ranks", type=int, default=16, help="EP ranks: the slice holds 896 / N experts (16: the "
                    "K3 rank the engine bench runs; 8: one GPU of mi355x-8)")
    ap.add_argument("--bw", type=float, default=3.35e12, help="bytes/s of the floor (default: H100 datasheet)")
    ap.add_argument("--out", default="gpu-runs/results")
    ap.add_argument("--reduce-ilp", action="store_true",
                    help="also time the served config with the reduction in the backend's other form (configs."
                         "REDUCE_LAUNCH ILP: column <served>-ilp when the backend loops, <served>-loop when it unrolls)")
    ap.add_argument("--served-only", action="store_true",
                    help="time the served config alone (e.g. under Nsight Compute: step mncu of gpu_engine.sh)")
    ap.add_argument("--small", action="store_true", help="smoke run: 64 experts, latent 64, intermediate 64, top-4")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton interpreter, TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    E, D, I, H, K = (64, 64, 64, 128, 4) if args.small else (E_K3, D_K3, I_K3, H_K3, K_K3)
    if not 1 <= args.ep_ranks <= E or E % args.ep_ranks:
        raise SystemExit(f"bench_moe_decode: --ep-ranks {args.ep_ranks} must divide the {E} experts")
    dev = args.device
    nl = E // args.ep_ranks
    g = torch.Generator(device=dev).manual_seed(0)
    ew = dict(w13_packed=torch.randint(0, 256, (nl, 2 * I, D // 2), dtype=torch.uint8, device=dev, generator=g),
              w13_scale=torch.randint(119, 122, (nl, 2 * I, D // 32), dtype=torch.uint8, device=dev, generator=g),
              w2_packed=torch.randint(0, 256, (nl, D, I // 2), dtype=torch.uint8, device=dev, generator=g),
              w2_scale=torch.randint(119, 122, (nl, D, I // 32), dtype=torch.uint8, device=dev, generator=g),
              num_experts=nl, first_expert=0)
    ew["kernel_layout"] = kernel_layout(ew)
    gate = (torch.randn(E, H, device=dev, generator=g) * H ** -0.5).bfloat16()
    bias = torch.randn(E, device=dev, generator=g) * 0.01
    expert_bytes = 3 * D * I // 2 + 3 * D * I // 32
    rows = []
    backend = current_target().backend
    ilp0 = REDUCE_LAUNCH[backend]["ILP"]
    for T in args.tokens:
        xh = torch.randn(T, H, device=dev, generator=g)
        xl = torch.randn(T, D, device=dev, generator=g).bfloat16()
        ids, wts = moe_router(xh if dev == "cuda" else xh.float(), gate.float() if dev != "cuda" else gate, bias, K)
        local = ids[(ids >= 0) & (ids < nl)]
        pairs = int(local.numel())
        used = int(torch.unique(local).numel())
        served = gemm_pick(T * K, nl, num_experts=E)
        r = dict(tokens=T, local_pairs=pairs, experts_used=used, served=gemm_name(served),
                 floor_us=used * expert_bytes / args.bw * 1e6)
        base = moe_experts(xl, ids, wts, ew, config=served)  # the served config's output, the reference of every run
        plain = {k: v for k, v in served.items() if k not in ("max_rows", "candidate")}
        runs = [(c, ilp0) for c in ([plain] if args.served_only else _configs(served))]
        if args.reduce_ilp:  # the reduction's other form, same bits
            runs.append((plain, not ilp0))
        for cfg, ilp in runs:
            name = gemm_name(cfg) + ("" if ilp == ilp0 else ("-ilp" if ilp else "-loop"))
            REDUCE_LAUNCH[backend]["ILP"] = ilp
            try:
                d = dispatch_gpu(ids, 0, nl, cfg["BLOCK_M"])
                out = moe_experts(xl, ids, wts, ew, config=cfg, dispatch=d)
                r[f"{name}_rel"] = ((out - base).abs().max() / base.abs().max().clamp_min(1e-30)).item()
                if dev == "cuda":
                    r[f"{name}_us"] = tt.do_bench_cudagraph(
                        lambda c=cfg, d=d: moe_experts(xl, ids, wts, ew, config=c, dispatch=d), rep=50) * 1e3
            except Exception as e:  # noqa: BLE001 - a config that fails is a result to report
                r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                REDUCE_LAUNCH[backend]["ILP"] = ilp0
        times = {k[:-3]: v for k, v in r.items() if k.endswith("_us") and k != "floor_us"}
        if times:
            best = min(times, key=times.get)
            r.update(best=best, best_us=times[best], served_us=times.get(gemm_name(served)),
                     best_fraction=r["floor_us"] / times[best])
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)", torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                backend=current_target().backend, commit=git_sha()[:12], experts=E, local_experts=nl, latent=D,
                intermediate=I, top_k=K, bw=args.bw)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_decode.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    names = sorted({k[:-3] for r in rows for k in r if k.endswith("_us") and k != "floor_us" and k[:-3] not in
                    ("best", "served")})
    md = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, commit {meta['commit']}; "
          f"{nl} of {E} experts (EP{args.ep_ranks}), graph-replayed us", "",
          "| tokens | local pairs | experts | floor | served | best | " + " | ".join(names) + " |",
          "|---|---|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r[n + '_us']:.1f}" if n + "_us" in r else "—" for n in names]
        md.append(f"| {r['tokens']} | {r['local_pairs']} | {r['experts_used']} | {r['floor_us']:.1f} | "
                  f"{r['served']} {r.get('served_us') or 0:.1f} | {r.get('best', '—')} {r.get('best_us') or 0:.1f} | "
                  + " | ".join(cells) + " |")
    with open(os.path.join(args.out, "moe_decode.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
