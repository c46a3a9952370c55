"""The embedded default checkpoint: k3-tiny, written once into the user cache.

With no ``--checkpoint`` every command uses :func:`default_checkpoint` (DESIGN §1): a tiny
K3-architecture checkpoint (the ``k3-tiny`` preset, random weights from a fixed seed) in the released
on-disk format, written by :func:`k3rocm.checkpoint.writer.write_checkpoint`. It is built into a private
temporary directory and renamed into place, so concurrent callers are safe: the first rename wins, the
others validate the winner's copy and use it. An existing copy is reused only when it passes
:func:`~k3rocm.checkpoint.reader.open_checkpoint` and its config is the current k3-tiny preset;
otherwise it is replaced.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.checkpoint.verify import make_manifest, verify_manifest
from k3rocm.checkpoint.writer import checkpoint_nbytes, require_free_space, write_checkpoint
from k3rocm.config import preset
from k3rocm.errors import CheckpointError, HardwareError, K3Error

DEFAULT_NAME = "k3-tiny-v1"
DEFAULT_SEED = 0
CACHE_ENV = "K3ROCM_CACHE"
#: room kept for k3rocm-manifest.json (about 120 bytes a file) in the free-space check
_MANIFEST_BYTES = 4096


def cache_root() -> Path:
    """``$K3ROCM_CACHE`` if set, else ``~/.cache/k3rocm``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "k3rocm"


def _usable(path: Path, say: bool = False) -> bool:
    """The cached copy opens, is k3-tiny, and every file matches the sha256 manifest written with it
    (the oracle and the engine read the same bytes, so a flipped bit would otherwise pass validation)."""
    if not (path / "config.json").is_file():
        return False
    try:
        idx = open_checkpoint(path)
        problems = verify_manifest(path)
    except K3Error:
        problems = ["unreadable or no manifest"]
        idx = None
    if problems:
        if say:
            print(f"note: the cached k3-tiny at {path} fails its check ({problems[0]}); writing it again",
                  file=sys.stderr)
        return False
    return idx.config.to_dict() == preset("k3-tiny").to_dict()


def default_checkpoint() -> Path:
    """Path of the embedded k3-tiny checkpoint (``<cache_root()>/k3-tiny-v1``), writing it on first use.

    Returns:
        the checkpoint directory (validated).
    Raises:
        CheckpointError: the cache directory cannot be written (the message names it).
        HardwareError: the cache's disk has too little free space (checked before anything is written), or it
            runs out or fails while writing; the message names the cache directory and ``$K3ROCM_CACHE``.
    """
    root = cache_root()
    final = root / DEFAULT_NAME
    if _usable(final, say=final.exists()):
        return final
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: the k3rocm cache must be a directory, and this is a file; set {CACHE_ENV} to a "
                              "writable directory")
    cfg = preset("k3-tiny")
    # the user named no preset and no --out: name the cache, not the private build directory inside it
    room = f"free space there or set {CACHE_ENV} to a directory on a disk with room"
    require_free_space(checkpoint_nbytes(cfg) + _MANIFEST_BYTES, root,
                       f"{root}: the default k3-tiny checkpoint (written once into the k3rocm cache)", room)
    try:
        root.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}.build-", dir=root))
    except OSError as e:
        raise CheckpointError(f"{root}: cannot create the k3rocm cache ({e.strerror or e}); set {CACHE_ENV} to a "
                              "writable directory") from None
    try:
        try:
            ck = write_checkpoint(cfg, build / "checkpoint", seed=DEFAULT_SEED)
            make_manifest(ck)
        except HardwareError as e:  # no space / I/O error met while writing: the build directory is removed below
            cause = e.__context__  # the OSError the writer turned into this line
            why = cause.strerror if isinstance(cause, OSError) and cause.strerror else "not enough free space"
            raise HardwareError(f"{root}: writing the default k3-tiny checkpoint into the k3rocm cache failed "
                                f"({why}); {room}") from None
        if final.exists() and not _usable(final):
            # a stale or broken copy: move it aside (atomic) and delete it
            stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}.stale-", dir=root))
            try:
                os.rename(final, stale / "old")
            except OSError:
                pass  # someone else moved or replaced it meanwhile
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(ck, final)
        except OSError:
            if not _usable(final):  # lost a race to a copy that is not usable: report it
                raise CheckpointError(f"{final}: cannot install the default checkpoint; remove that directory "
                                      "and retry") from None
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final


__all__ = ["default_checkpoint", "cache_root", "DEFAULT_NAME", "DEFAULT_SEED", "CACHE_ENV"]
