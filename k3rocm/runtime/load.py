"""Streaming load: each rank reads exactly the byte ranges its plan names, straight from the shard files.

For every ``(name, ShardSlice)`` of ``placement.ranks[r].tensors`` the loader takes the tensor's absolute
data offsets from the reader's :class:`~k3rocm.checkpoint.reader.TensorEntry` and

* a whole tensor or a dim-0 slice (rows: heads, vocab rows, expert rows) is one contiguous run: read with
  ``os.preadv`` directly into the destination tensor's memory (large runs in 64 MiB pieces, so the thread
  pool spreads one big tensor over several threads);
* a dim>0 slice (``o_proj`` / ``down_proj`` input columns, ``w2`` intermediate columns) is ``outer`` runs of
  equal length at a fixed stride: copied from a read-only ``mmap`` of the shard through a strided numpy view
  (only the touched pages are read).

Bytes stay as stored (BF16 / FP32 / U8: MXFP4 stays packed). The destination is first filled with 0xFF
(NaN for floats), so an unwritten byte cannot pass as data. On a GPU each host buffer is copied to the device
as soon as its reads are done, while the pool reads on (the copies overlap the disk), and then freed.

Proof that every planned tensor landed (:func:`verify_loaded`): for each planned tensor, the loaded tensor
exists, has the planned shape and dtype, and its checksum equals the checksum of the same slice taken from
the source through an independent path (the reader's ``read`` + torch indexing by :meth:`ShardSlice.index`).
Checksum: Fletcher-style pair over the bytes, computed with torch on the tensor's own device
(``s1 = sum(b)``, ``s2 = sum(b * (i % 251 + 1))``, int64) — any single changed byte changes ``s1``; a moved
byte changes ``s2``.

Throughput: per-rank and aggregate GB/s of the load, and — in the same run — the raw sequential read rate
of the same shard files (16 MiB reads with ``O_DIRECT``, bypassing the page cache where the file system allows;
the report says when it could not), so the raw figure is not a page-cache figure; the report gives the ratio.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from k3rocm.checkpoint.reader import DTYPES, CheckpointIndex, open_checkpoint
from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError, ValidationFailed
from k3rocm.model.weights import Weights
from k3rocm.profiles import load_profile
from k3rocm.runtime.plan import Placement, ShardSlice, plan

__all__ = ["load", "load_checkpoint", "verify_loaded", "checksum", "LoadReport", "LoadResult", "raw_read_throughput"]

Progress = Callable[[int, int, str], None]
#: the ``text`` a load's progress callback gets once the verification pass starts (bytes verified of the planned
#: bytes, from 0 again): a bar shows the new phase instead of sitting at 100% while the checksums run
VERIFY_TEXT = "verifying"
PIECE = 64 << 20
GROUP_BYTES = 8 << 20
GB = 1e9


@dataclass
class LoadReport:
    """What a load did (``to_dict()`` for the report). Sizes in bytes, times in seconds, rates in GB/s (1e9)."""

    checkpoint: str
    device: str
    world: int
    ranks: list[int]
    threads: int
    tensors_planned: int = 0
    tensors_loaded: int = 0
    tensors_verified: int = 0
    bytes_planned: dict[int, int] = field(default_factory=dict)
    bytes_loaded: dict[int, int] = field(default_factory=dict)
    device_bytes_used: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    gbps: dict[int, float] = field(default_factory=dict)
    total_seconds: float = 0.0
    aggregate_gbps: float = 0.0
    raw_read_bytes: int = 0
    raw_read_seconds: float = 0.0
    raw_read_gbps: float = 0.0
    load_vs_raw: float = 0.0
    page_cache_dropped: bool = False
    verify_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.tensors_verified == self.tensors_planned

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("bytes_planned", "bytes_loaded", "device_bytes_used", "seconds", "gbps"):
            d[k] = {str(r): v for r, v in d[k].items()}
        d["ok"] = self.ok
        return d


class LoadResult:
    """Loaded weights per rank plus the :class:`LoadReport`.

    Attributes:
        rank_weights: rank -> :class:`~k3rocm.model.weights.Weights` holding that rank's local slices
            (``expert_range`` = the rank's experts).
        report: :class:`LoadReport`.
        weights: the single-device :class:`Weights`: rank 0's when the plan has one rank, else the full
            tensors re-assembled from every rank's slices (concatenated along the split dims — itself a check
            that the slices tile each tensor). Needs all ranks loaded.
    """

    def __init__(self, cfg: K3Config, placement: Placement, rank_weights: dict[int, Weights], report: LoadReport):
        self.config = cfg
        self.placement = placement
        self.rank_weights = rank_weights
        self.report = report
        self._full: Weights | None = None

    def __iter__(self):  # ``weights, report = load(...)``
        yield self.weights
        yield self.report

    @property
    def weights(self) -> Weights:
        if self.placement.world == 1:
            return self.rank_weights[0]
        if self._full is None:
            self._full = assemble(self.config, self.placement, self.rank_weights)
        return self._full


# chunk length: a multiple of 251, so the position weights ((i mod 251) + 1) are the same for every chunk and
# are made once per device
_CK_STEP = 251 << 16
_CK_WEIGHTS: dict[str, torch.Tensor] = {}


def _checksum_weights(device: torch.device, n: int) -> torch.Tensor:
    key = str(device)
    w = _CK_WEIGHTS.get(key)
    if w is None:
        w = _CK_WEIGHTS[key] = (torch.arange(_CK_STEP, device=device, dtype=torch.int64) % 251) + 1
    return w[:n]


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Fletcher-style ``(s1, s2)`` over the raw bytes of ``t`` (any dtype, any device; computed there).

    ``s1`` = sum of the bytes, ``s2`` = sum of byte_i x ((i mod 251) + 1), both exact in int64.
    """
    b = t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    s1 = s2 = 0
    n = b.numel()
    for a in range(0, n, _CK_STEP):
        c = b[a:a + _CK_STEP].to(torch.int64)
        s1 += int(c.sum())
        s2 += int((c * _checksum_weights(c.device, c.numel())).sum())
    return s1, s2


def _drop_cache(paths: Iterable[Path]) -> bool:
    ok = hasattr(os, "posix_fadvise")
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
    return ok


def raw_read_throughput(paths: list[Path], limit_bytes: int | None = None, drop_cache: bool = True) -> tuple[int, float, bool]:
    """Sequentially read ``paths`` (16 MiB reads, up to ``limit_bytes`` in total).

    With ``drop_cache`` every file is read with ``O_DIRECT`` into a page-aligned buffer, so the figure is the
    storage's, not the page cache's (``posix_fadvise(DONTNEED)`` is only advice: identical runs measured 0.85 to
    9.35 GB/s). A file system without ``O_DIRECT`` (tmpfs, some overlays) is read through the page cache after the
    advice, and the third value says the cache could not be bypassed.

    Returns ``(bytes, seconds, page_cache_bypassed)``: ``page_cache_bypassed`` True only when every file read
    bypassed the page cache.
    """
    if drop_cache:
        _drop_cache(paths)
    chunk = 16 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    mv = memoryview(buf)
    direct = drop_cache and hasattr(os, "O_DIRECT")
    total = 0
    t0 = time.perf_counter()
    try:
        for p in paths:
            fd = -1
            if direct:
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    direct = False
            if fd < 0:
                fd = os.open(p, os.O_RDONLY)
            try:
                while limit_bytes is None or total < limit_bytes:
                    try:
                        n = os.readv(fd, [mv])
                    except OSError:  # O_DIRECT refused at read time: the rest through the page cache
                        if not direct:
                            raise
                        direct = False
                        off = os.lseek(fd, 0, os.SEEK_CUR)
                        os.close(fd)
                        fd = os.open(p, os.O_RDONLY)
                        os.lseek(fd, off, os.SEEK_SET)
                        continue
                    if not n:
                        break
                    total += n
            finally:
                os.close(fd)
            if limit_bytes is not None and total >= limit_bytes:
                break
        return total, time.perf_counter() - t0, bool(direct)
    finally:
        mv.release()
        buf.close()


class _Shards:
    """Open file descriptors and read-only maps of the shard files (shared by the worker threads)."""

    def __init__(self, root: Path):
        self.root = root
        self._fd: dict[str, int] = {}
        self._map: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def fd(self, shard: str) -> int:
        with self._lock:
            if shard not in self._fd:
                self._fd[shard] = os.open(self.root / shard, os.O_RDONLY)
            return self._fd[shard]

    def map(self, shard: str) -> mmap.mmap:
        with self._lock:
            if shard not in self._map:
                fd = os.open(self.root / shard, os.O_RDONLY)
                try:
                    self._map[shard] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                finally:
                    os.close(fd)
            return self._map[shard]

    def close(self) -> None:
        for fd in self._fd.values():
            os.close(fd)
        for m in self._map.values():
            m.close()
        self._fd.clear()
        self._map.clear()


def _pread_into(fd: int, dst: memoryview, offset: int, where: str) -> int:
    got = 0
    while got < len(dst):
        n = os.preadv(fd, [dst[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"{where}: short read at byte {offset + got} (file truncated?); "
                                  f"re-download the shard")
        got += n
    return got


def _jobs_for(sl: ShardSlice, entry, dst: torch.Tensor) -> list[Callable[[_Shards], int]]:
    """Closures that each fill part of ``dst`` and return the bytes they wrote."""
    first, count, length, stride = sl.runs()
    where = f"{entry.shard}:{sl.name}"
    planned = sl.nbytes
    full = int(np.prod(sl.shape)) * sl.itemsize
    if entry.end - entry.start != full or tuple(entry.shape) != tuple(sl.shape) or entry.dtype != sl.dtype:
        raise CheckpointError(f"{where}: stored {entry.dtype} {tuple(entry.shape)} ({entry.end - entry.start} bytes), "
                              f"planned {sl.dtype} {sl.shape} ({full} bytes); the checkpoint does not match its config")
    flat = dst.view(-1).view(torch.uint8).numpy() if dst.numel() else np.zeros(0, np.uint8)
    if count == 1:
        base = entry.start + first
        jobs = []
        for a in range(0, length, PIECE):
            b = min(length, a + PIECE)

            def job(sh: _Shards, a=a, b=b) -> int:
                return _pread_into(sh.fd(entry.shard), memoryview(flat)[a:b], base + a, where)
            jobs.append(job)
        return jobs or [lambda sh: 0]

    def strided(sh: _Shards) -> int:
        m = sh.map(entry.shard)
        src = np.frombuffer(m, dtype=np.uint8, count=entry.end - entry.start, offset=entry.start)
        src = src.reshape(count, stride)[:, first:first + length]
        flat.reshape(count, length)[...] = src
        return count * length
    assert count * length == planned
    return [strided]


def load(index: CheckpointIndex | str | Path, placement: Placement, ranks: Iterable[int] | None = None,
         device: str | torch.device = "cpu", threads: int | None = None, progress: Progress | None = None,
         measure_raw: bool = True, raw_limit_bytes: int | None = 4 << 30, verify: bool = True,
         strict: bool = True) -> LoadResult:
    """Stream the planned slices of ``ranks`` from the checkpoint onto ``device``.

    Args:
        index: a validated :class:`CheckpointIndex` (or a checkpoint directory, opened and validated here).
        placement: the plan (:func:`k3rocm.runtime.plan.plan`) of this checkpoint's config.
        ranks: which ranks this process loads (default: all — on one device, e.g. CI; under
            :mod:`k3rocm.runtime.dist` each process passes its own rank).
        device: where the tensors go (``cpu``, ``cuda:N``).
        threads: reader threads (default ``min(16, 2 * cpu_count)``).
        progress: ``progress(done_bytes, total_bytes, text)`` called as bytes land (thread-safe), then with
            ``text`` :data:`VERIFY_TEXT` as the verification pass checks them (its bytes counted from 0 again).
        measure_raw: also time a sequential read of the same shard files (up to ``raw_limit_bytes``).
        verify: prove every planned tensor landed (:func:`verify_loaded`).
        strict: raise :class:`ValidationFailed` when verification finds a problem.
    Returns:
        :class:`LoadResult` (``weights, report = load(...)`` also works).
    Raises:
        CheckpointError: a shard is shorter than its header says, or a planned tensor is absent from the index.
        ValidationFailed: (strict) a loaded tensor differs from the source or is missing.
    """
    if not isinstance(index, CheckpointIndex):
        index = open_checkpoint(index)
    cfg = index.config
    ranks = list(range(placement.world)) if ranks is None else [int(r) for r in ranks]
    for r in ranks:
        if not 0 <= r < placement.world:
            raise CheckpointError(f"rank {r} is outside the plan's {placement.world} ranks")
    dev = torch.device(device)
    threads = threads or max(1, min(16, 2 * (os.cpu_count() or 1)))
    rep = LoadReport(checkpoint=str(index.path), device=str(dev), world=placement.world, ranks=ranks, threads=threads)

    # shards this load touches (for the raw-read comparison)
    shard_names: list[str] = []
    plans = {}
    for r in ranks:
        items = list(placement.ranks[r].tensors.items())
        plans[r] = items
        for name, _ in items:
            e = index.entries.get(name)
            if e is None:
                raise CheckpointError(f"{index.path}: planned tensor {name} is not in the checkpoint index; "
                                      f"the plan and checkpoint configs differ")
            if e.shard not in shard_names:
                shard_names.append(e.shard)
        rep.bytes_planned[r] = placement.ranks[r].weights_bytes
        rep.tensors_planned += len(items)

    paths = [index.path / s for s in shard_names]
    if measure_raw:
        rep.raw_read_bytes, rep.raw_read_seconds, rep.page_cache_dropped = raw_read_throughput(paths, raw_limit_bytes)
        rep.raw_read_gbps = rep.raw_read_bytes / rep.raw_read_seconds / GB if rep.raw_read_seconds > 0 else 0.0
        _drop_cache(paths)

    total = sum(rep.bytes_planned.values())
    done = [0]
    lock = threading.Lock()
    shards = _Shards(index.path)
    rank_weights: dict[int, Weights] = {}
    t_all = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="k3rocm-load") as pool:
            for r in ranks:
                rp = placement.ranks[r]
                t0 = time.perf_counter()
                mem0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
                host: dict[str, torch.Tensor] = {}
                futs = []
                group: list = []
                group_bytes = 0
                # (tensor, index of the future that holds its last read): a tensor goes to the device as soon as
                # every read before and including that future is done, while the pool reads on, so the
                # host -> device copies overlap the disk instead of following it (and host buffers are freed early)
                last_read: list[tuple[str, int]] = []
                for name, sl in plans[r]:
                    tdt, _ = DTYPES[sl.dtype]
                    buf = torch.empty(sl.local_shape, dtype=tdt)
                    if buf.numel():
                        buf.view(-1).view(torch.uint8).fill_(0xFF)  # poison: unwritten bytes read as NaN / 255
                    host[name] = buf
                    for job in _jobs_for(sl, index.entries[name], buf):
                        group.append(job)
                        group_bytes += min(sl.nbytes, PIECE)
                        if group_bytes >= GROUP_BYTES:  # small tensors travel in groups: less pool overhead
                            futs.append(pool.submit(_run_jobs, group, shards, done, lock, progress, total, name))
                            group, group_bytes = [], 0
                    last_read.append((name, len(futs) if group else len(futs) - 1))
                if group:
                    futs.append(pool.submit(_run_jobs, group, shards, done, lock, progress, total, name))
                loaded, k = 0, 0
                tensors: dict[str, torch.Tensor] = {}
                for i, f in enumerate(futs + [None]):
                    if f is not None:
                        loaded += f.result()
                    while k < len(last_read) and (f is None or last_read[k][1] <= i):
                        n = last_read[k][0]
                        t = host.pop(n)
                        tensors[n] = t if dev.type == "cpu" else t.to(dev, non_blocking=False)
                        k += 1
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                dt = time.perf_counter() - t0
                rep.seconds[r] = dt
                rep.bytes_loaded[r] = loaded
                rep.gbps[r] = loaded / dt / GB if dt > 0 else 0.0
                rep.tensors_loaded += len(tensors)
                used = sum(t.numel() * t.element_size() for t in tensors.values())
                if dev.type == "cuda":
                    used = max(used, torch.cuda.memory_allocated(dev) - mem0)
                rep.device_bytes_used[r] = used
                rank_weights[r] = Weights.from_tensors(cfg, tensors, expert_range=(rp.expert_first, rp.expert_stop)
                                                       if rp.expert_stop > rp.expert_first else None)
    finally:
        shards.close()
    rep.total_seconds = time.perf_counter() - t_all
    rep.aggregate_gbps = sum(rep.bytes_loaded.values()) / rep.total_seconds / GB if rep.total_seconds > 0 else 0.0
    if rep.raw_read_gbps > 0:
        rep.load_vs_raw = rep.aggregate_gbps / rep.raw_read_gbps
    for r in ranks:
        if rep.bytes_loaded[r] != rep.bytes_planned[r]:
            rep.problems.append(f"rank {r}: {rep.bytes_loaded[r]} bytes read, {rep.bytes_planned[r]} planned")
    if verify:
        t0 = time.perf_counter()
        n_ok, probs = verify_loaded(index, placement, {r: rank_weights[r] for r in ranks}, progress=progress)
        rep.verify_seconds = time.perf_counter() - t0
        rep.tensors_verified = n_ok
        rep.problems.extend(probs)
    if strict and rep.problems:
        raise ValidationFailed(f"load of {index.path}: {len(rep.problems)} problem(s), first: {rep.problems[0]}")
    return LoadResult(cfg, placement, rank_weights, rep)


def _run_jobs(jobs, shards, done, lock, progress, total, name) -> int:
    n = sum(job(shards) for job in jobs)
    if progress is not None:
        with lock:
            done[0] += n
            d = done[0]
        progress(d, total, name)
    return n


def verify_loaded(index: CheckpointIndex, placement: Placement, rank_weights: dict[int, Any],
                  progress: Progress | None = None) -> tuple[int, list[str]]:
    """Prove each planned tensor of each given rank landed: present, planned shape/dtype, checksum == source.
    ``progress(done_bytes, total_bytes, VERIFY_TEXT)`` after each tensor checked (planned bytes of the given ranks).

    The source side is computed independently of the loader's byte arithmetic: ``index.read(name)`` (the
    reader's own mapping) cut with ``ShardSlice.index()`` by torch.

    Returns:
        ``(verified_count, problems)`` — one line per problem (missing tensor, wrong shape/dtype, checksum
        mismatch naming the tensor and rank, NaN/Inf values in a floating-point weight), and extra tensors
        that the plan does not name.
    """
    ok = 0
    probs: list[str] = []
    total = sum(placement.ranks[r].weights_bytes for r in rank_weights)
    done = 0
    if progress is not None:
        progress(0, total, VERIFY_TEXT)
    for r, w in rank_weights.items():
        planned = placement.ranks[r].tensors
        names = set(w.keys()) if hasattr(w, "keys") else set(w)
        for name, sl in planned.items():
            if progress is not None and done:
                progress(done, total, VERIFY_TEXT)
            done += sl.nbytes
            t = w.get(name) if hasattr(w, "get") else None
            if t is None:
                probs.append(f"rank {r}: planned tensor {name} was not loaded")
                continue
            tdt, _ = DTYPES[sl.dtype]
            if tuple(t.shape) != sl.local_shape or t.dtype != tdt:
                probs.append(f"rank {r}: {name} is {tuple(t.shape)} {t.dtype}, planned {sl.local_shape} {tdt}")
                continue
            whole = index.read(name)
            src = whole[sl.index()]
            if t.device.type != "cpu":  # checksum both on the device: a plain torch copy of the reader's bytes
                src = src.to(t.device)
            if checksum(t) != checksum(src):
                probs.append(f"rank {r}: {name} checksum differs from the source bytes "
                             f"({index.entries[name].shard} bytes {index.entries[name].start}..{index.entries[name].end})")
                continue
            if t.is_floating_point() and t.numel():
                if not bool(torch.isfinite(t).all()):  # landed exactly as stored, but the checkpoint holds NaN/Inf
                    # counted over the checkpoint's whole tensor, not this rank's slice: every rank holding a bad
                    # slice (a replicated tensor: every rank) states the same fact, which merge_rank_problems joins
                    bad = int((~torch.isfinite(whole)).sum())
                    probs.append(f"rank {r}: {name} holds {bad:,} NaN/Inf values in the checkpoint "
                                 f"({index.entries[name].shard}); the file is corrupt: re-download or re-make it")
                    continue
            ok += 1
        extra = names - set(planned)
        for name in sorted(extra)[:5]:
            probs.append(f"rank {r}: {name} was loaded but is not in the plan")
    if progress is not None:
        progress(total, total, VERIFY_TEXT)
    return ok, merge_rank_problems(probs)


_RANK_PREFIX = re.compile(r"ranks? ([\d, -]+): (.*)", re.S)


def _rank_list(text: str) -> list[int]:
    """``"0, 2-4"`` -> ``[0, 2, 3, 4]`` (the form :func:`_ranks_text` writes)."""
    out = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1]`` -> ``"ranks 0-1"``, ``[0, 2, 3, 4]`` -> ``"ranks 0, 2-4"``, ``[3]`` -> ``"rank 3"``."""
    rs = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    body = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'rank' if len(rs) == 1 else 'ranks'} {body}"


def rank_line(rank: int, line: str) -> str:
    """``line`` as a problem of ``rank``: ``"rank R: line"``, unless it names its rank(s) already. Raises nothing."""
    return line if _RANK_PREFIX.fullmatch(line) else f"rank {rank}: {line}"


def merge_rank_problems(problems: Iterable[str]) -> list[str]:
    """One line per distinct problem. Lines ``"rank N: <text>"`` that differ only in their rank (the copies of a
    replicated tensor, each rank reporting the same bad checkpoint tensor) become one ``"ranks 0-1: <text>"``, at
    the place of the first; a line already merged (``"ranks 0-1: ..."``) joins too, so merging twice changes
    nothing. A line with no rank prefix is kept as it is (once). Raises nothing."""
    order: list[str] = []
    ranks: dict[str, list[int]] = {}
    for line in problems:
        m = _RANK_PREFIX.fullmatch(line)
        rs, text = [], line
        if m:
            try:
                rs, text = _rank_list(m.group(1)), m.group(2)
            except ValueError:  # "rank 1-: ..." is no prefix of ours: the line stays whole
                pass
        if text not in ranks:
            order.append(text)
            ranks[text] = []
        ranks[text].extend(rs)
    return [f"{_ranks_text(ranks[t])}: {t}" if ranks[t] else t for t in order]


def assemble(cfg: K3Config, placement: Placement, rank_weights: dict[int, Weights]) -> Weights:
    """Full single-device tensors from every rank's slices (concatenate split dims, take replicated from rank 0).

    Raises:
        CheckpointError: a rank is missing, or the slices do not tile a tensor.
    """
    missing = [r for r in range(placement.world) if r not in rank_weights]
    if missing:
        raise CheckpointError(f"cannot assemble full weights: ranks {missing} were not loaded")
    out: dict[str, torch.Tensor] = {}
    for r in range(placement.world):
        rp = placement.ranks[r]
        for name, sl in rp.tensors.items():
            if sl.dim is None:
                out.setdefault(name, rank_weights[r].get(name))
    pieces: dict[str, list[tuple[int, torch.Tensor, ShardSlice]]] = {}
    for r in range(placement.world):
        for name, sl in placement.ranks[r].tensors.items():
            if sl.dim is not None:
                pieces.setdefault(name, []).append((sl.start, rank_weights[r].get(name), sl))
    for name, ps in pieces.items():
        ps.sort(key=lambda p: p[0])
        uniq = []
        for st, t, sl in ps:
            if not uniq or uniq[-1][0] != st:
                uniq.append((st, t, sl))
        sl0 = uniq[0][2]
        cat = torch.cat([t for _, t, _ in uniq], dim=sl0.dim)
        if cat.shape[sl0.dim] != sl0.shape[sl0.dim]:
            if name.endswith("self_attn.A_log"):  # stored [head_dim], only num_heads entries placed
                full = torch.zeros(sl0.shape, dtype=cat.dtype, device=cat.device)
                full[:cat.shape[0]] = cat
                cat = full
            else:
                raise CheckpointError(f"{name}: rank slices cover {cat.shape[sl0.dim]} of {sl0.shape[sl0.dim]} "
                                      f"along dim {sl0.dim}")
        out[name] = cat
    return Weights.from_tensors(cfg, out)


def load_checkpoint(path: str | Path | None = None, placement: Placement | None = None,
                    index: CheckpointIndex | None = None, device: str | torch.device = "cpu",
                    progress: Progress | None = None, ranks: Iterable[int] | None = None, **kw) -> LoadResult:
    """Convenience entry: open (if needed), plan for the CPU profile at tp=1 (if no placement), and :func:`load`."""
    if index is None:
        if path is None:
            raise CheckpointError("load_checkpoint needs a checkpoint directory or an opened index")
        index = open_checkpoint(path)
    if placement is None:
        placement = plan(index.config, load_profile("cpu"), tp=1, ep=1)
    return load(index, placement, ranks=ranks, device=device, progress=progress, **kw)
