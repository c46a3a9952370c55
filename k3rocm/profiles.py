"""Hardware profiles: the TOML schema, loading, listing, and matching a profile to detected hardware.

Profiles are TOML files in ``k3rocm/hwprofiles/`` (package data) read with :mod:`tomllib`:
:func:`list_profiles`, :func:`load_profile`, :func:`match_profile` (which takes :func:`k3rocm.hw.detect`'s
result). Every figure in a profile carries its source (a datasheet and its date, or "measured here" with the
date) — see ``hwprofiles/*.toml``. :func:`parse_profile` checks every field of a profile (type, range,
allowed values) and refuses unknown sections and keys, so a profile file given as ``--profile FILE.toml``
fails with one line naming the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from k3rocm.errors import ConfigError
from k3rocm.hw import Detected, detect


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

    def matches(self, detected: Detected) -> bool:
        """True when ``detected`` is the hardware this profile names: the same backend and base arch and at
        least ``device_count`` visible devices. A ``cpu`` profile matches any machine (the engine then runs on
        that machine's CPU, which is what the profile names)."""
        if self.backend == "cpu":
            return True
        return (detected.backend == self.backend and detected.arch == self.arch
                and detected.count >= self.device_count)

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


#: backends the code knows (:attr:`Detected.backend`; ``cpu`` is the no-GPU profile)
BACKENDS = ("rocm", "cuda", "cpu")
#: FP8 formats the code knows: OCP ``e4m3fn`` (gfx950, CUDA) and ``e4m3fnuz`` (gfx942, CDNA3) —
#: the same rule as ``k3rocm.model.mla.fp8_cache_dtype``
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
#: most devices one profile may describe (a plan builds one rank per device)
MAX_DEVICES = 65536
# ranks of a cpu profile: gloo processes on one host (tests and laptops run 2..8)
MAX_CPU_RANKS = 64
#: dtypes a profile gives dense peak FLOP/s for; bf16 must be a rate, the others a rate or "none"
PEAK_DTYPES = ("bf16", "fp8", "mxfp4")
#: base arch names per backend: no feature flags (``detect`` compares the base arch)
_ARCH_RE = {"rocm": (re.compile(r"gfx[0-9][0-9a-f]{2,3}"), "gfxNNN, e.g. gfx950 or gfx942, without feature flags"),
            "cuda": (re.compile(r"sm_[0-9]{2,3}[a-z]?"), "sm_NN, e.g. sm_90 or sm_100"),
            "cpu": (re.compile(r"cpu"), "cpu")}
#: every section and key a profile may hold; anything else is refused so a typo is never ignored
_SCHEMA: dict[str, tuple[str, ...]] = {
    "": ("name", "description", "backend", "device", "peak_flops", "link", "memory", "parallel", "targets"),
    "device": ("name", "arch", "count", "memory_bytes", "memory_source", "hbm_bandwidth", "hbm_bandwidth_source",
               "fp8_format"),
    "peak_flops": PEAK_DTYPES + ("source",),
    "link": ("kind", "bandwidth", "source"),
    "memory": ("usable_fraction", "usable_fraction_source", "workspace_reserve_bytes", "workspace_reserve_source"),
    "parallel": ("tp", "ep", "source"),
    "targets": ("name", "metric", "value", "unit", "setting", "source"),
}
_SECTIONS = ("device", "peak_flops", "link", "memory", "parallel")


def _show(v: Any) -> str:
    """A value as the TOML file spells it, on one line (strings quoted, ``true``/``false``, tables named)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        s = json.dumps(v)
    elif isinstance(v, dict):
        return "a table"
    elif isinstance(v, list):
        return "an array"
    else:
        s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."


class _Fields:
    """Typed, range-checked reads from a parsed profile document; every failure is one ConfigError line naming
    the file, the dotted field, the bad value, what it must be and what to do."""

    def __init__(self, doc: Any, fname: str):
        self.doc, self.fname = doc, fname

    def fail(self, path: str, v: Any, must: str, todo: str = "fix it in the profile file") -> ConfigError:
        return ConfigError(f"{self.fname}: {path} = {_show(v)} {must}; {todo}")

    def get(self, path: str, required: bool = True, default: Any = None) -> Any:
        cur: Any = self.doc
        for k in path.split("."):
            if not isinstance(cur, dict) or k not in cur:
                if not required:
                    return default
                raise ConfigError(f"{self.fname}: missing field {path}; every profile defines it "
                                  "(see hwprofiles/mi355x-8.toml)")
            cur = cur[k]
        return cur

    def table(self, path: str) -> dict:
        v = self.get(path)
        if not isinstance(v, dict):
            raise self.fail(path, v, f"must be a table (a [{path}] section)",
                            f"write it as the [{path}] section of hwprofiles/mi355x-8.toml")
        return v

    def string(self, path: str, required: bool = True, choices: tuple[str, ...] | None = None) -> str | None:
        v = self.get(path, required)
        if v is None and not required:
            return None
        if not isinstance(v, str) or not v.strip():
            raise self.fail(path, v, "must be a non-empty string", "quote it, as in hwprofiles/mi355x-8.toml")
        if choices is not None and v not in choices:
            raise self.fail(path, v, f"is not one the code knows; it must be one of "
                            f"{', '.join(json.dumps(c) for c in choices)}", "use one of those")
        return v

    def integer(self, path: str, lo: int, hi: int | None = None, what: str = "") -> int:
        v = self.get(path)
        must = f"must be an integer >= {lo}" if hi is None else (
            f"must be {lo}" if lo == hi else f"must be an integer from {lo} to {hi}")
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(path, v, f"{must}{what}, not a {type(v).__name__}",
                            "write it as a plain integer without quotes or a decimal point")
        if v < lo or (hi is not None and v > hi):
            raise self.fail(path, v, must + what)
        return v

    def number(self, path: str, positive: bool = True, allow_none: bool = False,
               hi: float | None = None, what: str = "") -> float | None:
        """A finite int or float; ``> 0`` when ``positive`` else ``>= 0``; ``<= hi`` when given; the string
        ``"none"`` (-> None) when ``allow_none``."""
        v = self.get(path)
        if allow_none and v == "none":
            return None
        alt = ' or "none"' if allow_none else ""
        rng = (f"in (0, {hi:g}]" if hi is not None else "> 0") if positive else ">= 0"
        must = f"must be a finite number {rng}{alt}{what}"
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self.fail(path, v, must, "write a number without quotes (e.g. 8e+12)"
                            + (', or "none" for no hardware support' if allow_none else ""))
        try:
            f = float(v)
        except OverflowError:
            raise self.fail(path, v, must) from None
        if not math.isfinite(f) or f < 0 or (positive and f == 0) or (hi is not None and f > hi):
            raise self.fail(path, v, must)
        return f

    def known_keys(self, sec: dict, path: str, schema: str) -> None:
        known = _SCHEMA[schema]
        for k in sec:
            if k not in known:
                where = f"{path}.{k}" if path else k
                kind = "section" if isinstance(sec[k], dict) and not path else "key"
                inside = f"in [{path}]" if path else "at the top level"
                moved = (f" (a key written below the [{path}] header belongs to [{path}]: move it above the "
                         "first [section])" if path and k in _SCHEMA[""] else "")
                raise ConfigError(f"{self.fname}: unknown {kind} {where} {inside}; the known ones are "
                                  f"{', '.join(known)}; fix the spelling or remove it{moved}")


def parse_profile(doc: dict, name: str, fname: str = "<profile>") -> Profile:
    """Build a :class:`Profile` from a parsed TOML document, checking every field.

    Checks: known sections and keys only (a typo is refused, never ignored); names are non-empty strings;
    ``backend`` in :data:`BACKENDS`; ``device.arch`` a base arch name of that backend (free-form otherwise:
    the code has no arch table to refuse one against); ``device.fp8_format`` in :data:`FP8_FORMATS` and
    ``e4m3fnuz`` exactly on gfx942; ``device.count`` an integer 1..:data:`MAX_DEVICES` (1 on ``cpu``);
    ``memory_bytes`` an integer > 0; ``hbm_bandwidth`` finite > 0; ``peak_flops.bf16`` finite > 0,
    ``fp8`` / ``mxfp4`` finite > 0 or ``"none"``; ``link.bandwidth`` finite, > 0 unless ``link.kind = "none"``
    (then 0); ``usable_fraction`` in (0, 1]; ``workspace_reserve_bytes`` an integer >= 0; ``parallel.tp``
    1..count (on ``cpu`` 1..:data:`MAX_CPU_RANKS` gloo processes on the host), ``parallel.ep`` >= 1 dividing tp;
    every target's value finite > 0.

    Raises:
        ConfigError: one line naming the file, the dotted field, the bad value, what it must be and what to do.
    """
    f = _Fields(doc, fname)
    if not isinstance(doc, dict):
        raise ConfigError(f"{fname}: a profile must be a TOML document of tables (see hwprofiles/mi355x-8.toml)")
    f.known_keys(doc, "", "")
    for s in _SECTIONS:  # a misplaced key inside a section first: it may be why a section looks missing
        if isinstance(doc.get(s), dict):
            f.known_keys(doc[s], s, s)
    secs = {s: f.table(s) for s in _SECTIONS}

    if "name" in doc:
        f.string("name")
    description = doc.get("description", "")
    if not isinstance(description, str):
        raise f.fail("description", description, "must be a string", "quote it")
    backend = f.string("backend", choices=BACKENDS)
    cpu = backend == "cpu"

    device_name = f.string("device.name")
    arch = f.string("device.arch")
    rx, form = _ARCH_RE[backend]
    if not rx.fullmatch(arch):
        raise f.fail("device.arch", arch, f"is not a {backend} base arch name ({form})",
                     "write the arch as `k3rocm env` shows it, without feature flags")
    fp8_format = f.string("device.fp8_format", required=False, choices=FP8_FORMATS)
    if fp8_format is not None and (fp8_format == "e4m3fnuz") != (arch == "gfx942"):
        want = "e4m3fnuz" if arch == "gfx942" else "e4m3fn"
        raise f.fail("device.fp8_format", fp8_format, f"does not match device.arch = {_show(arch)}, whose FP8 "
                     f"format is {_show(want)} (e4m3fnuz on gfx942 only)", f"set fp8_format = {_show(want)}")
    count = (f.integer("device.count", 1, 1, " on the cpu backend (one host; choose processes with --tp)")
             if cpu else f.integer("device.count", 1, MAX_DEVICES, " (devices of this profile)"))
    memory_bytes = f.integer("device.memory_bytes", 1, what=" (bytes per device)")
    hbm_bandwidth = f.number("device.hbm_bandwidth", what=" (bytes/s per device)")

    peaks: dict[str, float | None] = {"bf16": f.number("peak_flops.bf16", what=" (dense FLOP/s per device; "
                                                       "every device computes bf16)")}
    for k in PEAK_DTYPES[1:]:
        peaks[k] = f.number(f"peak_flops.{k}", allow_none=True, what=" (dense FLOP/s per device)")

    link_kind = f.string("link.kind")
    if link_kind == "none":
        link_bandwidth = f.number("link.bandwidth", positive=False, what=' (0 when link.kind = "none")')
        if link_bandwidth:
            raise f.fail("link.bandwidth", doc["link"]["bandwidth"], 'must be 0 when link.kind = "none"',
                         "set the link kind (xGMI, NVLink, ...) or bandwidth = 0")
    else:
        link_bandwidth = f.number("link.bandwidth", what=f" (bytes/s per device over {link_kind}; use "
                                  f'link.kind = "none" for no link)')

    usable_fraction = f.number("memory.usable_fraction", hi=1.0, what=" (fraction of memory_bytes)")
    reserve = f.integer("memory.workspace_reserve_bytes", 0, what=" (bytes per device)")

    if cpu:  # ranks are gloo processes sharing the host
        tp = f.integer("parallel.tp", 1, MAX_CPU_RANKS, f" on the cpu backend (gloo processes on this host, at most "
                       f"{MAX_CPU_RANKS})")
    else:
        tp = f.integer("parallel.tp", 1, count, f" (at most device.count = {count}: one process per device)")
    ep = f.integer("parallel.ep", 1, tp, f" (at most parallel.tp = {tp})")
    if tp % ep:
        raise f.fail("parallel.ep", ep, f"must divide parallel.tp = {tp} (experts split by EP, then by "
                     f"intermediate inside each EP group)", f"try ep = {tp}")

    sources: dict[str, str] = {}
    for s, sec in secs.items():
        for k in sec:
            if k.endswith("_source") or k == "source":
                sources[f"{s}.{k}"] = f.string(f"{s}.{k}")  # type: ignore[assignment]

    raw_targets = doc.get("targets", [])
    if not isinstance(raw_targets, list):
        raise f.fail("targets", raw_targets, "must be an array of tables", "write each as a [[targets]] section")
    targets = []
    for i, t in enumerate(raw_targets):
        p = f"targets[{i}]"
        if not isinstance(t, dict):
            raise f.fail(p, t, "must be a table", "write it as a [[targets]] section")
        f.known_keys(t, p, "targets")
        g = _Fields({p: t}, fname)
        targets.append(Target(name=g.string(f"{p}.name"), metric=g.string(f"{p}.metric"),  # type: ignore[arg-type]
                              value=g.number(f"{p}.value"), unit=g.string(f"{p}.unit"),  # type: ignore[arg-type]
                              setting=(g.string(f"{p}.setting") if "setting" in t else ""),  # type: ignore[arg-type]
                              source=g.string(f"{p}.source")))  # type: ignore[arg-type]

    return Profile(
        name=name, description=description, backend=backend, device_name=device_name,  # type: ignore[arg-type]
        arch=arch, device_count=count, memory_bytes=memory_bytes,  # type: ignore[arg-type]
        usable_fraction=usable_fraction, workspace_reserve_bytes=reserve,  # type: ignore[arg-type]
        hbm_bandwidth=hbm_bandwidth, peak_flops=peaks, link_kind=link_kind,  # type: ignore[arg-type]
        link_bandwidth=link_bandwidth, tp=tp, ep=ep, targets=tuple(targets),  # type: ignore[arg-type]
        sources=sources, fp8_format=fp8_format, raw=doc,
    )


@lru_cache(maxsize=32)
def load_profile(name: str) -> Profile:
    """Load the shipped profile ``name`` (e.g. ``mi355x-8``), or a profile file: a path ending in ``.toml``
    in the shipped profiles' format (e.g. a copy of ``hwprofiles/mi355x-8.toml`` edited to describe two nodes
    of 8 GPUs as 16 devices). A CPU profile whose memory is an assumption gets this machine's physical memory
    (:func:`host_memory_bytes`), its source saying so.

    Raises:
        ConfigError: unknown name (the message lists the known ones), a missing file, or a malformed file.
    """
    if str(name).endswith(".toml"):
        path = Path(name).expanduser()
        if path.is_dir():
            raise ConfigError(f"profile file {path} is a directory; pass a TOML file in the format of "
                              "hwprofiles/*.toml, or a shipped profile name (see `k3rocm profiles`)")
        if not path.is_file():
            raise ConfigError(f"profile file {path} does not exist; pass a TOML file in the format of "
                              "hwprofiles/*.toml, or a shipped profile name (see `k3rocm profiles`)")
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML ({' '.join(str(e).split())}); fix the file") from None
        except OSError as e:
            raise ConfigError(f"profile file {path} cannot be read ({e.strerror or e}); check its "
                              "permissions") from None
        # named by its absolute path: a modified copy saved as mi355x-8.toml must not pass for the shipped one
        # (report headers, the plan's messages and report merging all go by the name)
        return _with_host_memory(parse_profile(doc, str(path.resolve()), str(path)))
    known = list_profiles()
    if name not in known and ("/" in str(name) or os.sep in str(name)) and not Path(str(name)).exists():
        raise ConfigError(f"profile file {name} does not exist; pass an existing *.toml in the format of "
                          f"hwprofiles/*.toml, or a shipped profile name ({', '.join(known)})")
    if name not in known and ("/" in str(name) or os.sep in str(name) or Path(str(name)).exists()):
        raise ConfigError(f"profile {name!r} is a path but not a .toml file; a profile file must be TOML in the "
                          "format of hwprofiles/*.toml with a .toml suffix, or pass a shipped profile name "
                          f"({', '.join(known)})")
    if name not in known:
        raise ConfigError(f"unknown hardware profile {name!r}; choose one of {', '.join(known)}, or pass a "
                          "profile file (*.toml)")
    fname = f"hwprofiles/{name}.toml"
    try:
        doc = tomllib.loads(_profile_dir().joinpath(f"{name}.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{fname}: not valid TOML ({e}); fix the file") from None
    return _with_host_memory(parse_profile(doc, name, fname))


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``sysconf(SC_PHYS_PAGES) x sysconf(SC_PAGE_SIZE)``), or None
    where the OS does not say."""
    try:
        n = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return int(n) if n > 0 else None


#: the shipped cpu profile's assumed memory: a CPU profile still at this value takes the machine's own memory
CPU_ASSUMED_MEMORY_BYTES = 16 * 2**30


def _with_host_memory(prof: Profile) -> Profile:
    """A CPU profile whose memory is the shipped assumption (16 GiB, source "assumption...") with the memory this
    machine has instead (its source says so); any other profile, or a CPU profile stating its memory otherwise —
    a copied profile file whose ``memory_bytes`` was edited but whose source line was not included — as it is."""
    host = host_memory_bytes()
    if host is None or prof.backend != "cpu" or not prof.sources.get("device.memory_source", "").startswith(
            "assumption") or prof.memory_bytes != CPU_ASSUMED_MEMORY_BYTES:
        return prof
    src = dict(prof.sources)
    src["device.memory_source"] = (f"detected: this machine's physical memory ({host / 2**30:.2f} GiB, "
                                   "sysconf SC_PHYS_PAGES x SC_PAGE_SIZE)")
    return replace(prof, memory_bytes=host, sources=src)


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
