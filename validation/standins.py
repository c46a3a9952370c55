"""Small, self-contained paths the validator uses when a richer toolkit component is not importable.

* :func:`read_checkpoint` — validate a checkpoint directory against the layout of its config
  (:mod:`k3rocm.checkpoint.layout`: every expected tensor present with the right shape and dtype, no
  path leaving the directory, no 0xFF MXFP4 scale) and read it into a ``name -> Tensor`` mapping with
  ``safetensors`` (no pickle). Used by the load tier when ``k3rocm.runtime.load`` is not installed.
* :class:`RegistryEngine` — runs the model with the ops the kernel registry selects (``--kernels``),
  on BF16 weights as stored; the validator compares it against the fp32 oracle. Used when
  ``k3rocm.runtime.engine`` is not installed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3rocm.errors import CheckpointError

INDEX = "model.safetensors.index.json"


@dataclass
class ReadReport:
    """What :func:`read_checkpoint` did. Byte counts are tensor data bytes."""

    tensors_loaded: int = 0
    bytes_loaded: int = 0
    seconds: float = 0.0
    shards: int = 0
    scales_ff: int = 0
    nonfinite: int = 0
    bytes_per_device: dict = field(default_factory=dict)
    bytes_per_device_planned: dict = field(default_factory=dict)
    loader: str = "k3rocm.validation.standins.read_checkpoint"

    def to_dict(self) -> dict:
        return dict(vars(self))


def _index(ckpt: Path) -> dict[str, str]:
    p = ckpt / INDEX
    if p.is_file():
        try:
            wm = json.loads(p.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{p}: malformed index ({type(e).__name__}: {e}); re-download the index") from None
    else:
        shards = sorted(ckpt.glob("*.safetensors"))
        if len(shards) != 1:
            raise CheckpointError(f"{ckpt}: no {INDEX} and {len(shards)} shard files; the released layout has an index")
        from safetensors import safe_open
        with safe_open(str(shards[0]), "pt") as f:
            wm = {k: shards[0].name for k in f.keys()}
    root = ckpt.resolve()
    for name, fname in wm.items():
        q = (ckpt / fname).resolve()
        if root not in q.parents:
            raise CheckpointError(f"{p}: tensor {name} points outside the checkpoint ({fname}); refusing to read it")
    return wm


def read_checkpoint(ckpt: str | Path, cfg, device: str = "cpu", progress=None):
    """Validate and read a checkpoint; returns ``(weights: dict[str, Tensor], ReadReport)``.

    Vision tensors are skipped. Raises:
        CheckpointError: a missing / unreadable shard, a tensor missing from the index or the shard,
            a wrong shape or dtype, a 0xFF (NaN) MXFP4 scale — the message names the tensor and file.
    """
    import torch
    from safetensors import SafetensorError, safe_open

    from k3rocm.checkpoint import layout

    ckpt = Path(ckpt)
    wm = _index(ckpt)
    specs = list(layout.iter_specs(cfg))
    missing = [s.name for s in specs if s.name not in wm]
    if missing:
        raise CheckpointError(f"{ckpt / INDEX}: {len(missing)} tensors of the config are missing, first "
                              f"{missing[0]}; the checkpoint is incomplete")
    by_file: dict[str, list] = {}
    for s in specs:
        by_file.setdefault(wm[s.name], []).append(s)
    rep = ReadReport(shards=len(by_file))
    out: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    done = 0
    dt_names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.float16: "F16",
                torch.int64: "I64"}
    for fname, group in by_file.items():
        path = ckpt / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: shard named by the index is missing; re-download it")
        try:
            with safe_open(str(path), "pt", device="cpu") as f:
                have = set(f.keys())
                for s in group:
                    if s.name not in have:
                        raise CheckpointError(f"{path}: tensor {s.name} listed in the index is not in the shard")
                    t = f.get_tensor(s.name)
                    if tuple(t.shape) != tuple(s.shape) or dt_names.get(t.dtype) != s.dtype:
                        raise CheckpointError(f"{path}: tensor {s.name} is {dt_names.get(t.dtype, t.dtype)} "
                                              f"{list(t.shape)}, the config expects {s.dtype} {list(s.shape)}")
                    if s.name.endswith("weight_scale") and bool((t == 0xFF).any()):
                        rep.scales_ff += int((t == 0xFF).sum())
                    elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        rep.nonfinite += 1
                    out[s.name] = t.to(device)
                    rep.bytes_loaded += s.nbytes
                    done += 1
                    if progress:
                        progress(done, len(specs))
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}); re-download it") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if rep.scales_ff:
        raise CheckpointError(f"{ckpt}: {rep.scales_ff} MXFP4 scale bytes are 0xFF (NaN in OCP MX); "
                              "the checkpoint is corrupt")
    rep.tensors_loaded = len(out)
    rep.seconds = time.perf_counter() - t0
    rep.bytes_per_device = {device: rep.bytes_loaded}
    return out, rep


def load_from_index(index, device: str = "cpu", progress=None):
    """Read every text tensor of a validated ``CheckpointIndex`` onto ``device`` (stored dtypes; packed
    MXFP4 stays packed). Returns ``(weights: dict[str, Tensor], ReadReport)``."""
    import torch
    rep = ReadReport(shards=len(getattr(index, "shards", [])), loader="CheckpointIndex.read")
    out = {}
    t0 = time.perf_counter()
    names = list(index.entries)
    for i, n in enumerate(names):
        t = index.read(n, device)
        out[n] = t
        rep.bytes_loaded += t.numel() * t.element_size()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            rep.nonfinite += 1
        if progress and (i % 64 == 0 or i == len(names) - 1):
            progress(i + 1, len(names))
    rep.tensors_loaded = len(out)
    rep.seconds = time.perf_counter() - t0
    rep.bytes_per_device = {device: rep.bytes_loaded}
    return out, rep


class RegistryEngine:
    """The model run with the implementations :func:`k3rocm.kernels.registry.select` picks per op.

    Same API as :class:`k3rocm.model.model.K3Model` (``forward``, ``new_cache``, ``prefill``, ``decode``,
    ``generate_greedy``, ``embed``/``run_layer``/``final``), plus :attr:`impls` — op -> chosen implementation.

    Args:
        cfg: model config; weights: name -> tensor mapping or Weights (BF16 as stored).
        override: parsed ``--kernels`` (:func:`k3rocm.kernels.registry.parse_override`).
    Raises:
        HardwareError: the override asks for an implementation that cannot run here.
    """

    def __init__(self, cfg, weights, override: dict | None = None, moe_mode: str = "a16w4"):
        from k3rocm.kernels import registry
        from k3rocm.model.model import K3Model

        self.impls: dict[str, str] = {}
        ops = {}
        for op in registry.ORACLE_OPS:
            name, impl = registry.select(op, override or {})
            self.impls[op] = name
            ops[op] = impl.fn
        self.model = K3Model(cfg, weights, ops=ops, moe_mode=moe_mode)
        self.cfg = cfg

    def __getattr__(self, item):
        return getattr(self.model, item)

    def describe(self) -> str:
        return "K3Model with registry ops: " + ", ".join(f"{k}={v}" for k, v in self.impls.items())


def static_bench(engine, concurrency: int, input_len: int, output_len: int, num_prompts: int | None = None,
                 range_ratio: float = 0.8, warmups: int | None = None, seed: int = 0, num_gpus: int = 1,
                 progress=None) -> dict:
    """Benchmark ``engine`` with static batches of ``concurrency`` requests (the load of
    :func:`k3rocm.bench.loadgen.plan_load`, metrics of :func:`k3rocm.bench.metrics.aggregate`).

    Each wave prefills its prompts together (varlen) and decodes until every request has its
    ``output_len`` tokens (EOS ignored); a token's arrival time is when its step returns. Used when
    ``k3rocm.bench.run_bench`` (continuous batching) is not installed; results say ``runner``.

    Returns the aggregate dict (vLLM field names) plus ``concurrency``, ``input_len``, ``output_len``,
    ``runner``.
    """
    import torch

    from k3rocm.bench.loadgen import plan_load
    from k3rocm.bench.metrics import RequestRecord, aggregate

    cfg = engine.cfg
    special = (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    lp = plan_load(concurrency, input_len, output_len, cfg.vocab_size, num_prompts, range_ratio, warmups, seed,
                   special)
    total = len(lp.warmups) + len(lp.requests)
    done = 0

    def wave(reqs, measure: bool) -> list:
        nonlocal done
        recs = []
        cache = engine.new_cache(len(reqs), max(r.input_len + r.output_len for r in reqs) + 1)
        t_issue = time.perf_counter()
        for r in reqs:
            recs.append(RequestRecord(r.request_id, r.input_len, r.output_len, t_issue))
        with torch.no_grad():
            logits = engine.prefill([torch.tensor(r.prompt_ids) for r in reqs], cache)
            last = torch.stack([lg[-1] for lg in logits])
            now = time.perf_counter()
            for rec in recs:
                rec.token_times.append(now)
                rec.output_tokens = 1
            for _ in range(max(r.output_len for r in reqs) - 1):
                tok = last.argmax(-1)
                last = engine.decode(tok, cache)
                now = time.perf_counter()
                for rec in recs:
                    if rec.output_tokens < rec.output_len_target:
                        rec.token_times.append(now)
                        rec.output_tokens += 1
        for rec in recs:
            rec.success = rec.output_tokens == rec.output_len_target
        done += len(reqs)
        if progress:
            progress(done, total)
        return recs if measure else []

    for i in range(0, len(lp.warmups), concurrency):
        wave(lp.warmups[i:i + concurrency], False)
    records = []
    t0 = time.perf_counter()
    for i in range(0, len(lp.requests), concurrency):
        records += wave(lp.requests[i:i + concurrency], True)
    out = aggregate(records, time.perf_counter() - t0, num_gpus)
    out.update(concurrency=concurrency, input_len=input_len, output_len=output_len,
               runner="static batches (k3rocm.validation.standins.static_bench)")
    return out


def serve_bench(engine, concurrency: int, input_len: int, output_len: int, num_prompts: int | None = None,
                range_ratio: float = 0.8, warmups: int | None = None, seed: int = 0, num_gpus: int = 1,
                progress=None) -> dict:
    """Benchmark a continuous-batching engine (``add_request`` / ``step`` / ``has_unfinished``) with the
    InferenceX load of :func:`k3rocm.bench.loadgen.plan_load`: at most ``concurrency`` requests in flight,
    a new one issued as soon as one finishes, EOS ignored; token times are the engine's event times.
    Used when ``k3rocm.bench.run_bench`` is not installed. Returns
    :func:`k3rocm.bench.metrics.aggregate`'s dict plus ``concurrency``, ``input_len``, ``output_len``,
    ``runner``, ``steps``.
    """
    from k3rocm.bench.loadgen import plan_load
    from k3rocm.bench.metrics import RequestRecord, aggregate

    cfg = engine.cfg
    lp = plan_load(concurrency, input_len, output_len, cfg.vocab_size, num_prompts, range_ratio, warmups, seed,
                   (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id))
    total = len(lp.warmups) + len(lp.requests)
    state = {"done": 0, "steps": 0}

    def run(reqs) -> list:
        pending = list(reqs)
        inflight: dict[int, RequestRecord] = {}
        finished = []
        while pending or inflight:
            while pending and len(inflight) < concurrency:
                r = pending.pop(0)
                rec = RequestRecord(r.request_id, r.input_len, r.output_len, time.perf_counter())
                rid = engine.add_request(list(r.prompt_ids), r.output_len, ignore_eos=True)
                inflight[rid] = rec
            events = engine.step()
            state["steps"] += 1
            if not events and not engine.has_unfinished():
                break
            for ev in events:
                rec = inflight.get(ev.request_id)
                if rec is None:
                    continue
                rec.token_times.append(ev.time)
                rec.output_tokens += 1
                if ev.finished:
                    rec.success = rec.output_tokens == rec.output_len_target
                    if not rec.success:
                        rec.error = f"finished after {rec.output_tokens} tokens ({ev.finish_reason})"
                    finished.append(inflight.pop(ev.request_id))
                    state["done"] += 1
                    if progress:
                        progress(state["done"], total)
        for rec in inflight.values():  # the engine stopped with requests open: count them as failed
            rec.error = "engine idle with the request unfinished"
            finished.append(rec)
        return finished

    run(lp.warmups)
    t0 = time.perf_counter()
    records = run(lp.requests)
    out = aggregate(records, time.perf_counter() - t0, num_gpus)
    out.update(concurrency=concurrency, input_len=input_len, output_len=output_len, steps=state["steps"],
               runner="continuous batching through Engine.step (k3rocm.validation.standins.serve_bench)")
    return out
