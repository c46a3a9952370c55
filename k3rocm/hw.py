"""Hardware detection: backend, devices, arch, memory, driver and the environment that changes what runs.

:func:`detect` reads what this process can see: the torch build (ROCm when ``torch.version.hip`` is set,
else CUDA when ``torch.version.cuda`` is set and a device is visible, else CPU), every visible device
(name, arch, memory), driver / runtime versions, torch / triton versions, whether ``aiter`` is importable,
the environment variables that change how GPUs and collectives behave (:func:`relevant_env`, also what a
report records), and — when the optional packages are importable — ``amdsmi`` (AMD) or ``pynvml``
(``nvidia-ml-py``, NVIDIA) readings.

Arch strings: on ROCm the arch is ``torch.cuda.get_device_properties(i).gcnArchName`` (e.g.
``gfx950:sramecc+:xnack-``; :attr:`DeviceInfo.arch_base` strips the feature flags). On CUDA it is built from
the compute capability (``sm_90``). AMD devices report a CUDA-style capability such as (9, 4) too, so never
gate an AMD feature on the capability: use the gfx arch (HARDWARE.md "ROCm from Python").

Hardware profiles (the TOML schema, loading and matching a profile to what :func:`detect` saw) are in
:mod:`k3rocm.profiles`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import Any

#: environment variables that change what runs (device selection, collectives, kernels, threading, allocators):
#: every name starting with one of these (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` match whole names) ...
ENV_PREFIXES = ("AITER_", "CUDA_", "HIP_", "HSA_", "K3ROCM_", "NCCL_", "PYTORCH_", "RCCL_", "ROCM_", "ROCR_",
                "SGLANG_", "TORCH_", "TRITON_", "VLLM_", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
#: ... and these exact names (the torchrun rendezvous)
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


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
    """The environment variables that change device selection, collectives, kernels or threading.

    Args:
        environ: the environment to filter (default ``os.environ``).
    Returns:
        ``{name: value}`` sorted by name, for names in :data:`ENV_NAMES` or starting with one of
        :data:`ENV_PREFIXES`; recorded by :func:`detect` and by a report's reproduction block.
    """
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ)
            if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


@dataclass(frozen=True)
class TorchBuild:
    """The torch this process imports.

    Attributes:
        version: ``torch.__version__``.
        hip: ``torch.version.hip`` (set on a ROCm build), else None.
        cuda: ``torch.version.cuda`` (set on a CUDA build), else None.
    """

    version: str
    hip: str | None
    cuda: str | None

    @property
    def toolkit(self) -> tuple[str, str | None]:
        """``("hip", version)`` for a ROCm build (``hip`` wins when both are set), ``("cuda", version)`` for a
        CUDA build, ``("cpu", None)`` otherwise."""
        if self.hip:
            return "hip", self.hip
        return ("cuda", self.cuda) if self.cuda else ("cpu", None)

    @property
    def name(self) -> str:
        """``ROCm 6.4.x`` / ``CUDA 12.x`` / ``CPU`` (:attr:`Detected.torch_build`)."""
        kit, ver = self.toolkit
        return f"{_TOOLKIT_NAMES[kit]} {ver}" if ver else "CPU"


_TOOLKIT_NAMES = {"hip": "ROCm", "cuda": "CUDA"}


def torch_build() -> TorchBuild:
    """Version and build of the torch this process imports (:class:`TorchBuild`)."""
    import torch  # measured 1.1-1.3 s to import: `k3rocm plan` and report merging import this module without it

    return TorchBuild(torch.__version__, getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None))


def package_version(name: str) -> str | None:
    """Installed version of the distribution ``name`` (``importlib.metadata``), or None when it is absent."""
    try:
        return version(name)
    except Exception:
        return None


#: environment variable naming the commit of a source tree that is not a git checkout (an unpacked copy on a
#: borrowed machine): the evidence report's ``git_sha`` then says this commit, marked as declared
SOURCE_COMMIT_ENV = "K3ROCM_SOURCE_COMMIT"


def dist_timeout() -> float:
    """Seconds every collective and the rendezvous may take: ``K3ROCM_DIST_TIMEOUT`` (default 300).

    Raises:
        ConfigError: the variable is set but is not a finite number of seconds above 0.
    """
    raw = os.environ.get("K3ROCM_DIST_TIMEOUT")
    if raw is None or not raw.strip():
        return 300.0
    try:
        val = float(raw)
    except ValueError:
        val = float("nan")
    if not (math.isfinite(val) and val > 0):
        from k3rocm.errors import ConfigError
        raise ConfigError(f"K3ROCM_DIST_TIMEOUT={raw!r} is not a finite number of seconds above 0; unset it (default 300) "
                          "or set e.g. K3ROCM_DIST_TIMEOUT=600")
    return val


def tune_env() -> str | None:
    """``$K3ROCM_TUNE``: ``"1"`` (a timed warm-up), ``"0"`` (no timing anywhere) or None (unset or empty: the
    defaults of ``k3rocm.kernels.tune``).

    Raises:
        ConfigError: the variable is set to anything else (``yes`` / ``true`` used to mean off, silently).
    """
    raw = os.environ.get("K3ROCM_TUNE")
    if raw is None or not raw.strip():
        return None
    if raw.strip() not in ("0", "1"):
        from k3rocm.errors import ConfigError
        raise ConfigError(f"K3ROCM_TUNE={raw!r} must be 1 (time the kernel configs during warm-up) or 0 (never "
                          "time them); unset it for the defaults")
    return raw.strip()


def declared_commit() -> str | None:
    """The commit in ``$K3ROCM_SOURCE_COMMIT`` (7-40 hex digits, optionally ``-dirty``; any case), lower-cased, or
    None when unset or empty.

    Raises:
        ConfigError: the variable is set to anything else (one line naming it and the form it needs).
    """
    raw = os.environ.get(SOURCE_COMMIT_ENV, "").strip()
    if not raw:
        return None
    sha, dirty = (raw[:-6], "-dirty") if raw.lower().endswith("-dirty") else (raw, "")
    if not (7 <= len(sha) <= 40 and all(c in "0123456789abcdefABCDEF" for c in sha)):
        from k3rocm.errors import ConfigError
        raise ConfigError(f"{SOURCE_COMMIT_ENV}={raw!r} is not a commit: give 7-40 hex digits, optionally with "
                          "-dirty (e.g. the output of `git rev-parse HEAD`), or unset it")
    return sha.lower() + dirty


def _amdsmi_readings(n: int) -> tuple[list[dict], str | None]:
    try:
        import amdsmi  # type: ignore[import-not-found]  # optional package: absent on most machines
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
        import pynvml  # type: ignore[import-not-found]  # optional package: absent on most machines
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
    import torch  # measured 1.3 s to import: `k3rocm profiles` / `plan` import this module without detecting

    tb = torch_build()
    hip, cuda = tb.hip, tb.cuda
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

    triton_version = package_version("triton")
    triton_target = None
    if devices:
        try:
            from triton.runtime import driver as tdriver  # 0.34 s; only with a device, and may fail there
            t = tdriver.active.get_current_target()
            triton_target = f"{t.backend}:{t.arch}:warp{t.warp_size}"
        except Exception as e:
            notes.append(f"triton target unavailable: {type(e).__name__}")

    return Detected(
        backend=backend, devices=devices, torch_version=tb.version, torch_build=tb.name,
        hip_version=hip, cuda_version=cuda, triton_version=triton_version, triton_target=triton_target,
        aiter_version=package_version("aiter") or (_module_present("aiter") and "present (version unknown)") or None,
        driver=driver, python=platform.python_version(), host=platform.node(), cpu_count=os.cpu_count() or 1,
        env=relevant_env(), smi_source=smi_source, notes=notes,
    )


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
