"""One error hierarchy for the whole toolkit.

Every expected failure is raised as a subclass of :class:`K3Error` whose message is one line:
what is wrong, where (file / tensor / field), and what to do. The CLI prints that line and exits
with :attr:`K3Error.exit_code` (DESIGN.md §7):

* 1 — a validation tier failed (:class:`ValidationFailed`)
* 2 — bad input or usage (:class:`ConfigError`, :class:`CheckpointError`, :class:`PlanError`)
* 3 — environment / hardware problem (:class:`HardwareError`)
* 130 — interrupted (Ctrl-C) after part of the work finished (:class:`Interrupted`)
"""

from __future__ import annotations

import errno


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


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, ``timeout``) raised in the main thread: it ends a run where Ctrl-C would, so a
    sweep keeps its finished points and a report being written is finished first; the CLI exits 143."""


class Interrupted(K3Error):
    """The user interrupted a run (Ctrl-C) after part of it finished; what finished is kept (exit 130)."""

    exit_code = 130


def size_text(nbytes: float) -> str:
    """A byte count for a message, in the largest decimal unit it reaches, one decimal: ``6_475_776`` ->
    ``"6.5 MB"``, ``2048`` -> ``"2.0 KB"``, ``17.2e9`` -> ``"17.2 GB"``, ``512`` -> ``"512 bytes"``. A small
    size never shows as ``"0.0 GB"``. Raises nothing."""
    b = float(nbytes)
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:,.1f} {unit}"
    return f"{int(b)} bytes"


#: errno names whose cause is the machine, not what the user typed: no space, quota, I/O, read-only medium.
_ENV_ERRNOS = ("ENOSPC", "EDQUOT", "EIO", "EROFS", "ENOMEM", "EMFILE", "ENFILE", "ESTALE", "ENXIO")


def environment_error(e: OSError) -> bool:
    """Whether ``e`` is the machine's fault, not the input's: no space, quota, I/O, a read-only or vanished medium,
    out of memory or file handles (:data:`_ENV_ERRNOS`; exit 3 where it ends a command). Raises nothing."""
    return errno.errorcode.get(e.errno or 0, "") in _ENV_ERRNOS


def os_error(e: OSError, what: str = "") -> K3Error:
    """The one-line :class:`K3Error` of an :class:`OSError`, with the exit code of its class (DESIGN.md §7).

    No space, quota, I/O errors and read-only or vanished media are the environment's (:class:`HardwareError`,
    exit 3); every other OS error (a path that is a directory, a symlink loop, no permission, not found) is bad
    input (:class:`ConfigError`, exit 2). ``what`` (e.g. ``"writing the report"``) starts the line; the file
    name and the OS reason follow. Raises nothing.
    """
    name = errno.errorcode.get(e.errno or 0, "")
    where = f"{e.filename}: " if getattr(e, "filename", None) else ""
    reason = e.strerror or type(e).__name__
    hint = "free space (or choose another --out) and run again" if name in ("ENOSPC", "EDQUOT") else (
        "check the path and run again")
    line = f"{what + ': ' if what else ''}{where}{reason}" + (f" [{name}]" if name else "") + f"; {hint}"
    cls = HardwareError if environment_error(e) else ConfigError
    return cls(line)


def unresolved_link(path) -> str | None:
    """Why ``path`` names a symbolic link that does not resolve, as a clause for an error line, else None.

    ``"is a symbolic link that does not resolve (a loop: ...)"`` for a link loop (the path itself, or a link
    on the way to it), ``"... (broken: its target T does not exist)"`` for a dangling link; None when the path
    resolves or simply does not exist. Raises nothing.
    """
    import os

    try:
        os.stat(path)
        return None
    except OSError as e:
        loop = e.errno == errno.ELOOP
    except ValueError:  # an embedded NUL byte: not a link question
        return None
    try:
        target = os.readlink(path)
    except (OSError, ValueError):
        target = None
    if loop:
        if target is None:
            return "goes through a symbolic link that does not resolve (a loop)"
        return (f"is a symbolic link that does not resolve (a loop: it points to {target}, which leads back to it "
                "instead of to a directory)")
    if target is not None:
        return f"is a symbolic link that does not resolve (broken: its target {target} does not exist)"
    return None
