"""Probing a model layer by layer: one forward with per-sublayer records, teacher forcing against a shadow model,
and the forward under rounding-sized perturbations.

These run on any :class:`~k3rocm.model.model.K3Model` — the fp32 oracle, a model with the engine's ops and math,
or one rank of a TP/EP layout (where every rank runs the same call: its collectives are the layout's) — so the
validation tiers and the distributed runtime share them (:mod:`k3rocm.runtime.serve` runs them on every rank).
"""

from __future__ import annotations

import torch

from k3rocm.model.layer import Batch

__all__ = ["rel_rms", "flat_batch", "forward_layers", "perturbed_logits"]


def rel_rms(a, ref) -> float:
    """||a - ref||_2 / max(||ref||_2, tiny) in fp64 (relative RMS error); ``a``, ``ref`` tensors of one shape."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def flat_batch(B: int, T: int) -> Batch:
    """:class:`~k3rocm.model.layer.Batch` of ``B`` packed sequences of ``T`` tokens (no cache)."""
    return Batch(torch.arange(0, (B + 1) * T, T, dtype=torch.int32))


def _layers_from(outs: dict, num_layers: int) -> list[dict]:
    """``{"layerNN.attn_out": t, ...}`` -> ``[{"attn_out": t, "mlp_out": t}, ...]`` (one dict per layer)."""
    layers = [dict() for _ in range(num_layers)]
    for k, v in outs.items():
        head, _, kind = k.partition(".")
        if head.startswith("layer") and head[5:].isdigit() and int(head[5:]) < num_layers:
            layers[int(head[5:])][kind] = v
    return layers


def forward_layers(model, ids: torch.Tensor, num_layers: int, shadow=None) -> tuple[torch.Tensor, list[dict]]:
    """One causal forward (no cache) of ``ids`` ``[B, T]`` int64 on a K3Model-like object.

    Uses the layer-by-layer API (``embed`` / ``run_layer`` / ``final``) when the object has it, to also
    record each layer's activation max |h| (the Block AttnRes prefix, or the residual stream, after the
    layer; K3_FACTS §6 calls it |h|max). Returns ``(logits [B, T, V] fp32, layers)``, ``layers[i]`` a dict
    with ``attn_out``, ``mlp_out`` ``[B, T, D]`` fp32 and ``absmax`` (float).

    ``shadow``: another model with the layer API, run teacher-forced in the same pass: before each sublayer
    (token mixer, then channel mixer; :meth:`~k3rocm.model.model.K3Model.run_attn` / ``run_mlp``) the state
    (AttnRes bank and prefix, or the residual stream) is copied and ``shadow``'s sublayer runs on the copy, so
    neither half sees the shadow's own error of the other half (a MoE router's top-k is discontinuous: an
    attention-side rounding difference would flip near-tied experts and show up as a channel-mixer error);
    ``layers[i]["teacher_forced"]`` = ``{"attn_out": rel_rms, "mlp_out": rel_rms}`` of its outputs against
    ``model``'s. A shadow with only ``run_layer`` is forced per layer.
    """
    B, T = ids.shape
    if all(hasattr(model, a) for a in ("embed", "run_layer", "final")):
        halves = shadow is not None and all(hasattr(o, a) for o in (model, shadow) for a in ("run_attn", "run_mlp"))
        with torch.no_grad():
            st = model.embed(ids.reshape(-1), flat_batch(B, T), record=True)
            absmax, forced = [], []
            for i in range(num_layers):
                if halves:
                    se = st.clone()
                    shadow.run_attn(i, se)
                    model.run_attn(i, st)
                    sm = st.clone()
                    shadow.run_mlp(i, sm)
                    model.run_mlp(i, st)
                    se.outputs.update(sm.outputs)
                elif shadow is not None:
                    se = st.clone()
                    shadow.run_layer(i, se)
                    model.run_layer(i, st)
                else:
                    model.run_layer(i, st)
                if shadow is not None:
                    forced.append({n: rel_rms(se.outputs[f"layer{i:02d}.{n}"], st.outputs[f"layer{i:02d}.{n}"])
                                   for n in ("attn_out", "mlp_out")})
                h = st.res.prefix if getattr(st, "res", None) is not None else st.hidden
                absmax.append(float(h.abs().max()))
            logits = model.final(st).view(B, T, -1).float()
        layers = _layers_from({k: v.view(B, T, -1) for k, v in st.outputs.items()}, num_layers)
        for i, (lay, m) in enumerate(zip(layers, absmax)):
            lay["absmax"] = m
            if forced:
                lay["teacher_forced"] = forced[i]
        return logits, layers
    out = model.forward(ids, return_layers=True)
    logits, outs = out if isinstance(out, tuple) else (out.logits, out.layers)
    return logits.float(), _layers_from(dict(outs), num_layers)


def perturbed_logits(model, ids: torch.Tensor, rel: float) -> torch.Tensor:
    """Logits ``[B, T, V]`` fp32 of ``model`` with its embeddings and every sublayer output (each token mixer and
    channel mixer, before it is added to the residual prefix / stream) multiplied elementwise by ``1 + u``, ``u``
    uniform in ``[-rel, rel]`` (fixed seed, drawn on the CPU: the same on every rank of a layout)."""
    B, T = ids.shape
    g = torch.Generator().manual_seed(0)

    def jitter(x):
        # (the stored embeddings are often bf16 already, so a literal rounding would change nothing)
        u = torch.rand(x.shape, generator=g, dtype=torch.float32).to(x.device) * 2.0 - 1.0
        return x * (1.0 + u * rel)

    with torch.no_grad():
        st = model.embed(ids.reshape(-1), flat_batch(B, T))
        if st.res is not None:
            st.res.prefix = jitter(st.res.prefix)
        else:
            st.hidden = jitter(st.hidden)
        st.perturb = jitter
        for i in range(model.cfg.num_hidden_layers):
            model.run_layer(i, st)
        return model.final(st).view(B, T, -1).float()
