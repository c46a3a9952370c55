"""Benchmark one K3 MoE layer's routed experts on packed MXFP4 (Triton) against bf16 ``torch._grouped_mm``.

Problem (K3_FACTS §2-§5): 896 experts, latent 3584, intermediate 3072, top-16, router over hidden 7168.
For each token count: router time, dispatch time, the whole ``moe_experts`` call for every config of the backend's
list, each kernel of the expert path alone for the config the size picks (quantize for A8W4, w1|w3 + SiTU,
w2 x weight, reduce), and the bf16 baseline (two ``torch._grouped_mm`` on the same routing, SiTU in between).
Floors: bytes of the experts actually routed to (17,547,264 B each in MXFP4) over the measured copy bandwidth,
FLOPs over the measured bf16 matrix rate. Timing: ``triton.testing.do_bench`` (median) after warm-up, fresh random data.

Goal table (one row per size: the whole layer at 64 / 512 / 8192 tokens and the EP8 slice — 112 local experts of
896, first 0, the rank seeing every token's routing, pairs outside its slice dropped — at 64 and 512 tokens):
ours (A16W4, the size's picked config, weights in the tiled kernel layout made by ``ops.kernel_layout``, the
same in the checkpoint layout, and the tiled layout with the decode's general two-multiply variant that the
one-multiply one replaces where every scale byte is <= 128),
the MXFP4 byte floor, the fraction, bf16 ``torch._grouped_mm`` on the same
(local) pairs, and OpenAI's ``matmul_ogs`` through ``gpu-runs/peer_ogs.py`` (``time_matmul_ogs``; "not run:
<reason>" when that file is absent or raises). The repack (time, bytes, and the byte-exact check of both tensors
against the checkpoint) is reported once for the layer.

Usage: ``python gpu-runs/bench_moe.py --out DIR`` (default: the goal table, 64 / 512 / 8192 tokens, A16W4; writes
``DIR/moe_bench.json`` and ``DIR/moe_bench.md``); ``--tokens 64 512 8192 --modes a16w4 a8w4 --check
--candidates`` adds the per-config sweep. ``--small --device cpu`` (with ``TRITON_INTERPRET=1``) runs every step at
k3-tiny sizes on the CPU to check the script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time

import torch
import triton
from triton.testing import do_bench as _do_bench

from k3rocm.kernels import tune
from k3rocm.kernels.moe import GEMM_CONFIGS, gemm_config, gemm_name, moe_experts, moe_router
from k3rocm.kernels.moe import ops as moe_ops
from k3rocm.bench import wall_ms
from k3rocm.kernels.target import current_target
from k3rocm.validation.evidence import git_sha
from k3rocm.kernels.moe.configs import DQ_KINDS
from k3rocm.kernels.moe.ops import _experts_impl, dispatch_gpu, kernel_layout
from k3rocm.kernels.mx.layout import BIT_LAYOUTS, ORDER_LAYOUTS
from k3rocm.kernels.mx.layout import check_repack

E_K3, D_K3, I_K3, H_K3, K_K3 = 896, 3584, 3072, 7168, 16
EXPERT_BYTES = 3 * 3584 * 3072 // 2 + 3 * 3584 * 3072 // 32  # 17,547,264
COPY_BW = 4.2e12  # B/s, measured copy bandwidth (H200)
BF16_RATE = 682e12  # FLOP/s, measured bf16 matrix rate (H200)


# variants tried by --candidates (A16W4; not shipped until they join GEMM_CONFIGS and its tests): the two
# best dot_scaled configs of the first H200 run (reference points) and decode-path (kind "dq"/"dqn") tiles
# around the shipped ones. Each is checked against the oracle with --check. Candidates far from a token
# count's group size are skipped there (block_m >= 128 below 2048 tokens, block_m < 64 from 2048 tokens on)
# to keep one sweep of 64 / 512 / 8192 tokens near two minutes on an H200, compile time included.
CANDIDATES = [gemm_config(32, 128, 128, 4, 4), gemm_config(64, 128, 128, 8, 3),
              gemm_config(16, 64, 128, 4, 4, kind="dq"), gemm_config(16, 128, 128, 4, 4, kind="dq"),
              gemm_config(16, 128, 64, 4, 6, kind="dq"), gemm_config(32, 64, 128, 4, 4, kind="dq"),
              gemm_config(64, 128, 128, 8, 3, kind="dq"), gemm_config(128, 128, 128, 8, 3, kind="dq"),
              gemm_config(128, 128, 64, 8, 3, kind="dqn"),
              # scale-prefetch variants (kernel SCALE_PF 2 / 1): per-word scales a step ahead, and the untransposed one
              gemm_config(16, 128, 128, 8, 4, kind="dqw"), gemm_config(128, 128, 64, 8, 3, kind="dqnp")]


def _candidate_fits(cfg: tune.Config, tokens: int) -> bool:
    return cfg["BLOCK_M"] < 128 if tokens < 2048 else cfg["BLOCK_M"] >= 64


def situ(g, u):
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))


EP_RANKS = 8
EP_TOKENS = (64, 512)


def _peer_ogs():
    """``gpu-runs/peer_ogs.py``'s ``time_matmul_ogs``, or the reason it cannot be used (a string)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_ogs.py")
    if not os.path.exists(path):
        return "not run: gpu-runs/peer_ogs.py absent"
    try:
        spec = importlib.util.spec_from_file_location("peer_ogs", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.time_matmul_ogs
    except Exception as e:  # noqa: BLE001 - a peer that does not import is a result to report
        return f"not run: {type(e).__name__}: {str(e)[:200]}"


def _bf16_path(xl, ids, K, I, w13_bf, w2_bf, num_local):
    """The bf16 baseline on the pairs of experts ``0..num_local-1``: two ``torch._grouped_mm`` with SiTU."""
    flat = ids.flatten().long()
    keep = flat < num_local
    key = torch.where(keep, flat, torch.full_like(flat, num_local))
    order = torch.argsort(key, stable=True)[: int(keep.sum())]
    counts = torch.bincount(flat[keep], minlength=num_local)[:num_local]
    xs = xl[order // K].contiguous()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    b13 = w13_bf[:num_local].transpose(1, 2)
    b2 = w2_bf[:num_local].transpose(1, 2)

    def run():
        gu = torch._grouped_mm(xs, b13, offs=offs)
        h = situ(gu[:, :I].float(), gu[:, I:].float()).bfloat16()
        return torch._grouped_mm(h, b2, offs=offs)
    return run


def _goal_row(label, T, xl, ids, wts, ew, lay, num_local, E, D, I, K, expert_bytes, w13_bf, w2_bf, ogs,
              do_bench, dev, lay_alt=None, persist: tuple = ()) -> dict:
    """One row of the goal table (module docstring) for the experts ``ew`` (local slice) and its layout ``lay``
    (``lay_alt``: the same tiles with the other value bits or the other element order, ``--ab``, timed beside it;
    ``persist``: programs per SM at which the picked config is also timed on the persistent grid, ``--persist``)."""
    local = ids.flatten().long()
    local = local[local < num_local]
    used = int((torch.bincount(local, minlength=num_local) > 0).sum())
    pairs = int(local.numel())
    floor_b = (used * expert_bytes + T * D * 2 + T * D * 4) / COPY_BW * 1e3
    floor_f = 2 * pairs * (D * 2 * I + I * D) / BF16_RATE * 1e3
    r = dict(row=label, tokens=T, num_local=num_local, experts_used=used, local_pairs=pairs,
             floor_ms=max(floor_b, floor_f), floor_kind="bytes" if floor_b >= floor_f else "FLOPs")
    # the config the engine's rank runs (ops.gemm_pick: all ranks' pairs, scaled to this slice's share of the experts)
    cfg = moe_ops.gemm_pick(T * K, num_local, num_experts=E)
    r["config"] = gemm_name(cfg)
    ewt = dict(ew, kernel_layout=lay)
    try:
        r["ours_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ewt, mode="a16w4", config=cfg))
        r["ours_checkpoint_layout_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ew, mode="a16w4", config=cfg))
        r["bits"] = BIT_LAYOUTS[lay.w13.bits]
        r["order"] = ORDER_LAYOUTS[lay.w13.order]
        if lay_alt is not None and cfg["kind"] in DQ_KINDS:  # (planar bits, mma order: the decode path only)
            ewn = dict(ew, kernel_layout=lay_alt)
            r["alt"] = (f"{BIT_LAYOUTS[lay_alt.w13.bits]} bits" if lay_alt.w13.bits != lay.w13.bits else
                        f"{ORDER_LAYOUTS[lay_alt.w13.order]} order")
            r["ours_alt_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ewn, mode="a16w4", config=cfg))
            a = moe_experts(xl, ids, wts, ewt, mode="a16w4", config=cfg)
            b = moe_experts(xl, ids, wts, ewn, mode="a16w4", config=cfg)
            # other bits: the same bits; the other order: equal up to the fp32 order inside the k16 products
            r["alt_rel_diff"] = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        r["fraction"] = r["floor_ms"] / r["ours_ms"]
        if cfg["kind"] in DQ_KINDS and persist:  # the same config on the persistent grid, and its bits
            base = moe_experts(xl, ids, wts, ewt, mode="a16w4", config=cfg)
            for p in persist:
                cp = dict(cfg, persist=p)
                r[f"ours_persist{p}_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ewt, mode="a16w4", config=cp))
                got = moe_experts(xl, ids, wts, ewt, mode="a16w4", config=cp)
                r[f"persist{p}_rel_diff"] = ((got - base).abs().max() / base.abs().max().clamp_min(1e-30)).item()
            del base
        if cfg["kind"] in DQ_KINDS:  # the decode's general variant (two multiplies per pair), same weights
            real = moe_ops.fused_scale_ok
            moe_ops.fused_scale_ok = lambda _s: False
            try:
                r["ours_general_decode_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ewt, mode="a16w4",
                                                                           config=cfg))
            finally:
                moe_ops.fused_scale_ok = real
    except Exception as e:  # noqa: BLE001
        r["ours_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if w13_bf is not None:
        try:
            r["bf16_grouped_mm_ms"] = do_bench(_bf16_path(xl, ids, K, I, w13_bf, w2_bf, num_local))
        except Exception as e:  # noqa: BLE001
            r["bf16_grouped_mm_ms"] = f"not run: {type(e).__name__}: {str(e)[:200]}"
    if isinstance(ogs, str):
        r["matmul_ogs"] = ogs
    else:
        try:
            res = ogs(tokens=T, num_experts=E, d_model=D, d_ff=I, top_k=K,
                      num_local=None if num_local == E else num_local, device=dev)
            r["matmul_ogs"] = res.get("ms") if res.get("ms") is not None else f"not run: {res.get('note')}"
            r["matmul_ogs_note"] = res.get("note")
        except Exception as e:  # noqa: BLE001
            r["matmul_ogs"] = f"not run: {type(e).__name__}: {str(e)[:200]}"
    return r


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 8192])
    ap.add_argument("--modes", nargs="+", default=["a16w4"])
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare each mode with the fp32 oracle (rel. max error)")
    ap.add_argument("--candidates", action="store_true", help="also time CANDIDATES (A16W4 only, total time)")
    ap.add_argument("--sweep", action="store_true", help="also time every config of the list per token count "
                    "(implied by --check, --candidates, or a mode other than a16w4)")
    ap.add_argument("--sweep-layout", choices=("checkpoint", "tiled"), default="checkpoint",
                    help="weights the per-config sweep and the candidates read: the checkpoint layout (default) or "
                    "the tiled kernel layout made at load (what serving reads)")
    ap.add_argument("--sweep-ep", action="store_true",
                    help="(implies --sweep) also time every config of the list on the EP slice (E/--ep-ranks local "
                    "experts, tiled layout; the engine rank's few rows per expert), with each config's rel. max difference from "
                    "the picked config's output there")
    ap.add_argument("--ep-ranks", type=int, default=EP_RANKS,
                    help="EP ranks of the slice rows: one rank holds E / N experts (default 8: the EP8 slice of K3 on "
                         "8 GPUs; 16: the 56 experts of the K3 rank the engine bench runs at TP16/EP16)")
    ap.add_argument("--ab", choices=("order", "bits"), default="order",
                    help="the goal rows also time the layout with the other element order (checkpoint / mma) or the "
                         "other value bits (nibble / planar), the rest as the backend's default")
    ap.add_argument("--persist", type=int, nargs="*", default=[],
                    help="also time the picked config on the persistent grid at these programs per SM on every goal "
                         "row (with its difference from the plain grid's output; 2 and 3 were slower on every row on an "
                         "H100, 2026-12-07, so none by default)")
    ap.add_argument("--out", default="gpu-runs/results", help="folder for moe_bench.json and moe_bench.md")
    ap.add_argument("--small", action="store_true",
                    help="smoke run: 16 experts, latent 64, intermediate 64, top-4 (k3-tiny sizes)")
    ap.add_argument("--device", default="cuda", help="cuda (timed with do_bench) or cpu (Triton interpreter, "
                    "TRITON_INTERPRET=1; wall-clock, for checking this script, not for figures)")
    args = ap.parse_args(argv)
    dev = args.device
    E, D, I, H, K = (16, 64, 64, 128, 4) if args.small else (E_K3, D_K3, I_K3, H_K3, K_K3)
    expert_bytes = 3 * D * I // 2 + 3 * D * I // 32
    do_bench = _do_bench if dev == "cuda" else wall_ms
    torch.manual_seed(0)
    ew = dict(w13_packed=torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev),
              w13_scale=torch.randint(119, 122, (E, 2 * I, D // 32), dtype=torch.uint8, device=dev),
              w2_packed=torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev),
              w2_scale=torch.randint(119, 122, (E, D, I // 32), dtype=torch.uint8, device=dev),
              num_experts=E, first_expert=0)
    gate = (torch.randn(E, H, device=dev) * H ** -0.5).bfloat16()
    bias = torch.randn(E, device=dev) * 0.01
    w13_bf = w2_bf = None
    if not args.no_bf16:
        w13_bf = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16).mul_(0.02)
        w2_bf = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16).mul_(0.02)
    sweep = args.sweep or args.check or args.candidates or args.sweep_ep or args.modes != ["a16w4"]
    lay = kernel_layout(ew)  # once, as at load: the repack of this layer, then the byte-exact check
    repack = dict(repack_ms=lay.repack_s * 1e3, layout_bytes=lay.nbytes,
                  checkpoint_bytes=sum(ew[k].numel() for k in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")))
    t0 = time.perf_counter()
    check_repack(lay.w13, ew["w13_packed"], ew["w13_scale"])  # raises on any byte that differs
    check_repack(lay.w2, ew["w2_packed"], ew["w2_scale"])
    if dev == "cuda":
        torch.cuda.synchronize()
    repack["check_ms"] = (time.perf_counter() - t0) * 1e3
    print(json.dumps(repack), flush=True)
    ogs = _peer_ogs()
    goals = []
    ep_ranks = args.ep_ranks
    if not 1 <= ep_ranks <= E or E % ep_ranks:
        raise SystemExit(f"bench_moe: --ep-ranks {ep_ranks} must divide the {E} experts")
    nl = E // ep_ranks
    ew_ep = dict(w13_packed=ew["w13_packed"][:nl], w13_scale=ew["w13_scale"][:nl], w2_packed=ew["w2_packed"][:nl],
                 w2_scale=ew["w2_scale"][:nl], num_experts=nl, first_expert=0)
    lay_ep = kernel_layout(ew_ep)
    # the same tiles with the other element order or the other value bits (A/B of the backend's choice)
    lay_alt = (kernel_layout(ew, order=1 - lay.w13.order) if args.ab == "order"
               else kernel_layout(ew, bits=1 - lay.w13.bits))
    lay_alt_ep = lay_alt.experts(0, nl)
    rows = []
    for T in args.tokens:
        xh = torch.randn(T, H, device=dev).bfloat16()
        xl = torch.randn(T, D, device=dev).bfloat16()
        ids, wts = moe_router(xh if dev == "cuda" else xh.float(), gate, bias, K)
        if dev == "cuda":
            torch.cuda.synchronize()
        used = int((torch.bincount(ids.flatten().long(), minlength=E) > 0).sum())
        bytes_fp4 = used * expert_bytes + T * D * 2 + T * D * 4
        flops = 2 * T * K * (D * 2 * I + I * D)
        floor_fp4 = bytes_fp4 / COPY_BW
        floor_flop = flops / BF16_RATE
        r = dict(tokens=T, experts_used=used, bytes_fp4=bytes_fp4, floor_fp4_ms=floor_fp4 * 1e3,
                 floor_flops_ms=floor_flop * 1e3)
        goals.append(_goal_row(f"{T} tokens", T, xl, ids, wts, ew, lay, E, E, D, I, K, expert_bytes, w13_bf, w2_bf,
                               ogs, do_bench, dev, lay_alt, tuple(args.persist)))
        print(json.dumps(goals[-1]), flush=True)
        if T in EP_TOKENS:
            goals.append(_goal_row(f"EP{ep_ranks} slice, {T} tokens", T, xl, ids, wts, ew_ep, lay_ep, nl, E, D, I, K,
                                   expert_bytes, w13_bf, w2_bf, ogs, do_bench, dev, lay_alt_ep, tuple(args.persist)))
            print(json.dumps(goals[-1]), flush=True)
        if args.sweep_ep:
            ewt_ep = dict(ew_ep, kernel_layout=lay_ep)
            base = moe_experts(xl, ids, wts, ewt_ep, mode="a16w4")
            for cfg in tune.configs(GEMM_CONFIGS):
                key = f"ep{ep_ranks}_{gemm_name(cfg)}"
                try:
                    out = moe_experts(xl, ids, wts, ewt_ep, mode="a16w4", config=cfg)
                    r[f"{key}_rel_vs_picked"] = ((out - base).abs().max() / base.abs().max().clamp_min(1e-30)).item()
                    r[f"{key}_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ewt_ep, mode="a16w4", config=cfg))
                except Exception as e:  # noqa: BLE001 - a failing config is a result to report
                    r[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            del base
        if not sweep:
            continue
        # the weights the sweep and the candidates read (the tiled layout: as serving does)
        ews = dict(ew, kernel_layout=lay) if args.sweep_layout == "tiled" else ew
        r["router_ms"] = do_bench(lambda: moe_router(xh if dev == "cuda" else xh.float(), gate, bias, K))
        per_expert = T * K / min(E, T * K)
        cfg0 = tune.pick("moe_gemm", (tune.pow2(math.ceil(per_expert)),), tune.configs(GEMM_CONFIGS), rows=per_expert)
        r["dispatch_ms"] = do_bench(lambda: dispatch_gpu(ids, 0, E, cfg0["BLOCK_M"]))
        r["picked_config"] = gemm_name(cfg0)
        ref16 = None  # the a16w4 oracle output, kept for the candidates when --check computed it
        for mode in args.modes:
            ref = None
            if args.check:
                from k3rocm.model.moe import moe_experts as oracle

                torch.backends.cuda.matmul.allow_tf32 = False
                ref = oracle(xl, ids, wts, ew, mode=mode)
                if mode == "a16w4":
                    ref16 = ref
            for cfg in tune.configs(GEMM_CONFIGS):
                key = f"{mode}_{gemm_name(cfg)}"
                try:
                    stages: dict = {}
                    out, _ = _experts_impl(xl, ids, wts, ews, "situ", mode, 4.0, 25.0, cfg, stages=stages)
                    if ref is not None:
                        r[f"{key}_rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
                    t_all = do_bench(lambda: moe_experts(xl, ids, wts, ews, mode=mode, config=cfg))
                    r[f"{key}_experts_ms"] = t_all
                    r[f"{key}_kernel"] = stages.get("kernel")
                    if cfg == cfg0:  # each launch alone for the config this size picks (sweep time)
                        for st in ("w13", "w2", "reduce", "quantize"):
                            if stages.get(st) is not None:
                                r[f"{key}_{st}_ms"] = do_bench(stages[st])
                    r[f"{key}_frac_of_floor"] = max(floor_fp4, floor_flop) * 1e3 / t_all
                except Exception as e:  # noqa: BLE001 - a failing config is a result to report
                    r[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if args.check:
                out = moe_experts(xl, ids, wts, ews, mode=mode)
                r[f"{mode}_rel_err_vs_oracle"] = ((out - ref).abs().max() / ref.abs().max()).item()
                if mode == "a8w4" and "a16w4" in args.modes:
                    o16 = moe_experts(xl, ids, wts, ews, mode="a16w4")
                    r["a8w4_vs_a16w4_rel"] = ((out - o16).abs().max() / o16.abs().max()).item()
                del out
            del ref
            best = min(((r[f"{mode}_{gemm_name(c)}_experts_ms"], gemm_name(c)) for c in tune.configs(GEMM_CONFIGS)
                        if f"{mode}_{gemm_name(c)}_experts_ms" in r), default=(None, None))
            r[f"{mode}_best_ms"], r[f"{mode}_best_config"] = best
            r[f"{mode}_picked_ms"] = r.get(f"{mode}_{gemm_name(cfg0)}_experts_ms")
            pk = r[f"{mode}_picked_ms"]
            r[f"{mode}_router_plus_experts_ms"] = pk + r["router_ms"] if pk else None
        if args.candidates:
            if args.check and ref16 is None:
                from k3rocm.model.moe import moe_experts as oracle

                torch.backends.cuda.matmul.allow_tf32 = False
                ref16 = oracle(xl, ids, wts, ew, mode="a16w4")
            for cfg in CANDIDATES:
                if not _candidate_fits(cfg, T):
                    continue
                try:
                    out = moe_experts(xl, ids, wts, ews, mode="a16w4", config=cfg)
                    r[f"cand_{gemm_name(cfg)}_ms"] = do_bench(lambda: moe_experts(xl, ids, wts, ews, mode="a16w4",
                                                                              config=cfg))
                    if ref16 is not None:
                        r[f"cand_{gemm_name(cfg)}_rel_err"] = ((out - ref16).abs().max() / ref16.abs().max()).item()
                except Exception as e:  # noqa: BLE001
                    r[f"cand_{gemm_name(cfg)}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        ref16 = None
        if w13_bf is not None:
            try:
                counts = torch.bincount(ids.flatten().long(), minlength=E)
                order = torch.argsort(ids.flatten().long(), stable=True)
                xs = xl[order // K].contiguous()
                offs = torch.cumsum(counts, 0).to(torch.int32)
                b13 = w13_bf.transpose(1, 2)
                b2 = w2_bf.transpose(1, 2)

                def bf16_path():
                    gu = torch._grouped_mm(xs, b13, offs=offs)
                    h = situ(gu[:, :I].float(), gu[:, I:].float()).bfloat16()
                    return torch._grouped_mm(h, b2, offs=offs)

                r["bf16_grouped_mm_ms"] = do_bench(bf16_path)
                r["bf16_w13_only_ms"] = do_bench(lambda: torch._grouped_mm(xs, b13, offs=offs))
            except Exception as e:  # noqa: BLE001
                r["bf16_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), backend=current_target().backend,
                commit=git_sha()[:12])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_bench.json"), "w") as f:
        json.dump(dict(meta=meta, repack=repack, goals=goals, rows=rows), f, indent=1)
    md = _goal_markdown(meta, repack, goals, tuple(args.persist)) + ("\n" + _markdown(meta, rows, args.modes) if rows else "")
    with open(os.path.join(args.out, "moe_bench.md"), "w") as f:
        f.write(md)
    print(md)




def _cell(v, nd=3) -> str:
    return f"{v:.{nd}f}" if isinstance(v, float) else ("—" if v is None else str(v))


def _goal_markdown(meta, repack, goals, persist: tuple = ()) -> str:
    out = [f"device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
           f"commit {meta['commit']}", "",
           f"Repack of one layer into the kernel layout: {repack['repack_ms']:.1f} ms, {repack['layout_bytes']:,} B "
           f"(checkpoint {repack['checkpoint_bytes']:,} B); byte-exact check of both tensors against the checkpoint: "
           f"passed, {repack['check_ms']:.1f} ms.", "",
           "| row | experts used | config | ours ms (tiled layout: value bits, element order) | ours ms (tiled, the "
           "other bits or order; rel. diff of the output) | "
           "ours ms (checkpoint layout) | "
           "ours ms (tiled, general decode) | " + " | ".join(f"persistent grid, {p} per SM, ms (rel. diff)"
                                                          for p in persist) +
           " | MXFP4 floor ms | fraction | bf16 grouped_mm ms | matmul_ogs ms |",
           "|---|---|---|---|---|---|---|" + "---|" * len(persist) + "---|---|---|---|"]
    for g in goals:
        nib = _cell(g.get("ours_alt_ms"))
        if "alt_rel_diff" in g:
            nib += f" ({g['alt']}: {g['alt_rel_diff']:.1e})"
        ours = _cell(g.get("ours_ms", g.get("ours_error"))) + (f" ({g['bits']}, {g['order']})" if "bits" in g else "")
        out.append(f"| {g['row']} | {g['experts_used']} | {g['config']} | {ours}"
                   f" | {nib} | {_cell(g.get('ours_checkpoint_layout_ms'))} | {_cell(g.get('ours_general_decode_ms'))} | "
                   + "".join(f"{_cell(g.get(f'ours_persist{p}_ms'))}"
                             + (f" ({g[f'persist{p}_rel_diff']:.1e})" if f"persist{p}_rel_diff" in g else "") + " | "
                             for p in persist) +
                   f"{g['floor_ms']:.3f} ({g['floor_kind']}) | "
                   f"{_cell(g.get('fraction'), 2)} | {_cell(g.get('bf16_grouped_mm_ms'))} | {_cell(g.get('matmul_ogs'))} |")
    return "\n".join(out) + "\n"


def _markdown(meta, rows, modes) -> str:
    out = [f"device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
           f"commit {meta['commit']}", "",
           "| tokens | experts used | router ms | dispatch ms | mode | experts ms (picked) | best config | "
           "w13 ms | w2 ms | reduce ms | MXFP4 floor ms | fraction | bf16 grouped_mm ms | speed-up |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for m in modes:
            pc = r["picked_config"]
            t = r.get(f"{m}_picked_ms")
            bf = r.get("bf16_grouped_mm_ms")
            out.append(
                f"| {r['tokens']} | {r['experts_used']} | {r['router_ms']:.3f} | {r['dispatch_ms']:.3f} | {m} | "
                f"{t if t is None else round(t, 3)} ({pc}) | {r.get(f'{m}_best_config')} "
                f"{round(r.get(f'{m}_best_ms') or 0, 3)} | {round(r.get(f'{m}_{pc}_w13_ms', 0), 3)} | "
                f"{round(r.get(f'{m}_{pc}_w2_ms', 0), 3)} | {round(r.get(f'{m}_{pc}_reduce_ms', 0), 3)} | "
                f"{max(r['floor_fp4_ms'], r['floor_flops_ms']):.3f} | "
                f"{(max(r['floor_fp4_ms'], r['floor_flops_ms']) / t) if t else 0:.2f} | "
                f"{bf if bf is None else round(bf, 3)} | {(bf / t) if (bf and t) else 0:.2f} |")
    cands = sorted({k[5:-3] for r in rows for k in r if k.startswith("cand_") and k.endswith("_ms")})
    if cands:
        out += ["", "Candidates (A16W4, whole moe_experts call, ms; rel. max error vs the oracle with --check):", "",
                "| tokens | " + " | ".join(cands) + " |", "|---|" + "---|" * len(cands)]
        for r in rows:
            cells = []
            for c in cands:
                t, e = r.get(f"cand_{c}_ms"), r.get(f"cand_{c}_rel_err")
                cells.append("—" if t is None else f"{t:.3f}" + (f" ({e:.1e})" if e is not None else ""))
            out.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
