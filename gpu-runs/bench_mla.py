"""Benchmarks of the MLA and AttnRes kernels on one GPU, each against its floor (and SDPA for prefill).

Floors (HARDWARE.md "Measuring"): bytes / copy bandwidth and FLOPs / bf16 matmul rate, defaults the H200
figures measured on the device machine (4.2 TB/s, 682 TFLOP/s); override with --bw / --tflops.

* MLA prefill B1 T{8192, 32768} H12 and T8192 H96, causal, bf16: ours vs ``torch.nn.functional.
  scaled_dot_product_attention`` on the same problem (k = [k_nope, k_rope] per head, v padded to 192).
  FLOPs counted: 2 * H * (T^2/2) * (192 + 128).
* MLA decode, bf16 cache, batch {64, 256} x context {8k, 32k} x H {12, 96}, one query token: the whole op
  (q absorption, split kernel, merge + W_vc + gate). Floor: max(cache bytes N*L*576*2 / bandwidth,
  FLOPs N*L*H*2*(576+512) / bf16 rate); at H 96 the FLOPs dominate.
* AttnRes: 8 bank rows + prefix (the worst case), D 7168, T 8192 and T 256 (a decode batch), write-layer
  variant too. Floor: sources read once + h (fp32) + h_normed written (+ the appended row). Timed eagerly
  (each call pays the host launch, which dominates at T 256) and replayed from a CUDA graph of 20 calls (how
  the decode engine runs it; the T 256 goal is read from the graph column).
  Side by side, where installed: the ``flash-attn-res`` package's Triton forward kernels (phase 1: the bank
  rows against the block's pseudo-queries, phase 2: the online-softmax merge of the intra-block prefix).
  Same scores and mix as K3's Block AttnRes; they differ in that phase 1 keeps its per-query partial in bf16,
  neither phase applies the following RMSNorm or appends the bank row, and phase 1 is meant to be batched
  over all pseudo-queries of a block (so it is shown once per query and amortised over a 12-layer block's 24
  queries), and its kernel needs a power-of-two hidden size (7168 rows say so; D 8192 rows compare both).
* MLA at head dims that are not powers of two (96/32/96, rank 384): prefill and decode run (correctness).

Usage: ``python gpu-runs/bench_mla.py --out DIR`` (writes ``mla_bench.json`` and ``mla_bench.md``; one
Markdown table per goal) or ``--json PATH`` (the .md next to it); ``--only decode,prefill,attnres,odd``
picks parts, and ``part:TEXT`` only that part's cases whose name contains TEXT (``--only decode:H96,attnres:T256``,
``--only prefill:T8192``); ``--no-peers`` skips the flash-attn-res columns.
Timing: triton.testing.do_bench median after warm-up, fresh random data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton


def _t(fn, rep=100):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _want(args, part, case):
    """Whether ``--only`` asks for this case of ``part`` (``part`` alone: every case; ``part:TEXT``: names with TEXT)."""
    subs = args.filters.get(part)
    return subs is not None and (not subs or any(x in case for x in subs))


def _t_graph(fn, calls=20, rep=100):
    """ms per call of ``fn`` replayed from one CUDA graph of ``calls`` back-to-back calls (as the decode engine
    runs a step: no host launch cost between kernels)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median") / calls


def bench_prefill(args, rows):
    import torch.nn.functional as F

    from k3rocm.kernels.mla.prefill import mla_prefill
    Dn, Dr, Dv = 128, 64, 128
    for T, H, sdpa_ref in ((8192, 12, 0.52), (32768, 12, 7.50), (8192, 96, 3.82)):
        if not _want(args, "prefill", f"B1 T{T} H{H}"):
            continue
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
                if not _want(args, "decode", f"N{N} L{L} H{H} bf16"):
                    continue
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


def _peer_attnres():
    """The flash-attn-res forward ops, or None when the package is not installed."""
    try:
        from flash_attn_res import phase_1_batched_attention_triton_op, phase_2_online_softmax_merge_triton_op
    except ImportError:
        return None
    return phase_1_batched_attention_triton_op, phase_2_online_softmax_merge_triton_op


def _peer_row(peer, bank, rows_, pre, w, queries=24):
    """ms of the peer for one aggregation (phase 1 with one query + phase 2) and amortised over ``queries``."""
    p1, p2 = peer
    D = pre.shape[-1]
    src = bank[:rows_].to(torch.bfloat16).unsqueeze(1).contiguous()  # [S, B=1, T, D]
    pre_b = pre.to(torch.bfloat16)[None].contiguous()
    q1 = w.float()[None].contiguous()
    qn = w.float()[None].expand(queries, D).contiguous()
    out = {}
    try:
        o1, l1 = p1(src, q1, 1e-5)
        ms1 = _t(lambda: p1(src, q1, 1e-5))
        ms2 = _t(lambda: p2(pre_b, q1[0], o1[0], l1[0], 1e-5))
        msn = _t(lambda: p1(src, qn, 1e-5))
        out.update(peer_ms=ms1 + ms2, peer_amortised_ms=msn / queries + ms2)
    except Exception as e:  # noqa: BLE001 -- report the peer's failure in the table, keep ours
        out["peer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def bench_attnres(args, rows):
    from k3rocm.kernels.attnres.attnres import attn_res_norm
    peer = None if args.no_peers else _peer_attnres()
    g = torch.Generator(device="cuda").manual_seed(2)
    cases = [(7168, 8192), (7168, 256)] + ([(8192, 8192), (8192, 256)] if peer else [])
    for D, T in cases:
        for dt in (torch.float32, torch.bfloat16):
            eb = torch.tensor([], dtype=dt).element_size()
            bank = torch.randn(9, T, D, device="cuda", generator=g).to(dt)
            pre = torch.randn(T, D, device="cuda", generator=g).to(dt)
            w = torch.randn(D, device="cuda", generator=g) * D ** -0.5 * 4
            nw = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
            for rows_, append in ((8, False), (7, True)):
                if D != 7168 and (append or dt != torch.bfloat16):
                    continue  # the D 8192 rows are only there to meet the peer
                if not _want(args, "attnres", f"D{D} T{T} sources{rows_ + 1} {str(dt)[6:]}{' +append' if append else ''}"):
                    continue
                # tuned on the non-appending call (an appending one is never timed by the tuner)
                attn_res_norm(bank, rows_, pre, w, nw, 1e-5, out_dtype=torch.bfloat16)
                fn = lambda: attn_res_norm(bank, rows_, pre, w, nw, 1e-5, append=append, out_dtype=torch.bfloat16)
                ms = _t(fn)
                ms_graph = _t_graph(fn)
                byts = (rows_ + 1) * T * D * eb + T * D * 4 + T * D * 2 + (T * D * eb if append else 0)
                floor = byts / (args.bw * 1e12) * 1e3
                r = dict(bench="attn_res", case=f"D{D} T{T} sources{rows_ + 1} {str(dt)[6:]}"
                         f"{' +append' if append else ''}", ms=ms, floor_ms=floor, frac_floor=floor / ms,
                         gbps=byts / ms / 1e6, graph_ms=ms_graph, frac_floor_graph=floor / ms_graph)
                if not append and dt == torch.bfloat16:
                    r.update(_peer_row(peer, bank, rows_, pre, w) if peer else dict(peer_error="not installed"))
                rows.append(r)
                print(json.dumps(rows[-1]), flush=True)
                # the engine's call (model/layer.py _normed): h not stored, so its floor has no h bytes
                attn_res_norm(bank, rows_, pre, w, nw, 1e-5, out_dtype=torch.bfloat16, store_h=False)  # tuned apart
                fn = lambda: attn_res_norm(bank, rows_, pre, w, nw, 1e-5, append=append, out_dtype=torch.bfloat16,
                                           store_h=False)
                ms = _t(fn)
                ms_graph = _t_graph(fn)
                byts -= T * D * 4
                floor = byts / (args.bw * 1e12) * 1e3
                rows.append(dict(bench="attn_res", case=r["case"] + " engine (no h)", ms=ms, floor_ms=floor,
                                 frac_floor=floor / ms, gbps=byts / ms / 1e6, graph_ms=ms_graph,
                                 frac_floor_graph=floor / ms_graph))
                print(json.dumps(rows[-1]), flush=True)
            del bank, pre


def bench_odd(args, rows):
    """Head dims / rank that are not powers of two (padded + masked in the kernels): error vs the oracle."""
    from k3rocm.kernels.mla.decode import mla_cache_write, mla_decode
    from k3rocm.kernels.mla.prefill import mla_prefill
    from k3rocm.model import mla as M
    Dn, Dr, Dv, R, H, page, T = 96, 32, 96, 384, 12, 64, 1024
    g = torch.Generator(device="cuda").manual_seed(3)
    bf = torch.bfloat16
    q = torch.randn(T, H, Dn + Dr, device="cuda", generator=g)
    kn, kr = torch.randn(T, H, Dn, device="cuda", generator=g), torch.randn(T, Dr, device="cuda", generator=g)
    v = torch.randn(T, H, Dv, device="cuda", generator=g)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    sc = (Dn + Dr) ** -0.5
    ref = M.mla_prefill(q, kn, kr, v, cu, cu, sc)
    pargs = (q.to(bf), kn.to(bf), kr.to(bf), v.to(bf), cu, cu, sc)
    o = mla_prefill(*pargs)
    ms = _t(lambda: mla_prefill(*pargs, max_seqlen_q=T), rep=20)
    rows.append(dict(bench="odd_dims", case=f"prefill T{T} H{H} d{Dn}/{Dr}/{Dv}", ms=ms, rel_err=_rel(o, ref)))
    print(json.dumps(rows[-1]), flush=True)
    N, L = 8, 4096
    nb = N * L // page
    cache = torch.zeros(nb, page, R + Dr, device="cuda", dtype=bf)
    bt = torch.randperm(nb, device="cuda", generator=g).to(torch.int32).view(N, L // page)
    slots = (bt.long()[:, :, None] * page + torch.arange(page, device="cuda")).view(-1)
    mla_cache_write(cache, slots, torch.randn(N * L, R, device="cuda", generator=g).to(bf),
                    torch.randn(N * L, Dr, device="cuda", generator=g).to(bf))
    W = torch.randn(H * (Dn + Dv), R, device="cuda", generator=g) * R ** -0.5
    w_kc, w_vc = M.split_kv_b(W, H, Dn, Dv)
    qn, qr = torch.randn(N, 1, H, Dn, device="cuda", generator=g), torch.randn(N, 1, H, Dr, device="cuda", generator=g)
    cl = torch.full((N,), L, dtype=torch.int32, device="cuda")
    ref = M.mla_decode(qn, qr, cache.float(), bt, cl, w_kc, w_vc, sc)
    args_ = (qn.to(bf), qr.to(bf), cache, bt, cl, w_kc.to(bf), w_vc.to(bf), sc)
    o = mla_decode(*args_)
    ms = _t(lambda: mla_decode(*args_, max_context_len=L, total_context_tokens=N * L), rep=20)
    rows.append(dict(bench="odd_dims", case=f"decode N{N} L{L} H{H} rank{R} rope{Dr}", ms=ms, rel_err=_rel(o, ref)))
    print(json.dumps(rows[-1]), flush=True)


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def _tables(rows) -> list[str]:
    """One Markdown table per goal."""
    out = []
    by = {}
    for r in rows:
        by.setdefault(r["bench"], []).append(r)
    for part, err in ((b, r) for b, rs in by.items() for r in rs if "error" in r):
        out += [f"**{part} failed:** {err['error']}", ""]
    if by.get("mla_decode"):
        out += ["MLA decode (goal: >= 0.8 of floor at H12, >= 0.6 at H96)", "",
                "| case | ms | floor ms | frac of floor | GB/s | TFLOP/s | bytes-only floor ms |", "|---|---|---|---|---|---|---|"]
        out += [f"| {r['case']} | {r['ms']:.4f} | {r['floor_ms']:.4f} | {r['frac_floor']:.2f} | {r['gbps']:.0f} | "
                f"{r['tflops']:.0f} | {r['bytes_floor_ms']:.4f} |" for r in by["mla_decode"] if "error" not in r]
        out.append("")
    if by.get("mla_prefill"):
        out += ["MLA prefill (goal: ours/SDPA <= 1.0)", "",
                "| case | ours ms | with gate ms | SDPA ms | ours/SDPA | TFLOP/s | frac of floor | rel err vs SDPA |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['case']} | {r['ms']:.3f} | {r['ms_gate']:.3f} | {r['sdpa_ms']:.3f} | {r['ratio_vs_sdpa']:.2f} | "
                f"{r['tflops']:.0f} | {r['frac_floor']:.2f} | {r['rel_err_vs_sdpa']:.1e} |"
                for r in by["mla_prefill"] if "error" not in r]
        out.append("")
    if by.get("attn_res"):
        out += ["Block AttnRes (goal: >= 0.8 of floor at T8192, >= 0.5 at T256; peer: flash-attn-res forward, "
                "no fused norm/append, bf16 phase-1 partial)", "",
                "| case | ms | floor ms | frac of floor | GB/s | graph ms | frac of floor (graph) | "
                "flash-attn-res ms (1 query) | amortised over 24 queries |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in by["attn_res"]:
            if "error" in r:
                continue
            peer = (f"{r['peer_ms']:.4f} | {r['peer_amortised_ms']:.4f}" if "peer_ms" in r
                    else f"{r.get('peer_error', '-')} | -")
            out.append(f"| {r['case']} | {r['ms']:.4f} | {r['floor_ms']:.4f} | {r['frac_floor']:.2f} | {r['gbps']:.0f} | "
                       f"{r['graph_ms']:.4f} | {r['frac_floor_graph']:.2f} | {peer} |")
        out.append("")
    if by.get("odd_dims"):
        out += ["Head dims / rank that are not powers of two (goal: runs, matches the oracle)", "",
                "| case | ms | rel err vs fp32 oracle |", "|---|---|---|"]
        out += [f"| {r['case']} | {r['ms']:.4f} | {r['rel_err']:.1e} |" for r in by["odd_dims"] if "error" not in r]
        out.append("")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-runs/results", help="folder for mla_bench.json and mla_bench.md")
    ap.add_argument("--json", default=None, help="JSON path instead (the .md goes next to it)")
    ap.add_argument("--bw", type=float, default=4.2, help="copy bandwidth TB/s (floor)")
    ap.add_argument("--tflops", type=float, default=682.0, help="bf16 matmul TFLOP/s (floor)")
    ap.add_argument("--only", default="decode,prefill,attnres,odd",
                    help="parts to run, each optionally part:TEXT (only cases whose name contains TEXT)")
    ap.add_argument("--no-peers", action="store_true", help="skip the flash-attn-res columns")
    args = ap.parse_args()
    json_path = args.json or os.path.join(args.out, "mla_bench.json")
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    rows: list = []
    t0 = time.time()
    info = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(info), flush=True)
    parts = {"prefill": bench_prefill, "decode": bench_decode, "attnres": bench_attnres, "odd": bench_odd}
    args.filters = {}
    for item in args.only.split(","):
        part, _, sub = item.partition(":")
        if part not in parts:
            ap.error(f"--only: unknown part {part!r}; parts: {', '.join(parts)}")
        args.filters.setdefault(part, [])
        if sub:
            args.filters[part].append(sub)
    for part in args.filters:
        try:
            parts[part](args, rows)
        except Exception as e:  # keep the other parts' figures
            print(f"{part} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            rows.append(dict(bench=part, error=f"{type(e).__name__}: {e}"))
        torch.cuda.empty_cache()
    from k3rocm.kernels import tune as _tune
    info["tuned"] = {f"{k[0]}{k[1]}": v for k, v in _tune._CACHE.items()}
    info["seconds"] = time.time() - t0
    with open(json_path, "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
    lines = [f"device {info['device']}, torch {info['torch']}, triton {info['triton']}, {info['date']}, "
             f"{info['seconds']:.0f} s", ""] + _tables(rows)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
