"""Peer timing: one K3 MoE layer's routed experts through OpenAI's Triton MoE GEMM ``triton_kernels.matmul_ogs``.

The peer is the ``python/triton_kernels`` package of the triton repository as released with triton 3.6.0 (the
triton on the GPU host); it is not installed with pip. It is found on ``PYTHONPATH`` or in the folder named by the
environment variable ``K3ROCM_TRITON_KERNELS`` (the folder that holds ``triton_kernels/``). In that release the
grouped GEMM is ``triton_kernels.matmul_ogs.matmul_ogs`` (gather on the input rows, scatter + top-k combine on the
output rows, ragged over experts) and routing is ``triton_kernels.topk.topk`` plus
``triton_kernels.tensor.make_ragged_tensor_metadata`` into the ``RoutingData`` / ``GatherIndx`` / ``ScatterIndx``
of ``matmul_ogs`` (``triton_kernels.routing`` was removed before 3.6.0; ``matmul_ogs`` became ``matmul`` in 3.7).

Problem (K3_FACTS §2-§5): 896 experts, latent 3584, intermediate 3072, top-16. w13: latent -> 2 x intermediate
with the gate/up GLU fused into the epilogue (the peer's interleaved SwiGLU: same bytes and FLOPs as K3's GLU),
w2: intermediate -> latent with the routing weight applied in its epilogue and each token's top-k rows summed by
the peer. Weights: random bf16 quantised by the peer's ``downcast_to_mxfp`` along K (E2M1 values, E8M0 scales per
32) and put into the peer's default MXFP4 value/scale layouts for the device (its Hopper swizzles on sm_90), as its
own tests and benchmark do (scale swizzle for 4 warps up to 512 tokens, 8 above, as its benchmark picks). Routing:
the peer's ``topk`` over random logits; built once, not timed.

EP8 slice (``num_local``): one rank holds ``num_local`` of the ``num_experts`` experts, and each token brings
``top_k * num_local / num_experts`` pairs to it on average (2 for K3: 16 x 112 / 896). The slice is timed as
``tokens`` tokens each routed to that many distinct experts among the ``num_local`` (the same rows per expert on
average as the global routing restricted to one rank's experts).

Timing: ``triton.testing.do_bench`` (median ms) after a warm-up call. Usage (H200):
``K3ROCM_TRITON_KERNELS=/path/to/triton_kernels python gpu-runs/peer_ogs.py --out DIR`` prints a Markdown table
and writes ``DIR/peer_ogs.json``; rows print "not installed" when the package is absent.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

E_K3, D_K3, I_K3, K_K3, EP8_LOCAL = 896, 3584, 3072, 16, 112
ENV_VAR = "K3ROCM_TRITON_KERNELS"
ROWS = [(64, None), (512, None), (8192, None), (64, EP8_LOCAL), (512, EP8_LOCAL)]
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # the peer's own SwiGLU constants (GPT-OSS); cost does not depend on them


def local_top_k(top_k: int, num_experts: int, num_local: int | None) -> int:
    """Pairs per token that land on a rank holding ``num_local`` of ``num_experts`` experts (mean, >= 1).

    ``top_k * num_local / num_experts`` rounded, for uniform routing; ``top_k`` when ``num_local`` is None.
    Raises ValueError when ``num_local`` is not in 1..num_experts.
    """
    if num_local is None:
        return top_k
    if not 1 <= num_local <= num_experts:
        raise ValueError(f"num_local={num_local} must be in 1..{num_experts}")
    return max(1, round(top_k * num_local / num_experts))


def find_triton_kernels():
    """Import the peer package ``triton_kernels`` (PYTHONPATH first, then ``$K3ROCM_TRITON_KERNELS``).

    Returns the module. Raises ImportError with one line naming both places when it is absent.
    """
    try:
        importlib.import_module("triton_kernels.matmul_ogs")
        return importlib.import_module("triton_kernels")
    except ImportError as exc:
        first = exc
    root = os.environ.get(ENV_VAR)
    if root and (Path(root) / "triton_kernels").is_dir():
        sys.path.insert(0, str(Path(root)))
        importlib.import_module("triton_kernels.matmul_ogs")
        return importlib.import_module("triton_kernels")
    raise ImportError(f"triton_kernels (python/triton_kernels of the triton repository, 3.6.0) not found: put it "
                      f"on PYTHONPATH or set {ENV_VAR} to the folder that holds triton_kernels/ ({first})")


def pack_experts(vals: torch.Tensor, scales: torch.Tensor, value_layout, value_opts: dict, scale_layout,
                 scale_opts: dict, chunk: int = 64):
    """The peer's MXFP4 weight and scale ``Tensor``s for the grouped GEMM from quantised experts.

    vals: (E, K/2, N) uint8, two E2M1 codes a byte along K, K contiguous; scales: (E, K/32, N) uint8 E8M0, as the
    peer's ``downcast_to_mxfp(w, torch.uint8, axis=1)`` returns them for w (E, K, N). The layouts: the peer's
    layout classes and options (``make_default_matmul_mxfp4_w_layout`` / ``..._w_scale_layout`` on the device:
    its Hopper swizzles on sm_90), applied as its own tests do (``convert_layout``), ``chunk`` experts at a time:
    the Hopper value swizzle needs ~9x its input in temporaries, too much for a whole K3 layer at once. Each
    expert's swizzled block is independent of the others, so the chunks are stacked into one storage with the
    strides the peer's swizzle gives. Raises AssertionError if a swizzled chunk is not expert-major.
    """
    from triton_kernels.tensor import FP4, Storage, Tensor, convert_layout, wrap_torch_tensor

    def pack(t, dtype, layout_cls, opts):
        whole = wrap_torch_tensor(t, dtype=dtype)
        out = None
        for e0 in range(0, t.shape[0], chunk):
            part = convert_layout(wrap_torch_tensor(t[e0:e0 + chunk], dtype=dtype), layout_cls, **opts).storage.data
            if out is None:
                assert part.stride(0) == part[0].numel(), "swizzled experts are not expert-major"
                out = torch.empty_strided((t.shape[0], *part.shape[1:]), part.stride(), dtype=part.dtype,
                                          device=part.device)
            out[e0:e0 + part.shape[0]].copy_(part)
        return Tensor(Storage(out, layout_cls(t.shape, **opts)), dtype=whole.dtype, shape=whole.shape)

    return pack(vals, FP4, value_layout, value_opts), pack(scales, None, scale_layout, scale_opts)


def quantize_experts(num_experts: int, k: int, n: int, device, downcast, chunk: int = 64):
    """Random (num_experts, k, n) bf16 weights (N(0, 1/k)) quantised by ``downcast`` along k.

    downcast: the peer's ``downcast_to_mxfp`` (its torch reference ``downcast_to_mxfp_torch`` on the CPU).
    Returns (vals (E, k/2, n) uint8, k contiguous; scales (E, k/32, n) uint8), ready for :func:`pack_experts`.
    Quantised ``chunk`` experts at a time: the bf16 weights of a whole K3 layer would be ~60 GB.
    """
    vals = torch.empty((num_experts, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((num_experts, n, k // 32), dtype=torch.uint8, device=device)
    for e0 in range(0, num_experts, chunk):
        e1 = min(num_experts, e0 + chunk)
        w = torch.randn((e1 - e0, k, n), dtype=torch.bfloat16, device=device) * k ** -0.5
        v, s = downcast(w, torch.uint8, axis=1)
        vals[e0:e1], scales[e0:e1] = v.transpose(-1, -2), s.transpose(-1, -2)
        del w, v, s
    return vals.transpose(-1, -2), scales.transpose(-1, -2)


def scale_num_warps(tokens: int) -> int:
    """Warps the peer's Hopper MX scale swizzle is made for: 4 up to 512 tokens, else 8 (its own benchmark's
    choice; its kernel then runs with the layout's warp count)."""
    return 4 if tokens <= 512 else 8


def make_routing(logits: torch.Tensor, k: int, topk, make_ragged):
    """The peer's routing objects for ``logits`` (tokens, experts): (RoutingData, GatherIndx, ScatterIndx).

    ``topk`` / ``make_ragged``: the peer's ``topk`` and ``make_ragged_tensor_metadata`` (or their torch references
    on the CPU). The grouped GEMM's rows are the (token, slot) pairs sorted by expert: ``GatherIndx.src_indx``
    (int32) holds each row's pair index token * k + slot (the kernel reads token = pair // k), ``dst_indx`` its
    inverse; ``RoutingData.gate_scal`` each row's softmax routing weight (the w2 ``gammas``), ``expt_hist`` the rows
    per expert. Same construction as the peer's own single-device routing and tests.
    """
    from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx

    sparse = topk(logits, k, apply_softmax=True)
    meta = sparse.mask_metadata
    expert_sorted, pair_order = meta.col_sorted_indx, meta.row_sorted_indx
    ragged = make_ragged(meta.col_sum, pair_order.shape[0])
    gate_scal = sparse.vals.flatten()[expert_sorted]
    routing = RoutingData(gate_scal, ragged.slice_sizes, logits.shape[1], k, ragged)
    return routing, GatherIndx(expert_sorted, pair_order), ScatterIndx(pair_order, expert_sorted)


_WEIGHTS: dict = {}


def _weights(num_experts: int, d_model: int, d_ff: int, num_warps: int, device):
    """(w13, w13 scales), (w2, w2 scales) in the device's default MXFP4 layouts; one layer cached at a time."""
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
    from triton_kernels.tensor_details import layout

    raw_key = (num_experts, d_model, d_ff, str(device))
    if _WEIGHTS.get("raw_key") != raw_key:
        _WEIGHTS.clear()  # one layer at a time (a whole K3 layer is ~15 GB in MXFP4)
        _WEIGHTS["raw_key"] = raw_key
        _WEIGHTS["raw"] = (quantize_experts(num_experts, d_model, 2 * d_ff, device, downcast_to_mxfp),
                           quantize_experts(num_experts, d_ff, d_model, device, downcast_to_mxfp))
    if _WEIGHTS.get("warps") != num_warps:
        _WEIGHTS["warps"] = num_warps
        _WEIGHTS["packed"] = None  # free the previous packing before making the next
        value_layout = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
        _WEIGHTS["packed"] = tuple(pack_experts(v, s, *value_layout, *scale_layout) for v, s in _WEIGHTS["raw"])
    return _WEIGHTS["packed"]


def time_matmul_ogs(tokens: int, num_experts: int, d_model: int, d_ff: int, top_k: int, num_local: int | None,
                    device) -> dict:
    """Median ms of the peer's routed-expert path for one MoE layer (w13 + GLU, then w2 x weight + combine).

    tokens: rows of the bf16 latent input (tokens, d_model); num_experts, d_model, d_ff, top_k: the layer
    (K3: 896, 3584, 3072, 16); num_local: experts on one rank of an EP slice (K3 EP8: 112) or None for the
    whole layer; device: a CUDA/HIP device. Returns dict(ms, w13_ms, w2_ms, note); w2_ms includes the top-k
    combine. Raises ImportError (one line) when the peer package is absent; errors of the peer pass through.
    """
    import triton
    from triton.testing import do_bench

    find_triton_kernels()
    import triton_kernels.swiglu
    from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
    from triton_kernels.numerics import InFlexData
    from triton_kernels.tensor import make_ragged_tensor_metadata
    from triton_kernels.topk import topk

    n_exp = num_experts if num_local is None else num_local
    k = local_top_k(top_k, num_experts, num_local)
    warps = scale_num_warps(tokens)
    (w13, s13), (w2, s2) = _weights(n_exp, d_model, d_ff, warps, device)
    pc13 = PrecisionConfig(flex_ctx=FlexCtx(rhs_data=InFlexData()), weight_scale=s13)
    pc2 = PrecisionConfig(flex_ctx=FlexCtx(rhs_data=InFlexData()), weight_scale=s2)
    glu = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                          (SWIGLU_ALPHA, SWIGLU_LIMIT))
    logits = torch.randn((tokens, n_exp), dtype=torch.bfloat16, device=device)
    routing, gather, scatter = make_routing(logits, k, topk, make_ragged_tensor_metadata)
    x = torch.randn((tokens, d_model), dtype=torch.bfloat16, device=device)
    h = torch.empty((tokens * k, d_ff), dtype=torch.bfloat16, device=device)
    y = torch.empty((tokens, d_model), dtype=torch.bfloat16, device=device)

    def w13_call():
        matmul_ogs(x, w13, None, routing, gather_indx=gather, precision_config=pc13, fused_activation=glu, y=h)

    def w2_call():
        matmul_ogs(h, w2, None, routing, scatter_indx=scatter, precision_config=pc2, gammas=routing.gate_scal, y=y)

    def layer():
        w13_call()
        w2_call()

    layer()  # warm-up: compiles and picks the peer's opt flags
    torch.cuda.synchronize()
    note = (f"triton {triton.__version__}, {n_exp} experts x top-{k}, MXFP4 in the peer's default layouts "
            f"({warps}-warp scale swizzle)")
    return dict(ms=do_bench(layer), w13_ms=do_bench(w13_call), w2_ms=do_bench(w2_call), note=note)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for peer_ogs.json")
    args = ap.parse_args(argv)
    rows, missing = [], None
    print("| tokens | experts | matmul_ogs ms | w13 ms | w2 + combine ms | note |\n"
          "|---|---|---|---|---|---|")
    for tokens, num_local in ROWS:
        label = str(E_K3) if num_local is None else f"{num_local} (EP8 slice)"
        try:
            r = time_matmul_ogs(tokens, E_K3, D_K3, I_K3, K_K3, num_local, "cuda")
            print(f"| {tokens} | {label} | {r['ms']:.2f} | {r['w13_ms']:.2f} | {r['w2_ms']:.2f} | {r['note']} |",
                  flush=True)
        except ImportError as exc:
            missing = exc
            r = dict(ms=None, w13_ms=None, w2_ms=None, note=f"not installed: {exc}")
            print(f"| {tokens} | {label} | not installed | | | |", flush=True)
        rows.append(dict(tokens=tokens, num_local=num_local, **r))
    if missing is not None:
        print(f"\nnot installed: {missing}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "peer_ogs.json").write_text(json.dumps(dict(rows=rows), indent=1))


if __name__ == "__main__":
    main()
