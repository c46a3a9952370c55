"""Benchmark the skinny GEMM (``k3rocm.kernels.dense``) against the vendor GEMM the engine runs today on the dense
projections of a K3 rank's decode step (TP16 / EP16, K3_FACTS §2-§5).

Rows (weight ``[N, K]`` bf16, as the rank holds it): the latent MoE down / up projections (3584 x 7168, 7168 x
3584, replicated), the KDA layer's fused q|k|v|g|b|f_a projection at 6 heads (3 x 768 + 768 + 6 + f_a's rank,
taken 384 here) x 7168 and its o_proj (7168 x 768), the shared experts' gate|up (768 x 7168) and down (7168 x
384), MLA's q_a | kv_a (2112 x 7168), the lm_head slice (10240 x 7168); at M = 1, 16, 53 and 64 token rows.
Each row: ``torch.mm(x, W.T, out_dtype=fp32)`` (what ``k3rocm.model.common.linear`` runs in the engine's bf16 scope,
``F.linear(...).float()`` where that overload is missing) and every skinny config whose row band fits, timed
graph-replayed (``triton.testing.do_bench_cudagraph``: the decode step is one CUDA graph, so launch overhead is
not what the step pays), each checked against the float64 product (max error / max |y|). Floor: weight + activation
bytes / the measured copy bandwidth (``--bw``, default measured here with a 1 GiB device copy).

Usage: ``python gpu-runs/bench_dense.py --out DIR`` -> ``DIR/dense_bench.json`` and ``DIR/dense_bench.md``;
``--rows 1,53`` picks the token counts. ``--small --device cpu`` (with ``TRITON_INTERPRET=1``) checks the script on
tiny shapes; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from k3rocm.kernels.dense import SKINNY_CONFIGS, skinny_gemm

SHAPES = {"latent down": (3584, 7168), "latent up": (7168, 3584), "KDA in (6 heads)": (3846, 7168),
          "KDA o_proj": (7168, 768), "shared gate|up": (768, 7168), "shared down": (7168, 384),
          "MLA q_a|kv_a": (2112, 7168), "lm_head slice": (10240, 7168)}
SMALL = {"a": (200, 96), "b": (96, 200)}


def vendor(x, w):
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return torch.nn.functional.linear(x, w).float()


def timed(fn, device) -> float:
    if device == "cpu":
        fn()
        return float("nan")
    import triton.testing as tt
    return tt.do_bench_cudagraph(fn, rep=100)


def copy_bw(device) -> float:
    if device == "cpu":
        return float("nan")
    import triton.testing as tt
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), rep=100)
    return 2 * a.numel() * 2 / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/dense")
    ap.add_argument("--rows", default="1,16,53,64", help="token rows M, comma separated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    ap.add_argument("--bw", type=float, default=None, help="copy bandwidth in B/s for the floor (default: measured)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = a.device
    bw = a.bw or copy_bw(dev)
    table = SKINNY_CONFIGS["cuda" if dev == "cuda" else "interpreter"]
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in (SMALL if a.small else SHAPES).items():
        w = (torch.randn(N, K, generator=g) * 0.02).bfloat16().to(dev)
        for M in (int(v) for v in a.rows.split(",")):
            x = torch.randn(M, K, generator=g).bfloat16().to(dev)
            ref = x.double() @ w.double().T
            scale = ref.abs().max().item()
            floor_ms = (N * K + M * K) * 2 / bw * 1e3
            row = {"shape": name, "N": N, "K": K, "M": M, "floor_ms": floor_ms}
            row["vendor_ms"] = timed(lambda: vendor(x, w), dev)
            row["vendor_err"] = (vendor(x, w).double() - ref).abs().max().item() / scale
            best = None
            for c in table:
                if M > c.get("max_rows", M):
                    continue
                tag = json.dumps({k: v for k, v in c.items() if k != "candidate"}, sort_keys=True)
                try:
                    y = skinny_gemm(x, w, config=c)
                    err = (y.double() - ref).abs().max().item() / scale
                    ms = timed(lambda c=c: skinny_gemm(x, w, config=c), dev)
                except Exception as e:  # out of shared memory on this GPU, a compile error: report, go on
                    row[f"error[{tag}]"] = f"{type(e).__name__}: {e}"[:200]
                    continue
                row[f"ms[{tag}]"] = ms
                row[f"err[{tag}]"] = err
                if best is None or ms < best[1]:
                    best = (tag, ms, err)
            if best:
                row["best"], row["best_ms"], row["best_err"] = best
                row["best_over_vendor"] = best[1] / row["vendor_ms"] if row["vendor_ms"] else None
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("shape", "M", "vendor_ms", "best_ms", "floor_ms") if k in row}),
                  flush=True)
    with open(os.path.join(a.out, "dense_bench.json"), "w") as f:
        json.dump({"bw_Bps": bw, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "rows": rows},
                  f, indent=1)
    lines = ["| shape | N x K | M | vendor ms | frac | skinny best ms | frac | best / vendor | err (vendor / best) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fr = lambda ms: f"{r['floor_ms'] / ms:.2f}" if ms and ms == ms else "—"  # noqa: E731
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['M']} | {r['vendor_ms']:.4f} | {fr(r['vendor_ms'])} | "
                     f"{r.get('best_ms', float('nan')):.4f} | {fr(r.get('best_ms'))} | "
                     f"{(r.get('best_over_vendor') or float('nan')):.3f} | {r['vendor_err']:.1e} / "
                     f"{r.get('best_err', float('nan')):.1e} |")
    with open(os.path.join(a.out, "dense_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
