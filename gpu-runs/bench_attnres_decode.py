"""Block AttnRes at decode sizes, every shipped config, as the engine calls it inside its step graphs.

The decoder's call: bf16 bank (K3: 8 rows at most), fp32 prefix plus the pending sublayer output (``addend`` /
``prefix_out``), ``store_h=False``, bf16 ``h_normed``; D 7168. Each config is timed as ``bench_mla._t_graph``
replays it (20 calls in one CUDA graph, ms per call) at 1 / 16 / 53 / 64 / 256 tokens and 3 / 6 / 8 bank rows,
with its largest relative difference from the first config's ``h_normed``. Floor: the bytes at 4.2 TB/s
(H200 copy bandwidth; on another card read the ratios, not the fractions).

Usage: ``python gpu-runs/bench_attnres_decode.py [--tokens 1 16 53 64 256] [--rows 3 6 8] > out.jsonl``
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_mla import _rel, _t_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 53, 64, 256])
    ap.add_argument("--rows", type=int, nargs="+", default=[3, 6, 8])
    a = ap.parse_args()
    from k3rocm.kernels.attnres import attnres as AR
    cfgs = AR.ATTNRES_CONFIGS["hip" if torch.version.hip else "cuda"]
    D = 7168
    g = torch.Generator(device="cuda").manual_seed(5)
    for T in a.tokens:
        for rows in a.rows:
            bank = torch.randn(8, T, D, device="cuda", generator=g).bfloat16()
            pre = torch.randn(T, D, device="cuda", generator=g)
            add = torch.randn(T, D, device="cuda", generator=g)
            w = torch.randn(D, device="cuda", generator=g) * D ** -0.5 * 4
            nw = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
            pout = torch.empty_like(pre)
            byts = rows * T * D * 2 + 3 * T * D * 4 + T * D * 2  # bank rows, prefix + addend + prefix_out, h_normed
            floor = byts / 4.2e12 * 1e3
            ref = None
            for cfg in cfgs:
                hn = torch.empty(T, D, device="cuda", dtype=torch.bfloat16)
                f = lambda cfg=cfg, hn=hn: AR.attn_res_norm(bank, rows, pre, w, nw, 1e-5, config=cfg, out=(None, hn),  # noqa
                                                            store_h=False, addend=add, prefix_out=pout)
                try:
                    f()
                    rel = 0.0 if ref is None else _rel(hn, ref)
                    ref = hn.clone() if ref is None else ref
                    ms = _t_graph(f)
                    print(json.dumps(dict(T=T, rows=rows, cfg=cfg, us=ms * 1e3, frac=floor / ms, rel_vs_first=rel)),
                          flush=True)
                except Exception as e:  # noqa: BLE001 - a failing config is a result
                    print(json.dumps(dict(T=T, rows=rows, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")),
                          flush=True)


if __name__ == "__main__":
    main()
