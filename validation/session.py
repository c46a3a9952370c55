"""A validation session: the options of one command and the objects it builds, each built once, lazily.

The CLI and the tiers share one :class:`Session`: the checkpoint directory (default: the embedded
``k3-tiny`` written once into the user cache), its config and validated index, the detected hardware,
the hardware profile (``--profile`` or the match for the detected hardware), the placement plan, the
loaded weights, the fp32 oracle model and the engine that runs the selected kernels.

Whether measurements are ``measured`` or ``measured-fallback`` is decided here
(:attr:`Session.measured_level`): ``measured`` only when the detected hardware is what the profile names
(same backend and base arch, at least the profile's device count).

With ``--synthetic`` (:attr:`Options.synthetic`) no checkpoint is read: the config is a preset (or a
``--checkpoint``'s config.json alone), the layout is ``--tp/--ep`` on the profile's device kind (as many of them
as the layout needs), and this one process stands for rank ``--rank`` of it, with random weights made on the
device (:mod:`k3rocm.runtime.synthetic`) and a :class:`~k3rocm.runtime.dist.ProjectedGroup` that counts the
collectives instead of running them. Every figure of such a run is ``measured-fallback`` (compute) or
``projected`` (collectives, other hardware), and none says anything about correctness.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from k3rocm.checkpoint import layout
from k3rocm.checkpoint.reader import DTYPES, open_checkpoint
from k3rocm.config import K3Config
from k3rocm.config import preset as preset_config
from k3rocm.checkpoint.embedded import cache_root, default_checkpoint
from k3rocm.checkpoint.verify import MANIFEST_NAME, read_manifest
from k3rocm.errors import CheckpointError, ConfigError, HardwareError, K3Error, ValidationFailed, unresolved_link
from k3rocm.hw import detect, dist_timeout
from k3rocm.profiles import load_profile, match_profile
from k3rocm.runtime import registry
from k3rocm.model.model import K3Model
from k3rocm.runtime.dist import ProjectedGroup, under_torchrun
from k3rocm.runtime.engine import Engine
from k3rocm.runtime.load import LoadReport, LoadResult, load_checkpoint
from k3rocm.runtime.plan import default_ep, plan, scaled_profile
from k3rocm.runtime.synthetic import (RANDOM_WEIGHTS_NOTE, SyntheticIndex, check_rank, collective_projection,
                                      synthetic_weights, tpot_projection)
from k3rocm.runtime.serve import Cluster, RankSpec, RemoteModel
from k3rocm.validation.evidence import Stage, info


@dataclass(frozen=True)
class EndpointTarget:
    """The OpenAI-compatible server a ``bench --endpoint`` run measured, as the report's header names it.

    Attributes:
        url: the ``--endpoint`` URL.
        gpus: GPUs serving it (the divisor of its tok/s/GPU figures).
        gpus_source: where ``gpus`` comes from (``--endpoint-gpus`` or the device count of ``--profile``).
        timeout_s: seconds the server may stay silent before a request fails (``--endpoint-timeout``).
    """

    url: str
    gpus: int
    gpus_source: str
    timeout_s: float | None = None

    def to_dict(self) -> dict:
        """``{"url", "gpus", "gpus_source", "timeout_s"}`` (the report's ``endpoint`` block)."""
        return {"url": self.url, "gpus": self.gpus, "gpus_source": self.gpus_source, "timeout_s": self.timeout_s}


@dataclass
class Options:
    """Options common to every command (see ``k3rocm --help``).

    Attributes:
        checkpoint: checkpoint directory, or None for the embedded ``k3-tiny``.
        profile: hardware profile name, or None to detect.
        out: report directory.
        kernels: ``auto`` | ``torch`` | ``triton`` | ``aiter`` | ``op=impl,...`` (registry.parse_override).
        seed: RNG seed for generated inputs.
        golden: optional external golden file (safetensors) for the correctness tier.
        debug: show tracebacks.
        command: the command line, for the report.
        endpoint: the server a ``bench --endpoint`` run measured, set by that run once its points ran (the
            report's header then says what was measured: the server, not this machine or the checkpoint).
        synthetic: random weights made on the device instead of a checkpoint (see the module docstring).
        preset: with ``synthetic``: the preset config (``k3``, ``k3-prefix-N``, ...; default ``k3-tiny``).
        tp, ep: with ``synthetic``: the layout the rank belongs to (default: the profile's).
        rank: with ``synthetic``: the rank of that layout this process stands for.
        min_fraction: ``validate --min-fraction``: the performance tier's fraction of the roofline (all steps, each
            concurrency point) must reach this, else the tier fails; None = reported, not judged.
    """

    checkpoint: str | None = None
    profile: str | None = None
    out: str = "reports/latest"
    kernels: str = "auto"
    seed: int = 0
    golden: str | None = None
    debug: bool = False
    command: str = ""
    endpoint: EndpointTarget | None = None
    synthetic: bool = False
    preset: str | None = None
    tp: int | None = None
    ep: int | None = None
    rank: int | None = None
    min_fraction: float | None = None


def _refuse_unresolved_link(p: Path) -> None:
    """CheckpointError naming ``--checkpoint p`` when it is a symbolic link that does not resolve (loop or broken)."""
    link = unresolved_link(p)
    if link:
        raise CheckpointError(f"--checkpoint {p}: {link}; point the link at the checkpoint directory or pass the "
                              "directory itself")


class Session:
    """Lazily built objects of one command. Every property raises a :class:`k3rocm.errors.K3Error`
    subclass with a one-line message on expected failures (missing directory, unknown profile, ...)."""

    def __init__(self, opts: Options):
        self.opts = opts
        self._cache: dict[str, Any] = {}
        self.kernel_override = registry.parse_override(opts.kernels)

    def preflight(self) -> None:
        """Resolve what bad input can break before any tier runs or anything is printed: the checkpoint (the
        reader's whole structural check: index, shards, headers, tensor set, scales; its manifest parses where
        there is one), the hardware profile,
        the --kernels choice (triton/aiter need a GPU: exit 3), the --golden file, the --out directory
        (writable, not inside the checkpoint or the k3rocm cache).
        Raises the one-line K3Error."""
        self._check_synthetic()
        self.checkpoint_dir
        self.index
        if not self.synthetic and (self.checkpoint_dir / MANIFEST_NAME).exists():
            read_manifest(self.checkpoint_dir)  # a broken manifest stops here, not after the plan tables print
        self.config
        self.profile
        if self.synthetic:
            check_rank(self.placement, self.rank)
        for op in registry.ORACLE_OPS:
            registry.select(op, self.kernel_override)
        if self.opts.golden is not None:
            check_golden_file(self.opts.golden, self.config)
        require_dir_for_output(self.opts.out, keep=False)
        if not self.synthetic:
            refuse_output_inside(self.opts.out, self.checkpoint_dir)
        elif self.opts.checkpoint is not None:  # only its config.json is read, but a report there would change it
            refuse_output_inside(self.opts.out, Path(self.opts.checkpoint).expanduser())

    @property
    def rank(self) -> int:
        """The rank of the layout this process runs (``--rank``, default 0)."""
        return int(self.opts.rank or 0)

    @property
    def synthetic(self) -> bool:
        """True for a ``--synthetic`` run (random weights of one rank, no checkpoint read)."""
        return bool(self.opts.synthetic)

    def _check_synthetic(self) -> None:
        """The option combinations ``--synthetic`` refuses (one line each, ConfigError)."""
        o = self.opts
        if not o.synthetic:
            for flag, v in (("--preset", o.preset), ("--tp", o.tp), ("--ep", o.ep), ("--rank", o.rank)):
                if v is not None:
                    raise ConfigError(f"{flag} picks the model or layout of random weights and needs --synthetic; "
                                      "add --synthetic, or drop it to run the checkpoint")
            return
        if o.preset is not None and o.checkpoint is not None:
            raise ConfigError("--synthetic takes the config from --preset or from --checkpoint's config.json, not "
                              "both; drop one")
        if o.golden is not None:
            raise ConfigError("--golden compares outputs with known answers; random weights (--synthetic) have none: "
                              "drop --golden or --synthetic")
        for flag, v in (("--tp", o.tp), ("--ep", o.ep)):
            if v is not None and v < 1:
                raise ConfigError(f"{flag} {v} must be at least 1; leave it out for the profile's layout, or pass a "
                                  "divisor of the GPU count (`k3rocm plan` lists the layouts that work)")
        if o.rank is not None and o.rank < 0:
            raise ConfigError(f"--rank {o.rank} must be at least 0")

    def _memo(self, key: str, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    # ------------------------------------------------------------------ checkpoint
    @property
    def checkpoint_dir(self) -> Path:
        """Absolute checkpoint directory; the embedded default is written on first use. ``--synthetic``: a name
        for the report (no tensor is read from disk, not even from a ``--checkpoint`` that gave the config)."""
        def build() -> Path:
            if self.synthetic:
                return Path(f"<synthetic {self.config.name}: random weights>")
            if self.opts.checkpoint is None:
                return Path(default_checkpoint()).resolve()
            if not str(self.opts.checkpoint).strip():
                raise CheckpointError("--checkpoint is empty; pass a checkpoint directory, or omit it for the "
                                      "embedded k3-tiny")
            p = Path(self.opts.checkpoint).expanduser()
            _refuse_unresolved_link(p)
            if not p.exists():
                raise CheckpointError(f"{p}: checkpoint directory does not exist; pass --checkpoint DIR "
                                      "holding config.json and *.safetensors (or omit it for the embedded k3-tiny)")
            if not p.is_dir():
                raise CheckpointError(f"{p}: is a file, not a checkpoint directory; pass the folder that holds it")
            if (p / "config.json").is_dir():
                raise CheckpointError(f"{p / 'config.json'}: is a directory, not a file; config.json must be the "
                                      "checkpoint's JSON config file - replace it with the released config.json")
            if not (p / "config.json").is_file():
                raise CheckpointError(f"{p}: no config.json; pass a checkpoint directory in the released layout")
            return p.resolve()
        return self._memo("checkpoint_dir", build)

    @property
    def index(self):
        """The validated checkpoint index (:func:`k3rocm.checkpoint.reader.open_checkpoint`: directory, index,
        shard headers, tensor set vs the config's layout, E8M0 scales). The seconds its first build took are
        :attr:`index_open_seconds` (the pre-flight check builds it, so a later caller's own timer reads a cache
        lookup)."""
        def build():
            if self.synthetic:
                return SyntheticIndex(self.config, layout.counts(self.config)["tensors"])
            t0 = time.perf_counter()
            idx = open_checkpoint(self.checkpoint_dir)
            self._cache["index_open_seconds"] = time.perf_counter() - t0
            return idx
        return self._memo("index", build)

    @property
    def index_open_seconds(self) -> float | None:
        """Seconds the checkpoint index took to open and validate (None before :attr:`index` is built, or for
        synthetic weights)."""
        return self._cache.get("index_open_seconds")

    @property
    def config(self):
        """The checkpoint's :class:`k3rocm.config.K3Config`."""
        def build():
            if self.synthetic:
                if self.opts.checkpoint is None:
                    return preset_config(self.opts.preset, "--preset") if self.opts.preset else preset_config("k3-tiny")
                d = Path(self.opts.checkpoint).expanduser()
                _refuse_unresolved_link(d)
                f = d / "config.json"
                if f.is_dir():
                    raise CheckpointError(f"{f}: is a directory, not a file; --synthetic --checkpoint DIR reads "
                                          "DIR/config.json - replace it with the released config.json (or pass "
                                          "--preset NAME)")
                if not f.is_file():
                    raise CheckpointError(f"{f}: not found; --synthetic --checkpoint DIR reads only DIR/config.json "
                                          "(or pass --preset NAME)")
                return K3Config.from_file(f)
            idx = self._cache.get("index")
            cfg = getattr(idx, "config", None) if idx is not None else None
            if cfg is None:
                cfg = K3Config.from_file(self.checkpoint_dir / "config.json")
            return cfg
        return self._memo("config", build)

    @property
    def is_official(self) -> bool:
        """True when the checkpoint's config and index match the official release (K3_FACTS §6)."""
        # no blanket except: a bug here would silently switch off every known-answer check
        return bool(self.index.is_official())

    # ------------------------------------------------------------------ hardware
    @property
    def detected(self):
        return self._memo("detected", lambda: detect(with_smi=True))

    @property
    def profile(self):
        """``--profile`` (ConfigError for an unknown name) or the shipped profile matching the hardware."""
        def build():
            if self.opts.profile is not None and not str(self.opts.profile).strip():
                raise ConfigError("--profile is empty; pass a profile name (see `k3rocm profiles`), or omit it to "
                                  "use the one matching this machine")
            if self.opts.profile:
                return load_profile(self.opts.profile)
            return match_profile(self.detected)
        return self._memo("profile", build)

    @property
    def hardware_matches(self) -> bool:
        """Detected backend/arch equal the profile's and at least its device count is visible."""
        return self.profile.matches(self.detected)

    @property
    def measured_level(self) -> str:
        """``measured`` on the profile's hardware, else ``measured-fallback`` (always for ``--synthetic``: one
        process standing for one rank of a layout is never the layout)."""
        return "measured" if self.hardware_matches and not self.synthetic else "measured-fallback"

    @property
    def device(self) -> str:
        """torch device the engine runs on: ``cuda`` when a GPU is visible (ROCm too), else ``cpu``."""
        return "cpu" if self.detected.backend == "cpu" or self.profile.backend == "cpu" else "cuda"

    def device_block(self) -> dict:
        """``{sku, arch, count, memory_bytes, backend, torch_build}`` of the detected hardware."""
        d = self.detected
        return {"backend": d.backend, "sku": d.devices[0].name if d.devices else f"CPU ({d.cpu_count} cores)",
                "arch": d.arch or "cpu", "count": d.count or 1, "memory_bytes": d.memory_bytes,
                "torch_build": d.torch_build, "driver": d.driver}

    # ------------------------------------------------------------------ plan, load, models
    @property
    def placement(self):
        """``k3rocm.runtime.plan.plan(config, profile)`` (PlanError when it does not fit)."""
        def build():
            if self.synthetic:
                return self._layout_plan(self.profile)
            return plan(self.config, self.profile)
        return self._memo("placement", build)

    def _layout_plan(self, profile, tp: int | None = None, ep: int | None = None):
        """``--synthetic``: the ``--tp/--ep`` layout (or ``tp`` / ``ep`` given here) on ``profile``'s device kind,
        with as many devices as it has ranks (PlanError when the config does not split so or a rank does not fit
        one device). Without a tp, the profile's own layout as ``plan`` picks it; without an ep, ``plan``'s rule:
        the profile's where it divides tp, else tp."""
        o = self.opts
        tp = o.tp if tp is None else tp
        ep = o.ep if ep is None else ep
        if tp is None:
            return plan(self.config, profile, ep=ep, host_ranks=1)
        if ep is None:
            ep = default_ep(profile, tp)
        # a rank outside the layout is said before whether the layout fits
        check_rank((tp, ep), self.rank)
        # (one process builds one rank: on the cpu backend it has the whole host, not a 1/tp share)
        return plan(self.config, scaled_profile(profile, tp, ep), tp=tp, ep=ep, host_ranks=1)

    @property
    def run_placement(self):
        """The placement the weights are loaded with: the profile's when this is the profile's hardware,
        else a plan for the hardware detected here (a fallback run measures on what is present)."""
        def build():
            if self.synthetic:  # the same layout on the hardware measured here (its step floor)
                if self.hardware_matches:
                    return self.placement
                pl = self.placement  # the profile's layout (its tp / ep when --tp / --ep are not given)
                return self._layout_plan(self.run_profile, tp=pl.tp, ep=pl.ep)
            if self.hardware_matches:
                return self.placement
            return plan(self.config, self.run_profile)
        return self._memo("run_placement", build)

    @property
    def run_profile(self):
        """The profile of the hardware measurements are taken on: the profile itself on its hardware, else the
        shipped profile matching the hardware detected here."""
        if self.hardware_matches:
            return self.profile
        return self._memo("run_profile", lambda: match_profile(self.detected))

    @property
    def world(self) -> int:
        """Ranks of the layout this run loads and serves with (:attr:`run_placement`; 1 = one process). For
        ``--synthetic`` the layout's ranks, of which this one process runs rank ``--rank`` alone."""
        return self.run_placement.world

    @property
    def parallel(self):
        """``--synthetic``: the :class:`~k3rocm.runtime.dist.ProjectedGroup` of the rank (collectives counted, not
        run); None otherwise."""
        if not self.synthetic:
            return None
        return self._memo("parallel", lambda: ProjectedGroup(self.run_placement, self.rank, self.device))

    @property
    def _multiprocess(self) -> bool:
        return self.world > 1 and not self.synthetic

    @property
    def cluster(self) -> Cluster:
        """The ranks of a multi-rank :attr:`run_placement` (:mod:`k3rocm.runtime.serve`): this process is rank 0;
        the others are spawned on this host, or were started by torchrun (then their count must match).

        Raises:
            HardwareError: under torchrun with another world size than the plan's.
        """
        def build() -> Cluster:
            pl = self.run_placement
            prof = self.opts.profile if self.hardware_matches and self.opts.profile else self.run_profile.name
            spec = RankSpec(str(self.checkpoint_dir), str(prof), pl.tp, pl.ep, dict(self.kernel_override),
                            self.device, dist_timeout())
            if under_torchrun():
                n = int(os.environ.get("WORLD_SIZE", "1"))
                if n != pl.world:
                    Cluster.refuse_torchrun(spec.backend)
                    raise HardwareError(f"torchrun started {n} processes but the plan has {pl.world} ranks "
                                        f"(tp={pl.tp}, ep={pl.ep}); start --nnodes x --nproc-per-node = {pl.world}")
                return Cluster.attach(spec)
            return Cluster.start(spec, pl.world)
        failed = self._cache.get("cluster_error")
        if failed is not None:  # a group that did not form is not tried again (each try waits its timeout)
            raise failed
        try:
            return self._memo("cluster", build)
        except K3Error as e:
            self._cache["cluster_error"] = e
            raise

    def close(self) -> None:
        """Stop the other ranks of a multi-rank run (no-op for one process)."""
        cl = self._cache.pop("cluster", None)
        if cl is not None:
            cl.close()

    def load(self, progress=None):
        """Stream the checkpoint with :func:`k3rocm.runtime.load.load_checkpoint` onto :attr:`device` with the
        :attr:`run_placement`, proving every tensor landed. Returns the ``LoadResult`` (cached);
        ``progress(done_bytes, total_bytes, text)`` is called as bytes land. With several ranks each rank loads
        and verifies its own slice on its own device; the result holds rank 0's weights and every rank's
        figures."""
        def build():
            self._small_cpu_threads()
            if self.synthetic:
                return self._synthetic_load(progress)
            if self._multiprocess:
                cl = self.cluster
                rep = cl.call("load", True, local_kw={"progress": progress})
                return LoadResult(self.config, self.run_placement, {0: cl.worker.weights}, LoadReport(**rep))
            # not strict: the load tier reports every problem as evidence (load.problems) and fails; users of
            # the weights (:attr:`weights`) refuse a load with problems
            return load_checkpoint(self.checkpoint_dir, placement=self.run_placement, index=self.index,
                                   device=self.device, progress=progress, strict=False)
        return self._memo("load", build)

    def _synthetic_load(self, progress=None) -> LoadResult:
        """Random weights of rank ``--rank`` on :attr:`device` (:func:`synthetic_weights`), with a LoadReport of
        what was made: bytes, seconds, GB/s of generation, and a check of every tensor against the plan (name,
        local shape, dtype; floating tensors finite)."""
        pl, r = self.run_placement, self.rank
        dev = "cpu" if self.device == "cpu" else "cuda"
        rep = LoadReport(checkpoint=str(self.checkpoint_dir), device=dev, world=pl.world, ranks=[r], threads=1)
        t0 = time.perf_counter()
        w = synthetic_weights(self.config, pl, r, device=dev, seed=self.opts.seed, progress=progress)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        planned = pl.ranks[r].tensors
        rep.tensors_planned = len(planned)
        rep.tensors_loaded = len(w.keys())
        rep.bytes_planned[r] = pl.ranks[r].weights_bytes
        rep.bytes_loaded[r] = w.nbytes()
        rep.device_bytes_used[r] = w.nbytes()
        rep.seconds[r] = rep.total_seconds = dt
        rep.gbps[r] = rep.aggregate_gbps = w.nbytes() / dt / 1e9 if dt > 0 else 0.0
        for name, sl in planned.items():
            t = w.get(name)
            if t is None or tuple(t.shape) != sl.local_shape or t.dtype != DTYPES[sl.dtype][0]:
                rep.problems.append(f"rank {r}: synthetic {name} is not the planned {sl.local_shape} {sl.dtype}")
            elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                rep.problems.append(f"rank {r}: synthetic {name} holds NaN/Inf values")
            else:
                rep.tensors_verified += 1
        return LoadResult(self.config, pl, {r: w}, rep)

    def synthetic_rows(self, stage: Stage, results: list[dict], tier: str) -> None:
        """``--synthetic`` rows of a bench stage: the random-weights warning, the collectives the rank counted with
        their time projected over the ``--profile``'s links, and per point the TPOT of the config on the profile's
        own layout (e.g. K3 on mi355x-8 at TP8) projected from the measured step (:func:`tpot_projection`).
        No-op for other runs."""
        if not self.synthetic:
            return
        pl, r = self.run_placement, self.rank
        stage.add(info(tier, "synthetic.weights", "random", level="measured-fallback",
                       detail=f"{RANDOM_WEIGHTS_NOTE}; rank {r} of TP{pl.tp}/EP{pl.ep} of {self.config.name}, "
                              f"{pl.ranks[r].weights_bytes / 1e9:.2f} GB made on {self.device}, seed {self.opts.seed}"))
        link = float(self.profile.link_bandwidth or 0)
        target = None
        try:
            target = plan(self.config, self.profile)
        except K3Error as e:
            stage.add(info(tier, "synthetic.target_plan", "does not fit", level="projected",
                           detail=f"{self.config.name} on {self.profile.name}: {e}"))
        if target is not None:  # the layout the projected TPOT rows are of (it can differ from the rank's)
            stage.add(info(tier, "synthetic.target_layout", f"TP{target.tp}/EP{target.ep}", level="projected",
                           detail=f"the projected TPOT rows are of {self.config.name} on {self.profile.name} at its "
                                  f"own layout; the rank run here is of TP{pl.tp}/EP{pl.ep}"))
        if pl.world > 1 and link <= 0:
            stage.add(info(tier, "synthetic.collectives_ms_per_step", "not projected", level="projected",
                           detail=f"{self.profile.name} has no link bandwidth (link.kind none), so the collectives "
                                  f"of TP{pl.tp}/EP{pl.ep} are counted but their time is not projected; pass "
                                  "--profile of a multi-GPU target"))
        for res in results:
            c, tpot = res.get("concurrency"), res.get("median_tpot_ms")
            if not c or not tpot:
                continue
            tag = f"c{c}"
            ctx = int(res.get("input_len") or 0) + int(res.get("output_len") or 0) // 2
            if pl.world > 1 and link > 0:
                proj = collective_projection(self.parallel, link, c)
                stage.add(info(tier, f"{tag}.synthetic.collectives_ms_per_step",
                               round(proj["total"]["seconds"] * 1e3, 6), "ms", level="projected",
                               detail=f"{proj['total']['calls']:.0f} collectives, {proj['total']['bytes'] / 1e6:.3f} MB "
                                      f"per rank per decode step of {c} rows, over {self.profile.name}'s "
                                      f"{link / 1e9:.0f} GB/s links (ring, bandwidth term only: per-call latency "
                                      "not modelled; counted here, not run)"))
                stage.add(info(tier, f"{tag}.synthetic.step_with_collectives_ms",
                               round(tpot + proj["total"]["seconds"] * 1e3, 4), "ms", level="projected",
                               detail=f"measured median TPOT ({tpot:.3f} ms, no collectives run) + projected "
                                      "collectives"))
            if target is not None:
                tl = float(self.profile.link_bandwidth or 0)
                tcoll = 0.0
                if target.world > 1 and tl > 0:
                    tgrp = ProjectedGroup(target, 0)
                    tgrp.stats, tgrp.row_bytes = self.parallel.stats, self.parallel.row_bytes  # bytes per row as counted
                    tcoll = collective_projection(tgrp, tl, c)["total"]["seconds"]
                p = tpot_projection(tpot / 1e3, pl, target, c, max(ctx, 1), tcoll)
                stage.add(info(tier, f"{tag}.synthetic.projected_tpot_ms", round(p["tpot_s"] * 1e3, 4), "ms",
                               level="projected",
                               detail=f"{self.config.name} on {self.profile.name} at TP{target.tp}/EP{target.ep}: "
                                      f"measured TPOT x step floor ratio {p['ratio']:.3f} "
                                      f"({p['floor_target_s'] * 1e3:.3f} / {p['floor_here_s'] * 1e3:.3f} ms) + "
                                      f"{tcoll * 1e3:.3f} ms collectives; random weights"))

    def _small_cpu_threads(self) -> None:
        """On the CPU, run a small checkpoint (< 1 GB) on one thread unless OMP_NUM_THREADS says otherwise:
        its tensors are too small to gain from threads, and on a shared machine threads oversubscribe
        the cores (measured: a k3-tiny decode step 20x slower with 2 threads on 2 busy cores)."""
        if self.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return
        try:
            small = layout.counts(self.config)["bytes"] < 1e9
        except Exception:
            small = False
        if small:
            torch.set_num_threads(1)
            self._cache["threads"] = 1

    @property
    def weights(self):
        """The loaded Weights of this process: the one device's, or rank 0's slices of a multi-rank layout (no
        rank ever holds another rank's weights).

        Raises:
            ValidationFailed: the load found problems (a tensor that differs from its source, NaN/Inf weights).
        """
        res = self.load()
        if res.report.problems:
            p = res.report.problems
            raise ValidationFailed(f"load of {self.checkpoint_dir}: {len(p)} problem(s), first: {p[0]}")
        if self.synthetic:
            return res.rank_weights[self.rank]
        return res.rank_weights[0] if self.world > 1 else res.weights

    @property
    def load_report(self):
        """The loader's ``LoadReport``."""
        return self.load().report

    @property
    def oracle(self):
        """The fp32 reference model (``k3rocm.model.model.K3Model``) over the same Weights; with several ranks
        the TP/EP oracle on every rank (:class:`~k3rocm.runtime.serve.RemoteModel`: fp32, torch ops, the same
        collectives as the distributed engine)."""
        def build():
            if self._multiprocess:
                self.weights  # refuses a load with problems
                return RemoteModel(self.cluster, "oracle", self.config)
            return K3Model(self.config, self.weights, par=self.parallel)
        return self._memo("oracle", build)

    @property
    def engine(self):
        """The engine with the registry-selected kernels (default sizes); see :meth:`engine_for`."""
        return self.engine_for()

    def engine_for(self, max_batch: int = 8, max_model_len: int = 2048, max_num_batched_tokens: int | None = None):
        """:class:`k3rocm.runtime.engine.Engine` (continuous batching, registry-selected ops per ``--kernels``)
        able to hold ``max_batch`` sequences of ``max_model_len`` tokens, ``max_num_batched_tokens`` tokens per
        step (None: the engine's default). Cached per size; the last one built is also ``self._cache["engine"]``
        (described in the report)."""
        key = f"engine:{max_batch}:{max_model_len}:{max_num_batched_tokens}"
        kw = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": int(max_num_batched_tokens)}

        def build():
            if self._multiprocess:  # built on every rank, each on its shard; rank 0's sends each step to the others
                self.weights  # refuses a load with problems
                return self.cluster.engine(max_batch=max_batch, max_model_len=max_model_len, **kw)
            return Engine(self.config, self.weights, kernels=dict(self.kernel_override), device=self.device,
                          max_batch=max_batch, max_model_len=max_model_len, par=self.parallel, **kw)
        eng = self._memo(key, build)
        self._cache["engine"] = eng
        return eng

    def engine_model(self, engine=None):
        """A layer-by-layer model running exactly the engine's ops on the engine's weights (dtype and
        device as the engine holds them) with the engine's dense-projection math (``matmul_dtype``: bf16
        operands with fp32 accumulation on a GPU): the path the correctness tier compares with the fp32 oracle."""
        eng = engine or self.engine
        if getattr(eng, "channel", None) is not None:
            return RemoteModel(self.cluster, f"engine:{eng.channel.eid}", self.config)
        return K3Model(self.config, eng.weights, ops=dict(eng.ops), moe_mode=getattr(eng, "moe_mode", "a16w4"),
                       matmul_dtype=getattr(eng, "matmul_dtype", None), par=self.parallel)

    def kernel_selection(self) -> dict:
        """op -> implementation name the engine runs."""
        eng = self._cache.get("engine")
        if eng is None:
            return {}
        return dict(getattr(eng, "op_impls", {}) or {})


def check_golden_file(path: str | Path, config=None) -> None:
    """A --golden file must be a safetensors file of consistent golden outputs.

    Required: ``input_ids`` ``[B, T]`` integer, non-empty; ``logits`` ``[B, T, V]`` float. Optional:
    ``layerNN.attn_out`` / ``layerNN.mlp_out`` ``[B, T, hidden]``, ``logits_top1_margin`` ``[B, T]``,
    ``greedy_prompt`` ``[L]`` and ``greedy_tokens`` ``[n]`` integer, non-empty, ``greedy_margins`` ``[n]``.
    With ``config`` (a :class:`k3rocm.config.K3Config`): ids inside ``0 .. vocab_size-1``, ``V == vocab_size``,
    ``hidden == hidden_size``, layer numbers below ``num_hidden_layers``.

    Raises:
        CheckpointError: missing, a directory, unreadable, not safetensors, or any tensor of the wrong name,
            rank, shape or dtype (one line naming the tensor and what is expected).
    """
    if not str(path).strip():
        raise CheckpointError("--golden is empty; pass a safetensors file with input_ids and logits, or omit it")
    p = Path(path)
    if p.is_dir():
        raise CheckpointError(f"--golden {p}: is a directory; pass the golden safetensors file inside it")
    if not p.is_file():
        raise CheckpointError(f"--golden {p}: file not found; pass a safetensors file with input_ids and logits")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
            ids = f.get_tensor("input_ids") if "input_ids" in meta else None
            finite = {k: bool(f.get_tensor(k).float().isfinite().all()) for k in meta
                      if k == "logits" or k.endswith("_out") or k.endswith("margin") or k.endswith("margins")}
            greedy = {k: f.get_tensor(k) for k in ("greedy_prompt", "greedy_tokens") if k in meta}
    except Exception as e:  # any parse failure of a user-given file is bad input
        raise CheckpointError(f"--golden {p}: not a safetensors file ({type(e).__name__}); pass the golden "
                              "outputs file (input_ids, logits, layerNN.*)") from None
    missing = {"input_ids", "logits"} - set(meta)
    if missing:
        raise CheckpointError(f"--golden {p}: lacks {', '.join(sorted(missing))}; a golden file holds input_ids "
                              "and logits (and optionally layerNN.attn_out/mlp_out, greedy_*)")

    def bad(name: str, want: str) -> CheckpointError:
        shape, dt = meta[name]
        return CheckpointError(f"--golden {p}: tensor {name} is {dt} {shape}, expected {want}; use golden data "
                               "written in the documented layout")

    ints = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
    floats = ("F16", "BF16", "F32", "F64")
    ishape, idt = meta["input_ids"]
    if len(ishape) != 2 or 0 in ishape or idt not in ints:
        raise bad("input_ids", "a non-empty integer [B, T]")
    B, T = ishape
    lshape, ldt = meta["logits"]
    if len(lshape) != 3 or lshape[:2] != [B, T] or lshape[2] < 1 or ldt not in floats:
        raise bad("logits", f"a float [{B}, {T}, V] (the input_ids' batch and length)")
    known = {"input_ids", "logits", "logits_top1_margin", "greedy_prompt", "greedy_tokens", "greedy_margins"}
    for k in sorted(meta):
        if k not in known and not re.fullmatch(r"layer\d+\.(attn_out|mlp_out)", k):
            raise CheckpointError(f"--golden {p}: unknown tensor {k!r}; a golden file holds input_ids, logits, "
                                  "logits_top1_margin, layerNN.attn_out / layerNN.mlp_out, greedy_prompt, "
                                  "greedy_tokens, greedy_margins - rename or drop it so nothing is silently skipped")
        m = re.fullmatch(r"layer(\d+)\.(attn_out|mlp_out)", k)
        if m and len(m.group(1)) < 2:
            raise CheckpointError(f"--golden {p}: tensor {k!r} is not zero-padded; name layer outputs layerNN "
                                  f"(layer{int(m.group(1)):02d}.{m.group(2)})")
    hidden = config.hidden_size if config is not None else None
    for k in sorted(meta):
        m = re.fullmatch(r"layer(\d+)\.(attn_out|mlp_out)", k)
        if m:
            shape, dt = meta[k]
            if len(shape) != 3 or shape[:2] != [B, T] or dt not in floats or (hidden is not None and shape[2] != hidden):
                raise bad(k, f"a float [{B}, {T}, hidden]" + (f" with hidden {hidden}" if hidden is not None else ""))
            hidden = shape[2]
            if config is not None and int(m.group(1)) >= config.num_hidden_layers:
                raise CheckpointError(f"--golden {p}: tensor {k} names a layer past the checkpoint's "
                                      f"{config.num_hidden_layers}; use golden data made from this checkpoint")
        elif k.startswith("layer") and (k.endswith("attn_out") or k.endswith("mlp_out")):
            raise CheckpointError(f"--golden {p}: tensor {k} is not named layerNN.attn_out / layerNN.mlp_out")
    for k, ok in sorted(finite.items()):
        if not ok:
            raise CheckpointError(f"--golden {p}: tensor {k} holds NaN or Inf values; golden outputs must be finite "
                                  "- regenerate the file")
    if "logits_top1_margin" in meta and meta["logits_top1_margin"][0] != [B, T]:
        raise bad("logits_top1_margin", f"[{B}, {T}]")
    if ("greedy_prompt" in meta) != ("greedy_tokens" in meta):
        raise CheckpointError(f"--golden {p}: has only one of greedy_prompt / greedy_tokens; give both or neither")
    for k, t in greedy.items():
        if t.dim() != 1 or t.numel() == 0 or meta[k][1] not in ints:
            raise bad(k, "a non-empty integer [n]")
    if "greedy_margins" in meta and "greedy_tokens" in meta and \
            meta["greedy_margins"][0] != [int(greedy["greedy_tokens"].numel())]:
        raise bad("greedy_margins", f"[{int(greedy['greedy_tokens'].numel())}] (one per greedy token)")
    if config is not None:
        V = config.vocab_size
        all_ids = [("input_ids", ids)] + [(k, v) for k, v in greedy.items()]
        for k, t in all_ids:
            if int(t.min()) < 0 or int(t.max()) >= V:
                raise CheckpointError(f"--golden {p}: {k} holds ids {int(t.min())}..{int(t.max())}, outside the "
                                      f"checkpoint's vocabulary 0..{V - 1}; use golden data made from this checkpoint")
        if lshape[2] != V:
            raise CheckpointError(f"--golden {p}: logits have {lshape[2]} vocabulary entries, the checkpoint "
                                  f"{V}; use golden data made from this checkpoint")


def require_dir_for_output(out: str | Path, keep: bool = True) -> Path:
    """Create the report directory and prove it is writable (a probe file is created and removed).

    ``keep=False`` (the pre-flight check, before any tier runs): directories this call had to create are
    removed again after the probe, so a run refused later for another reason leaves nothing behind; the
    report writer creates them for real.

    Raises:
        ConfigError: ``out`` exists and is not a directory, holds a report.json/md/html that is not a regular
            file (a directory, a dangling link), or cannot be created / written (permissions, a read-only or
            pseudo file system); the message names the path and the OS reason.
    """
    if not str(out).strip():
        raise ConfigError("--out is empty; pass a report directory (default: reports/latest)")
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--out {p}: exists and is not a directory; choose another report directory")
    if p.is_symlink() and not p.exists():
        raise ConfigError(f"--out {p}: is a symbolic link that leads nowhere (dangling, or a loop); choose another "
                          "report directory")
    for name in ("report.json", "report.md", "report.html", ".report.lock"):
        q = p / name
        if (q.exists() and not q.is_file()) or (q.is_symlink() and not q.exists()):
            raise ConfigError(f"--out {p}: {name} there is not a regular file; move it away or choose another "
                              "report directory")
    created = [q for q in [p, *p.parents] if not q.exists()]
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".k3rocm-probe.", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--out {p}: cannot write reports there ({e.strerror or e}); "
                          "choose a writable directory") from None
    finally:
        if not keep:
            for q in created:  # deepest first
                try:
                    q.rmdir()
                except OSError:
                    break
    return p


def refuse_output_inside(out: str | Path, checkpoint_dir: str | Path) -> None:
    """Refuse a report directory inside (or equal to) the checkpoint directory or the embedded checkpoint cache.

    A report written into a checkpoint makes its next manifest check fail (`checkpoint verify` would say
    "re-download"), and one inside the embedded cache (:func:`k3rocm.embedded.cache_root`) is deleted when that
    cache is written again. Paths are compared resolved (symlinks followed).

    Raises:
        ConfigError: ``out`` lies inside one of them (one line naming both).
    """
    o = Path(out).expanduser().resolve()
    for what, d in (("the checkpoint directory", Path(checkpoint_dir)), ("the k3rocm cache", cache_root())):
        d = d.expanduser().resolve()
        if o == d or o.is_relative_to(d):
            raise ConfigError(f"--out {out}: lies inside {what} {d}; a report there would change what the checkpoint "
                              "holds - choose a report directory outside it")
