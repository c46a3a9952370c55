"""Quick GPU accuracy check of chosen KDA prefill configs (no pytest, no warm-up of every config).

    python gpu-runs/kda_quick_check.py [--products fp16] [--kinds gate,intra,wu,state] [--lens 1000,1,70] [--all]

For each config of the named tables (default: the candidates of the gate, intra, w / u and state tables, each beside
its table's first entry; ``--all``: every entry), the prefill on a packed batch of 1000 + 1 + 70 tokens (``--lens``;
H 12, bf16, with an initial state) at ordinary decays and near decay 1: rel. RMS of o and the final state against the
fp32 oracle, and whether 5 repeats are bit-identical; then finiteness at B1 T8192 H96. One JSON line per (config,
decay); exit status 1 if any exceeds 1.5e-3, is not finite or differs between runs. For a short borrowed-GPU slot
where the full GPU test (tests/kernels/test_kda_gpu.py) does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--products", default="fp16")
    ap.add_argument("--kinds", default="gate,intra,wu,state")
    ap.add_argument("--lens", default="1000,1,70", help="the packed batch's sequence lengths (a longer first one "
                    "gives the state table's SEG entries several segments)")
    ap.add_argument("--candidates-only", action="store_true", default=True)
    ap.add_argument("--all", dest="candidates_only", action="store_false", help="every entry, not only candidates")
    args = ap.parse_args()
    from k3rocm.kernels import tune
    from k3rocm.kernels.kda import configs as KC
    from k3rocm.kernels.kda import prefill as P
    from k3rocm.model import kda as O
    D, H = 128, 12
    lens = [int(x) for x in args.lens.split(",")]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    first = {k: tune.configs(getattr(KC, k.upper()))[0] for k in ("gate", "intra", "wu", "state", "out")}
    if args.products == "split":  # the output in the state loop (FO, the table's first entry) does not run there
        first["state"] = next(c for c in tune.configs(KC.STATE) if not c.get("FO"))
    bad = 0
    for shift in (0.0, -12.0):
        g = torch.Generator(device="cuda").manual_seed(1234 + int(shift))
        r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        T = sum(lens)
        a = dict(q=r(1, T, H, D).bfloat16(), k=r(1, T, H, D).bfloat16(), v=r(1, T, H, D).bfloat16(),
                 decay_raw=(r(1, T, H * D) * 2).bfloat16(), beta_raw=r(1, T, H).bfloat16(),
                 A_log=r(128) * 0.5, dt_bias=r(H * D) * 0.5 + shift, initial_state=r(len(lens), H, D, D) * 0.1)
        want_o, want_s = O.kda_prefill(**a, cu_seqlens=cu)
        rr = lambda x, y: ((x.float() - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt()).item()  # noqa: E731
        for kind in args.kinds.split(","):
            for c in tune.configs(getattr(KC, kind.upper()), candidates=True):
                if args.candidates_only and not c.get("candidate") and c != first[kind]:
                    continue
                cfg = {**first, kind: c}
                o0, s0 = P.kda_prefill(**a, cu_seqlens=cu, config=cfg, products=args.products)
                same = all(torch.equal(o, o0) and torch.equal(s, s0) for o, s in
                           (P.kda_prefill(**a, cu_seqlens=cu, config=cfg, products=args.products) for _ in range(5)))
                e = (rr(o0, want_o), rr(s0, want_s))
                ok = max(e) <= 1.5e-3 and same and bool(torch.isfinite(o0).all())
                bad += not ok
                print(json.dumps(dict(kind=kind, cfg=c, shift=shift, rel_rms_o=e[0], rel_rms_state=e[1],
                                      identical_5=same, ok=ok)), flush=True)
    big = dict(q=torch.randn(1, 8192, 96, D, device="cuda").bfloat16(), k=torch.randn(1, 8192, 96, D, device="cuda").bfloat16(),
               v=torch.randn(1, 8192, 96, D, device="cuda").bfloat16(),
               decay_raw=(torch.randn(1, 8192, 96 * D, device="cuda") * 2).bfloat16(),
               beta_raw=torch.randn(1, 8192, 96, device="cuda").bfloat16(), A_log=torch.randn(128, device="cuda") * 0.5,
               dt_bias=torch.randn(96 * D, device="cuda") * 0.5)
    for kind in args.kinds.split(","):
        for c in tune.configs(getattr(KC, kind.upper()), candidates=True):
            if args.candidates_only and not c.get("candidate") and c != first[kind]:
                continue
            o, s = P.kda_prefill(**big, config={**first, kind: c}, products=args.products)
            torch.cuda.synchronize()
            fin = bool(torch.isfinite(o).all() and torch.isfinite(s).all())
            bad += not fin
            print(json.dumps(dict(kind=kind, cfg=c, row="B1 T8192 H96", finite=fin)), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
