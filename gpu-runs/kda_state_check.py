"""The KDA prefill's state pass per config and per way its 16-bit tiles reach the products, each in its own
process (an illegal address kills the CUDA context): rel. RMS of o / final state against the fp32 oracle.

    python gpu-runs/kda_state_check.py [--rows 1x1000x12,1x8192x96] [--out FILE]

Written for the sm_90 / triton 3.6 fault of 2026-12-06: fp16 tiles (products="fp16") and split-stored bf16 planes
(products=dict(pre=...)) loaded and multiplied in the same step of the state loop gave wrong states or illegal
addresses, while the prefetching (PF = 1) configs were right. RB (prefill._reg): 0 the tile as loaded, 1 through a
select on its row mask, 2 times a runtime 1.0.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from bench_kda import prefill_inputs
from k3rocm.kernels.kda import prefill as P
from k3rocm.model import kda as O
B, T, H = (int(x) for x in sys.argv[2].split("x"))
form, cfg = json.loads(sys.argv[3]), json.loads(sys.argv[4])
prod = {"fp16": "fp16", "pre": dict(pre=("kg", "w")), "pre3": dict(pre=("kg", "qg", "w")), "split": "split"}[form]
a = prefill_inputs(B, T, H, seed=3, dt_shift=-12.0)
a["initial_state"] = torch.randn(B, H, 128, 128, device="cuda") * 0.1
from k3rocm.kernels import tune
from k3rocm.kernels.kda import configs as KC
first = {k: tune.configs(getattr(KC, k.upper()))[0] for k in ("intra", "wu", "out")}  # no tuning: one compile each
o, s = P.kda_prefill(**a, products=prod, config=dict(first, state=cfg))
torch.cuda.synchronize()
res = dict(finite=bool(torch.isfinite(o).all() and torch.isfinite(s).all()))
if T <= 4096:
    wo, ws = O.kda_prefill(**a)
    rr = lambda x, y: ((x.float() - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt()).item()
    res.update(rel_rms_o=rr(o, wo), rel_rms_state=rr(s, ws))
print("RESULT " + json.dumps(res))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1x1000x12,1x8192x96")
    ap.add_argument("--forms", default="fp16,pre3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cfgs", default="0,1,2,3,4", help="indices into the config list")
    ap.add_argument("--rbs", default="0,1,2")
    args = ap.parse_args()
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    cfgs = [dict(BV=32, PF=0, num_warps=4, num_stages=1), dict(BV=32, PF=1, num_warps=4, num_stages=1),
            dict(BV=32, PF=0, num_warps=4, num_stages=2), dict(BV=32, PF=0, FO=1, num_warps=4, num_stages=1),
            dict(BV=16, PF=0, FO=1, num_warps=4, num_stages=2)]
    cfgs = [cfgs[int(i)] for i in args.cfgs.split(",")]
    lines = []
    for row in args.rows.split(","):
        for form in args.forms.split(","):
            for c in cfgs:
                for rb in (int(x) for x in args.rbs.split(",")):
                    cfg = dict(c, RB=rb)
                    try:
                        p = subprocess.run([sys.executable, "-c", CHILD, here, row, json.dumps(form), json.dumps(cfg)],
                                           capture_output=True, text=True, timeout=120)
                        res = next((json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")),
                                   dict(error=(p.stderr.strip().splitlines() or ["?"])[-1][:200]))
                    except subprocess.TimeoutExpired:
                        res = dict(error="timeout")
                    rec = dict(row=row, form=form, cfg=cfg, **res)
                    print(json.dumps(rec), flush=True)
                    lines.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in lines) + "\n")


if __name__ == "__main__":
    main()
