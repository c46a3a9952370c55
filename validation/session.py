"""A validation session: the options of one command and the objects it builds, each built once, lazily.

The CLI and the tiers share one :class:`Session`: the checkpoint directory (default: the embedded
``k3-tiny`` written once into the user cache), its config and validated index, the detected hardware,
the hardware profile (``--profile`` or the match for the detected hardware), the placement plan, the
loaded weights, the fp32 oracle model and the engine that runs the selected kernels.

Whether measurements are ``measured`` or ``measured-fallback`` is decided here
(:attr:`Session.measured_level`): ``measured`` only when the detected hardware is what the profile names
(same backend and base arch, at least the profile's device count).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.errors import CheckpointError, ConfigError, HardwareError


class Unavailable(HardwareError):
    """A toolkit component this command needs is not importable in this installation (exit 3)."""


def need(module: str, attr: str | None = None) -> Any:
    """Import ``module`` (and return ``attr`` of it). Raises :class:`Unavailable` with one line."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(f"{module} cannot be imported ({e}); reinstall k3rocm (pip install -e .)") from None
    if attr is None:
        return mod
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise Unavailable(f"{module}.{attr} is missing; reinstall k3rocm (pip install -e .)") from None


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
    """

    checkpoint: str | None = None
    profile: str | None = None
    out: str = "reports/latest"
    kernels: str = "auto"
    seed: int = 0
    golden: str | None = None
    debug: bool = False
    command: str = ""
    extra: dict = field(default_factory=dict)


class Session:
    """Lazily built objects of one command. Every property raises a :class:`k3rocm.errors.K3Error`
    subclass with a one-line message on expected failures (missing directory, unknown profile, ...)."""

    def __init__(self, opts: Options):
        self.opts = opts
        self._cache: dict[str, Any] = {}
        self.kernel_override = need("k3rocm.kernels.registry", "parse_override")(opts.kernels)

    def preflight(self) -> None:
        """Resolve what bad input can break before any tier runs or anything is printed: the checkpoint (the
        reader's whole structural check: index, shards, headers, tensor set, scales), the hardware profile,
        the --kernels choice (triton/aiter need a GPU: exit 3), the --golden file, the --out directory.
        Raises the one-line K3Error."""
        self.checkpoint_dir
        self.index
        self.config
        self.profile
        reg = need("k3rocm.kernels.registry")
        for op in reg.ORACLE_OPS:
            reg.select(op, self.kernel_override)
        if self.opts.golden:
            check_golden_file(self.opts.golden)
        require_dir_for_output(self.opts.out)

    def _memo(self, key: str, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    # ------------------------------------------------------------------ checkpoint
    @property
    def checkpoint_dir(self) -> Path:
        """Absolute checkpoint directory; the embedded default is written on first use."""
        def build() -> Path:
            if self.opts.checkpoint is None:
                return Path(need("k3rocm.embedded", "default_checkpoint")()).resolve()
            if not str(self.opts.checkpoint).strip():
                raise CheckpointError("--checkpoint is empty; pass a checkpoint directory, or omit it for the "
                                      "embedded k3-tiny")
            p = Path(self.opts.checkpoint).expanduser()
            if not p.exists():
                raise CheckpointError(f"{p}: checkpoint directory does not exist; pass --checkpoint DIR "
                                      "holding config.json and *.safetensors (or omit it for the embedded k3-tiny)")
            if not p.is_dir():
                raise CheckpointError(f"{p}: is a file, not a checkpoint directory; pass the folder that holds it")
            if not (p / "config.json").is_file():
                raise CheckpointError(f"{p}: no config.json; pass a checkpoint directory in the released layout")
            return p.resolve()
        return self._memo("checkpoint_dir", build)

    @property
    def index(self):
        """The validated checkpoint index (:func:`k3rocm.checkpoint.open_checkpoint`: directory, index,
        shard headers, tensor set vs the config's layout, E8M0 scales)."""
        return self._memo("index", lambda: need("k3rocm.checkpoint.reader", "open_checkpoint")(self.checkpoint_dir))

    @property
    def config(self):
        """The checkpoint's :class:`k3rocm.config.K3Config`."""
        def build():
            idx = self._cache.get("index")
            cfg = getattr(idx, "config", None) if idx is not None else None
            if cfg is None:
                from k3rocm.config import K3Config
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
        return self._memo("detected", lambda: need("k3rocm.hw", "detect")(with_smi=True))

    @property
    def profile(self):
        """``--profile`` (ConfigError for an unknown name) or the shipped profile matching the hardware."""
        def build():
            hw = need("k3rocm.hw")
            if self.opts.profile:
                return hw.load_profile(self.opts.profile)
            return hw.match_profile(self.detected)
        return self._memo("profile", build)

    @property
    def hardware_matches(self) -> bool:
        """Detected backend/arch equal the profile's and at least its device count is visible."""
        d, p = self.detected, self.profile
        if p.backend == "cpu":
            return True  # the engine runs on this machine's CPU, which is what a CPU profile names
        return d.backend == p.backend and d.arch == p.arch and d.count >= p.device_count

    @property
    def measured_level(self) -> str:
        """``measured`` on the profile's hardware, else ``measured-fallback``."""
        return "measured" if self.hardware_matches else "measured-fallback"

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
            plan = need("k3rocm.runtime.plan", "plan")
            return plan(self.config, self.profile, **self.opts.extra.get("plan_kwargs", {}))
        return self._memo("placement", build)

    @property
    def run_placement(self):
        """The placement the weights are loaded with: the profile's when this is the profile's hardware,
        else a plan for the hardware detected here (a fallback run measures on what is present)."""
        def build():
            if self.hardware_matches:
                return self.placement
            hw = need("k3rocm.hw")
            plan = need("k3rocm.runtime.plan", "plan")
            return plan(self.config, hw.match_profile(self.detected))
        return self._memo("run_placement", build)

    def load(self, progress=None):
        """Stream the checkpoint with :func:`k3rocm.runtime.load.load_checkpoint` onto :attr:`device` with the
        :attr:`run_placement`, proving every tensor landed. Returns the ``LoadResult`` (cached);
        ``progress(done_bytes, total_bytes, text)`` is called as bytes land."""
        def build():
            self._small_cpu_threads()
            load_checkpoint = need("k3rocm.runtime.load", "load_checkpoint")
            return load_checkpoint(self.checkpoint_dir, placement=self.run_placement, index=self.index,
                                   device=self.device, progress=progress)
        return self._memo("load", build)

    def _small_cpu_threads(self) -> None:
        """On the CPU, run a small checkpoint (< 1 GB) on one thread unless OMP_NUM_THREADS says otherwise:
        its tensors are too small to gain from threads, and on a shared machine threads oversubscribe
        the cores (measured: a k3-tiny decode step 20x slower with 2 threads on 2 busy cores)."""
        import os
        if self.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return
        try:
            from k3rocm.checkpoint import layout
            small = layout.counts(self.config)["bytes"] < 1e9
        except Exception:
            small = False
        if small:
            import torch
            torch.set_num_threads(1)
            self._cache["threads"] = 1

    @property
    def weights(self):
        """The loaded single-device Weights (all ranks re-assembled when the plan has several)."""
        return self.load().weights

    @property
    def load_report(self):
        """The loader's ``LoadReport``."""
        return self.load().report

    @property
    def oracle(self):
        """The fp32 reference model (``k3rocm.model.model.K3Model``) over the same Weights."""
        return self._memo("oracle", lambda: need("k3rocm.model.model", "K3Model")(self.config, self.weights))

    @property
    def engine(self):
        """The engine with the registry-selected kernels (default sizes); see :meth:`engine_for`."""
        return self.engine_for()

    def engine_for(self, max_batch: int = 8, max_model_len: int = 2048):
        """:class:`k3rocm.runtime.engine.Engine` (continuous batching, registry-selected ops per ``--kernels``)
        able to hold ``max_batch`` sequences of ``max_model_len`` tokens. Cached per size; the last one
        built is also ``self._cache["engine"]`` (described in the report)."""
        key = f"engine:{max_batch}:{max_model_len}"

        def build():
            Engine = need("k3rocm.runtime.engine", "Engine")
            return Engine(self.config, self.weights, kernels=dict(self.kernel_override), device=self.device,
                          max_batch=max_batch, max_model_len=max_model_len)
        eng = self._memo(key, build)
        self._cache["engine"] = eng
        return eng

    def engine_model(self, engine=None):
        """A layer-by-layer model running exactly the engine's ops on the engine's weights (dtype and
        device as the engine holds them) with the engine's dense-projection math (``matmul_dtype``: bf16
        operands with fp32 accumulation on a GPU): the path the correctness tier compares with the fp32 oracle."""
        eng = engine or self.engine
        K3Model = need("k3rocm.model.model", "K3Model")
        return K3Model(self.config, eng.weights, ops=dict(eng.ops), moe_mode=getattr(eng, "moe_mode", "a16w4"),
                       matmul_dtype=getattr(eng, "matmul_dtype", None))

    def kernel_selection(self) -> dict:
        """op -> implementation name the engine runs."""
        eng = self._cache.get("engine")
        if eng is None:
            return {}
        return dict(getattr(eng, "op_impls", {}) or {})


def check_golden_file(path: str | Path) -> None:
    """A --golden file must be a safetensors file holding at least ``input_ids`` and ``logits``.

    Raises:
        CheckpointError: missing, unreadable, not safetensors, or without those tensors (one line).
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"--golden {p}: file not found; pass a safetensors file with input_ids and logits")
    try:
        from safetensors import safe_open
        with safe_open(str(p), framework="pt") as f:
            keys = set(f.keys())
    except Exception as e:  # any parse failure of a user-given file is bad input
        raise CheckpointError(f"--golden {p}: not a safetensors file ({type(e).__name__}); pass the golden "
                              "outputs file (input_ids, logits, layerNN.*)") from None
    missing = {"input_ids", "logits"} - keys
    if missing:
        raise CheckpointError(f"--golden {p}: lacks {', '.join(sorted(missing))}; a golden file holds input_ids "
                              "and logits (and optionally layerNN.attn_out/mlp_out, greedy_*)")


def require_dir_for_output(out: str | Path) -> Path:
    """Create the report directory and prove it is writable (a probe file is created and removed).

    Raises:
        ConfigError: ``out`` exists and is not a directory, or cannot be created / written (permissions,
            a read-only or pseudo file system); the message names the path and the OS reason.
    """
    import tempfile

    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--out {p}: exists and is not a directory; choose another report directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".k3rocm-probe.", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--out {p}: cannot write reports there ({e.strerror or e}); "
                          "choose a writable directory") from None
    return p
