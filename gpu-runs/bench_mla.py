"""Benchmarks of the MLA and AttnRes kernels on one GPU, each against its floor (and SDPA for prefill).

Floors (HARDWARE.md "Measuring"): bytes / copy bandwidth and FLOPs / bf16 matmul rate, defaults the H200
figures measured on the device machine (4.2 TB/s, 682 TFLOP/s); override with --bw / --tflops.

* MLA prefill B1 T{8192, 32768} H12 and T8192 H96, causal, bf16: ours vs ``torch.nn.functional.
  scaled_dot_product_attention`` on the same problem (k = [k_nope, k_rope] per head, v padded to 192).
  FLOPs counted: 2 * H * (T^2/2) * (192 + 128).
* MLA decode, bf16 cache, batch {64, 256} x context {8k, 32k} x H {12, 96}, one query token: the whole op
  (q absorption, split kernel, merge + W_vc + gate). Floor: max(cache bytes N*L*576*2 / bandwidth,
  FLOPs N*L*H*2*(576+512) / bf16 rate); at H 96 the FLOPs dominate.
* AttnRes: 8 bank rows + prefix (the worst case), D 7168, T 8192 and decode batch 256, write-layer
  variant too. Floor: sources read once + h (fp32) + h_normed written (+ the appended row).

Usage: python gpu-runs/bench_mla.py [--json out.json] [--quick]
Timing: triton.testing.do_bench median after warm-up, fresh random data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import triton


def _t(fn, rep=100):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_prefill(args, rows):
    import torch.nn.functional as F

    from k3rocm.kernels.mla.prefill import mla_prefill
    Dn, Dr, Dv = 128, 64, 128
    for T, H, sdpa_ref in ((8192, 12, 0.52), (32768, 12, 7.50), (8192, 96, 3.82)):
        g = torch.Generator(device="cuda").manual_seed(T + H)
        bf = torch.bfloat16
        q = torch.randn(T, H, Dn + Dr, device="cuda", generator=g, dtype=bf)
        kn = torch.randn(T, H, Dn, device="cuda", generator=g, dtype=bf)
        kr = torch.randn(T, Dr, device="cuda", generator=g, dtype=bf)
        v = torch.randn(T, H, Dv, device="cuda", generator=g, dtype=bf)
        gate = torch.randn(T, H * Dv, device="cuda", generator=g, dtype=bf)
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        scale = (Dn + Dr) ** -0.5
        out = torch.empty(T, H, Dv, device="cuda", dtype=bf)
        ms = _t(lambda: mla_prefill(q, kn, kr, v, cu, cu, scale, out=out, max_seqlen_q=T))
        ms_g = _t(lambda: mla_prefill(q, kn, kr, v, cu, cu, scale, gate=gate, out=out, max_seqlen_q=T))
        qs = q.permute(1, 0, 2)[None]
        ks = torch.cat([kn, kr[:, None, :].expand(T, H, Dr)], -1).permute(1, 0, 2)[None].contiguous()
        vs = F.pad(v, (0, Dn + Dr - Dv)).permute(1, 0, 2)[None].contiguous()
        qs = qs.contiguous()
        ms_sdpa = _t(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
        o_ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0, :, :, :Dv].permute(1, 0, 2)
        o = mla_prefill(q, kn, kr, v, cu, cu, scale)
        err = ((o.float() - o_ref.float()).pow(2).mean().sqrt() / o_ref.float().pow(2).mean().sqrt()).item()
        flops = 2 * H * (T * T / 2) * (Dn + Dr + Dv)
        floor = flops / (args.tflops * 1e12) * 1e3
        rows.append(dict(bench="mla_prefill", case=f"B1 T{T} H{H}", ms=ms, ms_gate=ms_g, sdpa_ms=ms_sdpa,
                         sdpa_issue_ms=sdpa_ref, ratio_vs_sdpa=ms / ms_sdpa, floor_ms=floor, frac_floor=floor / ms,
                         tflops=flops / ms / 1e9, rel_err_vs_sdpa=err))
        print(json.dumps(rows[-1]), flush=True)
        del q, kn, kr, v, gate, qs, ks, vs, out


def bench_decode(args, rows):
    from k3rocm.kernels.mla.decode import mla_decode
    Dn, Dr, Dv, R, page = 128, 64, 128, 512, 64
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    Lmax, Nmax = 32768, 256
    nb = Lmax // page
    cache = torch.empty(Nmax * nb, page, R + Dr, device="cuda", dtype=bf)
    cache.normal_(generator=g)
    bt_all = torch.randperm(Nmax * nb, device="cuda", generator=g).to(torch.int32).view(Nmax, nb)
    for H in (12, 96):
        W = torch.randn(H * (Dn + Dv), R, device="cuda", generator=g) * R ** -0.5
        w_kc = W.view(H, Dn + Dv, R)[:, :Dn].contiguous().to(bf)
        w_vc = W.view(H, Dn + Dv, R)[:, Dn:].transpose(1, 2).contiguous().to(bf)
        for N in (64, 256):
            for L in (8192, 32768):
                bt = bt_all[:N, : L // page].contiguous()
                cl = torch.full((N,), L, dtype=torch.int32, device="cuda")
                qn = torch.randn(N, 1, H, Dn, device="cuda", generator=g, dtype=bf)
                qr = torch.randn(N, 1, H, Dr, device="cuda", generator=g, dtype=bf)
                gate = torch.randn(N, 1, H * Dv, device="cuda", generator=g, dtype=bf)
                out = torch.empty(N, 1, H, Dv, device="cuda", dtype=bf)
                fn = lambda: mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, 0.0722, gate=gate, out=out,
                                        max_context_len=L, total_context_tokens=N * L)
                ms = _t(fn, rep=50)
                byts = N * L * (R + Dr) * 2
                flops = N * L * H * 2 * ((R + Dr) + R)  # scores over 576 + values over 512, per head
                floor = max(byts / (args.bw * 1e12), flops / (args.tflops * 1e12)) * 1e3
                rows.append(dict(bench="mla_decode", case=f"N{N} L{L} H{H} bf16", ms=ms, floor_ms=floor,
                                 frac_floor=floor / ms, gbps=byts / ms / 1e6, tflops=flops / ms / 1e9,
                                 bytes_floor_ms=byts / (args.bw * 1e12) * 1e3))
                print(json.dumps(rows[-1]), flush=True)
    del cache


def bench_attnres(args, rows):
    from k3rocm.kernels.attnres.attnres import attn_res_norm
    D = 7168
    g = torch.Generator(device="cuda").manual_seed(2)
    for T in (8192, 256):
        for dt in (torch.float32, torch.bfloat16):
            eb = torch.tensor([], dtype=dt).element_size()
            bank = torch.randn(9, T, D, device="cuda", generator=g).to(dt)
            pre = torch.randn(T, D, device="cuda", generator=g).to(dt)
            w = torch.randn(D, device="cuda", generator=g) * D ** -0.5 * 4
            nw = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
            for rows_, append in ((8, False), (7, True)):
                fn = lambda: attn_res_norm(bank, rows_, pre, w, nw, 1e-5, append=append, out_dtype=torch.bfloat16)
                ms = _t(fn)
                byts = (rows_ + 1) * T * D * eb + T * D * 4 + T * D * 2 + (T * D * eb if append else 0)
                floor = byts / (args.bw * 1e12) * 1e3
                rows.append(dict(bench="attn_res", case=f"T{T} sources{rows_ + 1} {str(dt)[6:]}"
                                 f"{' +append' if append else ''}", ms=ms, floor_ms=floor, frac_floor=floor / ms,
                                 gbps=byts / ms / 1e6))
                print(json.dumps(rows[-1]), flush=True)
            del bank, pre


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--bw", type=float, default=4.2, help="copy bandwidth TB/s (floor)")
    ap.add_argument("--tflops", type=float, default=682.0, help="bf16 matmul TFLOP/s (floor)")
    ap.add_argument("--only", default="prefill,decode,attnres")
    args = ap.parse_args()
    rows: list = []
    t0 = time.time()
    info = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__)
    print(json.dumps(info), flush=True)
    for part in args.only.split(","):
        try:
            {"prefill": bench_prefill, "decode": bench_decode, "attnres": bench_attnres}[part](args, rows)
        except Exception as e:  # keep the other parts' figures
            print(f"{part} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            rows.append(dict(bench=part, error=f"{type(e).__name__}: {e}"))
        torch.cuda.empty_cache()
    from k3rocm.kernels import tune as _tune
    info["tuned"] = {f"{k[0]}{k[1]}": v for k, v in _tune._CACHE.items()}
    info["seconds"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
    print("| bench | case | ms | floor ms | fraction of floor | notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['bench']} | error | | | | {r['error']} |")
            continue
        note = ""
        if r["bench"] == "mla_prefill":
            note = (f"SDPA {r['sdpa_ms']:.3f} ms, ours/SDPA {r['ratio_vs_sdpa']:.2f}; with gate {r['ms_gate']:.3f} ms; "
                    f"{r['tflops']:.0f} TFLOP/s")
        elif r["bench"] == "mla_decode":
            note = f"{r['gbps']:.0f} GB/s, {r['tflops']:.0f} TFLOP/s; bytes-only floor {r['bytes_floor_ms']:.4f} ms"
        else:
            note = f"{r['gbps']:.0f} GB/s"
        print(f"| {r['bench']} | {r['case']} | {r['ms']:.4f} | {r['floor_ms']:.4f} | {r['frac_floor']:.2f} | {note} |")


if __name__ == "__main__":
    main()
