"""How evenly the engine's router spreads tokens over the experts, per MoE layer and step kind.

The step roofline (:class:`k3rocm.runtime.sizing.StepRoofline`) charges a MoE layer the expected number of
distinct experts under **uniform** routing, ``E (1 - (1 - k/E)^T)`` for ``T`` tokens (:func:`experts_touched`),
and one rank of EP the ``1/ep`` share of them. The engine's ``--synthetic`` weights route with random gates,
which need not be uniform: tokens whose hidden states share a common direction share their top-k picks. This
script runs the engine eagerly (the prefill, then ``--steps`` decode steps of ``--batch`` rows), records every
``moe_router`` call's picks, and prints per layer and step kind:

* ``distinct``: experts picked at least once, against the uniform expectation;
* ``local``: (token, expert) pairs falling on the rank's expert slice (``--ep`` ranks, rank ``--rank``) and the
  distinct experts among them, against the uniform expectations ``T k / ep`` and ``experts_touched / ep``;
* ``max/mean``: the most-picked expert's count over the mean count of the picked ones;
* ``cos``: the mean pairwise cosine of the router's input rows (0 for independent directions); ``|x|`` their
  mean norm, ``max|z|`` the largest |logit|, ``sat`` the share of rows whose k-th score is 1.0 in fp32 (from a
  logit of ~17: a tie the router breaks by the lowest expert id).

Usage::

    python gpu-runs/route_skew.py --synthetic --preset k3-prefix-4 --profile mi355x-8 --tp 16 --ep 16 \\
        --batch 64 --prompt-len 32 --steps 2              # CPU: ~1 min per layer of the prefill
    python gpu-runs/route_skew.py --device cuda --kernels triton --synthetic --preset k3-prefix-48 \\
        --profile h200-8 --tp 16 --ep 16 --batch 64 --prompt-len 256 --steps 4 --json out/skew.json

The engine is the one of ``count_ops.py`` (same arguments); random weights mean nothing, so this measures the
synthetic bench's routing, not K3's (whose bias term is trained to balance the load).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import count_ops  # noqa: E402
from k3rocm.runtime.sizing import experts_touched  # noqa: E402


def record(args) -> dict:
    """Run the engine with the router wrapped; returns ``{"calls": [[step, layer, kind, ids]], ...}``."""
    torch.manual_seed(0)
    cfg, eng = count_ops.build_engine(args)
    where = {"layer": None, "step": 0, "kind": "?"}
    calls: list = []
    dec = eng.dec
    orig_mlp = dec.mlp

    def mlp(i, *a, **k):
        where["layer"] = i
        try:
            return orig_mlp(i, *a, **k)
        finally:
            where["layer"] = None
    dec.mlp = mlp
    fn = eng.ops["moe_router"]

    def router(x, *a, **k):
        out = fn(x, *a, **k)
        ids = out[0]
        xf = x.float()
        xn = xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        n = xn.shape[0]
        cos = float(((xn.sum(0).square().sum() - n) / max(n * (n - 1), 1)).item()) if n > 1 else 0.0
        # saturation: sigmoid(logit) rounds to 1.0 in fp32 from logit ~17, and ties go to the lowest expert id
        logits = xf @ a[0].float().t()
        s = torch.sigmoid(logits)
        kth = torch.topk(s, ids.shape[1], dim=-1).values[:, -1]
        sat = float((kth >= 1.0).float().mean())
        calls.append([where["step"], where["layer"], where["kind"], ids.detach().to("cpu", torch.int64), cos,
                      float(logits.abs().max()), float(xf.norm(dim=-1).mean()), sat])
        return out
    eng.ops["moe_router"] = functools.wraps(fn)(router)
    g = torch.Generator().manual_seed(1)
    for _ in range(args.batch):
        eng.add_request(torch.randint(3, cfg.vocab_size - 1, (args.prompt_len,), generator=g).tolist(),
                        args.steps + 2, ignore_eos=True)
    decode_steps = 0
    while eng.has_unfinished() and decode_steps < args.steps:
        where["kind"] = "decode" if count_ops._all_decode(eng) else "prefill"
        eng.step()
        decode_steps += where["kind"] == "decode"
        where["step"] += 1
    return {"calls": calls, "ep": args.ep or 1, "rank": args.rank, "top_k": cfg.num_experts_per_token,
            "experts": cfg.num_experts}


def summarise(res: dict) -> list[dict]:
    """One row per router call: tokens, distinct / expected, local pairs and experts / expected, max/mean, cos."""
    E, k, ep, r = res["experts"], res["top_k"], res["ep"], res["rank"]
    per = E // ep
    lo, hi = r * per, (r + 1) * per
    rows = []
    for step, layer, kind, ids, cos, lmax, xnorm, sat in res["calls"]:
        T = ids.shape[0]
        cnt = torch.bincount(ids.reshape(-1), minlength=E)
        picked = cnt[cnt > 0]
        loc = cnt[lo:hi]
        exp_d = experts_touched(E, k, T)
        rows.append({"step": step, "layer": layer, "kind": kind, "tokens": T,
                     "distinct": int(picked.numel()), "distinct_uniform": round(exp_d, 1),
                     "local_pairs": int(loc.sum()), "local_pairs_uniform": T * k / ep,
                     "local_distinct": int((loc > 0).sum()), "local_distinct_uniform": round(exp_d / ep, 2),
                     "max_over_mean": round(float(picked.max()) / float(picked.float().mean()), 2),
                     "cos": round(cos, 4), "max_abs_logit": round(lmax, 2), "x_norm": round(xnorm, 2),
                     "saturated_rows": round(sat, 4)})
    return rows


def table(rows: list[dict]) -> str:
    out = [f"{'step':>4} {'kind':7} {'layer':>5} {'T':>5} {'distinct':>14} {'local pairs':>14} "
           f"{'local experts':>14} {'max/mean':>8} {'cos':>7} {'|x|':>8} {'max|z|':>8} {'sat':>6}"]
    for x in rows:
        out.append(f"{x['step']:4d} {x['kind']:7} {x['layer']!s:>5} {x['tokens']:5d} "
                   f"{x['distinct']:6d} / {x['distinct_uniform']:6.1f} {x['local_pairs']:6d} / "
                   f"{x['local_pairs_uniform']:6.1f} {x['local_distinct']:6d} / {x['local_distinct_uniform']:6.2f} "
                   f"{x['max_over_mean']:8.2f} {x['cos']:7.4f} {x['x_norm']:8.2f} {x['max_abs_logit']:8.2f} "
                   f"{x['saturated_rows']:6.3f}")
    for kind in ("prefill", "decode"):
        sel = [x for x in rows if x["kind"] == kind]
        if sel:
            d = sum(x["distinct"] for x in sel) / sum(x["distinct_uniform"] for x in sel)
            lp = sum(x["local_pairs"] for x in sel) / sum(x["local_pairs_uniform"] for x in sel)
            ld = sum(x["local_distinct"] for x in sel) / sum(x["local_distinct_uniform"] for x in sel)
            out.append(f"{kind}: {len(sel)} router calls; distinct experts {d:.3f} x uniform, local pairs "
                       f"{lp:.3f} x, local experts {ld:.3f} x, mean cos {sum(x['cos'] for x in sel) / len(sel):.4f}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
    ap.add_argument("--matmul-dtype", default="bf16", choices=("bf16", "f16", "none"))
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--ep", type=int, default=None)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2, help="decode steps recorded after the prefill")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = record(args)
    rows = summarise(res)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
