"""Validation tiers (DESIGN.md §4): env → load → forward → correctness → performance.

``run_tiers(session, level)`` runs every tier up to ``level`` in order and stops at the first tier that
does not pass. Each tier returns a :class:`~k3rocm.validation.evidence.Stage` of evidence rows; a
tier that cannot run (missing component, unreadable checkpoint) is a stage with ``status="error"`` and
its one-line reason.

Thresholds (recorded in the report's reproduction block) are in :data:`THRESHOLDS`. Their sources:
the golden data README (fp32 vs fp32: logits within ~2e-3 absolute, per-layer within ~1e-3 relative
RMS, argmax equal where the top-1 margin exceeds 1e-2) and the BF16 round-off of the engine's weights
(unit round-off 2^-8 ≈ 3.9e-3 per product, accumulated over a 13-93 layer stack: a few 1e-2 relative).
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Callable

from k3rocm.errors import K3Error
from k3rocm.validation.evidence import TIERS, Stage, Timer, check, info, now_iso
from k3rocm.validation.session import Session

# name -> threshold value; the checks below cite these names.
THRESHOLDS: dict[str, float] = {
    # engine (BF16 weights, selected kernels) vs fp32 oracle
    "engine.layer_rel_rms": 5e-2,       # per-layer output, relative RMS error
    "engine.logits_kl": 5e-3,           # mean KL(oracle || engine) per token, nats
    "engine.top1_agreement": 0.90,      # fraction of positions with the same argmax
    "engine.logits_max_abs": 0.5,       # max |logit difference|
    "decode_vs_prefill.max_abs": 5e-3,  # logits of token-by-token decode vs one prefill (same path)
    # oracle (fp32) vs external golden logits (golden README)
    "golden.logits_max_abs": 3e-3,   # README: "within ~2e-3"; measured 2.28e-3 on k3-tiny (the unit test's bound)
    "golden.layer_rel_rms": 1e-3,
    "golden.top1_margin": 1e-2,         # argmax compared only where the golden margin exceeds this
    # official checkpoint known answers (K3_FACTS §6)
    "official.logit_abs": 5e-3,
    # forward tier
    "forward.max_abs_h": 1e4,           # activations beyond this mean a blow-up (K3 peaks ~80, K3_FACTS §6)
}

# K3_FACTS §6: known answers of a full fp32 forward on the official checkpoint.
OFFICIAL_IDS = [3, 4, 5, 6, 7]
OFFICIAL_ARGMAX, OFFICIAL_TOP_LOGIT, OFFICIAL_MEAN_LOGIT = 2494, 15.021948, -0.462536
OFFICIAL_FIRST_ABSMAX = [0.145457, 0.187096, 0.463652, 1.284419]
OFFICIAL_LAST_ABSMAX = 31.064180
OFFICIAL_PROMPT = [1008, 10484, 318, 15383, 387]
OFFICIAL_GREEDY = [17374, 20829, 10, 427, 414, 1008, 606, 142957]


# ============================================================================ model adapters
def _t():
    import torch
    return torch


def _layers_from(outs: dict, num_layers: int) -> list[dict]:
    """``{"layerNN.attn_out": t, ...}`` -> ``[{"attn_out": t, "mlp_out": t}, ...]`` (one dict per layer)."""
    layers = [dict() for _ in range(num_layers)]
    for k, v in outs.items():
        head, _, kind = k.partition(".")
        if head.startswith("layer") and head[5:].isdigit() and int(head[5:]) < num_layers:
            layers[int(head[5:])][kind] = v
    return layers


def _flat_batch(B: int, T: int):
    """:class:`~k3rocm.model.layer.Batch` of ``B`` packed sequences of ``T`` tokens (no cache)."""
    torch = _t()
    from k3rocm.model.layer import Batch
    return Batch(torch.arange(0, (B + 1) * T, T, dtype=torch.int32))


def model_forward(model, ids, num_layers: int, shadow=None):
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
    ``model``'s (see :func:`teacher_forced_layers`). A shadow with only ``run_layer`` is forced per layer.
    """
    torch = _t()
    B, T = ids.shape
    if all(hasattr(model, a) for a in ("embed", "run_layer", "final")):
        halves = shadow is not None and all(hasattr(o, a) for o in (model, shadow) for a in ("run_attn", "run_mlp"))
        with torch.no_grad():
            st = model.embed(ids.reshape(-1), _flat_batch(B, T), record=True)
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


def oracle_forward(model, ids):
    """fp32 oracle forward; see :func:`model_forward`."""
    return model_forward(model, ids, model.cfg.num_hidden_layers)


def teacher_forced_layers(model, oracle, ids) -> list[dict]:
    """Each layer of ``model`` run on the oracle's own input to that layer, compared with the oracle's output.

    ``ids`` ``[B, T]`` int64. Both objects need the layer-by-layer API (``embed`` / ``run_layer``). Errors do
    not compound across layers: a random-weight test model amplifies any rounding end to end (see
    :func:`oracle_sensitivity`), while a per-layer error here points at the layer that is wrong.
    Returns ``[{"attn_out": rel_rms, "mlp_out": rel_rms}, ...]`` per layer (one oracle pass,
    :func:`model_forward` with ``shadow=model``).
    """
    _, layers = model_forward(oracle, ids, oracle.cfg.num_hidden_layers, shadow=model)
    return [lay["teacher_forced"] for lay in layers]


def oracle_sensitivity(oracle, ids, ref_logits, rel: float = 2.0 ** -9) -> dict:
    """How much the fp32 oracle's own logits move under rounding-sized errors of relative size ``rel``.

    The embeddings and every sublayer output (each token mixer and channel mixer, before it is added to the
    residual prefix / stream) are multiplied elementwise by ``1 + u``, ``u`` uniform in ``[-rel, rel]`` (fixed
    seed). An engine makes rounding errors of its own precision at every projection (bf16: 2^-9 per rounding;
    fp32: about sqrt(D) x 2^-24 per dot product of length D), so an end-to-end comparison can never be tighter
    than the model's response to such errors. Perturbing every sublayer, not only the embeddings, also lets a
    MoE router see errors of that size at its own input (its top-k flips near-tied experts, a discontinuous
    response). Random-weight test models (k3-tiny) amplify such errors to O(1) logit changes; a trained model
    barely moves. Returns :func:`logits_compare` of the perturbed run against ``ref_logits`` ``[B, T, V]``.
    """
    torch = _t()
    B, T = ids.shape
    g = torch.Generator().manual_seed(0)

    def jitter(x):
        # (the stored embeddings are often bf16 already, so a literal rounding would change nothing)
        u = torch.rand(x.shape, generator=g, dtype=torch.float32).to(x.device) * 2.0 - 1.0
        return x * (1.0 + u * rel)

    with torch.no_grad():
        st = oracle.embed(ids.reshape(-1), _flat_batch(B, T))
        if st.res is not None:
            st.res.prefix = jitter(st.res.prefix)
        else:
            st.hidden = jitter(st.hidden)
        st.perturb = jitter
        for i in range(oracle.cfg.num_hidden_layers):
            oracle.run_layer(i, st)
        logits = oracle.final(st).view(B, T, -1).float()
    return logits_compare(logits, ref_logits)


def engine_rounding(engine, hidden_size: int) -> float:
    """Relative size of the rounding error one projection of ``engine`` makes: 2^-9 (half a bf16/fp16 ulp,
    2^-12 for fp16) when it computes or stores in reduced precision (weights, matmuls or cache), else the fp32
    dot-product error sqrt(hidden_size) x 2^-24 (accumulation-order differences between batch shapes)."""
    torch = _t()
    f32 = torch.float32
    dts = [getattr(engine, a, f32) for a in ("dtype", "kv_dtype", "matmul_dtype")]
    low = [d for d in dts if d is not None and d != f32]
    if not low:
        return math.sqrt(hidden_size) * 2.0 ** -24
    return 2.0 ** -9 if any(d != torch.float16 for d in low) else 2.0 ** -12


def serve_with_logits(engine, prompt: list[int], n: int):
    """Serve one request of ``prompt`` for ``n`` greedy tokens through the engine's own path (prefill
    chunk, then decode steps on the KDA slot pool and paged MLA cache, CUDA/HIP graphs when on) and
    capture the logits it sampled from. Returns ``(tokens [n] list, logits [n, V] fp32 cpu)``.

    Works on ``k3rocm.runtime.engine.Engine`` (``add_request``/``step``; logits observed at its
    ``_forward`` / ``_graph_decode`` return) and on K3Model-like objects (``new_cache``/``prefill``/``decode``).
    """
    torch = _t()
    if hasattr(engine, "add_request"):
        seen = []
        spies = {}
        for name in ("_forward", "_graph_decode"):
            orig = getattr(engine, name, None)
            if orig is None:
                continue

            def spy(*a, _orig=orig, **k):
                out = _orig(*a, **k)
                # never touch the host while a CUDA/HIP graph is being captured (the engine's warm-up and
                # capture call _forward in graph mode); the replay's logits are seen at _graph_decode
                if out is not None and not getattr(engine, "_graph_mode", False):
                    seen.append(out.detach().float().cpu())
                return out
            spies[name] = spy
            setattr(engine, name, spy)
        try:
            rid = engine.add_request(list(prompt), n, ignore_eos=True)
            while engine.has_unfinished():
                engine.step()
        finally:
            for name in spies:
                delattr(engine, name)  # back to the class method
        toks = list(engine.seqs[rid].output)
        rows = [x[-1] for x in seen if x.dim() == 2 and x.shape[0] >= 1]
        return toks, (torch.stack(rows) if rows else torch.zeros(0))
    cache = engine.new_cache(1, len(prompt) + n + 1)
    with torch.no_grad():
        last = engine.prefill(torch.tensor([prompt]), cache)[:, -1].float()
        toks, rows = [], []
        for step in range(n):
            rows.append(last[0].cpu())
            tok = last.argmax(-1)
            toks.append(int(tok))
            if step + 1 < n:
                last = engine.decode(tok, cache).float()
    return toks, torch.stack(rows)


def _absmax(layer: dict) -> float:
    v = layer.get("absmax")
    return float(v) if v is not None else float("nan")


# ============================================================================ metrics
def rel_rms(a, ref) -> float:
    """||a - ref||_2 / max(||ref||_2, tiny) in fp64 (relative RMS error)."""
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def logits_compare(test, ref) -> dict:
    """KL(ref || test) mean per position (nats), top-1 agreement, max |diff|, on ``[..., V]`` logits."""
    torch = _t()
    test, ref = test.detach().double().cpu(), ref.detach().double().cpu()
    lt, lr = torch.log_softmax(test, -1), torch.log_softmax(ref, -1)
    kl = (lr.exp() * (lr - lt)).sum(-1)
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((test.argmax(-1) == ref.argmax(-1)).double().mean()),
            "max_abs": float((test - ref).abs().max()),
            "finite": bool(torch.isfinite(test).all())}


def _ids(session: Session, batch: int, length: int):
    """Seeded random token ids ``[batch, length]`` int64 avoiding BOS/EOS/pad."""
    torch = _t()
    cfg = session.config
    g = torch.Generator().manual_seed(int(session.opts.seed))
    special = {cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id}
    lo = 3 if cfg.vocab_size > 16 else 0
    ids = torch.randint(lo, cfg.vocab_size, (batch, length), generator=g)
    for s in special:
        ids[ids == s] = (s + 7) % cfg.vocab_size
    return ids


# ============================================================================ tiers
def tier_env(session: Session, stage: Stage) -> None:
    """Is this the hardware and software the profile expects? (backend, arch, count, memory, versions)."""
    det, prof = session.detected, session.profile
    lv = session.measured_level
    stage.add(info("env", "backend", det.backend, detail=f"torch {det.torch_version} ({det.torch_build})"),
              info("env", "triton", det.triton_version or "absent",
                   detail=f"target {det.triton_target}" if det.triton_target else "no GPU target (CPU)"),
              info("env", "aiter", det.aiter_version or "absent"),
              info("env", "devices", det.count, detail=", ".join(f"{d.name} {d.arch}" for d in det.devices)
                   or "GPUs visible: none; the run uses the CPU (one device in the report's header)"),
              info("env", "device.memory_visible", round(det.memory_bytes / 1e9, 2), "GB",
                   detail="smallest visible device"),
              info("env", "profile", prof.name, level="projected",
                   detail=f"expects {prof.device_count} x {prof.device_name} ({prof.arch}, "
                          f"{prof.memory_bytes / 1e9:.0f} GB) [{_figure_kind(prof, 'device.memory_source')}]"))
    if prof.backend == "cpu":
        stage.add(check("env", "torch.import", True, eq=True, detail="torch imports and computes on the CPU"))
    elif session.hardware_matches:
        stage.add(check("env", "device.arch", det.arch, eq=prof.arch),
                  check("env", "device.count", det.count, ge=prof.device_count),
                  check("env", "device.memory", det.memory_bytes / 1e9, ge=0.9 * prof.memory_bytes / 1e9, unit="GB",
                        detail="at least 90% of the profile's HBM is visible"))
    else:
        stage.add(info("env", "hardware.fallback", f"{det.backend}:{det.arch or 'cpu'} x{det.count}",
                       level="measured-fallback",
                       detail=f"profile {prof.name} names {prof.arch} x{prof.device_count}; every measurement "
                              "in this report is measured-fallback, targets are projected"))
    stage.add(info("env", "env_vars", len(det.env), detail=", ".join(f"{k}={v}" for k, v in det.env.items())[:300]))
    from k3rocm.runtime import registry
    errs = registry.import_errors()
    if det.count:  # on a GPU a kernel family that does not import would silently run as the torch oracle
        stage.add(check("env", "kernels.import", len(errs), eq=0, unit="families failed",
                        detail="; ".join(f"{f}: {e}" for f, e in errs.items())[:300] or "every kernel family imports"))
    elif errs:
        stage.add(info("env", "kernels.import", len(errs), "families failed",
                       detail="; ".join(f"{f}: {e}" for f, e in errs.items())[:300]))
    for n in det.notes:
        stage.add(info("env", "note", n))
    stage.add(info("env", "level", lv, detail="level of every measurement in this report"))


def tier_load(session: Session, stage: Stage, progress: Callable | None = None) -> None:
    """Did every byte land where the plan said? Index complete, headers valid, scales sane, bytes, GB/s."""
    from k3rocm.checkpoint import layout
    with Timer() as t:
        idx = session.index
    stage.add(info("load", "index.open", round(t.seconds * 1e3, 2), "ms",
                   detail="directory, index, every shard header, tensor set and E8M0 scales validated"),
              check("load", "index.tensors", len(idx), eq=layout.counts(session.config)["tensors"],
                    detail="text tensors in the index vs the layout of the config"))
    stage.add(info("load", "checkpoint.official", session.is_official,
                   detail="config and tensor set equal the official release's (K3_FACTS §2); when true the "
                          "correctness tier checks the release's known answers"))
    manifest = session.checkpoint_dir / _manifest_name()
    if manifest.is_file():
        from k3rocm.checkpoint.verify import verify_manifest as verify
        with Timer() as tv:
            res = verify(session.checkpoint_dir)
        bad = list(res)
        stage.add(check("load", "manifest.sha256", len(bad), eq=0, unit="files",
                        detail=(f"files whose sha256 differs from {manifest.name}: none" if not bad
                                else "; ".join(bad)[:200])),
                  info("load", "manifest.seconds", round(tv.seconds, 3), "s"))
    plc = session.placement
    _placement_rows(stage, plc, "load")
    run = session.run_placement
    if run is not plc:
        # a fallback run loads with this machine's plan; the profile's plan above stays the projected one
        stage.add(info("load", "run_plan.tp", run.tp, level=session.measured_level,
                       detail=f"the plan the weights were loaded with: {run.profile_name} (this machine), not "
                              f"{plc.profile_name}"),
                  info("load", "run_plan.ep", run.ep, level=session.measured_level),
                  info("load", "run_plan.weights_bytes_per_gpu", run.ranks[0].weights_bytes if run.ranks else 0,
                       "B", level=session.measured_level))
    with Timer() as tl:
        rep = session.load(progress=progress).report
    lv = session.measured_level
    r = rep.to_dict()
    # the problems row first: a failed load's one error line then names the tensor and what is wrong with it
    stage.add(info("load", "load.seconds", round(tl.seconds, 3), "s", level=lv,
                   detail=f"{r['world']} rank(s) onto {r['device']}, {r['threads']} reader threads, "
                          "verification included"),
              check("load", "load.problems", len(r["problems"]), eq=0, level=lv,
                    detail="; ".join(map(str, r["problems"]))[:300] or "none"),
              check("load", "load.tensors_loaded", int(r["tensors_loaded"]), eq=int(r["tensors_planned"]), level=lv,
                    detail="tensors the plan names for the loaded ranks"),
              check("load", "load.tensors_verified", int(r["tensors_verified"]), eq=int(r["tensors_planned"]),
                    level=lv, detail="checksum of each loaded slice equals the same slice read independently"))
    planned, used = _per_rank(r["bytes_planned"]), _per_rank(r["bytes_loaded"])
    keys = sorted(set(planned) | set(used), key=lambda k: (len(k), k))
    for k in keys:
        stage.add(check("load", f"bytes[rank {k}]", used.get(k, 0), eq=planned.get(k, 0), unit="B", level=lv,
                        detail="bytes loaded vs planned for this rank"))
    if keys:
        stage.series["bytes_per_device"] = {"title": "weight bytes per rank: planned vs loaded", "kind": "bar",
                                            "x": keys, "xlabel": "rank", "ylabel": "MB",
                                            "y": {"planned": [planned.get(k, 0) / 1e6 for k in keys],
                                                  "loaded": [used.get(k, 0) / 1e6 for k in keys]}}
    stage.add(info("load", "load.bytes", sum(used.values()), "B", level=lv))
    for key, unit, d in (("aggregate_gbps", "GB/s", "load throughput, all ranks (reads and device copies; verification not included)"),
                         ("raw_read_gbps", "GB/s", "sequential read of the same shard files"
                          + (" (page cache dropped first)" if r.get("page_cache_dropped") else "")),
                         ("load_vs_raw", "", "load throughput / raw read throughput"),
                         ("verify_seconds", "s", "time to verify every tensor")):
        if r.get(key) is not None:
            stage.add(info("load", f"load.{key}", round(float(r[key]), 4), unit, level=lv, detail=d))


def _per_rank(d) -> dict:
    if not d:
        return {}
    return {str(k): int(v) for k, v in dict(d).items()}


def _manifest_name() -> str:
    from k3rocm.checkpoint.verify import MANIFEST_NAME
    return MANIFEST_NAME


def _as_dict(obj) -> dict:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return obj
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return dict(vars(obj))


def _figure_kind(prof, source_key: str) -> str:
    """``"assumed"`` when the profile's source note for a figure says it is an assumption (the ``cpu``
    profile's), else ``"datasheet"``."""
    src = str(getattr(prof, "sources", {}).get(source_key, ""))
    return "assumed" if src.lower().startswith("assumption") else "datasheet"


def _placement_rows(stage: Stage, plc, tier: str) -> None:
    """Projected rows of a placement: layout, per-GPU bytes, fits, cache capacity."""
    d = _as_dict(plc)
    where = f"plan of {d.get('config', '?')} on {d.get('profile', '?')}"
    if "fits" in d:
        stage.add(check(tier, "plan.fits", bool(d["fits"]), eq=True, level="projected",
                        detail=d.get("problem") or f"{where}: weights + reserves + one sequence of cache fit"))
    for k, unit in (("tp", ""), ("ep", ""), ("experts_per_rank", ""), ("weights_bytes_per_gpu", "B"),
                    ("needed_bytes", "B"), ("usable_bytes", "B")):
        if k in d:
            stage.add(info(tier, f"plan.{k}", d[k], unit, level="projected", detail=where))
    cache = d.get("cache") or {}
    for k in ("max_tokens", "max_sequences", "context_len"):
        if k in cache:
            stage.add(info(tier, f"plan.cache.{k}", cache[k], level="projected", detail=where))


def tier_forward(session: Session, stage: Stage) -> None:
    """Does a prefill + decode run? Finite outputs, shapes, per-layer activation max |h|, timings."""
    torch = _t()
    cfg, lv = session.config, session.measured_level
    eng = session.engine
    model = session.engine_model(eng)
    B, T, steps = 2, 16, 4
    ids = _ids(session, B, T)
    # the first call pays kernel compilation / autotuning (minutes at full width on a cold cache); the timed
    # figure is the second call
    with Timer() as t1:
        model_forward(model, ids, cfg.num_hidden_layers)
    with Timer() as tp:
        logits, layers = model_forward(model, ids, cfg.num_hidden_layers)
    stage.add(check("forward", "prefill.shape", list(logits.shape), eq=[B, T, cfg.vocab_size], level=lv),
              check("forward", "prefill.finite", bool(torch.isfinite(logits).all()), eq=True, level=lv),
              info("forward", "prefill.ms", round(tp.seconds * 1e3, 3), "ms", level=lv,
                   detail=f"B={B}, T={T}, layer by layer with the engine's ops, second call"),
              info("forward", "prefill.first_call_ms", round(t1.seconds * 1e3, 3), "ms", level=lv,
                   detail="the same, first call: includes kernel compilation and autotuning"))
    am = [_absmax(x) for x in layers]
    if am:
        worst = max(am) if all(math.isfinite(a) for a in am) else float("inf")
        stage.add(check("forward", "layers.max_abs_h", worst, le=THRESHOLDS["forward.max_abs_h"], level=lv,
                        detail=f"max over {len(am)} layers of max |h|"))
        stage.series["absmax"] = {"title": "per-layer activation max |h|", "x": list(range(len(am))),
                                  "y": {"max |h|": am}, "xlabel": "layer", "ylabel": "max |h|", "log": True}
    def serve():
        if hasattr(eng, "generate") and hasattr(eng, "add_request"):
            return torch.tensor(eng.generate([r.tolist() for r in ids], steps))
        return torch.as_tensor(eng.generate_greedy(ids, steps))

    serve()  # warm-up: decode kernels compile, graphs are captured
    with Timer() as td:
        toks = serve()
    stage.add(check("forward", "decode.shape", list(toks.shape), eq=[B, steps], level=lv,
                    detail="served prompts produced the requested number of tokens"),
              check("forward", "decode.in_vocab", bool(((toks >= 0) & (toks < cfg.vocab_size)).all()),
                    eq=True, level=lv),
              info("forward", "serve.ms_per_token", round(td.seconds * 1e3 / steps, 3), "ms", level=lv,
                   detail=f"{B} requests of {T} prompt tokens, {steps} output tokens each, prefill included "
                          "(after one warm-up run of the same)"))


def tier_correctness(session: Session, stage: Stage) -> None:
    """Does the selected implementation path match the fp32 oracle (and external references when given)?"""
    torch = _t()
    lv = session.measured_level
    eng, orc = session.engine, session.oracle
    model = session.engine_model(eng)
    ids = _ids(session, 2, 16)
    # per layer: each engine layer on the oracle's input (teacher-forced: the check, in the oracle's own pass),
    # and free-running (the plot)
    ol, olay = model_forward(orc, ids, orc.cfg.num_hidden_layers,
                             shadow=model if hasattr(model, "run_layer") else None)
    el, elay = model_forward(model, ids, session.config.num_hidden_layers)
    names = ("attn_out", "mlp_out")
    tf = [lay["teacher_forced"] for lay in olay if "teacher_forced" in lay]
    series = {n: [] for n in names}
    for a, b in zip(elay, olay):
        for n in names:
            if n in a and n in b:
                series[n].append(rel_rms(a[n], b[n]))
    per_layer = [(i, n, d[n]) for i, d in enumerate(tf) for n in names] or \
                [(i, n, v) for n in names for i, v in enumerate(series[n])]
    if per_layer:
        wi, wn, worst = max(per_layer, key=lambda x: x[2] if math.isfinite(x[2]) else float("inf"))
        worst = worst if math.isfinite(worst) else float("inf")
        how = "each engine layer on the oracle's input to it" if tf else "free-running stack"
        stage.add(check("correctness", "layers.rel_rms.max", worst, le=THRESHOLDS["engine.layer_rel_rms"], level=lv,
                        detail=f"engine ({_impl_note(session)}) vs fp32 oracle, {how}; worst: layer {wi} {wn}"))
        y = {f"teacher-forced: {n}": [d[n] for d in tf] for n in names} if tf else {}
        y.update({f"free-running: {k}": v for k, v in series.items() if v})
        stage.series["layer_error"] = {
            "title": "per-layer relative RMS error, engine vs fp32 oracle", "x": list(range(len(olay))),
            "xlabel": "layer", "ylabel": "relative RMS error", "log": True,
            "y": {k + (" (all exactly 0)" if not any(v) else ""): v for k, v in y.items()}}
    # end to end: the engine is held to the fixed thresholds or to a multiple of the oracle's own response to an
    # error of the engine's rounding size at every sublayer (embeddings included), whichever is looser
    rel = engine_rounding(eng, session.config.hidden_size)
    sens = oracle_sensitivity(orc, ids, ol, rel) if hasattr(orc, "run_layer") else None
    amp = 4.0
    kl_b, abs_b, top_b = (THRESHOLDS["engine.logits_kl"], THRESHOLDS["engine.logits_max_abs"],
                          THRESHOLDS["engine.top1_agreement"])
    note = ""
    if sens is not None:
        stage.add(info("correctness", "oracle.sensitivity.max_abs", round(sens["max_abs"], 6), level=lv,
                       detail=f"logits of the fp32 oracle with a +-{rel:.2g} relative error (the engine's rounding size) "
                              "on its embeddings and every sublayer output, vs without"),
                  info("correctness", "oracle.sensitivity.kl", sens["kl"], "nats", level=lv),
                  info("correctness", "oracle.sensitivity.top1", round(sens["top1"], 4), level=lv))
        kl_b, abs_b = max(kl_b, amp * sens["kl"]), max(abs_b, amp * sens["max_abs"])
        top_b = min(top_b, max(0.0, 1.0 - amp * (1.0 - sens["top1"])))
        note = (f"; bound = the fixed threshold or {amp:g} x the oracle's own response to a {rel:.2g} relative "
                "error at every sublayer, whichever is looser")
    c = logits_compare(el, ol)
    if set(session.kernel_selection().values()) == {"torch"}:
        note += "; every op is the torch oracle itself here, so this compares weight handling and batching only"
    stage.add(check("correctness", "logits.kl", c["kl"], le=kl_b, unit="nats", level=lv,
                    detail="mean KL(oracle || engine) per position" + note),
              check("correctness", "logits.top1_agreement", c["top1"], ge=top_b, level=lv, detail=note[2:]),
              check("correctness", "logits.max_abs", c["max_abs"], le=abs_b, level=lv, detail=note[2:]))
    tok_b = 1.0 if sens is None else max(0.0, 1.0 - amp * (1.0 - sens["top1"]))
    dvp_b = THRESHOLDS["decode_vs_prefill.max_abs"] if sens is None else \
        max(THRESHOLDS["decode_vs_prefill.max_abs"], amp * sens["max_abs"])
    # the engine's serving path (decode kernels, caches, graphs) vs one forward of the same ops
    n_dec = 4
    worst_abs, agree, rows = 0.0, 0, 0
    for r in range(ids.shape[0]):
        prompt = ids[r, :12].tolist()
        toks, got = serve_with_logits(eng, prompt, n_dec)
        full = torch.tensor([prompt + toks[:-1]])
        ref, _ = model_forward(model, full, session.config.num_hidden_layers)
        ref = ref[0, len(prompt) - 1:].cpu()
        if got.shape != ref.shape:
            stage.add(check("correctness", "serve.logits_rows", list(got.shape), eq=list(ref.shape), level=lv,
                            detail="logits observed from the engine per sampled token"))
            return
        worst_abs = max(worst_abs, float((got - ref).abs().max()))
        agree += int((torch.tensor(toks) == ref.argmax(-1)).sum())
        rows += n_dec
    stage.add(check("correctness", "decode_vs_prefill.max_abs", worst_abs, le=dvp_b,
                    level=lv, detail=f"engine serving path (prefill 12 + decode {n_dec - 1}, slot pool, paged MLA "
                                     "cache) vs one forward of the same ops, logits" + note),
              check("correctness", "decode_vs_prefill.tokens", agree / max(rows, 1), ge=tok_b, level=lv,
                    detail="served greedy tokens equal the forward's argmax" + note))
    if session.opts.golden:
        golden_checks(session, stage)
    if session.is_official:
        official_checks(session, stage)


def _impl_note(session: Session) -> str:
    sel = session.kernel_selection()
    kinds = sorted(set(sel.values()))
    note = "ops: " + (", ".join(kinds) if len(kinds) <= 1 else ", ".join(f"{k}={v}" for k, v in sel.items()))
    if kinds == ["torch"]:
        # say plainly what this row can and cannot show: both sides run the same op code here
        note += ("; every op is the torch oracle itself, so this row checks only the engine's weight handling "
                 "and batching, not kernels (the serving-path rows below and a GPU run exercise more)")
    return note


def golden_checks(session: Session, stage: Stage) -> None:
    """Compare the fp32 oracle with an external golden file (input_ids, logits, layerNN.*, greedy_*)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from k3rocm.validation.session import check_golden_file
    p = Path(session.opts.golden)
    check_golden_file(p, session.config)  # the same check as the pre-flight (this may be called without it)
    g = load_file(str(p))
    ids = g["input_ids"].long()
    ol, olay = oracle_forward(session.oracle, ids)
    ol = ol.cpu()
    ref = g["logits"].float()
    errs = []
    for i, lay in enumerate(olay):
        for n in ("attn_out", "mlp_out"):
            key = f"layer{i:02d}.{n}"
            if key in g and n in lay:
                errs.append((key, rel_rms(lay[n], g[key])))
    # an independent fp32 implementation differs by ~1e-6 at the first layer; an O(1) difference there means
    # the golden data was made from other weights (the usual mistake: the default k3-tiny, not its checkpoint)
    hint = (f"golden data of another checkpoint? ({errs[0][0]} already differs by {errs[0][1]:.2g}): pass the "
            "checkpoint it was made from with --checkpoint; " if errs and errs[0][1] > 0.5 else "")
    c = logits_compare(ol, ref)
    margin = g.get("logits_top1_margin")
    sure = (margin > THRESHOLDS["golden.top1_margin"]) if margin is not None else _t().ones_like(ref[..., 0], dtype=_t().bool)
    agree = float((ol.argmax(-1) == ref.argmax(-1))[sure].double().mean()) if bool(sure.any()) else 1.0
    stage.add(check("correctness", "golden.logits_max_abs", c["max_abs"], le=THRESHOLDS["golden.logits_max_abs"],
                    level="external", detail=f"{hint}fp32 oracle vs {p.name} logits {list(ref.shape)}"),
              check("correctness", "golden.top1_agreement", agree, ge=1.0, level="external",
                    detail=(f"argmax where golden margin > {THRESHOLDS['golden.top1_margin']:g} "
                            f"({int(sure.sum())} of {sure.numel()} positions)") if margin is not None else
                    f"argmax at all {sure.numel()} positions (the file has no logits_top1_margin, so near-ties "
                    "are compared too)"),
              info("correctness", "golden.logits_kl", c["kl"], "nats", level="external"))
    if errs:
        worst = max(errs, key=lambda x: x[1])
        stage.add(check("correctness", "golden.layers.rel_rms.max", worst[1], le=THRESHOLDS["golden.layer_rel_rms"],
                        level="external", detail=f"worst: {worst[0]} over {len(errs)} layer outputs"))
        ser = stage.series.setdefault("layer_error", {"title": "per-layer relative RMS error", "x": [],
                                                      "xlabel": "layer", "ylabel": "relative RMS error",
                                                      "log": True, "y": {}})
        for n in ("attn_out", "mlp_out"):
            vals = [e for k, e in errs if k.endswith(n)]
            if vals:
                ser["y"][f"oracle vs golden {n}"] = vals
                ser["x"] = ser["x"] or list(range(len(vals)))
    if "greedy_prompt" in g and "greedy_tokens" in g:
        prompt = g["greedy_prompt"].long().view(1, -1)
        want = g["greedy_tokens"].long().view(-1)
        got = _greedy(session.oracle, prompt, want.numel())
        margins = g.get("greedy_margins")
        stage.add(check("correctness", "golden.greedy_tokens", got, eq=want.tolist(), level="external",
                        detail=f"oracle greedy continuation of greedy_prompt "
                               f"(min margin {float(margins.min()) if margins is not None else float('nan'):.3g})"))


def _greedy(model, prompt, n: int) -> list[int]:
    """Greedy continuation of ``prompt`` ``[1, L]`` by ``n`` tokens through the model's cache path."""
    torch = _t()
    out = model.generate_greedy(prompt, n)
    return [int(x) for x in torch.as_tensor(out).reshape(-1)[-n:]]


def official_checks(session: Session, stage: Stage) -> None:
    """K3_FACTS §6 known answers on the official checkpoint (external evidence)."""
    torch = _t()
    ids = torch.tensor([OFFICIAL_IDS])
    logits, layers = oracle_forward(session.oracle, ids)
    last = logits[0, -1]
    tol = THRESHOLDS["official.logit_abs"]
    stage.add(check("correctness", "official.argmax", int(last.argmax()), eq=OFFICIAL_ARGMAX, level="external",
                    detail="ids [3,4,5,6,7], last position (K3_FACTS §6)"),
              check("correctness", "official.top_logit_err", abs(float(last.max()) - OFFICIAL_TOP_LOGIT), le=tol,
                    level="external", detail=f"vs {OFFICIAL_TOP_LOGIT}"),
              check("correctness", "official.mean_logit_err", abs(float(last.mean()) - OFFICIAL_MEAN_LOGIT), le=tol,
                    level="external", detail=f"vs {OFFICIAL_MEAN_LOGIT}"))
    am = [_absmax(x) for x in layers]
    if len(am) >= 4:
        err = max(abs(a - b) / b for a, b in zip(am[:4], OFFICIAL_FIRST_ABSMAX))
        stage.add(info("correctness", "official.absmax_first4_rel", err, level="external",
                       detail=f"max |h| after layers 0-3 vs {OFFICIAL_FIRST_ABSMAX} (|h| = AttnRes prefix; "
                              "informational: the published figure's definition of h is not stated)"),
                  info("correctness", "official.absmax_last_rel",
                       abs(am[-1] - OFFICIAL_LAST_ABSMAX) / OFFICIAL_LAST_ABSMAX, level="external",
                       detail=f"last layer vs {OFFICIAL_LAST_ABSMAX}"))
    got = _greedy(session.oracle, torch.tensor([OFFICIAL_PROMPT]), len(OFFICIAL_GREEDY))
    stage.add(check("correctness", "official.greedy_capital_of_france", got, eq=OFFICIAL_GREEDY, level="external"))


def tier_performance(session: Session, stage: Stage, progress: Callable | None = None) -> None:
    """A short benchmark (concurrency 2) and the fraction of the roofline it reaches."""
    res = run_bench_point(session, concurrency=2, input_len=32, output_len=8, num_prompts=4, warmups=1,
                          progress=progress)
    bench_rows(session, stage, [res], tier="performance")


# ============================================================================ bench helpers
def run_bench_point(session: Session, *, concurrency: int, input_len: int, output_len: int,
                    num_prompts: int | None = None, range_ratio: float = 0.8, warmups: int | None = None,
                    progress: Callable | None = None) -> dict:
    """One benchmark point through :func:`k3rocm.bench.run_bench` on an engine sized for it.

    The roofline model is :class:`k3rocm.sizing.StepRoofline` with the ceilings of the hardware
    the run is on (the run profile's datasheet bandwidth and bf16 peak) and the engine's weight and cache
    dtypes; ``run_bench`` evaluates it on every measured engine step. Returns a plain dict: vLLM metric
    fields, ``concurrency``, ``hang``, ``target`` and ``roofline`` (``total_floor_s``, ``total_measured_s``,
    ``fraction``) when the ceilings are known.
    """
    from k3rocm.bench import run_bench
    from k3rocm.sizing import StepRoofline
    eng = session.engine_for(max_batch=max(concurrency, 1), max_model_len=input_len + output_len + 1)
    prof = _run_profile(session)
    roof = None
    bw, peak = float(prof.hbm_bandwidth or 0), float(prof.peak("bf16") or 0)
    if bw > 0 and peak > 0:
        wbytes = _t().tensor([], dtype=eng.dtype).element_size()
        kvbytes = _t().tensor([], dtype=eng.kv_dtype).element_size()
        roof = StepRoofline.from_config(session.config, bw, peak, kv_bytes=kvbytes,
                                        trunk_dtype_bytes=None if wbytes == 2 else wbytes)
    ngpu = max(1, session.detected.count) if session.device != "cpu" else 1
    res = run_bench(eng, concurrency, input_len, output_len, num_prompts=num_prompts, range_ratio=range_ratio,
                    warmups=warmups, seed=session.opts.seed,
                    progress=(lambda phase, done, total: progress(done, total)) if progress else None,
                    num_gpus=ngpu, roofline=roof)
    d = res.to_dict(per_request=False)
    d["roofline_ceilings"] = {"profile": prof.name, "hbm_bandwidth": bw, "peak_bf16": peak,
                              "kind": _figure_kind(prof, "device.hbm_bandwidth_source")}
    return d


def _run_profile(session: Session):
    """The profile of the hardware measurements are taken on (the profile itself on its hardware)."""
    if session.hardware_matches:
        return session.profile
    from k3rocm.profiles import match_profile
    return match_profile(session.detected)


def bench_rows(session: Session, stage: Stage, results: list[dict], tier: str, level: str | None = None) -> None:
    """Evidence rows + plots for bench results (latency percentiles, throughput, roofline fraction).

    ``level`` overrides the session's measurement level (``external`` for a benchmark of another server).
    """
    lv = level or session.measured_level
    for r in results:
        c = r.get("concurrency")
        tag = f"c{c}"
        n = r.get("completed", 0)
        errs = r.get("errors") or []
        why = "; ".join(f"{e['count']} x {e['error']}" for e in errs)[:300]
        stage.add(check(tier, f"{tag}.failed", int(r.get("failed", 0)), eq=0, level=lv,
                        detail=f"failed requests: {why}" if why else "failed requests"),
                  check(tier, f"{tag}.completed", int(n), ge=1, level=lv))
        if r.get("short_outputs"):
            stage.add(info(tier, f"{tag}.short_outputs", int(r["short_outputs"]), "requests", level=lv,
                           detail=f"of {n} completed requests returned fewer output tokens than requested (the "
                                  "server stopped early: EOS or a length limit); the load was lighter than asked "
                                  "and requests with one token define no TPOT / ITL"))
        for k, unit in (("output_throughput", "tok/s"), ("total_token_throughput", "tok/s"),
                        ("output_throughput_per_gpu", "tok/s/GPU"), ("median_ttft_ms", "ms"), ("p99_ttft_ms", "ms"),
                        ("median_tpot_ms", "ms"), ("p99_tpot_ms", "ms"), ("median_itl_ms", "ms"), ("p99_itl_ms", "ms"),
                        ("median_e2el_ms", "ms"), ("p99_e2el_ms", "ms")):
            if k in r:
                stage.add(info(tier, f"{tag}.{k}", round(float(r[k]), 4), unit, level=lv))
        stage.add(check(tier, f"{tag}.no_hang", r.get("hang") is None, eq=True, level=lv,
                        detail=f"watchdog: {r['hang']}" if r.get("hang") else "no request outlived the watchdog"))
        roof = r.get("roofline") or {}
        if roof.get("total_floor_s"):
            ceil = r.get("roofline_ceilings", {})
            stage.add(info(tier, f"{tag}.roofline.floor_s", round(float(roof["total_floor_s"]), 6), "s",
                           level="projected",
                           detail=f"sum over measured engine steps of max(bytes/bandwidth, FLOPs/peak); "
                                  f"ceilings of {ceil.get('profile')} ({ceil.get('kind', 'datasheet')})"),
                      info(tier, f"{tag}.roofline.measured_s", round(float(roof.get("total_measured_s", 0)), 6), "s",
                           level=lv, detail="sum of the same steps' measured times"),
                      info(tier, f"{tag}.roofline.fraction", round(float(roof.get("fraction", 0)), 6), "",
                           level=lv, detail="projected floor / measured time (1.0 = at the roofline), all steps"))
            dec = roof.get("decode_only") or {}
            if dec.get("steps"):
                stage.add(info(tier, f"{tag}.roofline.decode_fraction", round(float(dec["fraction"]), 6), "",
                               level=lv, detail=f"the same over the {dec['steps']} steps that carried no prefill "
                                                f"tokens (pure decode steps; median step "
                                                f"{float(dec['median_fraction']):.3f})"))
        for t in getattr(session.profile, "targets", ()):
            if lv in ("measured", "external") and t.metric in r and c == _target_conc(t.setting):
                ok = r[t.metric] <= t.value if t.metric.endswith("_ms") else r[t.metric] >= t.value
                stage.add(info(tier, f"target.{t.name}", r[t.metric], t.unit, level=lv,
                               detail=f"public figure {t.value} {t.unit} ({t.setting}; {t.source}): "
                                      f"{'meets' if ok else 'below'}"))
    cs = [r.get("concurrency") for r in results]
    pct = {}
    for m in ("ttft", "tpot", "itl", "e2el"):
        vals = [r.get(f"median_{m}_ms") for r in results]
        if all(v is not None for v in vals):
            pct[f"median {m.upper()}"] = vals
        vals = [r.get(f"p99_{m}_ms") for r in results]
        if all(v is not None for v in vals):
            pct[f"p99 {m.upper()}"] = vals
    if pct:
        stage.series["latency"] = {"title": "latency percentiles vs concurrency", "kind": "bar",
                                   "x": cs, "xlabel": "concurrency", "ylabel": "ms", "y": pct, "log": True}
    thr = {k: [r.get(k) for r in results] for k in ("output_throughput", "total_token_throughput")}
    thr = {k: v for k, v in thr.items() if all(x is not None for x in v)}
    if thr:
        stage.series["throughput"] = {"title": "throughput vs concurrency", "kind": "bar", "x": cs,
                                      "xlabel": "concurrency", "ylabel": "tok/s", "y": thr}
    # the serving trade-off (InferenceX's axes): output tok/s per GPU against tok/s per user, one point per
    # concurrency; tok/s/user = 1000 / median TPOT (ms)
    pts = sorted((1000.0 / r["median_tpot_ms"], r["output_throughput_per_gpu"], r.get("concurrency"))
                 for r in results if r.get("median_tpot_ms") and r.get("output_throughput_per_gpu") is not None)
    for u, _, c in sorted(pts, key=lambda p: p[2]):  # rows in concurrency order, the plot in x order
        stage.add(info(tier, f"c{c}.tok_s_per_user", round(u, 4), "tok/s/user", level=lv,
                       detail="1000 / median TPOT (ms): decode speed one user sees"))
    # fraction of roofline per concurrency: all steps, pure decode steps, steps carrying prefill chunks
    roofs = [r.get("roofline") or {} for r in results]
    if any(x.get("total_floor_s") for x in roofs):
        y = {"all steps": [float(x.get("fraction", 0.0)) for x in roofs]}
        for key, label in (("decode_only", "decode-only steps"), ("with_prefill", "steps with prefill")):
            vals = [float((x.get(key) or {}).get("fraction", 0.0)) for x in roofs]
            if any(vals):
                y[label] = vals
        stage.series["roofline"] = {"title": "fraction of the roofline vs concurrency (1.0 = at the floor)",
                                    "kind": "bar", "x": cs, "xlabel": "concurrency", "ylabel": "floor / measured",
                                    "y": y}
    if pts:
        stage.series["tradeoff"] = {"title": "throughput per GPU vs speed per user (labels: concurrency)",
                                    "kind": "line", "x": [p[0] for p in pts], "xlabel": "tok/s/user",
                                    "ylabel": "output tok/s/GPU", "y": {"output tok/s/GPU": [p[1] for p in pts]},
                                    "labels": [f"c={p[2]}" for p in pts]}


def _target_conc(setting: str) -> int | None:
    import re
    m = re.search(r"concurrency\s*(\d+)", setting or "")
    return int(m.group(1)) if m else None


# ============================================================================ runner
TIER_FUNCS = {"env": tier_env, "load": tier_load, "forward": tier_forward, "correctness": tier_correctness,
              "performance": tier_performance}


def run_stage(name: str, fn: Callable[[Stage], None], command: str = "", debug: bool = False) -> Stage:
    """Run ``fn(stage)``, timing it; a K3Error becomes ``status="error"`` with its one-line message.

    Unexpected exceptions propagate (they are bugs and deserve a traceback)."""
    stage = Stage(name, started=now_iso(), command=command)
    t0 = time.perf_counter()
    try:
        fn(stage)
    except K3Error as e:
        stage.status, stage.error = "error", str(e)
        stage.exit_code = e.exit_code  # type: ignore[attr-defined]
        if debug:
            traceback.print_exc()
    stage.seconds = time.perf_counter() - t0
    return stage


def run_tiers(session: Session, level: str, progress: Callable | None = None,
              on_stage: Callable[[Stage], None] | None = None,
              on_start: Callable[[str], None] | None = None) -> list[Stage]:
    """Run tiers ``env`` .. ``level`` in order, stopping after the first that does not pass.

    ``on_start(tier)`` is called before each tier, ``on_stage(stage)`` after it; ``progress(done, total)`` is
    passed to the tiers that report progress (load, performance).

    Raises:
        ConfigError: ``level`` is not a tier name.
    """
    from k3rocm.errors import ConfigError
    if level not in TIERS:
        raise ConfigError(f"--level {level!r}: choose one of {', '.join(TIERS)}")
    out = []
    for name in TIERS[: TIERS.index(level) + 1]:
        fn = TIER_FUNCS[name]
        if on_start:
            on_start(name)
        if name in ("load", "performance"):
            st = run_stage(name, lambda s, f=fn: f(session, s, progress), session.opts.command, session.opts.debug)
        else:
            st = run_stage(name, lambda s, f=fn: f(session, s), session.opts.command, session.opts.debug)
        out.append(st)
        if on_stage:
            on_stage(st)
        if st.status != "passed":
            break
    return out
