"""One error hierarchy for the whole toolkit.

Every expected failure is raised as a subclass of :class:`K3Error` whose message is one line:
what is wrong, where (file / tensor / field), and what to do. The CLI prints that line and exits
with :attr:`K3Error.exit_code` (DESIGN.md §7):

* 1 — a validation tier failed (:class:`ValidationFailed`)
* 2 — bad input or usage (:class:`ConfigError`, :class:`CheckpointError`, :class:`PlanError`)
* 3 — environment / hardware problem (:class:`HardwareError`)
"""

from __future__ import annotations


class K3Error(Exception):
    """Base of all expected k3rocm failures. ``str(err)`` is the one line shown to the user."""

    exit_code: int = 2


class ConfigError(K3Error):
    """A config.json / preset / CLI option is malformed or inconsistent."""

    exit_code = 2


class CheckpointError(K3Error):
    """A checkpoint directory, index, shard header or tensor is missing, malformed or unsafe."""

    exit_code = 2


class PlanError(K3Error):
    """A placement cannot work (does not fit, heads/experts not divisible, groups split)."""

    exit_code = 2


class HardwareError(K3Error):
    """The environment lacks what was asked for (no GPU, wrong arch, missing backend)."""

    exit_code = 3


class ValidationFailed(K3Error):
    """A validation tier ran and its evidence did not meet the thresholds."""

    exit_code = 1
