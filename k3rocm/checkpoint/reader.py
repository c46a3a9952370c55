"""Open and validate a checkpoint directory before any device work; read tensors lazily (mmap).

:func:`open_checkpoint` checks, in this order, and raises a one-line :class:`CheckpointError` /
:class:`ConfigError` naming the file or tensor at the first problem:

1. the directory exists and holds no pickle files (``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``):
   nothing is ever unpickled (DESIGN §7);
2. ``config.json`` parses as a :class:`K3Config` (which refuses a missing ``full_attn_layers``);
3. ``model.safetensors.index.json`` parses (``weight_map`` of name -> shard, no duplicate names);
4. every shard it names is a file inside the directory (no absolute paths, no ``..``, no symlink that
   leaves the directory, except, in a Hugging Face cache snapshot ``<repo>/snapshots/<rev>/``, a symlink
   into the same repo's ``<repo>/blobs/`` - the way the hub cache stores every download);
5. every shard header parses: 8-byte little-endian length within the file, JSON object, known dtypes,
   ``data_offsets`` matching shape x dtype size, and the offsets, sorted, tiling the data region exactly as the
   safetensors format requires (and ``safetensors.safe_open`` enforces): the first starts at 0, each begins where
   the previous ends (no overlap, no gap), the last ends at the end of the file (no trailing bytes);
6. the index and the headers agree (an index entry the shard lacks, a tensor in two shards, a shard
   tensor the index does not list);
7. the tensor set is exactly ``layout.iter_specs(config)`` with the right dtypes and shapes (vision tensors
   ``vision_tower.`` / ``mm_projector.`` are recognised and skipped);
8. (``check_scales=True``) no E8M0 ``weight_scale`` byte is 0xFF (NaN) or 0xFD / 0xFE (2^126 / 2^127: the block's
   E2M1 values up to 6 decode past the bf16 / fp32 range, to Inf), checked with numpy on the mapped bytes.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from k3rocm.checkpoint import layout
from k3rocm.config import K3Config, preset
from k3rocm.errors import CheckpointError, ConfigError, unresolved_link

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_HEADER_BYTES = 1 << 30

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4), "F64": (torch.float64, 8),
    "U8": (torch.uint8, 1), "I8": (torch.int8, 1), "I16": (torch.int16, 2), "I32": (torch.int32, 4),
    "I64": (torch.int64, 8), "BOOL": (torch.bool, 1), "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives.

    Attributes:
        shard: shard file name (relative to the checkpoint directory).
        dtype: safetensors dtype string (``BF16``, ``F32``, ``U8``, ...).
        shape: stored shape.
        start, end: absolute byte offsets of the data in the shard file (``end - start`` = nbytes).
    """

    shard: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _no_dup_object(where: str) -> Callable[[list], dict]:
    def hook(pairs: list) -> dict:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set = set()
            k = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise CheckpointError(f"{where}: key {k!r} appears twice; the file is corrupt - re-download it")
        return d
    return hook


def hf_cache_blobs(root: Path) -> Path | None:
    """The ``blobs/`` folder of the Hugging Face cache repo that snapshot directory ``root`` belongs to.

    In the hub cache (``~/.cache/huggingface/hub/models--ORG--NAME/``) a download lives in
    ``snapshots/<revision>/`` and every file there is a symlink to ``../../blobs/<hash>``. Returns
    ``<repo>/blobs`` (resolved) when ``root`` (resolved) is ``<repo>/snapshots/<revision>`` and ``<repo>/blobs``
    is a directory, else None. Raises nothing.
    """
    root = root.resolve()
    if root.parent.name != "snapshots":
        return None
    blobs = root.parent.parent / "blobs"
    return blobs.resolve() if blobs.is_dir() else None


def _allowed_roots(root: Path) -> list[Path]:
    """Where a shard may really live: the checkpoint directory, and the blobs of its HF cache repo."""
    blobs = hf_cache_blobs(root)
    return [root.resolve()] + ([blobs] if blobs is not None else [])


def _safe_shard_path(root: Path, name: object, index_file: Path) -> Path:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index_file}: shard name {name!r} is not a file name; fix the index")
    pure = Path(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name:
        raise CheckpointError(f"{index_file}: shard path {name!r} leaves the checkpoint directory; "
                              "refusing it (shard names must be plain file names inside it)")
    p = root / pure
    try:
        real = p.resolve(strict=False)
    except (RuntimeError, OSError):  # a symlink loop: RuntimeError before Python 3.13, OSError ELOOP after
        raise CheckpointError(f"{root}: shard {name!r} is a symlink loop; replace it with the shard file") from None
    if not any(real.is_relative_to(d) for d in _allowed_roots(root)):
        raise CheckpointError(f"{index_file}: shard {name!r} resolves to {real}, outside the checkpoint "
                              "directory (symlink?); copy the file into the directory")
    if p.exists() and not p.is_file():
        raise CheckpointError(f"{root}: shard {name!r} named by the index is a directory or special file, not a "
                              "shard; replace it with the shard file")
    if not p.is_file():
        raise CheckpointError(f"{root}: shard {name!r} named by the index is missing; re-download it")
    return p


def read_shard_header(path: Path) -> tuple[dict, int, int]:
    """Parse a safetensors header.

    Returns:
        ``(header dict, data_start, file_size)``; ``data_start`` = 8 + header length.
    Raises:
        CheckpointError: file unreadable or shorter than 8 bytes, header length past the end of the file,
            bad JSON; the message names the shard by its full path.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors header; "
                                      "the shard is truncated - re-download it")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {n} runs past the end of the file ({size} bytes); "
                                      "the shard is truncated or not safetensors - re-download it")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the shard ({e.strerror or e}); check that the file is "
                              "readable") from None
    try:
        hdr = json.loads(raw, object_pairs_hook=_no_dup_object(str(path)))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}); re-download the shard") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; re-download the shard")
    return hdr, 8 + n, size


#: what to do about a shard whose header does not describe its bytes
_REWRITE = "re-download the shard (or write it again)"


def _shard_entries(path: Path, shard: str) -> dict[str, TensorEntry]:
    hdr, base, size = read_shard_header(path)
    out: dict[str, TensorEntry] = {}
    spans = []
    sizes = {k: v[1] for k, v in DTYPES.items()}
    for name, info in hdr.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(info["shape"])
            a, b = info["data_offsets"]
            n = sizes[dtype]
            for d in shape:
                if type(d) is not int or d < 0:
                    raise ValueError
                n *= d
        except KeyError:
            if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in sizes:
                raise CheckpointError(f"{path}: tensor {name} has unknown dtype {info['dtype']!r}; the header is "
                                      f"corrupt or the shard was converted to a dtype k3rocm does not read - "
                                      f"{_REWRITE}") from None
            raise CheckpointError(f"{path}: header entry for {name} lacks dtype/shape/data_offsets; "
                                  "re-download the shard") from None
        except (TypeError, ValueError):
            raise CheckpointError(f"{path}: header entry for {name} has a malformed shape or data_offsets; "
                                  "re-download the shard") from None
        if type(a) is not int or type(b) is not int or not 0 <= a <= b or b - a != n:
            raise CheckpointError(f"{path}: tensor {name} data_offsets [{a}, {b}] do not match shape "
                                  f"{list(shape)} x {dtype}; the header is corrupt - {_REWRITE}")
        if base + b > size:
            raise CheckpointError(f"{path}: tensor {name} ends at byte {base + b} but the file has {size} "
                                  "bytes; the shard is truncated - re-download it")
        out[name] = TensorEntry(shard, dtype, shape, base + a, base + b)
        spans.append((a, b, name))
    # the safetensors format: the offsets, sorted (start, end), tile the data region exactly - what
    # safetensors.safe_open refuses ("invalid offset for tensor", "incomplete metadata, file not fully covered")
    spans.sort()
    end, prev = 0, None
    for a, b, name in spans:
        if a < end:
            raise CheckpointError(f"{path}: tensors {prev} and {name} overlap in the file; the header is corrupt - "
                                  f"{_REWRITE}")
        if a > end:
            after = f"tensor {prev} ends at data offset {end}" if prev else "the data region starts at offset 0"
            raise CheckpointError(f"{path}: {a - end} bytes before tensor {name} (at data offset {a}) belong to no "
                                  f"tensor ({after}); the header is corrupt - {_REWRITE}")
        end, prev = b, name
    if base + end != size:
        last = f"the last tensor, {prev}, ends at byte {base + end}" if prev else "the header lists no tensor"
        raise CheckpointError(f"{path}: the file's last {size - base - end} bytes belong to no tensor ({last} of "
                              f"{size}); the shard is damaged - {_REWRITE}")
    return out


class CheckpointIndex:
    """A validated checkpoint directory (build it with :func:`open_checkpoint`).

    Attributes:
        config: the parsed :class:`K3Config`.
        path: the checkpoint directory (resolved).
        shards: shard file names in index order (sorted).
        entries: text tensor name -> :class:`TensorEntry` (exactly ``layout.iter_specs(config)``).
        vision: skipped vision tensors (``vision_tower.``, ``mm_projector.``) -> :class:`TensorEntry`.
        total_size: ``metadata.total_size`` of the index (None when absent).
        shard_sizes: shard name -> file size in bytes.
    """

    def __init__(self, config: K3Config, path: Path, shards: list[str], entries: dict[str, TensorEntry],
                 vision: dict[str, TensorEntry], total_size: int | None, shard_sizes: dict[str, int],
                 parts: dict[str, str]):
        self.config = config
        self.path = path
        self.shards = shards
        self.entries = entries
        self.vision = vision
        self.total_size = total_size
        self.shard_sizes = shard_sizes
        self._parts = parts
        self._maps: dict[str, mmap.mmap] = {}
        self._readonly: set[str] = set()

    def __repr__(self) -> str:
        return f"CheckpointIndex({str(self.path)!r}, {len(self.entries)} tensors in {len(self.shards)} shards)"

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def part(self, name: str) -> str:
        """``"expert"`` (routed-expert tensor) or ``"trunk"`` for a text tensor (``layout.TensorSpec.part``)."""
        return self._parts[name]

    def _map(self, shard: str) -> mmap.mmap:
        m = self._maps.get(shard)
        if m is None:
            with open(self.path / shard, "rb") as f:
                # private copy-on-write mapping: torch gets a writable buffer without copying the file
                try:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                except (OSError, ValueError):  # strict overcommit refuses a private map: map read-only
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    self._readonly.add(shard)
            self._maps[shard] = m
        return m

    def raw_bytes(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name`` as a read-only uint8 numpy view of the mapped file."""
        e = self._entry(name)
        a = np.frombuffer(self._map(e.shard), dtype=np.uint8, count=e.nbytes, offset=e.start)
        a.flags.writeable = False
        return a

    def _entry(self, name: str) -> TensorEntry:
        e = self.entries.get(name) or self.vision.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: no tensor named {name}; check the name against the index")
        return e

    def read(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Tensor ``name`` in its stored dtype and shape.

        On CPU the result shares memory with a private copy-on-write mapping of the shard (no read until
        touched, writes never reach the file); other devices get a copy. Unaligned data, and data of a
        shard the kernel would only map read-only (strict overcommit), is copied. Tensors read from one
        index share that mapping: an in-place change shows in later reads of the same tensor (clone first).
        Raises:
            CheckpointError: unknown name.
        """
        e = self._entry(name)
        tdt, isz = DTYPES[e.dtype]
        if e.nbytes == 0:
            t = torch.empty(e.shape, dtype=tdt)
        elif e.start % isz == 0 and e.shard not in self._readonly:
            t = torch.frombuffer(self._map(e.shard), dtype=tdt, count=e.nbytes // isz, offset=e.start)
        else:  # unaligned data, or a read-only mapping: copy the bytes out
            b = np.frombuffer(self._map(e.shard), dtype=np.uint8, count=e.nbytes, offset=e.start)
            t = torch.from_numpy(b.copy()).view(tdt)
        t = t.reshape(e.shape)
        if torch.device(device).type != "cpu":
            t = t.to(device)
        return t

    def read_many(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """``{name: read(name, device)}`` in the given order."""
        return {n: self.read(n, device) for n in names}

    def nbytes_by_part(self) -> dict[str, int]:
        """Data bytes by part: ``{"expert", "trunk", "vision", "total"}`` (total = text + vision)."""
        out = {"expert": 0, "trunk": 0, "vision": sum(e.nbytes for e in self.vision.values())}
        for n, e in self.entries.items():
            out[self._parts[n]] += e.nbytes
        out["total"] = out["expert"] + out["trunk"] + out["vision"]
        return out

    def is_official(self) -> bool:
        """True when config.json equals the official ``moonshotai/Kimi-K3`` one and the text tensor set is
        the official 497,052 (validated against the layout when opened)."""
        off = preset("k3")
        return self.config.to_dict() == off.to_dict() and len(self.entries) == layout.counts(off)["tensors"]

    def close(self) -> None:
        """Drop the shard mappings (tensors already read keep theirs alive)."""
        self._maps.clear()


def _byte_count(v: object) -> int | None:
    """``v`` as a non-negative integer when it is one (int, integral float, digit string), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    return v if isinstance(v, int) and v >= 0 else None


def _refuse_pickles(root: Path) -> None:
    for p in sorted(root.iterdir()):
        if p.suffix.lower() in PICKLE_SUFFIXES:
            raise CheckpointError(f"{p}: pickle file in the checkpoint; k3rocm never unpickles - remove it "
                                  "or convert the checkpoint to safetensors")


def check_scale_bytes(index: CheckpointIndex, names: Iterable[str] | None = None) -> None:
    """Raise on the first ``weight_scale`` tensor holding an E8M0 byte 0xFF (NaN; K3_FACTS §4) or 0xFD / 0xFE
    (2^126 / 2^127: E2M1 values up to 6 in that block decode to more than bf16's and fp32's 3.4e38, i.e. Inf —
    no quantizer picks such a scale, whose block maximum would itself be past that range).

    Raises:
        CheckpointError: naming the tensor, its shard, the byte and the first bad (row, column).
    """
    names = [n for n in index.entries if n.endswith(".weight_scale")] if names is None else list(names)
    for n in names:
        e = index.entries[n]
        b = index.raw_bytes(n)
        if b.size and b.max() >= _SCALE_INF:
            bad = b >= _SCALE_INF
            flat = int(np.argmax(bad))
            where = np.unravel_index(flat, e.shape) if e.shape else ()
            byte = int(b.reshape(-1)[flat])
            what = "0xFF (NaN)" if byte == 0xFF else f"0x{byte:02X} (2^{byte - 127}: decodes to Inf)"
            raise CheckpointError(f"{n} in {e.shard}: E8M0 scale byte {what} at {tuple(int(i) for i in where)} "
                                  f"({int(bad.sum())} such bytes in this tensor); the checkpoint is corrupt - "
                                  "re-download that shard")


#: the smallest E8M0 byte refused: 0xFD = 2^126, where 6 (E2M1's largest) x 2^126 passes fp32's largest finite value
_SCALE_INF = 0xFD


#: the names an MXFP4 routed-expert weight is stored under (compressed-tensors' pack-quantized format), and the one
#: an unquantized expert weight has
PACKED_SUFFIXES = (".weight_packed", ".weight_scale")
PLAIN_SUFFIX = ".weight"


def _refuse_quantization_mismatch(root: Path, cfg: K3Config, name: str, found: dict[str, TensorEntry]) -> None:
    """When ``name`` (a tensor the config requires) is missing because config.json and the shards disagree on
    whether the routed experts are MXFP4, raise the one line that says so instead of "the checkpoint is
    incomplete": a config without ``quantization_config`` over shards holding ``<w>.weight_packed`` /
    ``weight_scale``, or a config declaring MXFP4 over shards holding plain ``<w>.weight``. Returns otherwise.

    Raises:
        ConfigError: the config and the files disagree on the experts' format (the fix is config.json's).
    """
    where = "text_config.quantization_config" if "text_config" in cfg.raw else "quantization_config"
    if cfg.quant is None and name.endswith(PLAIN_SUFFIX) and ".experts." in name:
        stem = name[:-len(PLAIN_SUFFIX)]
        if any(stem + suf in found for suf in PACKED_SUFFIXES):
            n = sum(1 for k in found if k.endswith(PACKED_SUFFIXES[0]))
            raise ConfigError(f"{root / CONFIG_NAME}: has no {where}, but the shards hold the routed experts as packed "
                              f"MXFP4 ({n} *.weight_packed + *.weight_scale tensors); restore {where} from the "
                              "released config.json")
    if cfg.quant is not None and name.endswith(PACKED_SUFFIXES) and ".experts." in name:
        stem = name[:name.rindex(".")]
        if stem + PLAIN_SUFFIX in found:
            raise ConfigError(f"{root / CONFIG_NAME}: {where} declares MXFP4 routed experts, but the shards hold "
                              f"unquantized {stem}.weight (no .weight_packed / .weight_scale); remove {where} for "
                              "these files, or use the released MXFP4 shards")


def open_checkpoint(path: str | Path, check_scales: bool = True) -> CheckpointIndex:
    """Validate a checkpoint directory and return its :class:`CheckpointIndex` (no tensor data read except
    the scale bytes when ``check_scales``).

    Args:
        path: directory with ``config.json``, ``model.safetensors.index.json`` and shards (a single
            ``model.safetensors`` without an index is accepted too).
        check_scales: scan every ``weight_scale`` for 0xFF (default on; reads ~6% of a K3 checkpoint).
    Raises:
        ConfigError: config.json missing or invalid.
        CheckpointError: any other problem (see the module doc), one line naming the file / tensor.
    """
    root = Path(path)
    if not root.is_dir():
        link = unresolved_link(root)
        if link:
            raise CheckpointError(f"{root}: {link}; point the link at the checkpoint directory or pass the "
                                  "directory itself")
        raise CheckpointError(f"{root}: not a checkpoint directory (it does not exist or is a file)")
    root = root.resolve()
    _refuse_pickles(root)
    cfg = K3Config.from_file(root / CONFIG_NAME)

    index_file = root / INDEX_NAME
    total_size = None
    if index_file.is_file():
        try:
            doc = json.loads(index_file.read_text(), object_pairs_hook=_no_dup_object(INDEX_NAME))
        except OSError as e:
            raise CheckpointError(f"{index_file}: cannot read it ({e.strerror or e}); check that the file is "
                                  "readable") from None
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{index_file}: not valid JSON ({why}); re-download it") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if wm is not None and not isinstance(wm, dict):
            raise CheckpointError(f"{index_file}: weight_map is a JSON {type(wm).__name__}, not an object of tensor "
                                  "name -> shard file; re-download the index")
        if not wm:
            raise CheckpointError(f"{index_file}: no weight_map; re-download the index")
        bad = next(((k, v) for k, v in wm.items() if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise CheckpointError(f"{index_file}: weight_map entry for {bad[0]} is {bad[1]!r:.60}, not a shard file "
                                  "name; fix or re-download the index")
        meta = doc.get("metadata") or {}
        ts = meta.get("total_size") if isinstance(meta, dict) else None
        total_size = _byte_count(ts)  # some writers store it as a float or a string of digits
        if ts is not None and total_size is None:
            raise CheckpointError(f"{index_file}: metadata.total_size is {ts!r:.60}, not a byte count; fix or "
                                  "re-download the index")
    elif (root / SINGLE_FILE).is_file():
        hdr, _, _ = read_shard_header(_safe_shard_path(root, SINGLE_FILE, root))
        wm = {k: SINGLE_FILE for k in hdr if k != "__metadata__"}
    else:
        raise CheckpointError(f"{root}: no {INDEX_NAME} (nor a single {SINGLE_FILE}); "
                              "pass a complete checkpoint directory")

    shards = sorted(set(wm.values()), key=str)
    paths = {s: _safe_shard_path(root, s, index_file) for s in shards}
    found: dict[str, TensorEntry] = {}
    sizes: dict[str, int] = {}
    for s in shards:
        sizes[s] = paths[s].stat().st_size
        for name, e in _shard_entries(paths[s], s).items():
            if name in found:
                raise CheckpointError(f"tensor {name} is stored in both {found[name].shard} and {s}; "
                                      "remove the duplicate (the index must name exactly one shard)")
            found[name] = e
    for name, s in wm.items():
        e = found.get(name)
        if e is None:
            raise CheckpointError(f"{index_file}: tensor {name} is listed in {s} but that shard does not hold it; "
                                  "the shard is stale or the index is wrong - re-download both")
        if e.shard != s:
            raise CheckpointError(f"{index_file}: tensor {name} is listed in {s} but stored in {e.shard}; "
                                  "fix the index")
    for name, e in found.items():
        if name not in wm:
            raise CheckpointError(f"{root / e.shard}: holds tensor {name} that {INDEX_NAME} does not list; "
                                  "fix the index")

    entries: dict[str, TensorEntry] = {}
    vision: dict[str, TensorEntry] = {}
    parts: dict[str, str] = {}
    for spec in layout.iter_specs(cfg):
        e = found.pop(spec.name, None)
        if e is None:
            _refuse_quantization_mismatch(root, cfg, spec.name, found)
            missing = sum(1 for s in layout.iter_specs(cfg) if s.name not in entries and s.name not in found)
            raise CheckpointError(f"{root}: tensor {spec.name} (and {missing - 1} more) required by config.json is "
                                  "missing; the checkpoint is incomplete or for another config")
        if e.dtype != spec.dtype:
            raise CheckpointError(f"{root / e.shard}: tensor {spec.name} has dtype {e.dtype}, expected {spec.dtype}; "
                                  "the checkpoint was converted wrongly - use the released files")
        if e.shape != spec.shape:
            raise CheckpointError(f"{root / e.shard}: tensor {spec.name} has shape {list(e.shape)}, expected "
                                  f"{list(spec.shape)} from config.json; checkpoint and config disagree")
        entries[spec.name] = e
        parts[spec.name] = spec.part
    for name, e in found.items():
        if layout.is_vision(name):
            vision[name] = e
    extra = sorted(n for n in found if not layout.is_vision(n))
    if extra:
        raise CheckpointError(f"{root / found[extra[0]].shard}: unexpected tensor {extra[0]} "
                              f"(and {len(extra) - 1} more) that config.json does not imply; checkpoint and "
                              "config disagree")
    idx = CheckpointIndex(cfg, root, shards, entries, vision, total_size, sizes, parts)
    if check_scales:
        check_scale_bytes(idx)
    return idx


__all__ = ["open_checkpoint", "CheckpointIndex", "TensorEntry", "read_shard_header", "check_scale_bytes",
           "INDEX_NAME", "CONFIG_NAME", "PICKLE_SUFFIXES", "ConfigError"]
