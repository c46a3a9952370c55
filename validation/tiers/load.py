"""Tier ``load``: did every byte land where the plan said? Index complete, headers valid, scales sane,
bytes per rank, GB/s."""

from __future__ import annotations

from typing import Callable

import torch

from k3rocm.checkpoint import layout
from k3rocm.checkpoint.verify import MANIFEST_NAME, manifest_extras, verify_manifest
from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.kernels.moe.configs import LAYOUT_BITS, LAYOUT_TILES
from k3rocm.kernels.mx.layout import BIT_LAYOUTS, check_repack, repack_mxfp4
from k3rocm.runtime.plan import NO_MLA_BOUND
from k3rocm.validation.evidence import Stage, Timer, check, info, listed
from k3rocm.validation.session import Session


def tier_load(session: Session, stage: Stage, progress: Callable | None = None) -> None:
    """Did every byte land where the plan said? Index complete, headers valid, scales sane, bytes, GB/s.

    ``--synthetic``: nothing is read, so the checkpoint rows (index, manifest, read checksums, raw read rate) are
    left out and the rows that remain say what was checked instead: the made tensors' shapes, dtypes and
    finiteness, and the kernel layout's read-back against them."""
    if session.synthetic:
        return _synthetic_rows(session, stage, progress)
    with Timer() as t:
        idx = session.index
    secs = session.index_open_seconds  # the build's own time: the pre-flight check usually built it already
    stage.add(info("load", "index.open", round((t.seconds if secs is None else secs) * 1e3, 2), "ms",
                   detail="directory, index, every shard header, tensor set and E8M0 scales validated"),
              check("load", "index.tensors", len(idx), eq=layout.counts(session.config)["tensors"],
                    detail="text tensors in the index vs the layout of the config"))
    stage.add(info("load", "checkpoint.official", session.is_official,
                   detail="config and tensor set equal the official release's (K3_FACTS §2); when true the "
                          "correctness tier checks the release's known answers"))
    manifest = session.checkpoint_dir / MANIFEST_NAME
    if manifest.is_file():
        with Timer() as tv:
            res = verify_manifest(session.checkpoint_dir)
        bad = list(res)
        stage.add(check("load", "manifest.sha256", len(bad), eq=0, unit="files",
                        detail=(f"files whose sha256 differs from {manifest.name}: none" if not bad
                                else listed(bad, limit=200))),
                  info("load", "manifest.seconds", round(tv.seconds, 3), "s"))
        extra = manifest_extras(session.checkpoint_dir)
        stage.add(info("load", "manifest.extra_files", len(extra), "files",
                       detail=("files beside the checkpoint that the manifest does not list (unchecked, not "
                               "corruption): " + listed(extra, ", ", limit=120)) if extra else "none"))
    else:
        stage.add(info("load", "manifest.sha256", "absent",
                       detail=f"no {MANIFEST_NAME} beside the checkpoint: the files are NOT checked against known "
                              f"hashes (the load's checksums compare the device copy with the files as read, so a "
                              f"corrupted file passes them); write one from a trusted copy with 'k3rocm checkpoint "
                              f"verify --write-manifest'"))
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
                    detail=listed(r["problems"]) or "none"),
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
                                                  "loaded": [used.get(k, 0) / 1e6 for k in keys]},
                                            # the plan's bytes are projected, the loaded ones what this run measured
                                            "levels": {"planned": "projected", "loaded": lv}}
    stage.add(info("load", "load.bytes", sum(used.values()), "B", level=lv))
    for key, unit, d in (("aggregate_gbps", "GB/s", "load throughput, all ranks (reads and device copies; verification not included)"),
                         ("raw_read_gbps", "GB/s", "sequential read of the same shard files"
                          + (" (O_DIRECT: the page cache bypassed)" if r.get("page_cache_dropped") else
                             " (the page cache could not be bypassed on this file system: may be a memory-read "
                             "figure)")),
                         ("load_vs_raw", "", "load throughput / raw read throughput"),
                         ("verify_seconds", "s", "time to verify every tensor")):
        if r.get(key) is not None:
            stage.add(info("load", f"load.{key}", round(float(r[key]), 4), unit, level=lv, detail=d))
    if not r["problems"]:
        _kernel_layout_rows(stage, session, lv)


def _synthetic_rows(session: Session, stage: Stage, progress: Callable | None) -> None:
    """The load tier of a ``--synthetic`` run: the rank's random tensors made on the device and checked against
    the plan (no file is read, so no index, manifest, checksum or read-rate row)."""
    plc = session.placement
    rank = session.rank
    stage.add(info("load", "weights.source", "synthetic", level="measured-fallback",
                   detail=f"random weights of rank {rank} of TP{plc.tp}/EP{plc.ep} made on the device from the config "
                          f"{session.config.name}: no checkpoint index, shard, manifest or scale file is read, so "
                          "none is checked"))
    _placement_rows(stage, plc, "load")
    with Timer() as tl:
        rep = session.load(progress=progress).report
    lv = session.measured_level
    r = rep.to_dict()
    stage.add(info("load", "load.seconds", round(tl.seconds, 3), "s", level=lv,
                   detail=f"rank {rank} of {r['world']} made on {r['device']} (random fill and the checks below)"),
              check("load", "load.problems", len(r["problems"]), eq=0, level=lv,
                    detail=listed(r["problems"]) or "none"),
              check("load", "load.tensors_loaded", int(r["tensors_loaded"]), eq=int(r["tensors_planned"]), level=lv,
                    detail="tensors made vs the tensors the plan names for this rank"),
              check("load", "load.tensors_verified", int(r["tensors_verified"]), eq=int(r["tensors_planned"]),
                    level=lv, detail="made tensors with the planned local shape and dtype (floating ones finite); "
                                     "random values: no checksum against a source"))
    planned, used = _per_rank(r["bytes_planned"]), _per_rank(r["bytes_loaded"])
    for k in sorted(set(planned) | set(used), key=lambda k: (len(k), k)):
        stage.add(check("load", f"bytes[rank {k}]", used.get(k, 0), eq=planned.get(k, 0), unit="B", level=lv,
                        detail="bytes made vs planned for this rank"))
    stage.add(info("load", "load.bytes", sum(used.values()), "B", level=lv))
    if not r["problems"]:
        _kernel_layout_rows(stage, session, lv)


def _kernel_layout_rows(stage: Stage, session: Session, lv) -> None:
    """Every loaded MoE layer's MXFP4 experts repacked on their device into the grouped GEMM's tiled layout
    (``k3rocm.kernels.mx.layout``, the tiles of the device's backend; CUDA's on the CPU) and read back byte for
    byte against the checkpoint tensors: a row with the layers that differ (0 expected), the repack seconds
    and the layout's bytes."""
    w = session.weights
    cfg = session.config
    dev = str(session.device)
    backend = "hip" if dev.startswith("cuda") and torch.version.hip else "cuda"
    tn, tk = LAYOUT_TILES[backend]
    bits = LAYOUT_BITS[backend]
    layers, bad, seconds, nbytes = 0, [], 0.0, 0
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        try:
            ew = w.experts(i)
        except CheckpointError:  # a layer this rank does not hold
            continue
        if not ew.quantized or ew.released:  # released: an engine already moved it (checked read-back there)
            continue
        layers += 1
        for groups, p, sc in ((2, ew.w13_packed, ew.w13_scale), (1, ew.w2_packed, ew.w2_scale)):
            t = repack_mxfp4(p, sc, groups, tn, tk, bits)
            seconds += t.repack_s
            nbytes += t.nbytes
            try:
                check_repack(t, p, sc)
            except ConfigError as e:
                bad.append(f"layer {i}: {e}")
            del t
    if not layers:
        return
    stage.add(check("load", "kernel_layout.layers_differing", len(bad), eq=0, level=lv,
                    detail=(f"{layers} MoE layer(s) repacked into the {tn}x{tk} tiled MXFP4 layout "
                            f"({BIT_LAYOUTS[bits]} value bits) and read back: "
                            "every value and scale byte equals the "
                            + ("random source tensors'" if session.synthetic else "checkpoint's") if not bad
                            else listed(bad))),
              info("load", "kernel_layout.repack_seconds", round(seconds, 4), "s", level=lv,
                   detail="device time of the repack, all loaded MoE layers (the check not included)"),
              info("load", "kernel_layout.bytes", nbytes, "B", level=lv,
                   detail="bytes of the tiled layout, all loaded MoE layers (padding included)"))


def _per_rank(d) -> dict:
    """``{rank: bytes}`` with string keys (the report's JSON form)."""
    if not d:
        return {}
    return {str(k): int(v) for k, v in dict(d).items()}


def _as_dict(obj) -> dict:
    """A placement as a dict (its ``to_dict()``, or its attributes); ``{}`` for None."""
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return obj
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return dict(vars(obj))


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
    for n in d.get("notes") or ():  # e.g. the layout reduced from the profile's, which must never pass unseen
        stage.add(info(tier, "plan.note", n, level="projected", detail=where))
    cache = d.get("cache") or {}
    for k in ("max_tokens", "max_sequences", "context_len"):
        if k == "max_tokens" and k in cache and cache[k] is None:  # no MLA layer: no token bound from its cache
            stage.add(info(tier, "plan.cache.max_tokens", "n/a", level="projected", detail=f"{where}: {NO_MLA_BOUND}"))
        elif k in cache:
            stage.add(info(tier, f"plan.cache.{k}", cache[k], level="projected", detail=where))
