"""Validation tiers (DESIGN.md §4): env → load → forward → correctness → performance.

``run_tiers(session, level)`` runs every tier up to ``level`` in order and stops at the first tier that
does not pass. Each tier returns a :class:`~k3rocm.validation.evidence.Stage` of evidence rows; a
tier that cannot run (missing component, unreadable checkpoint) is a stage with ``status="error"`` and
its one-line reason.

One module per tier (:mod:`.env`, :mod:`.load`, :mod:`.forward`, :mod:`.correctness`, :mod:`.performance`);
the pass thresholds (recorded in the report's reproduction block) in :mod:`.thresholds`, the official
checkpoint's known answers in :mod:`.known_answers`, the numeric comparisons in :mod:`.numerics`, and how a
tier drives a model in :mod:`.adapters`.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable

from k3rocm.errors import ConfigError, K3Error
from k3rocm.validation.evidence import TIERS, Stage, now_iso
from k3rocm.validation.session import Session
from k3rocm.validation.tiers.correctness import tier_correctness
from k3rocm.validation.tiers.env import tier_env
from k3rocm.validation.tiers.forward import tier_forward
from k3rocm.validation.tiers.load import tier_load
from k3rocm.validation.tiers.performance import tier_performance

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
