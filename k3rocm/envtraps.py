"""Known environment traps of Kimi K3 on ROCm: settings that make a serving stack produce wrong output or fail.

:data:`TRAPS` is one table of data, one :class:`Trap` per public report: the variables (environment variables
or server options) it reads, the condition as clauses over them, the consequence, the fix and the source.
:func:`match_traps` evaluates it over an environment (``os.environ``, or a deployment's environment file and
server command line) on a platform (``rocm``, ``cuda``, ``cpu``). The ``env`` validation tier fails on a match;
``k3rocm env --deployment-env FILE`` checks a vLLM or SGLang node's settings on their own. :func:`check_traps` is
the per-trap verdict for settings read from some sources only: a trap whose variables come from a source not given
(no environment file, no server command line) is ``"unchecked"``, never ``"clear"``.

Clause kinds (``(variable or tuple of variables, kind)``; a tuple means any one of them):

* ``"on"`` — set to a true value (``1``, ``true``, ``yes``, ``on``; case-insensitive);
* ``"off"`` — unset or not a true value;
* ``"not 0"`` — unset or anything but ``0`` (an unset variable takes the library's non-zero default);
* ``"= VALUE"`` — equal to ``VALUE`` (case-insensitive).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from k3rocm.errors import ConfigError

TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Trap:
    """One known trap.

    Attributes:
        name: short identifier (the env tier's row is ``trap.<name>``).
        variables: every variable or server option the condition reads.
        platform: the platform it occurs on (``rocm``), or ``"any"``.
        when: clauses that must all hold (see the module docstring).
        condition: the condition in words.
        consequence: what goes wrong.
        fix: what to set instead.
        source: the public report it comes from.
    """

    name: str
    variables: tuple[str, ...]
    platform: str
    when: tuple[tuple[str | tuple[str, ...], str], ...]
    condition: str
    consequence: str
    fix: str
    source: str


A8W4 = ("AITER_SITUV2_A8W4", "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4")

TRAPS: tuple[Trap, ...] = (
    Trap("a8w4_layout_flags",
         ("AITER_SITUV2_A8W4", "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4"), "rocm",
         (("AITER_SITUV2_A8W4", "on"), ("VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4", "off")),
         "AITER_SITUV2_A8W4 is on but VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4 is not",
         "aiter runs its gate/up-interleaved A8W4 SiTU MoE kernel on weights the engine shuffled in the separated "
         "layout: silently wrong output, no error",
         "set VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4=1 as well, or unset AITER_SITUV2_A8W4",
         "vLLM issue #52442"),
    Trap("a8w4_decode_bound",
         ("AITER_SITUV2_A8W4", "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4", "AITER_BF16_FP8_MOE_BOUND"), "rocm",
         ((A8W4, "on"), ("AITER_BF16_FP8_MOE_BOUND", "not 0")),
         "the A8W4 MoE path is on and AITER_BF16_FP8_MOE_BOUND is not 0 (unset: aiter's default 256)",
         "below the bound (decode batches) aiter swaps in a bf16 stage-1 MoE kernel that expects the separated "
         "layout and misreads the interleaved weights: decode output is wrong while prefill is right",
         "set AITER_BF16_FP8_MOE_BOUND=0 (vLLM builds with PR #50582 pin it themselves)",
         "vLLM PR #50579"),
    Trap("kda_cuda_backend_on_rocm",
         ("--kda-prefill-backend",), "rocm",
         (("--kda-prefill-backend", "= flashkda"),),
         "the KDA prefill backend FlashKDA (a CUDA-only extension) is selected on ROCm",
         "the server fails when it loads the extension",
         "leave --kda-prefill-backend at auto (ROCm selects its own KDA kernels)",
         "vLLM PR #50262"),
)


def _holds(settings: dict[str, str], var: str | tuple[str, ...], kind: str) -> bool:
    names = var if isinstance(var, tuple) else (var,)
    vals = [settings.get(n) for n in names]
    if kind == "on":
        return any(v is not None and v.strip().lower() in TRUE for v in vals)
    if kind == "off":
        return all(v is None or v.strip().lower() not in TRUE for v in vals)
    if kind == "not 0":
        return any(v is None or v.strip() != "0" for v in vals)
    if kind.startswith("= "):
        want = kind[2:].strip().lower()
        return any(v is not None and v.strip().lower() == want for v in vals)
    raise ConfigError(f"environment trap clause kind {kind!r} is unknown")  # a bug in TRAPS


def settings_text(trap: Trap, settings: dict[str, str]) -> str:
    """``"A=1, B unset"``: the values of the trap's variables in ``settings``."""
    return ", ".join(f"{v}={settings[v]}" if v in settings else f"{v} unset" for v in trap.variables)


def match_traps(settings: dict[str, str], platform: str, traps: tuple[Trap, ...] = TRAPS) -> list[Trap]:
    """The traps whose condition holds for ``settings`` (environment variables and server options, name -> value)
    on ``platform`` (``rocm`` / ``cuda`` / ``cpu``), in table order. Raises nothing for known clause kinds."""
    return [t for t in traps if t.platform in ("any", platform) and all(_holds(settings, v, k) for v, k in t.when)]


ENVIRONMENT = "environment"
SERVER_ARGS = "server args"
#: why a trap whose variables come from a source that was not given is not checked
NOT_GIVEN = {ENVIRONMENT: "no environment given (--deployment-env FILE)",
             SERVER_ARGS: "no server command line given (--server-args CMD)"}


def variable_source(name: str) -> str:
    """Where a trap variable is set: :data:`SERVER_ARGS` for a server option (``--name``), else
    :data:`ENVIRONMENT` (an environment variable)."""
    return SERVER_ARGS if name.startswith("-") else ENVIRONMENT


def trap_sources(trap: Trap) -> tuple[str, ...]:
    """The sources (:data:`ENVIRONMENT`, :data:`SERVER_ARGS`) ``trap``'s variables come from, in first-use order."""
    return tuple(dict.fromkeys(variable_source(v) for v in trap.variables))


@dataclass(frozen=True)
class TrapResult:
    """One trap checked (or not) against a deployment's settings.

    Attributes:
        trap: the trap.
        status: ``"match"`` (its condition holds), ``"clear"`` (checked, it does not), ``"n/a"`` (another
            platform's trap) or ``"unchecked"`` (a source its variables come from was not given: an unseen
            variable is not an unset one).
        settings: the values its variables had (:func:`settings_text`), or, where a source was not given, why they
            were not seen.
    """

    trap: Trap
    status: str
    settings: str


def check_traps(settings: dict[str, str], platform: str, given, traps: tuple[Trap, ...] = TRAPS) -> list[TrapResult]:
    """Every trap of ``traps`` against ``settings`` on ``platform``, where ``given`` names the sources
    (:data:`ENVIRONMENT`, :data:`SERVER_ARGS`) that ``settings`` holds: a trap reading a source not given is
    ``"unchecked"`` — never ``"clear"`` (its variables were not seen) and never a match."""
    given = set(given)
    out = []
    for t in traps:
        missing = [s for s in trap_sources(t) if s not in given]
        text = "; ".join(NOT_GIVEN[s] for s in missing) if missing else settings_text(t, settings)
        if t.platform not in ("any", platform):
            status = "n/a"
        elif missing:
            status = "unchecked"
        else:
            status = "match" if match_traps(settings, platform, (t,)) else "clear"
        out.append(TrapResult(t, status, text))
    return out


def read_env_file(path: str | Path) -> dict[str, str]:
    """A deployment's environment: ``KEY=VALUE`` lines (a docker ``--env-file``, ``env`` output, a shell file with
    ``export``; ``#`` comments and blank lines skipped, one level of quotes removed) or NUL-separated entries
    (``/proc/<pid>/environ``).

    Raises:
        ConfigError: the file is missing, unreadable, or a line is not ``KEY=VALUE`` (one line naming it).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"--deployment-env {p}: cannot read it ({e.strerror or e}); pass a KEY=VALUE file") from None
    text = raw.decode("utf-8", errors="replace")
    entries = text.split("\0") if "\0" in text else text.splitlines()
    out: dict[str, str] = {}
    for n, line in enumerate(entries, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[7:].strip()
        key, sep, val = line.partition("=")
        if not sep or not key.strip() or any(c.isspace() for c in key.strip()):
            raise ConfigError(f"--deployment-env {p}: entry {n} is not KEY=VALUE; write one variable per line")
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        out[key.strip()] = val
    return out


def server_options(command: str) -> dict[str, str]:
    """``--name value`` and ``--name=value`` options of a server command line (``vllm serve ... --kda-prefill-backend
    flashkda``), as ``{"--name": value}`` (underscores in names read as dashes); a flag without a value maps to
    ``"1"``.

    Raises:
        ConfigError: the command line cannot be split (an unclosed quote), or is empty (nothing would be checked, and
            every trap would read "clear").
    """
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ConfigError(f"--server-args: cannot split the command line ({e}); quote it as a shell would") from None
    if not words:
        raise ConfigError("--server-args is empty: give the server's command line, e.g. --server-args "
                          "\"vllm serve moonshotai/Kimi-K3 -tp 8\"")
    out: dict[str, str] = {}
    for i, w in enumerate(words):
        if not w.startswith("--"):
            continue
        name, sep, val = w.partition("=")
        name = "--" + name[2:].replace("_", "-")  # vLLM and SGLang accept --a_b for --a-b
        if not sep:
            nxt = words[i + 1] if i + 1 < len(words) else None
            val = nxt if nxt is not None and not nxt.startswith("--") else "1"
        out[name] = val
    return out


__all__ = ["Trap", "TRAPS", "match_traps", "settings_text", "read_env_file", "server_options", "ENVIRONMENT",
           "SERVER_ARGS", "NOT_GIVEN", "variable_source", "trap_sources", "TrapResult", "check_traps"]
