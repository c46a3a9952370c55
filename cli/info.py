"""Supporting commands: ``profiles``, ``env``, ``plan``."""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.table import Table

from k3rocm.cli.common import (checkpoint_option, checkpoint_session, console, debug_option, handle_errors, not_empty,
                               profile_option)
from k3rocm.checkpoint import layout
from k3rocm.config import PRESETS, preset as make_preset
from k3rocm.envtraps import ENVIRONMENT, SERVER_ARGS, check_traps, read_env_file, server_options, settings_text
from k3rocm.errors import ConfigError, HardwareError, PlanError
from k3rocm.hw import detect
from k3rocm.profiles import list_profiles, load_profile, match_profile
from k3rocm.runtime.plan import NO_MLA_BOUND, plan

GB = 1e9


def human_bytes(b: float) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units)."""
    b = float(b)
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.3f} {unit}"
    return f"{int(b)} B"


@click.command("profiles", epilog="""\b
Examples:
  k3rocm profiles
  k3rocm profiles --json""")
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
@debug_option
@handle_errors
def profiles_cmd(as_json, debug):
    """List the shipped hardware profiles (datasheet figures, sourced in each TOML file)."""
    profs = [load_profile(n) for n in list_profiles()]
    if as_json:
        click.echo(json.dumps([p.to_dict() for p in profs], indent=2))
        return
    t = Table(title="hardware profiles (figures per device)")
    for col in ("name", "device", "arch", "GPUs", "HBM GB", "TB/s", "bf16 TF", "mxfp4 TF", "tp/ep", "figures"):
        t.add_column(col)
    for p in profs:
        bf, fp4 = p.peak_flops.get("bf16"), p.peak_flops.get("mxfp4")
        t.add_row(p.name, p.device_name, p.arch, str(p.device_count), f"{p.memory_bytes / GB:.1f}",
                  f"{p.hbm_bandwidth / 1e12:.2f}", _tflops(bf), _tflops(fp4) if fp4 else "none", f"{p.tp}/{p.ep}",
                  _figure_sources(p))
    console().print(t)
    console().print("each figure's source is in the profile's TOML (hwprofiles/<name>.toml) and in `profiles --json`; "
                    "HBM GB = 10^9 bytes (288 GiB = 309.2 GB), the unit of plan, env and load", highlight=False)


def _tflops(flops: float | None) -> str:
    """FLOP/s as TFLOP/s for the table: whole numbers from 10 TF up, two decimals below (a CPU's 0.10, not 0)."""
    if not flops:
        return "-"
    tf = flops / 1e12
    return f"{tf:.0f}" if tf >= 10 else f"{tf:.2f}"


#: the table's figures (memory, bandwidth, peaks) and their source keys in a profile
_TABLE_SOURCES = (("memory", "device.memory_source"), ("bandwidth", "device.hbm_bandwidth_source"),
                  ("peaks", "peak_flops.source"))


def _figure_sources(p) -> str:
    """Where the table's figures of profile ``p`` come from: ``datasheet`` when every one is sourced from one,
    else each figure's kind (``memory detected, bandwidth assumed, ...``): sources starting with ``detected`` /
    ``assumption`` say so (the CPU profile's memory is this machine's, its rates are assumptions)."""
    kinds = {}
    for what, key in _TABLE_SOURCES:
        v = str(p.sources.get(key, ""))
        kinds[what] = "detected" if v.startswith("detected") else "assumed" if v.startswith("assumption") else "datasheet"
    if all(k == "datasheet" for k in kinds.values()):
        return "datasheet"
    return ", ".join(f"{what} {k}" for what, k in kinds.items())


@click.command("env", epilog="""\b
Examples:
  k3rocm env                      # what is here, and which profile it matches
  k3rocm env --profile mi355x-8   # compare with a given profile
  k3rocm env --json
  k3rocm env --deployment-env vllm.env --server-args "vllm serve moonshotai/Kimi-K3 -tp 8"
                                  # a serving node's settings vs the known traps of K3 on ROCm""")
@profile_option
@click.option("--json", "as_json", is_flag=True, help="Print detection + profile as JSON.")
@click.option("--deployment-env", type=click.Path(path_type=str), default=None, metavar="FILE",
              help="Check a deployment's environment (KEY=VALUE lines, or /proc/PID/environ) against the known "
                   "environment traps of K3 on ROCm instead of describing this machine; exit 3 on a match.")
@click.option("--server-args", default=None, metavar="CMD",
              help="The server's command line (vllm serve ... / python -m sglang.launch_server ...), checked with "
                   "--deployment-env (or alone) for the traps that server options set. Alone, the environment-variable "
                   "traps are reported unchecked (no environment is read, not even this process's).")
@click.option("--platform", type=click.Choice(["rocm", "cuda"]), default=None,
              help="Platform of the checked deployment (with --deployment-env / --server-args; default rocm).")
@debug_option
@handle_errors
def env_cmd(profile, as_json, deployment_env, server_args, platform, debug):
    """Detect backend, devices, arch, memory and software; match a hardware profile.

    Exit 3 when --profile names hardware that is not here (the one-line error says what differs). With
    --deployment-env / --server-args: check those settings against the known traps (k3rocm.envtraps), exit 3
    naming the first match, its reason and fix.
    """
    if deployment_env is not None or server_args is not None:
        if profile:
            raise ConfigError("--profile describes this machine; a --deployment-env check does not use it: drop one")
        _check_deployment(deployment_env, server_args, platform or "rocm", as_json)
        return
    if platform is not None:  # it names the checked deployment's platform; alone it would be silently ignored
        raise ConfigError("--platform applies to a deployment check: add --deployment-env FILE and/or --server-args "
                          "CMD, or drop --platform (this machine's platform is detected)")
    det = detect()
    prof = load_profile(profile) if profile else match_profile(det)
    matches = prof.matches(det)
    if as_json:
        click.echo(json.dumps({"detected": det.to_dict(), "profile": prof.to_dict(), "matches": matches},
                              indent=2, default=str))
    else:
        t = Table(title="environment", show_header=False)
        t.add_column("item")
        t.add_column("value")
        t.add_row("backend", det.backend)
        t.add_row("torch", f"{_shown(det.torch_version, 'not installed')} ({_shown(det.torch_build, 'unknown build')})")
        t.add_row("triton", _shown(det.triton_version, "not installed")
                  + (f" (target {det.triton_target})" if det.triton_target else " (no GPU target)"))
        t.add_row("aiter", _shown(det.aiter_version, "not installed"))
        t.add_row("driver", _shown(det.driver, "none detected"))
        for d in det.devices:
            t.add_row(f"device {d.index}", f"{d.name} {d.arch} {d.memory_bytes / GB:.1f} GB, {d.multiprocessors} CUs/SMs")
        if not det.devices:
            t.add_row("devices", f"none (CPU, {det.cpu_count} cores)")
        t.add_row("profile", f"{prof.name}: {prof.device_count} x {prof.device_name} ({prof.arch})")
        t.add_row("matches", "yes" if matches else "no: measurements would be measured-fallback")
        for k, v in det.env.items():
            t.add_row(k, v)
        for n in det.notes:
            t.add_row("note", n)
        console().print(t)
    if profile and not matches:
        raise HardwareError(f"profile {prof.name} expects {prof.device_count} x {prof.arch} ({prof.backend}); "
                            f"found {det.count} x {det.arch or 'cpu'} ({det.backend}); run `k3rocm env` without "
                            "--profile to see what this machine is, or pass the profile that matches it "
                            "(`k3rocm profiles`)")


@click.command("plan", epilog="""\b
Examples:
  k3rocm plan --preset k3 --profile mi355x-8            # the real model on 8 x MI355X (fits at TP8)
  k3rocm plan --preset k3 --profile mi300x-8            # does not fit: exit 2 with the numbers
  k3rocm plan --checkpoint /models/Kimi-K3 --profile mi355x-8 --kv-dtype fp8
  k3rocm plan                                           # embedded k3-tiny on this machine""")
@checkpoint_option
@click.option("--preset", default=None, metavar="NAME",
              callback=not_empty("pass k3, k3-tiny, k3-prefix-N or kimi-linear-48b-a3b, or omit it"),
              help=f"Plan a preset config instead of a checkpoint: {', '.join(PRESETS)}.")
@profile_option
@click.option("--tp", type=int, default=None, help="Tensor-parallel ranks (default: the profile's).")
@click.option("--ep", type=int, default=None,
              help="Expert-parallel degree, a divisor of tp (default: the profile's where it divides tp, else tp).")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8", "fp16", "fp32"]), default="bf16", show_default=True,
              help="dtype of the MLA latent cache (fp8 halves its bytes per token, so more sequences fit).")
@click.option("--context-len", type=int, default=None, metavar="TOKENS",
              help="Tokens per sequence for the 'concurrent sequences' figure. Default: 9216 (8k prompt + 1k output).")
@click.option("--json", "as_json", is_flag=True, help="Print the placement as JSON.")
@debug_option
@handle_errors
def plan_cmd(checkpoint, preset, profile, tp, ep, kv_dtype, context_len, as_json, debug):
    """Will it fit, where does every byte go, what is the roofline? (layout, per-GPU bytes, cache capacity)

    Exit 2 with the numbers when the checkpoint does not fit the profile.
    """
    if preset and checkpoint:
        raise ConfigError("plan: give --preset or --checkpoint, not both")
    if context_len is not None and context_len < 1:
        raise ConfigError(f"--context-len {context_len} must be >= 1 (tokens per sequence)")
    if preset:
        cfg = make_preset(preset, "--preset")
    else:
        from k3rocm.checkpoint.reader import open_checkpoint  # torch: 1.2 s (measured); --help needs none

        # the whole structural check (index, shards, headers, tensor set) — a plan of a checkpoint that cannot
        # load is no plan; the E8M0 scale scan is left to `load` (it reads ~85 GB on the real release)
        cfg = open_checkpoint(checkpoint_session(checkpoint).checkpoint_dir, check_scales=False).config
    text = cfg.raw.get("text_config", cfg.raw) if isinstance(getattr(cfg, "raw", None), dict) else {}
    max_pos = text.get("max_position_embeddings") if isinstance(text, dict) else None
    if context_len is not None and isinstance(max_pos, int) and not isinstance(max_pos, bool) and context_len > max_pos:
        raise ConfigError(f"--context-len {context_len:,} exceeds the model's max_position_embeddings {max_pos:,}; "
                          "pass a length the model supports")
    prof = load_profile(profile) if profile else match_profile(detect(with_smi=False))
    pl = plan(cfg, prof, tp=tp, ep=ep, kv_dtype=kv_dtype, context_len=context_len, strict=False)
    size = model_size(cfg)
    if as_json:
        click.echo(json.dumps({**pl.to_dict(), "model": size}, indent=2, default=str))
    else:
        console().print(f"model {cfg.name}: {size['params']:,} parameters ({human_bytes(size['bytes'])}), "
                        f"{size['params_activated']:,} active per token ({human_bytes(size['bytes_activated'])}: "
                        f"{ACTIVE_DEFINITION})", highlight=False)
        print_plan(pl, cfg.name, prof.name)
    if not pl.fits:
        raise PlanError(pl.problem or f"{cfg.name} does not fit {prof.name}")


def _check_deployment(env_file: str | None, server_args: str | None, platform: str, as_json: bool) -> None:
    """``env --deployment-env``: every known trap (:data:`k3rocm.envtraps.TRAPS`) against a deployment's settings.

    Only the sources given are read: the environment file (never this process's own environment) and the server
    command line. A trap whose variables come from a source not given is reported unchecked, not clear.

    Raises:
        HardwareError: a trap matched (exit 3; the line names it, the reason and the fix).
        ConfigError: an unreadable environment file or command line.
    """
    settings = read_env_file(env_file) if env_file is not None else {}
    given = [ENVIRONMENT] if env_file is not None else []
    if server_args is not None:
        settings.update(server_options(server_args))
        given.append(SERVER_ARGS)
    results = check_traps(settings, platform, given)
    hits = [r.trap for r in results if r.status == "match"]
    checked = [r for r in results if r.status in ("match", "clear")]
    unchecked = [r for r in results if r.status == "unchecked"]
    if as_json:
        click.echo(json.dumps({"platform": platform, "given": given,
                               "checked": [r.trap.name for r in checked],
                               "unchecked": [{"name": r.trap.name, "reason": r.settings} for r in unchecked],
                               "not_applicable": [r.trap.name for r in results if r.status == "n/a"],
                               "matched": [{**asdict(t), "settings": settings_text(t, settings)} for t in hits]},
                              indent=2, default=str))
    else:
        t = Table(title=f"known environment traps of K3 on {platform} ({len(checked)} of {len(results)} checked)")
        for col in ("trap", "result", "settings", "source"):
            t.add_column(col)
        shown = {"match": "[red]MATCH[/]", "clear": "clear", "unchecked": "unchecked"}
        for r in results:
            t.add_row(r.trap.name, shown.get(r.status, f"n/a ({r.trap.platform})"), r.settings, r.trap.source)
        console().print(t)
        for trap in hits:
            console().print(f"  [red]TRAP[/] {trap.name}: {trap.condition}: {trap.consequence}; fix: {trap.fix}",
                            highlight=False)
        if unchecked:
            why = "; ".join(dict.fromkeys(r.settings for r in unchecked))
            console().print(f"note: {len(unchecked)} trap(s) not checked ({', '.join(r.trap.name for r in unchecked)})"
                            f": {why}; their settings were not seen, so they are neither clear nor matched",
                            highlight=False)
    if hits:
        h = hits[0]
        raise HardwareError(f"deployment environment: {len(hits)} known trap(s) matched, first {h.name}: {h.condition} "
                            f"({h.source}); fix: {h.fix}")


def _shown(v, absent: str) -> str:
    """``v`` as text, or ``absent`` (what its absence means) for None / empty: a table never shows a raw None."""
    return absent if v is None or str(v).strip() in ("", "None") else str(v)


#: what "active per token" counts, parameters and bytes alike (the header line of ``plan`` says it)
ACTIVE_DEFINITION = "the trunk without the input embedding table, plus the top-k routed experts"


def _is_input_embedding(spec) -> bool:
    """The input embedding table, which ``layout.counts``' ``params_activated`` leaves out (a token reads one row)."""
    return spec.name.endswith("embed_tokens.weight")


def model_size(cfg) -> dict:
    """Total and per-token active parameters and bytes of ``cfg`` (:func:`k3rocm.checkpoint.layout.counts`).

    Both active figures have one definition (:data:`ACTIVE_DEFINITION`): every trunk tensor but the input
    embedding table (lm_head counted), plus the top-k routed experts of each MoE layer. ``params_activated`` is
    ``layout.counts``'; ``bytes_activated`` = trunk bytes - input embedding bytes + expert bytes x top_k /
    num_experts (every expert of a layer has the same shapes, so the routed experts' share of the expert bytes is
    exact); bytes as stored in the checkpoint (bf16 trunk, packed MXFP4 experts + E8M0 scales)."""
    c = layout.counts(cfg)
    k, e = cfg.num_experts_per_token, max(cfg.num_experts, 1)
    embed = sum(s.nbytes for s in layout.model_specs(cfg) if _is_input_embedding(s))
    return {"params": c["params"], "params_activated": c["params_activated"], "bytes": c["bytes"],
            "bytes_activated": c["bytes_trunk"] - embed + c["bytes_expert"] * k // e}


def print_plan(pl, model_name: str, profile_name: str) -> None:
    """Render a :class:`~k3rocm.runtime.plan.Placement`: parts per GPU, per-rank weight bytes, fit and cache.

    Used by ``plan`` and, before anything loads, by ``load``.
    """
    c = console()
    t = Table(title=f"plan: {model_name} on {profile_name} (tp={pl.tp}, ep={pl.ep}, {pl.experts_per_rank} "
                    f"experts/rank)")
    for col in ("item", "per GPU", "detail"):
        t.add_column(col)
    for r in pl.summary():
        shown = (human_bytes(r["bytes"]) if "count" not in r else "n/a" if r["count"] is None else f"{r['count']:,}")
        t.add_row(r["item"], shown, r["detail"])
    c.print(t)
    rt = Table(title="per-rank weight bytes")
    rt.add_column("rank")
    rt.add_column("ep rank")
    rt.add_column("experts")
    rt.add_column("GB")
    rt.add_column("tensors")
    for r in pl.ranks:
        rt.add_row(str(r.rank), str(r.ep_rank), f"{r.expert_first}..{r.expert_stop - 1}" if r.expert_stop > r.expert_first else "-",
                   f"{r.weights_bytes / GB:.3f}", str(getattr(r, "num_tensors", "")))
    c.print(rt)
    st = pl.roofline.decode(1, 1024)
    tokens = f"({NO_MLA_BOUND})" if pl.cache.max_tokens is None else f"{pl.cache.max_tokens:,} tokens"
    c.print(f"fits: {'[green]yes[/]' if pl.fits else '[red]NO[/]'}; cache capacity "
            f"{tokens} / {pl.cache.max_sequences:,} sequences of "
            f"{pl.cache.context_len:,}; decode floor batch 1 @1k context {st['floor_s'] * 1e3:.3g} ms "
            f"({st['bound']}-bound, projected)")
    for n in pl.notes:
        c.print(f"note: {n}")


def register(cli: click.Group) -> None:
    for cmd in (profiles_cmd, env_cmd, plan_cmd):
        cli.add_command(cmd)

