"""``k3rocm checkpoint make | inspect | verify``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click
from rich.table import Table

from k3rocm.checkpoint import layout
from k3rocm.checkpoint.verify import (MANIFEST_NAME, make_manifest, manifest_extras, read_manifest, shard_fingerprints,
                                     verify_manifest)
from k3rocm.cli.common import Progress, checkpoint_session, console, debug_option, fail, handle_errors, kept
from k3rocm.config import PRESETS, preset as make_preset
from k3rocm.errors import CheckpointError, ConfigError, Terminated, unresolved_link

GB = 1e9


@click.group("checkpoint")
def checkpoint_group():
    """Make, inspect and verify checkpoints in the released K3 layout."""


@checkpoint_group.command("make", epilog="""\b
Examples:
  k3rocm checkpoint make --out ./k3-tiny                     # random k3-tiny, seed 0
  k3rocm checkpoint make --preset k3-prefix-2 --out ./k3p2 --seed 7
  k3rocm checkpoint make --preset k3-prefix-4 --out ./k3p4 --expert-init codes   # full width, fast
  k3rocm checkpoint make --out ./k3-tiny --manifest          # + k3rocm-manifest.json (sha256)""")
@click.option("--preset", default="k3-tiny", show_default=True, metavar="NAME",
              help=f"{', '.join(PRESETS)} (full sizes need the disk space).")
@click.option("--out", required=True, type=click.Path(path_type=str), metavar="DIR", help="New directory to write.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1),
              help="Weights are a function of (seed, tensor name).")
@click.option("--shards", type=int, default=None,
              help="Number of shards, from 1 to one a layer (plus one for the embedding / head; default: about one "
                   "per 20 GB, at least 2).")
@click.option("--manifest", is_flag=True, help="Also write k3rocm-manifest.json (sha256 per file).")
@click.option("--expert-init", type=click.Choice(["gaussian", "codes"]), default="gaussian", show_default=True,
              help="Routed experts: N(0, 1/in) quantized to MXFP4, or random E2M1 codes + E8M0 scales of the "
                   "same RMS drawn directly in the format (~100x faster; for full-width presets).")
@debug_option
@handle_errors
def make_cmd(preset, out, seed, shards, manifest, expert_init, debug):
    """Write a deterministic random-weight checkpoint in the released on-disk layout."""
    from k3rocm.checkpoint.writer import write_checkpoint  # torch: 1.2 s (measured); --help needs none

    _check_out_dir(out)
    cfg = make_preset(preset, "--preset")
    try:
        with Progress() as bar:
            cb = bar.callback(f"writing {preset}")
            path = write_checkpoint(cfg, out, seed=seed, num_shards=shards,
                                    progress=lambda done, total, *_: cb(done, total), expert_init=expert_init)
    except Terminated:  # the writer removed its temporary directory and any parent it created
        fail("terminated (SIGTERM) while writing the checkpoint; nothing was written (the partial files were "
             "removed)", 143)
    if manifest:
        kept(f"the checkpoint in {path} is complete but has no {MANIFEST_NAME} (write it with `k3rocm checkpoint "
             f"verify --checkpoint {path} --write-manifest`)")
        make_manifest(path)
    kept(f"the checkpoint in {path} is complete")
    files = sorted(Path(path).iterdir())
    click.echo(f"wrote {preset} (seed {seed}) to {path}: {len(files)} files, "
               f"{sum(f.stat().st_size for f in files) / 1e6:.1f} MB")


def _check_out_dir(out: str) -> None:
    """Refuse an ``--out`` that is empty or lies where nothing can be created, before any size check.

    The checkpoint is written into a temporary directory beside ``out`` (in its parent, created if need be)
    and renamed at the end, so what must be writable is the nearest existing ancestor of ``out``'s parent.
    That is probed by creating and removing an empty temporary directory there: permission bits alone do not
    tell (root passes ``os.access`` on a read-only mount, and ``/proc`` or ``/sys`` refuse new entries
    whatever the bits say).

    Raises:
        CheckpointError: ``out`` is empty/blank, a symbolic link that does not resolve, or that location
            refuses a new directory (one line naming it and the system's reason).
    """
    if not out.strip():
        raise CheckpointError("--out is empty; pass the new directory to write, e.g. --out ./k3-tiny")
    link = unresolved_link(out)
    if link:
        raise CheckpointError(f"--out {out}: {link}; remove the link or choose another directory")
    probe = Path(out).absolute().parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():  # a parent path is a file: the writer says so in its own words
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".k3rocm-probe-", dir=probe))
    except OSError as e:
        raise CheckpointError(f"{out}: cannot create a directory in {probe} ({e.strerror or e}); the location is "
                              "not writable - choose a directory you can write to") from None


@checkpoint_group.command("inspect", epilog="""\b
Examples:
  k3rocm checkpoint inspect --checkpoint /models/Kimi-K3
  k3rocm checkpoint inspect                 # the embedded k3-tiny
  k3rocm checkpoint inspect --json""")
@click.option("--checkpoint", type=click.Path(path_type=str), default=None, metavar="DIR",
              help="Checkpoint directory (default: the embedded k3-tiny).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@debug_option
@handle_errors
def inspect_cmd(checkpoint, as_json, debug):
    """Validate the index and every shard header against the config's layout, and summarise it."""
    s = checkpoint_session(checkpoint)
    idx = s.index
    cfg = s.config
    cnt = layout.counts(cfg)
    parts = idx.nbytes_by_part()
    doc = {"checkpoint": str(s.checkpoint_dir), "config_hash": cfg.config_hash(), "family": cfg.family,
           "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
           "mla_layers": cfg.num_mla_layers, "kda_layers": cfg.num_kda_layers, "experts": cfg.num_experts,
           "top_k": cfg.num_experts_per_token, "quantization": cfg.quant.format if cfg.quant else None,
           "tensors": len(idx), "tensors_expected": cnt["tensors"],
           "params": cnt["params"], "params_activated": cnt["params_activated"], "bytes_by_part": parts,
           "official": bool(idx.is_official()),
           "shards": shard_fingerprints(s.checkpoint_dir, idx.shards)}  # those the index names, not every file
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    t = Table(title=f"checkpoint {doc['checkpoint']}", show_header=False)
    t.add_column("item")
    t.add_column("value")
    for k, v in doc.items():
        if k in ("shards", "checkpoint"):
            continue
        if isinstance(v, dict):  # bytes by part: one row each, in GB
            for part, b in v.items():
                t.add_row(f"bytes: {part}", f"{b:,} ({b / GB:.3f} GB)")
            continue
        t.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    t.add_row("shards", f"{len(doc['shards'])} files, {sum(x.get('bytes', 0) for x in doc['shards']) / GB:.3f} GB")
    console().print(t)
    click.echo("index, shard headers, tensor set and scales valid (weight values are not scanned here: `k3rocm load` "
               "checks every tensor for NaN/Inf and its checksum, `checkpoint verify` the sha256 manifest)")


@checkpoint_group.command("verify", epilog="""\b
Examples:
  k3rocm checkpoint verify --checkpoint ./k3-tiny                 # against k3rocm-manifest.json
  k3rocm checkpoint verify --checkpoint ./k3-tiny --write-manifest  # on a trusted copy
\b
--write-manifest first checks the index and every shard header, and, where a manifest already exists, every
file against it: it refuses to write over a manifest the files no longer match (that is what corruption looks
like) unless --force says the files changed on purpose.""")
@click.option("--checkpoint", type=click.Path(path_type=str), default=None, metavar="DIR",
              help="Checkpoint directory. Default: the embedded k3-tiny.")
@click.option("--write-manifest", is_flag=True, help="Write k3rocm-manifest.json (sha256 of every file) instead of checking.")
@click.option("--force", is_flag=True,
              help="With --write-manifest: replace an existing manifest even though the files differ from it.")
@debug_option
@handle_errors
def verify_cmd(checkpoint, write_manifest, force, debug):
    """Check every file's sha256 against k3rocm-manifest.json (exit 2 naming the first mismatch)."""
    s = checkpoint_session(checkpoint)
    d = s.checkpoint_dir
    if force and not write_manifest:
        raise ConfigError("--force only applies with --write-manifest; drop it, or add --write-manifest")
    if write_manifest:
        s.index  # a manifest vouches only for a checkpoint whose index and shard headers are valid
        had = (d / MANIFEST_NAME).is_file()
        if had and not force:
            res = verify_manifest(d)
            if res:
                raise CheckpointError(f"{d}: {len(res)} file(s) differ from the existing {MANIFEST_NAME}, first: "
                                      f"{res[0]}; not replacing it (the files may be corrupt): re-download them, or "
                                      "pass --force if they changed on purpose")
        unreadable = False
        if had and force:  # the previous one is replaced unchecked; say so when it could not even be read
            try:
                read_manifest(d)
            except CheckpointError:
                unreadable = True
        mf = make_manifest(d)
        click.echo(f"wrote {mf}" + (" (replacing the previous manifest" + (
            ", which could not be read: --force)" if unreadable else
            ", which the files no longer matched: --force)" if force else ", which the files matched)")
            if had else ""))
        return
    if not (d / MANIFEST_NAME).is_file():
        raise CheckpointError(f"{d}: no {MANIFEST_NAME}; create one with `k3rocm checkpoint verify --checkpoint {d} "
                              "--write-manifest` on a trusted copy")
    s.index  # headers and layout first
    res = verify_manifest(d)
    if res:
        raise CheckpointError(f"{d}: {len(res)} file(s) differ from {MANIFEST_NAME}, first: {res[0]}; "
                              "re-download them")
    extra = manifest_extras(d)
    if extra:
        click.echo(f"note: {len(extra)} file(s) not in {MANIFEST_NAME}, left unchecked (extra, not corruption): "
                   + ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else ""))
    click.echo(f"{d}: every file {MANIFEST_NAME} lists matches it")


def register(cli: click.Group) -> None:
    cli.add_command(checkpoint_group)
