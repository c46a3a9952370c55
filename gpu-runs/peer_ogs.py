"""Peer timing: one K3 MoE layer's routed experts through OpenAI's ``triton_kernels.matmul_ogs`` on MXFP4 weights.

The peer is the ``python/triton_kernels`` package of the triton repository at the tag of the installed triton
(3.6.0); it is not installed with pip. It is found on ``PYTHONPATH`` or in the folder named by the environment
variable ``K3ROCM_TRITON_KERNELS`` (the folder that holds ``triton_kernels/``).

Problem (K3_FACTS §2-§5): 896 experts, latent 3584, intermediate 3072, top-16. w13: latent -> 2 x intermediate
with the gate/up GLU fused into the epilogue (the peer's interleaved SwiGLU: same bytes and FLOPs as K3's GLU),
w2: intermediate -> latent, scaled by the routing weight and combined over the token's experts. Weights: random
bf16 quantised by the peer's ``downcast_to_mxfp`` (E2M1 values, E8M0 scales per 32 along K) and put into the
peer's default MXFP4 value/scale layouts for the device (Hopper swizzle on sm_90). Routing: the peer's ``topk``
over random logits and its ragged metadata; it is built once and not timed.

EP8 slice (``num_local``): one rank holds ``num_local`` of the ``num_experts`` experts, and each token brings
``top_k * num_local / num_experts`` pairs to it on average (2 for K3: 16 x 112 / 896). The slice is timed as
``tokens`` tokens each routed to that many distinct experts among the ``num_local`` (same rows per expert on
average as the global routing restricted to the rank's experts).

Timing: ``triton.testing.do_bench`` (median ms) after a warm-up call. Usage (H200):
``PYTHONPATH=/path/to/triton_kernels python gpu-runs/peer_ogs.py --out DIR`` prints a Markdown table and writes
``DIR/peer_ogs.json``.
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
    except ImportError:
        pass
    root = os.environ.get(ENV_VAR)
    if root and (Path(root) / "triton_kernels").is_dir():
        sys.path.insert(0, str(Path(root)))
        importlib.import_module("triton_kernels.matmul_ogs")
        return importlib.import_module("triton_kernels")
    raise ImportError(f"triton_kernels (python/triton_kernels of the triton repository) not found: put it on "
                      f"PYTHONPATH or set {ENV_VAR} to the folder that holds triton_kernels/")


def _quantize_experts(num_experts: int, n: int, k: int, device, chunk: int = 64):
    """Random (num_experts, n, k) bf16 weights -> the peer's MXFP4 (values, scales) in its matmul layouts.

    Quantised ``chunk`` experts at a time (peak memory), along k, then viewed as (E, k, n) column-major as the
    peer's kernel reads them on Hopper.
    """
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout

    vals = torch.empty((num_experts, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((num_experts, n, k // 32), dtype=torch.uint8, device=device)
    for e0 in range(0, num_experts, chunk):
        e1 = min(num_experts, e0 + chunk)
        w = torch.randn((e1 - e0, n, k), dtype=torch.bfloat16, device=device) * k ** -0.5
        vals[e0:e1], scales[e0:e1] = downcast_to_mxfp(w, torch.uint8, axis=-1)
        del w
    vals, scales = vals.transpose(-2, -1), scales.transpose(-2, -1)  # (E, k/2, n), (E, k/32, n): mx axis 1
    value_layout, value_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
    scale_layout, scale_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
    w = convert_layout(wrap_torch_tensor(vals, dtype=FP4), value_layout, **value_opts)
    s = convert_layout(wrap_torch_tensor(scales), scale_layout, **scale_opts)
    return w, s


_WEIGHTS: dict = {}


def _weights(num_experts: int, d_model: int, d_ff: int, device):
    key = (num_experts, d_model, d_ff, str(device))
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # one layer's weights at a time (the full K3 layer is ~15 GB in MXFP4)
        _WEIGHTS[key] = (_quantize_experts(num_experts, 2 * d_ff, d_model, device),
                         _quantize_experts(num_experts, d_model, d_ff, device))
    return _WEIGHTS[key]


def _routing(tokens: int, num_experts: int, k: int, device):
    """The peer's routing objects for random logits: (RoutingData, GatherIndx, ScatterIndx)."""
    from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
    from triton_kernels.tensor import make_ragged_tensor_metadata
    from triton_kernels.topk import topk

    logits = torch.randn((tokens, num_experts), dtype=torch.bfloat16, device=device)
    sparse = topk(logits, k, apply_softmax=True)
    meta = sparse.mask_metadata
    expert_sorted, token_sorted = meta.col_sorted_indx, meta.row_sorted_indx
    ragged = make_ragged_tensor_metadata(meta.col_sum, token_sorted.shape[0])
    gate_scal = sparse.vals.flatten()[expert_sorted]
    routing = RoutingData(gate_scal, meta.col_sum, num_experts, k, ragged)
    return routing, GatherIndx(expert_sorted, token_sorted), ScatterIndx(token_sorted, expert_sorted)


def time_matmul_ogs(tokens: int, num_experts: int, d_model: int, d_ff: int, top_k: int, num_local: int | None,
                    device) -> dict:
    """Median ms of the peer's routed-expert path for one MoE layer (w13 + GLU, then w2 + weighted combine).

    tokens: rows of the bf16 latent input (tokens, d_model); num_experts, d_model, d_ff, top_k: the layer
    (K3: 896, 3584, 3072, 16); num_local: experts on one rank of an EP slice (K3 EP8: 112) or None for the
    whole layer; device: a CUDA/HIP device. Returns dict(ms, w13_ms, w2_ms, note). Raises ImportError (one line)
    when the peer package is absent; torch/triton errors from the peer pass through.
    """
    import triton
    from triton.testing import do_bench

    find_triton_kernels()
    import triton_kernels.swiglu
    from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
    from triton_kernels.numerics import InFlexData

    n_exp = num_experts if num_local is None else num_local
    k = local_top_k(top_k, num_experts, num_local)
    (w13, s13), (w2, s2) = _weights(n_exp, d_model, d_ff, device)
    pc13 = PrecisionConfig(weight_scale=s13, flex_ctx=FlexCtx(rhs_data=InFlexData()))
    pc2 = PrecisionConfig(weight_scale=s2, flex_ctx=FlexCtx(rhs_data=InFlexData()))
    glu = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit"), reduction_n=2),
                          (1.702, 7.0))  # the peer's own SwiGLU constants
    routing, gather, scatter = _routing(tokens, n_exp, k, device)
    x = torch.randn((tokens, d_model), dtype=torch.bfloat16, device=device)
    h = torch.empty((1, tokens * k, d_ff), dtype=torch.bfloat16, device=device)
    y = torch.empty((1, tokens, d_model), dtype=torch.bfloat16, device=device)

    def w13_call():
        matmul_ogs(x, w13, None, routing, gather_indx=gather, precision_config=pc13, fused_activation=glu, y=h)

    def w2_call():
        matmul_ogs(h.view(tokens * k, d_ff), w2, None, routing, scatter_indx=scatter, precision_config=pc2,
                   gammas=routing.gate_scal, y=y)

    def layer():
        w13_call()
        w2_call()

    layer()  # warm-up: compiles and picks the peer's opt flags
    torch.cuda.synchronize()
    note = f"triton {triton.__version__}, {n_exp} experts x top-{k}, MXFP4 weights in the peer's default layouts"
    return dict(ms=do_bench(layer), w13_ms=do_bench(w13_call), w2_ms=do_bench(w2_call), note=note)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for peer_ogs.json")
    args = ap.parse_args(argv)
    rows = []
    print("| tokens | experts | matmul_ogs ms | w13 ms | w2 ms | note |\n|---|---|---|---|---|---|")
    for tokens, num_local in ROWS:
        label = "896" if num_local is None else f"{num_local} (EP8 slice)"
        try:
            r = time_matmul_ogs(tokens, E_K3, D_K3, I_K3, K_K3, num_local, "cuda")
            print(f"| {tokens} | {label} | {r['ms']:.2f} | {r['w13_ms']:.2f} | {r['w2_ms']:.2f} | {r['note']} |",
                  flush=True)
        except ImportError as exc:
            r = dict(ms=None, w13_ms=None, w2_ms=None, note=f"not installed: {exc}")
            print(f"| {tokens} | {label} | not installed | | | {exc} |", flush=True)
        rows.append(dict(tokens=tokens, num_local=num_local, **r))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "peer_ogs.json").write_text(json.dumps(dict(rows=rows), indent=1))


if __name__ == "__main__":
    main()
