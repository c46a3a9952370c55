"""sha256 manifests of checkpoint directories and cheap shard fingerprints for reports.

* :func:`make_manifest` hashes every file of a checkpoint directory into ``k3rocm-manifest.json``
  (``{"format": "k3rocm-manifest/1", "files": {name: {"size": bytes, "sha256": hex}}}``);
* :func:`verify_manifest` re-hashes and returns one line per mismatch (missing, changed size, changed
  hash); :func:`manifest_extras` names the files the manifest does not list (an adapter, a README: extra,
  not corruption);
* :func:`shard_fingerprints` gives each shard's size and the sha256 of its header bytes (8-byte length +
  JSON): enough to tell two checkpoints apart in a report without reading 1.5 TB.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from k3rocm.errors import CheckpointError, HardwareError, environment_error

MANIFEST_NAME = "k3rocm-manifest.json"
MANIFEST_FORMAT = "k3rocm-manifest/1"
_CHUNK = 16 << 20

Progress = Callable[[int, int, str], None]


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks; ``progress(n)`` after each chunk of ``n`` bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST_NAME)


def make_manifest(path: str | Path, progress: Progress | None = None) -> Path:
    """Hash every (non-hidden) file of checkpoint directory ``path`` into ``path/k3rocm-manifest.json``.

    Args:
        path: checkpoint directory.
        progress: ``progress(bytes_done, bytes_total, file_name)`` as files are read.
    Returns:
        the manifest's path.
    Raises:
        CheckpointError: not a directory, or it cannot be read / written.
        HardwareError: no space, quota or an I/O error while reading or writing (exit 3).
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; pass a checkpoint directory to make a manifest of")
    files = _files(root)
    total = sum(p.stat().st_size for p in files)
    done = 0
    out: dict[str, dict] = {}
    try:
        for p in files:
            def tick(n: int, name: str = p.name) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(done, total, name)
            out[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p, tick)}
        dst = root / MANIFEST_NAME
        tmp = root / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
        try:
            tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": out}, indent=2) + "\n")
            os.replace(tmp, dst)
        except BaseException:  # an error or SIGTERM between the two: no half-written temporary file left
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise
    except OSError as e:
        # no space, quota, I/O error: the environment's (exit 3, as README's exit codes say); any other: bad input
        cls = HardwareError if environment_error(e) else CheckpointError
        raise cls(f"{root}: cannot write {MANIFEST_NAME} ({e}); check free space and permissions") from None
    return dst


def read_manifest(path: str | Path) -> dict[str, dict]:
    """The ``files`` map (name -> ``{"size", "sha256"}``) of checkpoint directory ``path``'s ``k3rocm-manifest.json``.

    Raises:
        CheckpointError: no manifest, an unreadable one, or one that is not a k3rocm manifest (one line naming the
            file and what to do).
    """
    mf = Path(path) / MANIFEST_NAME
    try:
        doc = json.loads(mf.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{mf}: no manifest; create one first with `k3rocm checkpoint verify --checkpoint "
                              f"{Path(path)} --write-manifest` on a trusted copy") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mf}: unreadable manifest ({e}); re-create it with `k3rocm checkpoint verify "
                              f"--checkpoint {Path(path)} --write-manifest --force` on a trusted copy") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{mf}: not a {MANIFEST_FORMAT} manifest; re-create it with `k3rocm checkpoint verify "
                              f"--checkpoint {Path(path)} --write-manifest --force` on a trusted copy")
    return doc["files"]


def verify_manifest(path: str | Path, progress: Progress | None = None) -> list[str]:
    """Re-hash a checkpoint directory against its ``k3rocm-manifest.json``.

    Returns:
        one line per problem (empty list = every file matches): ``"<file>: missing"``,
        ``"<file>: size <a> != manifest <b>"``, ``"<file>: sha256 <a> != manifest <b>"``. A file the manifest
        does not list is no problem here (:func:`manifest_extras` names those).
    Raises:
        CheckpointError: no manifest, or it is not a k3rocm manifest.
    """
    root = Path(path)
    want = read_manifest(root)
    problems: list[str] = []
    present = {p.name: p for p in _files(root)}
    total = sum(present[n].stat().st_size for n in want if n in present)
    done = 0
    for name, rec in sorted(want.items()):
        p = present.get(name)
        if p is None or Path(name).name != name:
            problems.append(f"{name}: missing")
            continue
        size = p.stat().st_size
        if size != rec.get("size"):
            problems.append(f"{name}: size {size} != manifest {rec.get('size')}")
            done += size
            continue

        def tick(n: int, fname: str = name) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total, fname)
        digest = sha256_file(p, tick)
        if digest != rec.get("sha256"):
            problems.append(f"{name}: sha256 {digest} != manifest {rec.get('sha256')}")
    return problems


def manifest_extras(path: str | Path) -> list[str]:
    """Names of the (non-hidden) files in checkpoint directory ``path`` that its ``k3rocm-manifest.json`` does
    not list, sorted: files added beside the checkpoint (an adapter, a README), which the manifest cannot vouch
    for and which change no listed file. Empty when there is no readable manifest. Raises nothing."""
    root = Path(path)
    try:
        want = json.loads((root / MANIFEST_NAME).read_text()).get("files", {})
        return sorted(set(p.name for p in _files(root)) - set(want))
    except (OSError, ValueError, AttributeError, TypeError):
        return []


def shard_fingerprints(path: str | Path, names: list[str] | None = None) -> list[dict]:
    """Size and header hash of each ``*.safetensors`` file in ``path`` (or of the shards ``names``, e.g. those the
    index names), sorted by file name. Never raises for a bad shard: a report (its reproduction block) and
    ``checkpoint inspect`` record what they find.

    Returns:
        ``[{"file": name, "bytes": file size, "header_sha256": hex}]``: the hash covers the 8-byte header
        length and the JSON header (names, dtypes, shapes, offsets), not the data, so it identifies a shard's
        layout in O(header) time even for a 16 GB shard (full-content hashes: :func:`make_manifest`). A shard
        that cannot be read, or whose header length runs past its end, gives ``{"file": name, "error": line}``.
    """
    out: list[dict] = []
    files = Path(path).glob("*.safetensors") if names is None else (Path(path) / n for n in set(names))
    for p in sorted(files):
        try:
            size = p.stat().st_size
            with open(p, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 0 or 8 + n > size:
                    out.append({"file": p.name, "error": f"{p}: header length past the end of the file; "
                                                         "the shard is truncated"})
                    continue
                hdr = f.read(n)
        except OSError as e:
            out.append({"file": p.name, "error": str(e)})
            continue
        out.append({"file": p.name, "bytes": size, "header_sha256": hashlib.sha256(head + hdr).hexdigest()})
    return out


__all__ = ["make_manifest", "verify_manifest", "manifest_extras", "shard_fingerprints", "sha256_file", "MANIFEST_NAME"]
