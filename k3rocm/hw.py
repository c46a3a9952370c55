"""Hardware detection and hardware profiles.

:func:`detect` reads what this process can see: the torch build (ROCm when ``torch.version.hip`` is set,
else CUDA when ``torch.version.cuda`` is set and a device is visible, else CPU), every visible device
(name, arch, memory), driver / runtime versions, torch / triton versions, whether ``aiter`` is importable,
the environment variables that change how GPUs and collectives behave, and — when the optional packages
are importable — ``amdsmi`` (AMD) or ``pynvml`` (``nvidia-ml-py``, NVIDIA) readings.

Arch strings: on ROCm the arch is ``torch.cuda.get_device_properties(i).gcnArchName`` (e.g.
``gfx950:sramecc+:xnack-``; :attr:`DeviceInfo.arch_base` strips the feature flags). On CUDA it is built from
the compute capability (``sm_90``). AMD devices report a CUDA-style capability such as (9, 4) too, so never
gate an AMD feature on the capability: use the gfx arch (HARDWARE.md "ROCm from Python").

Profiles are TOML files in ``k3rocm/hwprofiles/`` (package data) read with :mod:`tomllib`:
:func:`list_profiles`, :func:`load_profile`, :func:`match_profile`. Every figure in a profile carries its
source (a datasheet and its date, or "measured here" with the date) — see ``hwprofiles/*.toml``.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from k3rocm.errors import ConfigError

ENV_PREFIXES = ("NCCL_", "RCCL_", "TRITON_", "HSA_", "PYTORCH_", "HIP_", "ROCM_", "CUDA_", "TORCH_NCCL_", "K3ROCM_")
ENV_NAMES = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "OMP_NUM_THREADS",
             "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


# ---------------------------------------------------------------------------------------------- detect
@dataclass
class DeviceInfo:
    """One visible accelerator.

    Attributes:
        index: torch device index.
        name: marketing name as the runtime reports it (``AMD Instinct MI355X``, ``NVIDIA H200``).
        arch: full arch string (``gfx950:sramecc+:xnack-`` on ROCm, ``sm_90`` on CUDA).
        memory_bytes: total device memory in bytes, as the runtime reports it.
        multiprocessors: CUs (AMD) or SMs (NVIDIA).
        capability: CUDA-style (major, minor) as torch reports it — informational only on AMD.
        smi: readings from amdsmi / pynvml when importable (memory used, power, clocks), else ``{}``.
    """

    index: int
    name: str
    arch: str
    memory_bytes: int
    multiprocessors: int = 0
    capability: tuple[int, int] = (0, 0)
    smi: dict = field(default_factory=dict)

    @property
    def arch_base(self) -> str:
        """The arch without feature flags: ``gfx950:sramecc+:xnack-`` -> ``gfx950``."""
        return self.arch.split(":", 1)[0]


@dataclass
class Detected:
    """What :func:`detect` found. ``backend`` is ``"rocm"``, ``"cuda"`` or ``"cpu"``."""

    backend: str
    devices: list[DeviceInfo]
    torch_version: str
    torch_build: str  # "ROCm 6.4.x" / "CUDA 12.x" / "CPU"
    hip_version: str | None
    cuda_version: str | None
    triton_version: str | None
    triton_target: str | None
    aiter_version: str | None
    driver: str | None
    python: str
    host: str
    cpu_count: int
    env: dict[str, str]
    smi_source: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def arch(self) -> str | None:
        """Base arch of device 0 (``gfx950``, ``sm_90``) or None on CPU."""
        return self.devices[0].arch_base if self.devices else None

    @property
    def memory_bytes(self) -> int:
        """Smallest device memory among the visible devices (what a placement can count on), 0 on CPU."""
        return min((d.memory_bytes for d in self.devices), default=0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["count"] = self.count
        d["arch"] = self.arch
        for dev, dd in zip(self.devices, d["devices"]):
            dd["arch_base"] = dev.arch_base
            dd["capability"] = list(dev.capability)
        return d


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that change device selection, collectives or kernels (sorted by name)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ)
            if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


def _amdsmi_readings(n: int) -> tuple[list[dict], str | None]:
    try:
        import amdsmi  # type: ignore[import-not-found]
    except Exception:
        return [{} for _ in range(n)], None
    out: list[dict] = []
    try:
        amdsmi.amdsmi_init()
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
            for h in handles[:n]:
                r: dict[str, Any] = {}
                for key, fn in (("vram", "amdsmi_get_gpu_vram_usage"), ("power", "amdsmi_get_power_info"),
                                ("asic", "amdsmi_get_gpu_asic_info"), ("driver", "amdsmi_get_gpu_driver_info")):
                    try:
                        r[key] = getattr(amdsmi, fn)(h)
                    except Exception as e:  # one unsupported query must not hide the others
                        r[key] = f"unavailable: {type(e).__name__}"
                out.append(r)
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception as e:
        return [{"error": f"amdsmi: {e}"} for _ in range(n)], "amdsmi"
    return out + [{} for _ in range(n - len(out))], "amdsmi"


def _pynvml_readings(n: int) -> tuple[list[dict], str | None, str | None]:
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception:
        return [{} for _ in range(n)], None, None
    out: list[dict] = []
    driver = None
    try:
        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            for i in range(min(n, pynvml.nvmlDeviceGetCount())):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                r: dict[str, Any] = {}
                try:
                    m = pynvml.nvmlDeviceGetMemoryInfo(h)
                    r["memory"] = {"total": int(m.total), "used": int(m.used), "free": int(m.free)}
                except Exception as e:
                    r["memory"] = f"unavailable: {type(e).__name__}"
                try:
                    r["power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
                except Exception:
                    pass
                try:
                    r["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
                except Exception:
                    pass
                out.append(r)
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:
        return [{"error": f"pynvml: {e}"} for _ in range(n)], "pynvml", driver
    return out + [{} for _ in range(n - len(out))], "pynvml", driver


def _rocm_driver() -> str | None:
    for p in ("/sys/module/amdgpu/version", "/opt/rocm/.info/version"):
        try:
            with open(p) as f:
                return f"{p}: {f.read().strip()}"
        except OSError:
            continue
    return None


def detect(with_smi: bool = True) -> Detected:
    """Detect the backend, devices and software this process sees. Never raises for a missing GPU.

    Backend rule: ``torch.version.hip`` set -> ``"rocm"``; else ``torch.version.cuda`` set and
    ``torch.cuda.is_available()`` -> ``"cuda"``; else ``"cpu"`` (a ROCm/CUDA build with no visible device
    is reported as ``cpu`` with a note).

    Returns:
        :class:`Detected` (``to_dict()`` for the report).
    """
    import torch

    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    notes: list[str] = []
    try:
        avail = torch.cuda.is_available()
    except Exception as e:  # pragma: no cover - broken driver
        avail = False
        notes.append(f"torch.cuda.is_available() raised {type(e).__name__}: {e}")
    if hip and avail:
        backend = "rocm"
    elif cuda and avail and not hip:
        backend = "cuda"
    else:
        backend = "cpu"
        if (hip or cuda) and not avail:
            notes.append(f"torch is a {'ROCm' if hip else 'CUDA'} build but no device is visible")
    build = f"ROCm {hip}" if hip else (f"CUDA {cuda}" if cuda else "CPU")

    devices: list[DeviceInfo] = []
    if backend != "cpu":
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cap = (int(p.major), int(p.minor))
            if backend == "rocm":
                arch = getattr(p, "gcnArchName", "") or "gfx?"
            else:
                arch = f"sm_{cap[0]}{cap[1]}"
            devices.append(DeviceInfo(index=i, name=p.name, arch=arch, memory_bytes=int(p.total_memory),
                                      multiprocessors=int(getattr(p, "multi_processor_count", 0)), capability=cap))

    smi_source = None
    driver = None
    if with_smi and devices:
        if backend == "rocm":
            readings, smi_source = _amdsmi_readings(len(devices))
            driver = _rocm_driver()
        else:
            readings, smi_source, driver = _pynvml_readings(len(devices))
        for d, r in zip(devices, readings):
            d.smi = r
    if driver is None and backend == "cuda":
        try:
            driver = f"CUDA driver API {torch.cuda.driver_version()}" if hasattr(torch.cuda, "driver_version") else None
        except Exception:
            driver = None

    triton_version = _version("triton")
    triton_target = None
    if devices:
        try:
            from triton.runtime import driver as tdriver
            t = tdriver.active.get_current_target()
            triton_target = f"{t.backend}:{t.arch}:warp{t.warp_size}"
        except Exception as e:
            notes.append(f"triton target unavailable: {type(e).__name__}")

    return Detected(
        backend=backend, devices=devices, torch_version=torch.__version__, torch_build=build,
        hip_version=hip, cuda_version=cuda, triton_version=triton_version, triton_target=triton_target,
        aiter_version=_version("aiter") or (_module_present("aiter") and "present (version unknown)") or None,
        driver=driver, python=platform.python_version(), host=platform.node(), cpu_count=os.cpu_count() or 1,
        env=relevant_env(), smi_source=smi_source, notes=notes,
    )


def _module_present(name: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class Sourced:
    """A figure and where it comes from (``"AMD MI355X datasheet, 2025-06"`` / ``"measured here, 2026-11-30"``)."""

    value: Any
    source: str


@dataclass(frozen=True)
class Target:
    """A public performance figure a run can be compared with (K3_FACTS §7)."""

    name: str
    metric: str  # vLLM field name where one exists: "mean_tpot_ms", "output_throughput", ...
    value: float
    unit: str
    setting: str  # engine, input/output lengths, concurrency, devices
    source: str


@dataclass(frozen=True)
class Profile:
    """A hardware profile (one node). All sizes in bytes, rates in bytes/s and FLOP/s, per device.

    Attributes:
        name: profile name (file stem).
        backend: ``rocm`` / ``cuda`` / ``cpu``.
        device_name, arch (base: ``gfx950``, ``sm_90``, ``cpu``), device_count.
        memory_bytes: HBM per device.
        usable_fraction: fraction of ``memory_bytes`` a placement may use (an assumption, sourced).
        workspace_reserve_bytes: per device, kept aside for runtime, collectives and kernel workspaces.
        hbm_bandwidth: bytes/s per device.
        peak_flops: dense FLOP/s per dtype (``bf16``, ``fp8``, ``mxfp4``); ``None`` = no hardware support.
        link: interconnect kind (``xGMI``, ``NVLink``, ``none``) and per-device bandwidth in bytes/s.
        tp, ep: default parallel layout.
        targets: public performance figures for this node.
        sources: figure name -> source text.
    """

    name: str
    description: str
    backend: str
    device_name: str
    arch: str
    device_count: int
    memory_bytes: int
    usable_fraction: float
    workspace_reserve_bytes: int
    hbm_bandwidth: float
    peak_flops: dict[str, float | None]
    link_kind: str
    link_bandwidth: float
    tp: int
    ep: int
    targets: tuple[Target, ...]
    sources: dict[str, str]
    fp8_format: str | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def usable_bytes(self) -> int:
        """Per-device bytes a placement may fill: ``memory_bytes * usable_fraction``."""
        return int(self.memory_bytes * self.usable_fraction)

    @property
    def has_fp4(self) -> bool:
        return bool(self.peak_flops.get("mxfp4"))

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of ``dtype``, falling back to bf16 when the hardware lacks it (emulated by upcast)."""
        v = self.peak_flops.get(dtype)
        return float(v) if v else float(self.peak_flops.get("bf16") or 0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw", None)
        d["usable_bytes"] = self.usable_bytes
        d["targets"] = [asdict(t) for t in self.targets]
        return d


def _profile_dir():
    return resources.files("k3rocm.hwprofiles")


@lru_cache(maxsize=1)
def list_profiles() -> tuple[str, ...]:
    """Names of the shipped profiles (``*.toml`` stems), sorted."""
    return tuple(sorted(p.name[:-5] for p in _profile_dir().iterdir() if p.name.endswith(".toml")))


def _need(doc: dict, path: str, fname: str) -> Any:
    cur: Any = doc
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            raise ConfigError(f"{fname}: missing field {path}; every profile defines it (see hwprofiles/mi355x-8.toml)")
        cur = cur[k]
    return cur


def parse_profile(doc: dict, name: str, fname: str = "<profile>") -> Profile:
    """Build a :class:`Profile` from a parsed TOML document. Raises ConfigError naming the missing field."""
    dev = _need(doc, "device", fname)
    mem = _need(doc, "memory", fname)
    peaks = _need(doc, "peak_flops", fname)
    link = _need(doc, "link", fname)
    par = _need(doc, "parallel", fname)
    sources: dict[str, str] = {}
    for sec_name, sec in (("device", dev), ("memory", mem), ("peak_flops", peaks), ("link", link),
                          ("parallel", par)):
        for k, v in sec.items():
            if k.endswith("_source") or k == "source":
                sources[f"{sec_name}.{k}"] = str(v)
    targets = tuple(Target(name=t["name"], metric=t["metric"], value=float(t["value"]), unit=t["unit"],
                           setting=t.get("setting", ""), source=t["source"]) for t in doc.get("targets", []))

    def rate(v):
        return None if v in (None, "none", 0) else float(v)

    return Profile(
        name=name, description=str(doc.get("description", "")), backend=str(_need(doc, "backend", fname)),
        device_name=str(_need(doc, "device.name", fname)), arch=str(_need(doc, "device.arch", fname)),
        device_count=int(_need(doc, "device.count", fname)), memory_bytes=int(_need(doc, "device.memory_bytes", fname)),
        usable_fraction=float(_need(doc, "memory.usable_fraction", fname)),
        workspace_reserve_bytes=int(_need(doc, "memory.workspace_reserve_bytes", fname)),
        hbm_bandwidth=float(_need(doc, "device.hbm_bandwidth", fname)),
        peak_flops={k: rate(peaks.get(k)) for k in ("bf16", "fp8", "mxfp4")},
        link_kind=str(_need(doc, "link.kind", fname)), link_bandwidth=float(_need(doc, "link.bandwidth", fname)),
        tp=int(_need(doc, "parallel.tp", fname)), ep=int(_need(doc, "parallel.ep", fname)),
        targets=targets, sources=sources, fp8_format=dev.get("fp8_format"), raw=doc,
    )


@lru_cache(maxsize=32)
def load_profile(name: str) -> Profile:
    """Load the shipped profile ``name`` (e.g. ``mi355x-8``), or a profile file: a path ending in ``.toml``
    in the shipped profiles' format (e.g. a copy of ``hwprofiles/mi355x-8.toml`` edited to describe two nodes
    of 8 GPUs as 16 devices).

    Raises:
        ConfigError: unknown name (the message lists the known ones), a missing file, or a malformed file.
    """
    if str(name).endswith(".toml"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"profile file {path} does not exist; pass a TOML file in the format of "
                              "hwprofiles/*.toml, or a shipped profile name (see `k3rocm profiles`)")
        try:
            doc = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML ({e}); fix the file") from None
        return parse_profile(doc, path.stem, str(path))
    known = list_profiles()
    if name not in known:
        raise ConfigError(f"unknown hardware profile {name!r}; choose one of {', '.join(known)}, or pass a "
                          "profile file (*.toml)")
    fname = f"hwprofiles/{name}.toml"
    try:
        doc = tomllib.loads(_profile_dir().joinpath(f"{name}.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{fname}: not valid TOML ({e}); fix the file") from None
    return parse_profile(doc, name, fname)


def match_profile(detected: Detected | None = None) -> Profile:
    """The shipped profile that best describes ``detected`` (default: :func:`detect`).

    Rule: same backend and base arch, device name containing the profile's SKU token (``MI355X``,
    ``H200``...) when possible; among those the one whose device count equals the visible count, else the
    largest count not above it, else the smallest. CPU (or an unknown GPU) -> ``cpu`` with the GPU
    figures unknown. Never raises for unknown hardware.
    """
    det = detected if detected is not None else detect(with_smi=False)
    if det.backend == "cpu" or not det.devices:
        return load_profile("cpu")
    profiles = [load_profile(n) for n in list_profiles() if n != "cpu"]
    arch = det.arch
    name = det.devices[0].name.upper().replace(" ", "")
    cands = [p for p in profiles if p.backend == det.backend and p.arch == arch]
    named = [p for p in cands if _sku(p.device_name) and _sku(p.device_name) in name]
    cands = named or cands
    if not cands:
        return load_profile("cpu")
    n = det.count
    exact = [p for p in cands if p.device_count == n]
    if exact:
        return exact[0]
    below = sorted((p for p in cands if p.device_count < n), key=lambda p: -p.device_count)
    return below[0] if below else sorted(cands, key=lambda p: p.device_count)[0]


def _sku(device_name: str) -> str:
    """SKU token of a profile's device name: ``AMD Instinct MI355X`` -> ``MI355X``; ``NVIDIA H200`` -> ``H200``."""
    m = re.search(r"(MI\d{3}[A-Z]?|[HB]\d{3})", device_name.upper())
    return m.group(1) if m else ""
