"""Config and split sweep of the MLA decode / prefill and Block AttnRes kernels beyond their shipped tables.

Times every candidate (shipped configs and a wider grid) on the benchmark rows of ``bench_mla.py`` and checks
each candidate's output against the shipped default's, so a faster candidate that is also right can be
moved into the table. Writes one JSON line per measurement to ``--out`` (and stdout) as it goes; stops
starting new rows after ``--deadline`` seconds.

* decode: rows N{64,256} x L{8192,32768} x H12, N{64,256} L8192 H96; each config at the planned split count,
  then the three fastest at forced split counts; the fastest also replayed from a CUDA graph.
* prefill: B1 T8192 H12, T32768 H12, T8192 H96, every grid config, and SDPA on the same problem.
* attnres: D7168 T8192 / T256, bf16 and fp32 banks, 8 bank rows + prefix, every grid config (phased path and
  PIPE stream; graph-replayed at T256), each with and without the h store (the engine's call).

Usage: ``python gpu-runs/sweep_attn.py --out DIR [--only decode,prefill,attnres] [--deadline S]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import triton

# the timers and the error measure of the goal benchmark (this script's folder is first on sys.path)
from bench_mla import _rel, _t as _bench_t, _t_graph

T0 = time.time()
#: SWEEP_NEW_ONLY=1: leave out the prefill grid and the phased AttnRes grid (measured on 2026-12-03, none beat the
#: shipped tables), time the shipped tables and the AttnRes PIPE variants only
NEW_ONLY = os.environ.get("SWEEP_NEW_ONLY") == "1"


def _t(fn, rep=60):
    return _bench_t(fn, rep=rep)


def _tg(fn, calls=10):
    return _t_graph(fn, calls=calls, rep=60)


class Log:
    def __init__(self, path):
        self.f = open(path, "a")

    def __call__(self, **row):
        row["t_s"] = round(time.time() - T0, 1)
        line = json.dumps(row)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def sweep_decode(log, deadline):
    from k3rocm.kernels.mla import decode as MD
    Dn, Dr, Dv, R, page = 128, 64, 128, 512, 64
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    Lmax, Nmax = 32768, 256
    nb = Lmax // page
    cache = torch.empty(Nmax * nb, page, R + Dr, device="cuda", dtype=bf)
    cache.normal_(generator=g)
    bt_all = torch.randperm(Nmax * nb, device="cuda", generator=g).to(torch.int32).view(Nmax, nb)
    grid = list(MD.DECODE_CONFIGS["cuda"])
    for bh, bn, w, st in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (2, 3, 4)):
        c = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st)
        if c not in grid and not (bh == 64 and w == 4) and not (bh >= 32 and bn == 64 and st > 2):
            grid.append(c)
    rows = [(64, 8192, 12), (64, 32768, 12), (256, 8192, 12), (256, 32768, 12), (64, 8192, 96), (256, 8192, 96)]
    for N, L, H in rows:
        if time.time() - T0 > deadline:
            log(part="decode", skipped=f"N{N} L{L} H{H}", why="deadline")
            continue
        W = torch.randn(H * (Dn + Dv), R, device="cuda", generator=g) * R ** -0.5
        w_kc = W.view(H, Dn + Dv, R)[:, :Dn].contiguous().to(bf)
        w_vc = W.view(H, Dn + Dv, R)[:, Dn:].transpose(1, 2).contiguous().to(bf)
        bt = bt_all[:N, : L // page].contiguous()
        cl = torch.full((N,), L, dtype=torch.int32, device="cuda")
        qn = torch.randn(N, 1, H, Dn, device="cuda", generator=g, dtype=bf)
        qr = torch.randn(N, 1, H, Dr, device="cuda", generator=g, dtype=bf)
        gate = torch.randn(N, 1, H * Dv, device="cuda", generator=g, dtype=bf)
        out = torch.empty(N, 1, H, Dv, device="cuda", dtype=bf)
        case = f"N{N} L{L} H{H}"
        byts = N * L * (R + Dr) * 2
        flops = N * L * H * 2 * ((R + Dr) + R)
        floor = max(byts / 4.2e12, flops / 682e12) * 1e3

        def call(cfg=None, sp=None):
            return MD.mla_decode(qn, qr, cache, bt, cl, w_kc, w_vc, 0.0722, gate=gate, out=out, config=cfg,
                                 num_splits=sp, max_context_len=L, total_context_tokens=N * L)

        ref = call().clone()
        t_def = _t(call)
        log(part="decode", case=case, cfg="default", ms=t_def, frac=floor / t_def, floor_ms=floor)
        res = []
        for cfg in grid:
            if time.time() - T0 > deadline:
                break
            try:
                o = call(cfg).clone()
                ms = _t(lambda: call(cfg))
                err = _rel(o, ref)
                res.append((ms, cfg))
                log(part="decode", case=case, cfg=cfg, ms=ms, frac=floor / ms, rel_vs_default=err)
            except Exception as e:  # a config that does not compile or run: recorded, not fatal
                log(part="decode", case=case, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:160]}")
        res.sort(key=lambda r: r[0])
        for ms0, cfg in res[:3]:
            for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64):
                if sp * 64 > L or time.time() - T0 > deadline:
                    continue
                try:
                    o = call(cfg, sp).clone()
                    ms = _t(lambda: call(cfg, sp))
                    log(part="decode", case=case, cfg=cfg, splits=sp, ms=ms, frac=floor / ms, rel_vs_default=_rel(o, ref))
                except Exception as e:
                    log(part="decode", case=case, cfg=cfg, splits=sp, error=f"{type(e).__name__}: {str(e)[:160]}")
        if res:
            try:
                ms = _tg(lambda: call(res[0][1]))
                log(part="decode", case=case, cfg=res[0][1], graph_ms=ms, frac=floor / ms)
            except Exception as e:
                log(part="decode", case=case, graph_error=f"{type(e).__name__}: {str(e)[:160]}")
        del W, w_kc, w_vc, qn, qr, gate, out


def sweep_prefill(log, deadline):
    import torch.nn.functional as F
    from k3rocm.kernels.mla import prefill as MP
    Dn, Dr, Dv = 128, 64, 128
    grid = list(MP.PREFILL_CONFIGS["cuda"])
    for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4, 5)):
        if NEW_ONLY:
            break
        c = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        if c in grid or (bm == 64 and w == 8) or (bn == 128 and st > 3) or (bm == 128 and w == 4 and bn == 128):
            continue
        grid.append(c)
    for T, H in ((8192, 12), (32768, 12), (8192, 96)):
        if time.time() - T0 > deadline:
            log(part="prefill", skipped=f"T{T} H{H}", why="deadline")
            continue
        g = torch.Generator(device="cuda").manual_seed(T + H)
        bf = torch.bfloat16
        q = torch.randn(T, H, Dn + Dr, device="cuda", generator=g, dtype=bf)
        kn = torch.randn(T, H, Dn, device="cuda", generator=g, dtype=bf)
        kr = torch.randn(T, Dr, device="cuda", generator=g, dtype=bf)
        v = torch.randn(T, H, Dv, device="cuda", generator=g, dtype=bf)
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        scale = (Dn + Dr) ** -0.5
        out = torch.empty(T, H, Dv, device="cuda", dtype=bf)
        case = f"B1 T{T} H{H}"
        qs = q.permute(1, 0, 2)[None].contiguous()
        ks = torch.cat([kn, kr[:, None, :].expand(T, H, Dr)], -1).permute(1, 0, 2)[None].contiguous()
        vs = F.pad(v, (0, Dn + Dr - Dv)).permute(1, 0, 2)[None].contiguous()
        t_sdpa = _t(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0, :, :, :Dv].permute(1, 0, 2)
        del qs, ks, vs
        t_def = _t(lambda: MP.mla_prefill(q, kn, kr, v, cu, cu, scale, out=out, max_seqlen_q=T))
        log(part="prefill", case=case, cfg="default", ms=t_def, sdpa_ms=t_sdpa, ratio=t_def / t_sdpa)
        for cfg in grid:
            if time.time() - T0 > deadline:
                break
            try:
                o = MP.mla_prefill(q, kn, kr, v, cu, cu, scale, config=cfg, max_seqlen_q=T)
                ms = _t(lambda: MP.mla_prefill(q, kn, kr, v, cu, cu, scale, out=out, config=cfg, max_seqlen_q=T))
                log(part="prefill", case=case, cfg=cfg, ms=ms, ratio=ms / t_sdpa, rel_vs_sdpa=_rel(o, ref))
            except Exception as e:
                log(part="prefill", case=case, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:160]}")
        del q, kn, kr, v, out, ref


def sweep_attnres(log, deadline):
    """Every AttnRes config (the shipped table, a phased-path grid, a PIPE-stream grid) on D7168 x 8 bank rows +
    prefix, bf16 / fp32 banks at T8192 / T256 (graph-replayed), each once storing h (``frac`` against the floor
    with h) and, the shipped and PIPE configs, once as the engine calls it, ``store_h=False`` (``no_h`` rows,
    ``frac`` against the floor without the h bytes). A PIPE config runs with its stage count lowered to fit shared
    memory (``PIPE_SMEM_BYTES``): the ``pipe_as_run`` field says the count that ran."""
    from k3rocm.kernels.attnres import attnres as AR
    shipped = list(AR.ATTNRES_CONFIGS["cuda"])
    grid = list(shipped)
    for rows, w, pps in itertools.product((2, 4, 8), (8, 16, 32), (0, 2, 4, 8)):
        if NEW_ONLY:
            break
        c = dict(BLOCK_D=8192, PROGS_PER_SM=pps, ROWS=rows, num_warps=w, num_stages=1)
        if c not in grid:
            grid.append(c)
    # the PIPE stream: rows per tile x warps x stages (ptxas sm_90a: ROWS 1 spill-free at 16 / 32 warps, ROWS 2 at
    # 16; ROWS 2 at 32 warps spills a few bytes with triton 3.6),
    # one persistent program per SM (two cannot be resident: 128 registers x 16 warps) or one per token
    for rows, w, pipe, pps in itertools.product((1, 2), (16, 32), (2, 3, 4, 5, 6, 7), (1, 0)):
        if pps == 0 and pipe > 3:
            continue
        c = dict(BLOCK_D=8192, PROGS_PER_SM=pps, ROWS=rows, PIPE=pipe, num_warps=w, num_stages=1)
        if c not in grid:
            grid.append(c)
    for rows, pipe in ((4, 2), (4, 3), (1, 8)):  # at the edge: ROWS 4 spills a little, 8 stages need a cut
        grid.append(dict(BLOCK_D=8192, PROGS_PER_SM=1, ROWS=rows, PIPE=pipe, num_warps=16, num_stages=1))
    g = torch.Generator(device="cuda").manual_seed(2)
    D = 7168
    for T, dt in ((8192, torch.bfloat16), (8192, torch.float32), (256, torch.bfloat16), (256, torch.float32)):
        if time.time() - T0 > deadline:
            log(part="attnres", skipped=f"T{T} {dt}", why="deadline")
            continue
        eb = torch.tensor([], dtype=dt).element_size()
        bank = torch.randn(9, T, D, device="cuda", generator=g).to(dt)
        pre = torch.randn(T, D, device="cuda", generator=g).to(dt)
        w = torch.randn(D, device="cuda", generator=g) * D ** -0.5 * 4
        nw = 1 + 0.1 * torch.randn(D, device="cuda", generator=g)
        rows_ = 8
        byts = (rows_ + 1) * T * D * eb + T * D * 4 + T * D * 2
        floor = byts / 4.2e12 * 1e3
        floor_no_h = (byts - T * D * 4) / 4.2e12 * 1e3
        case = f"D{D} T{T} {str(dt)[6:]}"
        ref = AR.attn_res_norm(bank, rows_, pre, w, nw, 1e-5, out_dtype=torch.bfloat16)
        timer = _tg if T <= 256 else _t
        for store_h in (True, False):
            fn = lambda sh=store_h: AR.attn_res_norm(bank, rows_, pre, w, nw, 1e-5, out_dtype=torch.bfloat16,  # noqa
                                                     store_h=sh)
            ms = timer(fn)
            fl = floor if store_h else floor_no_h
            log(part="attnres", case=case, cfg="default", no_h=not store_h, ms=ms, frac=fl / ms, graphed=T <= 256)
        for cfg in grid:
            if time.time() - T0 > deadline:
                break
            pipe = cfg.get("PIPE", 0)
            as_run = AR._pipe_stages(pipe, cfg["ROWS"], cfg["BLOCK_D"], eb, "cuda") if pipe > 2 else pipe
            # without h: the shipped table and the PIPE grid (the phased grid's h rows were all within 1% of each
            # other on 2026-12-02's H200; its no-h rows would mostly cost compiles)
            for store_h in (True, False) if cfg in shipped or pipe else (True,):
                fl = floor if store_h else floor_no_h
                try:
                    o = AR.attn_res_norm(bank, rows_, pre, w, nw, 1e-5, out_dtype=torch.bfloat16, config=cfg,
                                         store_h=store_h)
                    f = lambda cfg=cfg, sh=store_h: AR.attn_res_norm(  # noqa: E731
                        bank, rows_, pre, w, nw, 1e-5, out_dtype=torch.bfloat16, config=cfg, store_h=sh)
                    ms = timer(f)
                    err = _rel(o[1], ref[1]) if o[0] is None else max(_rel(o[0], ref[0]), _rel(o[1], ref[1]))
                    log(part="attnres", case=case, cfg=cfg, no_h=not store_h, pipe_as_run=as_run, ms=ms,
                        frac=fl / ms, rel_vs_default=err)
                except Exception as e:
                    log(part="attnres", case=case, cfg=cfg, no_h=not store_h,
                        error=f"{type(e).__name__}: {str(e)[:160]}")
        del bank, pre


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="decode,prefill,attnres")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after start: no new candidate after it")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    log = Log(os.path.join(a.out, "sweep_attn.jsonl"))
    log(env=dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name()))
    parts = a.only.split(",")
    # each part gets its share of what is left
    for i, part in enumerate(parts):
        left = a.deadline - (time.time() - T0)
        share = time.time() - T0 + left / (len(parts) - i)
        try:
            dict(decode=sweep_decode, prefill=sweep_prefill, attnres=sweep_attnres)[part](log, share)
        except Exception as e:  # one part's failure leaves the others' rows
            log(part=part, error=f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
