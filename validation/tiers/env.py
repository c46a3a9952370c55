"""Tier ``env``: is this the hardware and software the profile expects?"""

from __future__ import annotations

import os
import platform

from k3rocm.envtraps import TRAPS, match_traps, settings_text
from k3rocm.runtime import registry
from k3rocm.validation.evidence import Evidence, Stage, check, info, listed, setting
from k3rocm.validation.session import Session


def figure_kind(prof, source_key: str) -> str:
    """``"assumed"`` when the profile's source note for a figure says it is an assumption (the ``cpu``
    profile's), ``"detected"`` when it was read from this machine (the ``cpu`` profile's host memory), else
    ``"datasheet"``."""
    src = str(getattr(prof, "sources", {}).get(source_key, "")).lower()
    return "assumed" if src.startswith("assumption") else ("detected" if src.startswith("detected") else "datasheet")


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
                   detail="smallest visible device"))
    # the profile is what the run was told (or chose) to check against: a setting, not a claim
    given = getattr(getattr(session, "opts", None), "profile", None)
    stage.add_settings(setting("env", "profile", prof.name,
                               detail=f"{'--profile' if given else 'matched to the detected hardware'}; expects "
                                      f"{prof.device_count} x {prof.device_name} ({prof.arch}, "
                                      f"{prof.memory_bytes / 1e9:.0f} GB) [{figure_kind(prof, 'device.memory_source')}]"))
    if prof.backend == "cpu":
        stage.add(check("env", "torch.import", True, eq=True, detail="torch imports and computes on the CPU"))
    elif session.hardware_matches:
        stage.add(check("env", "device.arch", det.arch, eq=prof.arch),
                  check("env", "device.count", det.count, ge=prof.device_count),
                  check("env", "device.memory", det.memory_bytes / 1e9, ge=0.9 * prof.memory_bytes / 1e9, unit="GB",
                        detail="at least 90% of the profile's HBM is visible"))
    else:
        here = (f"{det.count} x {det.arch} ({det.backend})" if det.count else
                f"the CPU ({platform.machine() or 'unknown arch'}, no GPU)")
        stage.add(info("env", "hardware.fallback", here,
                       level="measured-fallback",
                       detail=f"profile {prof.name} names {prof.arch} x{prof.device_count}; every measurement "
                              "in this report is measured-fallback, targets are projected"))
    stage.add(info("env", "env_vars", len(det.env), detail=listed((f"{k}={v}" for k, v in det.env.items()), ", ")))
    errs = registry.import_errors()
    if det.count:  # on a GPU a kernel family that does not import would silently run as the torch oracle
        stage.add(check("env", "kernels.import", len(errs), eq=0, unit="families failed",
                        detail=listed(f"{f}: {e}" for f, e in errs.items()) or "every kernel family imports"))
    elif errs:
        stage.add(info("env", "kernels.import", len(errs), "families failed",
                       detail=listed(f"{f}: {e}" for f, e in errs.items())))
    trap_rows(stage, dict(os.environ), det.backend)
    for n in det.notes:
        stage.add(info("env", "note", n))
    stage.add(info("env", "level", lv, detail="level of every measurement in this report"))


def trap_rows(stage: Stage, settings: dict[str, str], platform: str) -> None:
    """Rows of the known environment traps (:data:`k3rocm.envtraps.TRAPS`) on ``platform``: ``traps`` (how many
    match; passes at 0), and per match a failing ``trap.<name>`` row whose detail gives the reason, fix and source."""
    hits = match_traps(settings, platform)
    stage.add(check("env", "traps", len(hits), eq=0, unit="matched",
                    detail=f"known silent-failure settings of K3 on ROCm checked: {len(TRAPS)} (k3rocm.envtraps)"))
    for t in hits:
        stage.add(Evidence("env", f"trap.{t.name}", settings_text(t, settings), "", "no known trap", False,
                           "measured", f"{t.condition}: {t.consequence}; fix: {t.fix} ({t.source})"))
