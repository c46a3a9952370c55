"""One model across ranks: the process model of the distributed engine (DESIGN.md §6).

One process per GPU (on the cpu backend, that many gloo processes on the host). The process that runs the
command — the CLI's ``load`` / ``validate`` / ``bench`` — is **rank 0**: it owns the scheduler, the load
generator, the metrics and the report. Every other rank is a **follower**: it loads only its own slice of
the checkpoint, then obeys rank 0, running the same work on its shard.

Starting the ranks:

* on one node, :meth:`Cluster.start` spawns the followers itself (a free localhost port, ``spawn`` start
  method) and rank 0 joins the group in-process;
* across nodes, ``torchrun`` starts every rank (``torchrun --nnodes 2 --nproc-per-node 8 ... -m k3rocm.cli
  bench ...``); the CLI sees it (:func:`k3rocm.runtime.dist.under_torchrun`): rank 0 runs the command and
  :meth:`Cluster.attach` joins the group, every other rank runs :func:`follow` instead of the command.

Either way rank 0 first broadcasts a :class:`RankSpec` (checkpoint, profile, layout, kernels, device) as
JSON, so a follower needs nothing on its command line.

The control protocol (rank 0 -> all, over a CPU ``gloo`` group, so it never touches the GPU streams): every
message starts with a 5-int64 header ``[op, a, b, c, d]``.

* ``OP_STEP`` (``a`` = engine id, ``b`` = tokens T, ``c`` = sequences N, ``d`` = decode rows) then **one** int64 tensor holding the
  step's :class:`~k3rocm.runtime.engine.StepBatch` (ids ``[T]``, rows ``[N, 4]``: slot, position, tokens,
  sampled; block-table rows ``[N, max_blocks]``). Every rank then runs
  :meth:`~k3rocm.runtime.engine.Engine.execute` on its shard (its collectives are the TP/EP ones of
  :class:`~k3rocm.runtime.dist.TPGroup`, on the device group).
* ``OP_CALL`` (``a`` = JSON byte count) then the JSON of ``[method, args]``: every rank runs
  ``RankWorker.<method>(*args)`` (load, build an engine, an SPMD validation function); rank 0 keeps its own
  result, a method that needs the others' answers gathers them itself.
* ``OP_STOP``: followers leave the group and exit.

Faults: every collective has a timeout (``timeout_s``); a follower that raises reports one line (its rank,
what it was doing, the error) on its error queue and exits; one that dies or hangs is found by rank 0's
failing or timing-out collective. Rank 0 then raises :class:`~k3rocm.runtime.dist.WorkerFailed` naming the
rank and what it was doing, and stops every follower (no orphans: followers also exit when rank 0's process
is gone). Nothing is pickled: commands are JSON, steps are integer tensors.
"""

from __future__ import annotations

import atexit
import json
import os
import queue as _queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as tdist

from k3rocm.checkpoint.reader import open_checkpoint
from k3rocm.errors import HardwareError, K3Error, PlanError
from k3rocm.profiles import load_profile
from k3rocm.model.model import K3Model
from k3rocm.model.probe import forward_layers, perturbed_logits
from k3rocm.runtime.dist import (DistContext, TPGroup, WorkerFailed, _stop, _watch_parent, free_port, init,
                                 under_torchrun)
from k3rocm.runtime.engine import Engine, StepBatch
from k3rocm.runtime.load import load, merge_rank_problems, rank_line
from k3rocm.runtime.plan import plan

__all__ = ["RankSpec", "Cluster", "RankWorker", "RemoteModel", "follow", "SPMD"]

OP_STEP, OP_CALL, OP_STOP = 1, 2, 3

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass
class RankSpec:
    """What every rank needs to build its part of the run (JSON-serialisable).

    Attributes:
        checkpoint: checkpoint directory (the same path on every node).
        profile: hardware profile name or ``*.toml`` path (the plan's layout comes from it with ``tp``/``ep``).
        tp, ep: the layout; ``tp`` = world size.
        kernels: the ``--kernels`` override as ``{op: impl}`` (``"*"`` for all).
        device: ``cpu`` or ``cuda`` (each rank takes ``cuda:LOCAL_RANK``).
        timeout_s: per-collective timeout, the watchdog's limit for a hung rank.
    """

    checkpoint: str
    profile: str
    tp: int
    ep: int
    kernels: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    timeout_s: float = 120.0

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def _header(op: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> torch.Tensor:
    return torch.tensor([op, a, b, c, d], dtype=torch.int64)


def _bcast(t: torch.Tensor, group: Any) -> torch.Tensor:
    tdist.broadcast(t, src=0, group=group)
    return t


def _encode(obj: Any) -> torch.Tensor:
    """``obj`` as JSON bytes in a uint8 tensor (the form every control payload travels in)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Any:
    """The JSON object a uint8 tensor from :func:`_encode` holds."""
    return json.loads(t.numpy().tobytes().decode())


def _control_group(backend: str) -> Any:
    """The CPU group of the control messages: the default group under gloo, a gloo group beside NCCL (collective:
    every rank calls it once, in the same order)."""
    return tdist.new_group(backend="gloo") if backend != "gloo" else None


def _pack_step(sb: StepBatch) -> torch.Tensor:
    return torch.cat([sb.ids.reshape(-1), sb.rows.reshape(-1), sb.block_rows.to(torch.int64).reshape(-1)])


def _unpack_step(flat: torch.Tensor, T: int, N: int, num_decode: int) -> StepBatch:
    return StepBatch(num_decode, flat[:T], flat[T:T + 4 * N].view(N, 4), flat[T + 4 * N:].view(N, -1).to(torch.int32))


class RankWorker:
    """One rank's part of the run: its weights, its engines, its TP/EP oracle.

    Args:
        ctx: the rank's :class:`DistContext`; ``cpu_group``: the gloo group of the control messages.
        spec: the run's :class:`RankSpec`.
    """

    def __init__(self, ctx: DistContext, spec: RankSpec, cpu_group: Any = None):
        self.ctx = ctx
        self.spec = spec
        self.cpu_group = cpu_group
        self.index = open_checkpoint(spec.checkpoint)
        self.cfg = self.index.config
        self.placement = plan(self.cfg, load_profile(spec.profile), tp=spec.tp, ep=spec.ep)
        self.par = TPGroup(ctx, self.placement, ctx.rank)
        self.weights = None
        self.engines: dict[int, Engine] = {}
        self.doing = "starting"

    # ------------------------------------------------------------------ commands
    def load(self, measure_raw: bool = False, progress: Callable | None = None) -> dict:
        """Stream this rank's slices onto its device and verify them; returns every rank's
        :class:`LoadReport` merged on rank 0 (``{}`` elsewhere)."""
        res = load(self.index, self.placement, ranks=[self.ctx.rank], device=self.ctx.device,
                   progress=progress, measure_raw=measure_raw and self.ctx.rank == 0, strict=False)
        self.weights = res.rank_weights[self.ctx.rank]
        reports = self.gather_json(asdict(res.report))
        return merge_load_reports(reports) if self.ctx.rank == 0 else {}

    def build_engine(self, eid: int, kw: dict) -> Engine:
        """Build engine ``eid`` on this rank's weights (``kw``: :class:`Engine` keyword arguments as JSON); its pools
        must fit the cache budget of this rank's plan.

        Raises:
            PlanError: the pools exceed this rank's budget.
        """
        kw = {k: v for k, v in kw.items() if k != "device"}  # each rank runs on its own device
        for k in ("dtype", "kv_dtype", "matmul_dtype"):
            if isinstance(kw.get(k), str) and kw[k] != "auto":
                kw[k] = _DTYPES[kw[k]]
        eng = Engine(self.cfg, self.weights, kernels=dict(self.spec.kernels), device=str(self.ctx.device),
                     par=self.par, **kw)
        used, budget = eng.mla.nbytes() + eng.kda.nbytes(), int(self.placement.cache.budget_bytes)
        if used > budget:  # each rank holds its own pools: its own plan's budget bounds them
            raise PlanError(f"rank {self.ctx.rank}: the engine's caches take {used:,} B, over the {budget:,} B its "
                            "plan leaves for caches; lower the concurrency or max_model_len")
        self.engines[eid] = eng
        return eng

    def set_record(self, eid: int, flag: bool) -> None:
        """Engine ``eid`` keeps (or stops keeping) whole-vocabulary logits (:meth:`Engine.recording`)."""
        self.engines[eid].record_logits = bool(flag)

    def spmd(self, name: str, args: list) -> Any:
        """Run the SPMD function ``SPMD[name](worker, *args)`` (every rank the same; rank 0 keeps the result)."""
        return SPMD[name](self, *args)

    # ------------------------------------------------------------------ helpers
    def gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable) on rank 0, in rank order (``[]`` on the others)."""
        data = _encode(obj)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.ctx.world_size)]
        tdist.all_gather(sizes, n, group=self.cpu_group)
        m = int(max(int(s) for s in sizes))
        buf = torch.zeros(m, dtype=torch.uint8)
        buf[:data.numel()] = data
        parts = [torch.zeros(m, dtype=torch.uint8) for _ in range(self.ctx.world_size)]
        tdist.all_gather(parts, buf, group=self.cpu_group)
        if self.ctx.rank != 0:
            return []
        return [_decode(p[:int(s)]) for p, s in zip(parts, sizes)]

    def serve(self) -> None:
        """A follower's loop: obey rank 0 until ``OP_STOP``."""
        g = self.cpu_group
        while True:
            self.doing = "waiting for rank 0"
            h = _bcast(_header(0), g).tolist()
            op = h[0]
            if op == OP_STOP:
                return
            if op == OP_STEP:
                eid, T, N, nd = h[1], h[2], h[3], h[4]
                eng = self.engines[eid]
                flat = _bcast(torch.zeros(T + N * (4 + eng.max_blocks_per_seq), dtype=torch.int64), g)
                self.doing = f"a serving step ({T} tokens, {N} sequences)"
                eng.execute(_unpack_step(flat, T, N, nd))
            elif op == OP_CALL:
                raw = _bcast(torch.zeros(h[1], dtype=torch.uint8), g)
                name, args = _decode(raw)
                self.doing = _describe(name, args)
                getattr(self, name)(*args)
            else:
                raise HardwareError(f"unknown control message {op} from rank 0")


def _describe(name: str, args: list) -> str:
    if name == "load":
        return "loading its checkpoint slice"
    if name == "build_engine":
        return "building its engine"
    if name == "spmd":
        return f"running {args[0]}"
    return name


def merge_load_reports(reports: list[dict]) -> dict:
    """One :class:`LoadReport` (as a dict) from every rank's: per-rank figures side by side, counts summed,
    problems once each with the rank(s) that found them (:func:`~k3rocm.runtime.load.merge_rank_problems`); the
    raw-read figures are rank 0's."""
    out = dict(reports[0])
    out["ranks"] = sorted(r for rep in reports for r in rep["ranks"])
    for k in ("tensors_planned", "tensors_loaded", "tensors_verified"):
        out[k] = sum(int(rep[k]) for rep in reports)
    for k in ("bytes_planned", "bytes_loaded", "device_bytes_used", "seconds", "gbps"):
        merged = {}
        for rep in reports:
            merged.update({int(r): v for r, v in rep[k].items()})
        out[k] = merged
    out["total_seconds"] = max(float(rep["total_seconds"]) for rep in reports)
    out["verify_seconds"] = max(float(rep["verify_seconds"]) for rep in reports)
    out["aggregate_gbps"] = sum(float(rep["aggregate_gbps"]) for rep in reports)
    # each rank's lines name their rank already ("rank 1: ..."): not prefixed again; the same problem on several ranks
    # (a replicated tensor of the checkpoint) is one line naming them all, so one bad tensor is one problem
    out["problems"] = list(reports[0]["problems"]) if len(reports) == 1 else merge_rank_problems(
        rank_line(i, p) for i, rep in enumerate(reports) for p in rep["problems"])
    if out.get("raw_read_gbps"):
        out["load_vs_raw"] = out["aggregate_gbps"] / out["raw_read_gbps"]
    return out


# ---------------------------------------------------------------------------------------------- SPMD functions
def _model(worker: RankWorker, which: str) -> K3Model:
    """This rank's model ``which``: ``"oracle"`` (the TP/EP oracle: fp32 math, torch ops, the layout's
    collectives) or ``"engine:<id>"`` (exactly that engine's ops and math on its weights)."""
    cache = worker.__dict__.setdefault("_models", {})
    if which not in cache:
        if which == "oracle":
            cache[which] = K3Model(worker.cfg, worker.weights, par=worker.par)
        else:
            eng = worker.engines[int(which.split(":", 1)[1])]
            cache[which] = K3Model(worker.cfg, eng.w, ops=dict(eng.ops), moe_mode=eng.moe_mode,
                                   matmul_dtype=eng.matmul_dtype, par=worker.par)
    return cache[which]


def _forward_layers(worker: RankWorker, which: str, ids: list, num_layers: int, shadow: str | None) -> Any:
    return forward_layers(_model(worker, which), torch.tensor(ids, dtype=torch.int64), num_layers,
                          _model(worker, shadow) if shadow else None)


def _perturbed_logits(worker: RankWorker, which: str, ids: list, rel: float) -> torch.Tensor:
    return perturbed_logits(_model(worker, which), torch.tensor(ids, dtype=torch.int64), rel)


def _generate_greedy(worker: RankWorker, which: str, prompt: list, n: int) -> torch.Tensor:
    return _model(worker, which).generate_greedy(torch.tensor(prompt, dtype=torch.int64), n)


#: the probes every rank runs together (:meth:`RankWorker.spmd`): the result is the same on every rank
SPMD: dict[str, Callable[..., Any]] = {"forward_layers": _forward_layers, "perturbed_logits": _perturbed_logits,
                                       "generate_greedy": _generate_greedy}


class RemoteModel:
    """Rank 0's handle on a model that lives on every rank of a layout (the TP/EP oracle, or an engine's
    model): its probes run on every rank together (:data:`SPMD`), rank 0 returns its own result.

    Args:
        cluster: the :class:`Cluster`. which: ``"oracle"`` or ``"engine:<id>"``. cfg: the model config.
    """

    def __init__(self, cluster: "Cluster", which: str, cfg: Any):
        self.cluster = cluster
        self.which = which
        self.cfg = cfg

    def forward_layers(self, ids: torch.Tensor, num_layers: int, shadow: "RemoteModel | None" = None):
        """:func:`k3rocm.model.probe.forward_layers` on every rank."""
        return self.cluster.call("spmd", "forward_layers",
                                 [self.which, ids.tolist(), int(num_layers), shadow.which if shadow else None])

    def perturbed_logits(self, ids: torch.Tensor, rel: float) -> torch.Tensor:
        """:func:`k3rocm.model.probe.perturbed_logits` on every rank."""
        return self.cluster.call("spmd", "perturbed_logits", [self.which, ids.tolist(), float(rel)])

    def generate_greedy(self, prompt, n: int) -> torch.Tensor:
        """:meth:`K3Model.generate_greedy` on every rank (prompt ``[L]`` or ``[1, L]``)."""
        return self.cluster.call("spmd", "generate_greedy", [self.which, torch.as_tensor(prompt).tolist(), int(n)])

    # the layer-by-layer API exists only on the ranks; these names tell the tiers the probes can run
    def run_layer(self, *a: Any) -> None:
        raise HardwareError("a multi-rank model runs layer by layer only inside its probes (forward_layers)")

    run_attn = run_mlp = embed = final = run_layer


# ---------------------------------------------------------------------------------------------- rank 0
_live: list["Cluster"] = []
_refused: list[bool] = []  # rank 0 under torchrun told the other ranks to leave (Cluster.refuse_torchrun)


def _close_live() -> None:
    for c in list(_live):
        c.close()


atexit.register(_close_live)


class Cluster:
    """Rank 0's handle on the ranks of one layout (see the module docstring).

    Build with :meth:`start` (local followers) or :meth:`attach` (under torchrun). ``worker`` is rank 0's own
    :class:`RankWorker`; :meth:`call` runs a command on every rank; :meth:`engine` builds a distributed engine
    whose steps every rank runs.
    """

    def __init__(self, spec: RankSpec, ctx: DistContext, cpu_group: Any, procs: list, errq: Any):
        self.spec = spec
        self.ctx = ctx
        self.cpu_group = cpu_group
        self.procs = procs
        self.errq = errq
        self.worker = RankWorker(ctx, spec, cpu_group)
        self.doing = "starting"
        self._next_engine = 0
        self._closed = False
        _live.append(self)

    @property
    def world(self) -> int:
        return self.ctx.world_size

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, spec: RankSpec, world: int) -> "Cluster":
        """Spawn ``world - 1`` followers on this host and join the group as rank 0.

        Raises:
            WorkerFailed: a follower failed to start or to join within ``spec.timeout_s``.
        """
        import multiprocessing as mp

        if tdist.is_initialized():
            raise HardwareError("a process group is already initialised in this process; run one layout at a time")
        port = free_port()
        mctx = mp.get_context("spawn")
        errq = mctx.Queue()
        procs = [start_follower(mctx.Process(
            target=_follower_main, name=f"k3rocm-rank{r}",
            args=(r, world, port, spec.backend, spec.timeout_s, errq, os.getpid()), daemon=True))
            for r in range(1, world)]
        mine = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": str(world),
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)}
        saved = {k: os.environ.get(k) for k in mine}
        os.environ.update(mine)
        try:
            ctx = init(spec.backend, spec.timeout_s)
            group = _control_group(spec.backend)
            _send_spec(spec, group)
        except Exception as e:
            line = _first_error(errq, wait=1.0) or _dead_rank(procs, "joining the group")
            for p in procs:
                _stop(p)
            raise WorkerFailed(f"distributed run on {world} ranks stopped: "
                               f"{line or f'the {world}-rank group did not form: {_line(e)}'}") from None
        finally:
            # read once by the rendezvous; the user's environment is what reports record. Restored on failure too:
            # RANK / WORLD_SIZE left behind made a later call in this process look like a torchrun rank (a second
            # rendezvous, and its traceback, after a group that did not form)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return cls(spec, ctx, group, procs, errq)

    @staticmethod
    def refuse_torchrun(backend: str, timeout_s: float = 60.0) -> None:
        """Rank 0 under torchrun refuses the run: join the group and tell the other ranks to leave (an empty
        spec), so they exit at once instead of waiting on a rank 0 that is gone. Once per process: a later
        caller (the same refused session asked again) finds them gone."""
        if _refused:
            return
        _refused.append(True)
        try:
            init(backend, timeout_s)
            group = _control_group(backend)
            _bcast(torch.zeros(1, dtype=torch.int64), group)
            tdist.destroy_process_group()
        except Exception:
            pass

    @classmethod
    def attach(cls, spec: RankSpec) -> "Cluster":
        """Rank 0 under torchrun: join the group torchrun set up and send the spec to the other ranks."""
        ctx = init(spec.backend, spec.timeout_s)
        group = _control_group(spec.backend)
        _send_spec(spec, group)
        return cls(spec, ctx, group, [], None)

    # ------------------------------------------------------------------ commands
    def call(self, name: str, *args: Any, local_kw: dict | None = None) -> Any:
        """Run ``RankWorker.<name>(*args)`` on every rank; returns rank 0's result. ``local_kw`` go to rank 0's
        call only (e.g. a progress callback)."""
        self.doing = _describe(name, list(args))
        payload = _encode([name, list(args)])
        with self.guard():
            _bcast(_header(OP_CALL, payload.numel()), self.cpu_group)
            _bcast(payload, self.cpu_group)
            return getattr(self.worker, name)(*args, **(local_kw or {}))

    def send_step(self, eid: int, sb: StepBatch) -> None:
        """Send one step's description to the followers (rank 0 then runs it itself)."""
        self.doing = f"a serving step ({sb.ids.numel()} tokens, {sb.rows.shape[0]} sequences)"
        _bcast(_header(OP_STEP, eid, sb.ids.numel(), sb.rows.shape[0], sb.num_decode), self.cpu_group)
        _bcast(_pack_step(sb), self.cpu_group)

    def engine(self, **kw: Any) -> Engine:
        """A distributed engine: built on every rank (caches sized from each rank's budget, the smallest
        taken), rank 0's returned; its :meth:`~Engine.step` sends each step to the other ranks."""
        eid = self._next_engine
        self._next_engine += 1
        jkw = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in kw.items()}
        eng = self.call("build_engine", eid, jkw)
        eng.channel = _EngineChannel(self, eid)
        return eng

    # ------------------------------------------------------------------ faults
    def guard(self) -> "_Guard":
        """Context manager: an error inside (a failed or timed-out collective, a follower's error) becomes one
        :class:`WorkerFailed` line naming the rank and what it was doing; every follower is stopped."""
        return _Guard(self)

    def failure(self, exc: BaseException) -> WorkerFailed:
        """The one-line :class:`WorkerFailed` for ``exc`` raised on rank 0 while ranks worked together."""
        line = _first_error(self.errq, wait=2.0) if self.errq is not None else None
        if line is None:
            line = _dead_rank(self.procs, f"rank 0 was running {self.doing}")
        if line is None:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                line = (f"a rank did not answer within {self.spec.timeout_s:.0f} s (hung) while running {self.doing}; "
                        f"rank 0 saw: {_line(exc)}")
            else:
                line = f"rank 0 failed while running {self.doing}: {type(exc).__name__}: {_line(exc)}"
        self.close(force=True)
        return WorkerFailed(f"distributed run on {self.world} ranks stopped: {line}; all ranks were stopped")

    def close(self, force: bool = False) -> None:
        """Stop the followers (``OP_STOP``, then terminate what is left) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self in _live:
            _live.remove(self)
        if not force:
            try:
                _bcast(_header(OP_STOP), self.cpu_group)
            except Exception:
                force = True
        for p in self.procs:
            p.join(timeout=0.1 if force else 10)
            _stop(p)
        try:
            if tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception:
            pass
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)


class _Guard:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def __enter__(self) -> None:
        return None

    def __exit__(self, et, e, tb) -> bool:
        if e is None or isinstance(e, WorkerFailed):
            return False
        if isinstance(e, KeyboardInterrupt):  # the user's Ctrl-C: stop the followers, let the interrupt through
            self.cluster.close(force=True)
            return False
        if isinstance(e, K3Error) and self.cluster.errq is not None and _peek(self.cluster) is None:
            return False  # rank 0's own expected failure (bad input): not a fault of the ranks
        raise self.cluster.failure(e) from None


def _peek(cluster: Cluster) -> str | None:
    try:
        item = cluster.errq.get_nowait()
    except (_queue.Empty, OSError, ValueError):
        return None
    cluster.errq.put(item)
    return item


class _EngineChannel:
    """What a distributed engine's :meth:`~Engine.step` uses to reach the other ranks."""

    def __init__(self, cluster: Cluster, eid: int):
        self.cluster = cluster
        self.eid = eid

    def send_step(self, sb: StepBatch) -> None:
        self.cluster.send_step(self.eid, sb)

    def set_recording(self, flag: bool) -> None:
        self.cluster.call("set_record", self.eid, bool(flag))

    def guard(self) -> _Guard:
        return self.cluster.guard()


def _dead_rank(procs: list, when: str) -> str | None:
    """One line for the first follower process that has ended (rank = its index + 1), or None."""
    for p in procs:
        p.join(timeout=0.2)
    for i, p in enumerate(procs):
        code = p.exitcode
        if code is not None:
            how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
            return f"rank {i + 1} {how} while {when}"
    return None


def _first_error(errq: Any, wait: float = 0.0) -> str | None:
    if errq is None:
        return None
    try:
        return errq.get(timeout=wait) if wait else errq.get_nowait()
    except (_queue.Empty, OSError, ValueError):
        return None


def _line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def _send_spec(spec: RankSpec, group: Any) -> None:
    data = _encode(asdict(spec))
    _bcast(torch.tensor([data.numel()], dtype=torch.int64), group)
    _bcast(data, group)


def _recv_spec(group: Any) -> RankSpec | None:
    n = int(_bcast(torch.zeros(1, dtype=torch.int64), group))
    if n == 0:  # rank 0 refused the run (e.g. torchrun started another count than the plan has): leave
        return None
    raw = _bcast(torch.zeros(n, dtype=torch.uint8), group)
    return RankSpec(**_decode(raw))


# ---------------------------------------------------------------------------------------------- followers
def follow(backend: str | None = None, timeout_s: float = 120.0, errq: Any = None) -> None:
    """A follower rank's whole life: join the group (env://), receive the spec, then obey rank 0.

    Under torchrun the CLI calls this on every rank but 0 instead of the command. A failure is reported on
    ``errq`` (local launcher) or stderr (torchrun) as one line naming the rank and what it was doing.
    """
    rank = int(os.environ.get("RANK", "-1"))
    worker = None
    try:
        ctx = init(backend, timeout_s)
        group = _control_group(ctx.backend)
        spec = _recv_spec(group)
        if spec is not None:
            worker = RankWorker(ctx, spec, group)
            worker.serve()
    except BaseException as e:
        what = worker.doing if worker is not None else "joining the group"
        line = f"rank {rank} failed while {what}: {type(e).__name__}: {_line(e)}"
        if errq is not None:
            errq.put(line)
            time.sleep(0.2)  # let the queue's feeder thread deliver it
        else:
            print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(1)
    try:
        if tdist.is_initialized():
            tdist.destroy_process_group()
    except Exception:
        pass


def start_follower(proc):
    """Start ``proc`` (a ``multiprocessing`` process, spawn context) as a follower rank: Ctrl-C ignored from its
    first instruction, and torch's C++ log at ``FATAL`` unless the user set ``TORCH_CPP_LOG_LEVEL``.

    Python leaves SIGINT ignored in a process whose parent ignored it, so SIGINT is ignored here around
    ``proc.start()`` (main thread only; other threads cannot set handlers) and restored: a Ctrl-C while a follower
    still imports the package printed the follower's ``KeyboardInterrupt`` traceback before rank 0's one line
    (rank 0 handles Ctrl-C for every rank). The C++ log level is read once as the child loads torch, so it is set in
    the environment the child inherits, around ``proc.start()``, and restored: a follower that could not join
    printed c10d's ``[E ... socket.cpp]`` lines and their frame lists before rank 0's one line (the follower's
    error reaches rank 0 through the error queue, which quotes it). Returns ``proc``.
    """
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    if user_level is None:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        if threading.current_thread() is not threading.main_thread():
            proc.start()
            return proc
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, old)
        return proc
    finally:
        if user_level is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _follower_main(rank: int, world: int, port: int, backend: str, timeout_s: float, errq: Any, ppid: int) -> None:
    # Ctrl-C reaches the whole process group: rank 0 handles it (keeps finished work, stops every rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    follow(backend, timeout_s, errq)
    os._exit(0)


def torchrun_follower() -> bool:
    """True when this process is a torchrun rank other than 0 (the CLI then calls :func:`follow`)."""
    return under_torchrun() and int(os.environ.get("RANK", "0")) != 0

