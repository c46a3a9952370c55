"""Process groups and a local launcher with a watchdog (one process per GPU, DESIGN.md §6).

Backends: ``nccl`` when a GPU is visible (on a ROCm build of torch this *is* RCCL — same name), else
``gloo`` (CPU, tests). Rendezvous is ``env://``: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``
(and ``LOCAL_RANK`` for the device index).

Two ways to run N workers:

* **Local launcher** — :func:`launch(fn, world_size, args)` starts the N workers itself (``spawn`` start
  method, a free localhost port), each calls ``fn(ctx, *args)`` with a :class:`DistContext`, and returns the
  per-rank results in rank order. ``fn`` must be importable (a module-level function).
* **torchrun** — across nodes, or when you want torchrun's elastic agent, start one Python process per GPU
  with torchrun and call :func:`run_under_torchrun(fn, *args)` (or :func:`init` then your own code) in the
  script; ``torchrun`` exports the env:// variables. Example (2 nodes x 8 GPUs)::

      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
          -m k3rocm.runtime.dist   # or your script calling run_under_torchrun(...)

  :func:`under_torchrun` tells whether the env was set up by torchrun (``TORCHELASTIC_RUN_ID`` or
  ``LOCAL_WORLD_SIZE`` present together with ``RANK``/``WORLD_SIZE``).

Watchdog (local launcher): every collective has a timeout (``timeout_s``, passed to
``init_process_group``), and the parent polls the workers: when one exits with an error, is killed, or the
whole run passes ``deadline_s``, the parent terminates (then kills) every remaining worker and raises
:class:`WorkerFailed` with one line naming the rank and what happened. Children are also terminated when the
parent exits (``atexit``), and each child exits when its parent disappears (a parent-death check thread),
so no orphan processes remain.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import queue as _queue
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as tdist

from k3rocm.checkpoint.layout import PREFIX
from k3rocm.errors import HardwareError, K3Error
from k3rocm.model.common import f32
from k3rocm.model.decoder import Parallel

__all__ = ["DistContext", "WorkerFailed", "default_backend", "init", "launch", "run_under_torchrun",
           "under_torchrun", "all_reduce", "all_gather_cat", "free_port", "TPGroup", "ProjectedGroup", "CommStats",
           "GATHERS"]

GATHERS = ("greedy", "logits")  # collectives that are all_gathers; every other name is an all_reduce


class WorkerFailed(HardwareError):
    """A distributed worker died, raised, or hung (one line: which rank, what happened, what to do)."""


@dataclass
class DistContext:
    """What a worker knows about its place in the run.

    Attributes:
        rank, world_size, local_rank: from env:// (``LOCAL_RANK`` = device index on this node).
        backend: ``nccl`` (RCCL on ROCm) or ``gloo``.
        device: ``torch.device`` of this rank (``cuda:LOCAL_RANK`` or ``cpu``).
        group: the process group (``None`` = default world group).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    group: Any = None


def default_backend() -> str:
    """``nccl`` when a CUDA/ROCm device is visible (RCCL on ROCm), else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when torchrun (torch.distributed.elastic) set up this process's env:// variables."""
    env = os.environ
    return "RANK" in env and "WORLD_SIZE" in env and ("TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env)


def init(backend: str | None = None, timeout_s: float = 300.0) -> DistContext:
    """Join the env:// process group (idempotent) and pick this rank's device.

    Args:
        backend: ``nccl`` / ``gloo`` (default :func:`default_backend`).
        timeout_s: timeout of every collective (the watchdog's first line of defence against a hang).
    Raises:
        HardwareError: env:// variables missing, or ``nccl`` asked for without a GPU.
    """
    env = os.environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise HardwareError(f"distributed env:// rendezvous needs {', '.join(missing)}; start with "
                            f"torchrun or k3rocm.runtime.dist.launch")
    backend = backend or default_backend()
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local = int(env.get("LOCAL_RANK", rank))
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise HardwareError("backend nccl (RCCL on ROCm) needs a GPU and none is visible; use gloo")
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", local % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    if not tdist.is_initialized():
        kw = {}
        if backend == "nccl":
            kw["device_id"] = device
        tdist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistContext(rank, world, local, backend, device)


def all_reduce(t: torch.Tensor, ctx: DistContext | None) -> torch.Tensor:
    """Sum ``t`` over all ranks in place (no-op for a single rank / no group). Returns ``t``."""
    if ctx is not None and ctx.world_size > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM, group=ctx.group)
    return t


def all_gather_cat(t: torch.Tensor, ctx: DistContext | None, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``t`` (same shape on all ranks) along ``dim``, in rank order."""
    if ctx is None or ctx.world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    tdist.all_gather(parts, t.contiguous(), group=ctx.group)
    return torch.cat(parts, dim=dim)


@dataclass
class CommStats:
    """Collectives one rank issued, by name (``attn``, ``mlp``, ``moe``, ``embed``, ``greedy``, ``logits``): calls,
    bytes each rank put into them (a ring all-reduce of B bytes moves about ``2 (w-1)/w · B`` per rank over the
    links) and, where the collective runs synchronously on the host (gloo on the CPU), its seconds; on a GPU the
    collectives run on the device stream (and inside captured graphs), so their time is not observed here."""

    calls: dict[str, int]
    bytes: dict[str, int]
    seconds: dict[str, float]

    @classmethod
    def empty(cls) -> "CommStats":
        return cls({}, {}, {})

    def add(self, name: str, nbytes: int, seconds: float = 0.0, calls: int = 1) -> None:
        self.calls[name] = self.calls.get(name, 0) + calls
        self.bytes[name] = self.bytes.get(name, 0) + int(nbytes)
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{name: {"calls": n, "bytes": b, "seconds": s}}`` (a copy)."""
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "seconds": self.seconds.get(k, 0.0)}
                for k in sorted(self.calls)}

    @staticmethod
    def delta(after: dict, before: dict) -> dict[str, dict[str, float]]:
        """What was issued between two :meth:`snapshot` s."""
        out = {}
        for k, v in after.items():
            b = before.get(k, {"calls": 0, "bytes": 0, "seconds": 0.0})
            d = {f: v[f] - b[f] for f in ("calls", "bytes", "seconds")}
            if d["calls"]:
                out[k] = d
        return out


class TPGroup(Parallel):
    """The parallel context of one rank of a TP/EP layout: owns every collective the decoder issues.

    Activations are replicated; each token mixer's ``o_proj``, the dense MLP and the latent MoE (routed
    partials of this rank's experts + shared-expert partials) are summed with one ``all_reduce`` each over all
    ranks; the embedding and lm_head are vocabulary-parallel (rows ``vocab_start .. vocab_stop - 1`` here).
    The greedy pick exchanges one ``[N, 2]`` (max, id) pair per row (``all_gather``): logits are never
    gathered whole. Every collective is counted in :attr:`stats`.

    Args:
        ctx: this rank's :class:`DistContext`.
        placement: the :class:`~k3rocm.runtime.plan.Placement` (its ``world`` must equal the group's size).
        rank: this rank's index in ``placement.ranks``.
    Raises:
        HardwareError: the process group's size differs from the placement's.
    """

    def __init__(self, ctx: DistContext, placement: Any, rank: int):
        if ctx.world_size != placement.world:
            raise HardwareError(f"the placement has {placement.world} ranks but the process group has "
                                f"{ctx.world_size}; start as many processes as the plan has ranks")
        self.ctx = ctx
        self.tp = placement.tp
        self.world = placement.world
        self.rank = rank
        emb = placement.ranks[rank].tensors[PREFIX + "embed_tokens.weight"]
        if emb.dim is not None:
            self.vocab_start, self.vocab_stop = emb.start, emb.stop
        self.stats = CommStats.empty()

    def _timed(self, name: str, nbytes: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.ctx.device.type != "cpu":  # device-stream collective (maybe inside a graph): bytes only
            self.stats.add(name, nbytes)
            return fn()
        t0 = time.perf_counter()
        out = fn()
        self.stats.add(name, nbytes, time.perf_counter() - t0)
        return out

    def reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        t = t.contiguous()
        return self._timed(name, t.numel() * t.element_size(), lambda: all_reduce(t, self.ctx))

    def embed_rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: ids in ``vocab_start .. vocab_stop - 1`` look up this rank's rows, every
        other id a zero row, and one ``all_reduce`` ("embed") sums the ranks' rows: ``[T, hidden]`` fp32. A
        replicated embedding (no vocabulary slice) is looked up whole, with no collective."""
        if self.vocab_start is None:
            return super().embed_rows(table, ids)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_stop)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        return self.reduce(f32(table[local]) * mine.unsqueeze(1), "embed")

    def agree_min(self, values: list[int]) -> list[int]:
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.ctx.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN, group=self.ctx.group)
        return [int(v) for v in t.tolist()]

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        return self._timed("logits", local.numel() * local.element_size(),
                           lambda: all_gather_cat(local.contiguous(), self.ctx, dim=-1))

    def greedy(self, local: torch.Tensor) -> torch.Tensor:
        val, idx = local.float().max(-1)
        start = self.vocab_start or 0
        pair = torch.stack([val.double(), (idx + start).double()], -1)  # ids < 2^53: exact in float64
        every = self._timed("greedy", pair.numel() * pair.element_size(),  # [world, N, 2], rank order = vocab order
                            lambda: all_gather_cat(pair.unsqueeze(0), self.ctx, dim=0))
        best = every[..., 0].argmax(0)  # first (lowest-id) rank among equal maxima
        return every[..., 1].gather(0, best.unsqueeze(0)).squeeze(0).to(torch.int64)


class ProjectedGroup(TPGroup):
    """One rank of a TP/EP layout run alone in this process (``--synthetic``): every collective the rank would
    issue is counted exactly as :class:`TPGroup` counts it (calls, bytes this rank puts in) but nothing is
    exchanged, so its time can only be projected (:meth:`projected_seconds`).

    Results are this rank's partial values: a reduce returns the local partial sum, the greedy pick is the
    argmax over this rank's vocabulary rows, ``gather_vocab`` puts the local slice at its own columns of a
    full-width row filled with the slice's row minimum (shapes as in the real group; values are not those of the
    whole model).

    Args:
        placement: the layout (any ``world``). rank: the rank this process stands for. device: its device.
    Attributes:
        row_bytes: collective name -> bytes one row (token) puts into one call (``[rows, width]`` inputs: the width
            in bytes is fixed per name, so a step of N rows puts ``N x row_bytes`` into each call; kept per name
            rather than summed, as a replayed graph repeats the calls without re-entering Python).
    """

    def __init__(self, placement: Any, rank: int, device: str | torch.device = "cpu"):
        dev = torch.device(device)
        super().__init__(DistContext(rank, placement.world, rank, "none", dev), placement, rank)
        self.ctx = DistContext(rank, 1, rank, "none", dev)  # a one-process group: the collectives are no-ops
        self.row_bytes: dict[str, float] = {}

    def _timed(self, name: str, nbytes: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        out = fn()
        self.stats.add(name, nbytes)
        return out

    def _row(self, name: str, t: torch.Tensor) -> None:
        if t.numel():
            self.row_bytes[name] = t.numel() * t.element_size() / (int(t.shape[0]) if t.dim() > 1 else 1)

    def reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        self._row(name, t)
        return super().reduce(t, name)

    def agree_min(self, values: list[int]) -> list[int]:
        return [int(v) for v in values]

    def embed_rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The embedding as one rank alone can stand it in: ids held here look up their own rows, every other id
        the **stand-in** row ``id mod V_local`` of this rank's slice; the ``all_reduce`` is counted as in
        :class:`TPGroup`. Without the stand-in, ``(tp - 1) / tp`` of a random prompt's tokens would enter the
        layers as zero rows (no other rank adds theirs), and a zero row scores every expert ``sigmoid(0)``: the
        tie sends it to experts ``0 .. k-1``, piling the prefill's pairs onto rank 0's experts (measured on
        k3-prefix-3 at TP16 with the zero rows: 9.8 x the uniform share of pairs; ``gpu-runs/route_skew.py``).
        ``[T, hidden]`` fp32, every row of the embedding's magnitude."""
        if self.vocab_start is None:  # replicated: every row is here, nothing to stand in or count
            return super().embed_rows(table, ids)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_stop)
        local = torch.where(mine, ids - self.vocab_start, ids % table.shape[0])
        return self.reduce(f32(table[local]), "embed")

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        self._row("logits", local)
        local = super().gather_vocab(local)
        start = self.vocab_start or 0
        # the rank's slice at its own columns, every other column its row minimum: finite, and the argmax lies
        # in the slice as :meth:`greedy` picks it
        out = local.amin(-1, keepdim=True).expand(*local.shape[:-1], local.shape[-1] * self.world).clone()
        out[..., start:start + local.shape[-1]] = local
        return out

    def greedy(self, local: torch.Tensor) -> torch.Tensor:
        self._row("greedy", local[:, :2].double())  # the [N, 2] float64 (max, id) pair each rank puts in
        return super().greedy(local)

    def projected_seconds(self, name: str, nbytes: float, link_bandwidth: float) -> float:
        """Seconds the collective ``name`` of ``nbytes`` (this rank's input) takes over links of
        ``link_bandwidth`` bytes/s per device: a ring all_reduce moves ``2 (w-1)/w · B`` per rank, an all_gather
        ``(w-1) · B`` (bandwidth term only; per-call latency is not modelled). 0 for one rank.

        Raises:
            HardwareError: ``link_bandwidth`` is not > 0 while the layout has several ranks.
        """
        w = self.world
        if w <= 1:
            return 0.0
        if not link_bandwidth > 0:
            raise HardwareError("the profile has no link bandwidth (link.kind = none), so the collectives of a "
                                f"{w}-rank layout cannot be projected; pass a --profile of the multi-GPU target")
        moved = (w - 1) * nbytes if name in GATHERS else 2 * (w - 1) / w * nbytes
        return moved / link_bandwidth


def run_under_torchrun(fn: Callable[..., Any], *args, backend: str | None = None, timeout_s: float = 300.0) -> Any:
    """Entry point for a script started by ``torchrun``: ``init`` from env://, run ``fn(ctx, *args)``, clean up."""
    ctx = init(backend, timeout_s)
    try:
        return fn(ctx, *args)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


# ------------------------------------------------------------------------------------------ local launcher
_children: list = []


def _reap_children() -> None:
    for p in list(_children):
        _stop(p)


atexit.register(_reap_children)


def _stop(p, grace: float = 3.0) -> None:
    try:
        if p.is_alive():
            p.terminate()
            p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(grace)
    except Exception:  # pragma: no cover - already gone
        pass
    if p in _children:
        _children.remove(p)


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:  # parent died: re-parented to init / a subreaper
            os._exit(3)


def _worker(rank: int, world: int, port: int, backend: str, timeout_s: float, fn, args, results, ppid: int,
            env: dict[str, str]) -> None:
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1"))))
    try:
        ctx = init(backend, timeout_s)
        out = fn(ctx, *args)
        # plain pickle (tensors copied into the bytes): torch's queue reducers would pass shared-memory
        # file descriptors that vanish when this worker exits
        results.put((rank, "ok", pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException as e:  # report, then exit non-zero
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = type(e).__name__
        results.put((rank, "error", f"{kind}: {line}", traceback.format_exc(), isinstance(e, K3Error)))
        try:
            if tdist.is_initialized():
                tdist.destroy_process_group()
        finally:
            os._exit(1)
    try:
        if tdist.is_initialized():
            tdist.barrier()
            tdist.destroy_process_group()
    except Exception:
        pass


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), backend: str | None = None,
           timeout_s: float = 120.0, deadline_s: float | None = None, env: dict[str, str] | None = None,
           poll_s: float = 0.05) -> list[Any]:
    """Start ``world_size`` local workers running ``fn(ctx, *args)``; return their results in rank order.

    Args:
        fn: module-level function (it is pickled by reference for the ``spawn`` start method).
        world_size: processes to start (one per GPU; on CPU they share the cores).
        backend: ``nccl`` / ``gloo`` (default :func:`default_backend`).
        timeout_s: per-collective timeout in the workers.
        deadline_s: whole-run limit (default ``2 * timeout_s + 60``); past it the run is a hang.
        env: extra environment for the workers (``OMP_NUM_THREADS`` defaults to 1).
    Raises:
        WorkerFailed: a worker raised (its first line is quoted), died (exit code / signal), or the run hung;
            all other workers are terminated first.
    """
    import multiprocessing as mp

    if world_size < 1:
        raise HardwareError(f"world_size {world_size} must be >= 1")
    backend = backend or default_backend()
    deadline_s = deadline_s if deadline_s is not None else 2 * timeout_s + 60
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    wenv = {"OMP_NUM_THREADS": "1"}
    wenv.update(env or {})
    procs = []
    for r in range(world_size):
        p = ctx.Process(target=_worker, name=f"k3rocm-rank{r}",
                        args=(r, world_size, port, backend, timeout_s, fn, args, results, os.getpid(), wenv),
                        daemon=True)
        p.start()
        procs.append(p)
        _children.append(p)
    got: dict[int, Any] = {}
    t0 = time.monotonic()
    failure: str | None = None
    worker_tb = ""
    try:
        while len(got) < world_size and failure is None:
            try:
                item = results.get(timeout=poll_s)
            except _queue.Empty:
                item = None
            if item is not None:
                if item[1] == "ok":
                    got[item[0]] = pickle.loads(item[2])
                else:
                    failure = f"rank {item[0]} failed: {item[2]}"
                    worker_tb = item[3]
                    break
            for r, p in enumerate(procs):
                if r not in got and not p.is_alive() and p.exitcode not in (None, 0):
                    # give its queued error message a moment to arrive
                    try:
                        item = results.get(timeout=0.5)
                        if item[1] == "error":
                            failure = f"rank {item[0]} failed: {item[2]}"
                            worker_tb = item[3]
                        else:
                            got[item[0]] = pickle.loads(item[2])
                            continue
                    except _queue.Empty:
                        code = p.exitcode
                        how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                               else f"exited with code {code}")
                        failure = f"rank {r} {how} without a result"
                    break
            if failure is None and time.monotonic() - t0 > deadline_s:
                missing = [r for r in range(world_size) if r not in got]
                failure = (f"ranks {missing} hung: no result after {deadline_s:.0f} s "
                           f"(collective timeout {timeout_s:.0f} s)")
    finally:
        if failure is not None:
            for p in procs:
                _stop(p, grace=2.0)
        else:
            for p in procs:
                p.join(timeout=10)
                _stop(p)
    if failure is not None:
        err = WorkerFailed(f"distributed run of {getattr(fn, '__name__', fn)} on {world_size} {backend} workers: "
                           f"{failure}; all workers stopped (the worker traceback is in .worker_traceback)")
        err.worker_traceback = worker_tb
        raise err
    return [got[r] for r in range(world_size)]


def _demo(ctx: DistContext) -> dict:
    t = torch.full((2,), float(ctx.rank + 1), device=ctx.device)
    all_reduce(t, ctx)
    return {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend, "sum": t.tolist()}


if __name__ == "__main__":  # ``torchrun --nproc-per-node N -m k3rocm.runtime.dist``: a collective smoke test
    print(run_under_torchrun(_demo))
