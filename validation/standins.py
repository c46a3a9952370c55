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
