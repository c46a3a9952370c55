"""Model weights by checkpoint name, as stored (BF16 / FP32 / U8; MXFP4 experts stay packed).

:class:`Weights` is what the oracle model and the engine read: ``get(name)`` by full checkpoint name
(``language_model.model.layers.3.self_attn.q_a_proj.weight``), ``layer(i)`` for one decoder layer, and
``experts(i)`` for the routed experts of MoE layer ``i`` stacked in the op contract's
:class:`ExpertWeights` layout (docs/ARCHITECTURE.md "Ops"):

* MXFP4 (K3): ``w13_packed [E, 2I, D/2]`` u8 (rows ``0..I-1`` = ``w1`` / gate, ``I..2I-1`` = ``w3`` / up),
  ``w13_scale [E, 2I, D/32]`` u8, ``w2_packed [E, D, I/2]`` u8, ``w2_scale [E, D, I/32]`` u8; element ``2i``
  of a row in the low nibble, E8M0 scales (K3_FACTS §4);
* unquantized (kimi_linear family): ``w13 [E, 2I, D]``, ``w2 [E, D, I]`` bf16.

``D`` = ``cfg.expert_in_size`` (the latent width for K3), ``I`` = ``moe_intermediate_size``.
Once stacked, the per-expert tensors returned by ``get`` are views into the stacks, so memory is held once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from k3rocm.checkpoint import layout
from k3rocm.checkpoint.reader import DTYPES, open_checkpoint
from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError

Progress = Callable[[int, int, str], None]


@dataclass
class ExpertWeights:
    """Routed experts of one MoE layer (local experts ``first_expert .. first_expert + num_experts - 1``).

    Attributes:
        num_experts: local expert count E.
        first_expert: global id of local expert 0 (expert parallelism).
        w13_packed, w13_scale, w2_packed, w2_scale: MXFP4 stacks (see module doc), or None.
        w13, w2: unquantized bf16 stacks, or None.
        kernel_layout: the same MXFP4 experts in the grouped GEMM's tiled layout (an
            ``k3rocm.kernels.moe.ops.ExpertLayout``: ``w13`` / ``w2`` ``TiledMxfp4``, ``experts(a, b)``, ``to(dev)``,
            ``checkpoint_expert(e)``), made once on the device (:meth:`Weights.use_kernel_layout`), or None. Once
            it holds them the four checkpoint-layout stacks may be *released*: meta tensors of the same shapes and
            dtypes (no storage; any computation on them raises), and :meth:`expert_mxfp4` reads an expert back
            from the tiled bytes instead.
    """

    num_experts: int
    first_expert: int = 0
    w13_packed: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_packed: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13: torch.Tensor | None = None
    w2: torch.Tensor | None = None
    kernel_layout: Any = None

    @property
    def released(self) -> bool:
        """True when the checkpoint-layout MXFP4 stacks are released (meta tensors; the kernel layout holds the
        bytes)."""
        return self.w13_packed is not None and self.w13_packed.is_meta

    def expert_mxfp4(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local expert ``e`` in the checkpoint layout: ``(w13_packed [2I, D/2], w13_scale [2I, D/32],
        w2_packed [D, I/2], w2_scale [D, I/32])`` u8 — views of the stacks, or, when they are released, read back
        from the kernel layout bit for bit (new tensors). Raises CheckpointError for unquantized experts."""
        if not self.quantized:
            raise CheckpointError("expert_mxfp4: these experts are not packed MXFP4")
        if not self.released:
            return self.w13_packed[e], self.w13_scale[e], self.w2_packed[e], self.w2_scale[e]
        if self.kernel_layout is None:
            raise CheckpointError("expert_mxfp4: the checkpoint-layout stacks were released without a kernel layout")
        return self.kernel_layout.checkpoint_expert(e)

    @property
    def quantized(self) -> bool:
        """True for packed MXFP4 experts."""
        return self.w13_packed is not None

    @property
    def intermediate_size(self) -> int:
        """I (``moe_intermediate_size``)."""
        t = self.w13_packed if self.quantized else self.w13
        return int(t.shape[1]) // 2

    @property
    def in_features(self) -> int:
        """D (expert input width: the latent for K3)."""
        return int(self.w13_packed.shape[2]) * 2 if self.quantized else int(self.w13.shape[2])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-None stacks by field name (released ones as their meta tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        """Bytes held by the stacks and the kernel layout (released stacks hold none)."""
        n = sum(t.numel() * t.element_size() for t in self.tensors().values() if not t.is_meta)
        return n + (self.kernel_layout.nbytes if self.kernel_layout is not None else 0)

    def to(self, device: str | torch.device) -> "ExpertWeights":
        """A copy with every stack (and the kernel layout) on ``device``; released stacks stay meta."""
        return ExpertWeights(self.num_experts, self.first_expert,
                             **{k: v if v.is_meta else v.to(device) for k, v in self.tensors().items()},
                             kernel_layout=None if self.kernel_layout is None else self.kernel_layout.to(device))


# tensors stored FP32 in the checkpoint that the kernels read in fp32 (K3_FACTS §3): never cast down
FP32_TENSORS = ("conv1d", "A_log", "dt_bias", "o_norm", "e_score_correction_bias")


def keep_fp32(name: str) -> bool:
    """True for a tensor name in :data:`FP32_TENSORS` (kept fp32 by :meth:`Weights.cast`)."""
    return any(s in name for s in FP32_TENSORS)


def as_weights(cfg: K3Config, source: Any) -> "Weights":
    """``source`` as :class:`Weights`: a Weights is returned as is, a ``Mapping[str, Tensor]`` by full checkpoint
    name is wrapped without copies (its experts are stacked on first use)."""
    if isinstance(source, Weights):
        return source
    if isinstance(source, Mapping):
        return Weights.from_tensors(cfg, source)
    raise CheckpointError(f"weights of type {type(source).__name__} are neither Weights nor a mapping of tensors "
                          "by checkpoint name")


def _parse_expert(name: str) -> tuple[int, str, str]:
    """``...experts.{e}.{w1|w2|w3}.{weight_packed|weight_scale|weight}`` -> ``(e, "w1", "weight_packed")``."""
    e, wn, kind = name.split(".experts.", 1)[1].split(".")
    return int(e), wn, kind


def _check_range(cfg: K3Config, expert_range: tuple[int, int] | None) -> tuple[int, int]:
    if expert_range is None:
        return 0, cfg.num_experts
    a, b = int(expert_range[0]), int(expert_range[1])
    if not 0 <= a < b <= cfg.num_experts:
        raise CheckpointError(f"expert_range {expert_range} must be a half-open range inside 0..{cfg.num_experts}")
    return a, b


class Weights:
    """Tensors by full checkpoint name (stored dtypes), with stacked routed experts.

    Build with :meth:`from_checkpoint` (a validated :class:`~k3rocm.checkpoint.reader.CheckpointIndex`) or
    :meth:`from_tensors`. Behaves as a read-only mapping: ``w[name]``, ``name in w``, ``len(w)``, ``keys()``.

    Args:
        cfg: the model config.
        tensors: full name -> tensor.
        expert_range: default half-open ``(first, end)`` global expert ids held (expert parallelism).
    """

    def __init__(self, cfg: K3Config, tensors: Mapping[str, torch.Tensor],
                 expert_range: tuple[int, int] | None = None):
        self.config = cfg
        self._t: dict[str, torch.Tensor] = dict(tensors)
        self.expert_range = _check_range(cfg, expert_range)
        self._experts: dict[tuple[int, int, int], ExpertWeights] = {}
        self._views: set[str] = set()
        #: per-expert names whose stack was released into a kernel layout: name -> (layer, first, end, local e)
        self._released: dict[str, tuple[int, int, int, int]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(cls, cfg: K3Config, tensors: Mapping[str, torch.Tensor],
                     expert_range: tuple[int, int] | None = None) -> "Weights":
        """Wrap a ``{full name: tensor}`` dict (e.g. a state dict in checkpoint naming). No copies."""
        return cls(cfg, tensors, expert_range)

    @classmethod
    def from_checkpoint(cls, index: Any, device: str | torch.device = "cpu", layers: Iterable[int] | None = None,
                        include_experts: bool = True, progress: Progress | None = None,
                        expert_range: tuple[int, int] | None = None) -> "Weights":
        """Load tensors from a validated checkpoint index.

        Args:
            index: :class:`~k3rocm.checkpoint.reader.CheckpointIndex`.
            device: target device; on CPU tensors stay zero-copy views of the mapped shards (except the
                expert stacks, which are gathered into one buffer per layer and field).
            layers: decoder layers to load (0-based; default all); model-level tensors always load.
            include_experts: load routed experts (stacked directly on ``device``).
            progress: ``progress(bytes_done, bytes_total, name)`` after each tensor.
            expert_range: half-open global expert ids to load (expert parallelism; default all).
        Raises:
            CheckpointError: a layer index out of range or a bad expert range.
        """
        cfg: K3Config = index.config
        L = cfg.num_hidden_layers
        want = set(range(L)) if layers is None else {int(i) for i in layers}
        bad = sorted(i for i in want if not 0 <= i < L)
        if bad:
            raise CheckpointError(f"layers {bad} out of range 0..{L - 1} for {index.path}")
        first, end = _check_range(cfg, expert_range)
        names = [s.name for s in layout.model_specs(cfg)]
        for i in sorted(want):
            names += [s.name for s in layout.layer_specs(cfg, i, with_experts=False)]
        moe_layers = [i for i in sorted(want) if cfg.is_moe_layer(i)] if include_experts else []
        expert_names = [s.name for i in moe_layers for e in range(first, end) for s in layout.expert_specs(cfg, i, e)]
        total = sum(index.entries[n].nbytes for n in names) + sum(index.entries[n].nbytes for n in expert_names)
        done = 0
        tensors: dict[str, torch.Tensor] = {}
        for n in names:
            tensors[n] = index.read(n, device)
            done += index.entries[n].nbytes
            if progress is not None:
                progress(done, total, n)
        w = cls(cfg, tensors, (first, end))
        for i in moe_layers:
            done = w._stack_from(index, i, device, done, total, progress)
        return w

    def _stack_from(self, index: Any, i: int, device: str | torch.device, done: int, total: int,
                    progress: Progress | None) -> int:
        """Read layer ``i``'s experts straight into stacked buffers; register per-expert views."""
        cfg = self.config
        first, end = self.expert_range
        E = end - first
        specs = {s.name: s for e in range(first, end) for s in layout.expert_specs(cfg, i, e)}
        stacks: dict[str, torch.Tensor] = {}
        for s in layout.expert_specs(cfg, i, first):
            _, wn, kind = _parse_expert(s.name)
            key = self._field(wn, kind)
            rows = s.shape[0] * (2 if wn in ("w1", "w3") else 1)
            if key not in stacks:
                dt = DTYPES[index.entries[s.name].dtype][0]
                stacks[key] = torch.empty((E, rows, *s.shape[1:]), dtype=dt, device=device)
        for n, s in specs.items():
            e, wn, kind = _parse_expert(n)
            dst = self._slot(stacks, wn, kind, e - first, s.shape[0])
            dst.copy_(index.read(n))
            self._t[n] = dst
            self._views.add(n)
            done += s.nbytes
            if progress is not None:
                progress(done, total, n)
        self._experts[(i, first, end)] = self._make_experts(stacks, E, first)
        return done

    @staticmethod
    def _field(wn: str, kind: str) -> str:
        base = "w13" if wn in ("w1", "w3") else "w2"
        return {"weight_packed": f"{base}_packed", "weight_scale": f"{base}_scale", "weight": base}[kind]

    def _slot(self, stacks: dict[str, torch.Tensor], wn: str, kind: str, e: int, rows: int) -> torch.Tensor:
        t = stacks[self._field(wn, kind)][e]
        return t[rows:] if wn == "w3" else (t[:rows] if wn == "w1" else t)

    @staticmethod
    def _make_experts(stacks: dict[str, torch.Tensor], E: int, first: int) -> ExpertWeights:
        return ExpertWeights(num_experts=E, first_expert=first, **stacks)

    # ------------------------------------------------------------------ access
    def get(self, name: str, default: Any = None) -> torch.Tensor | Any:
        """Tensor by full checkpoint name, or ``default`` when absent. An expert tensor whose stack was released
        into the kernel layout (:meth:`use_kernel_layout`) is read back from it (a new tensor, bit for bit)."""
        t = self._t.get(name)
        if t is None:
            return default
        return self._read_back(name, t) if name in self._released else t

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name} is not in these weights (not loaded, or not in the checkpoint)")
        return t

    def _read_back(self, name: str, meta: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor ``name`` of a released expert stack, from the kernel layout."""
        i, a, b, e = self._released[name]
        _, wn, kind = _parse_expert(name)
        p13, s13, p2, s2 = self._experts[(i, a, b)].expert_mxfp4(e)
        t = {("w13", "weight_packed"): p13, ("w13", "weight_scale"): s13,
             ("w2", "weight_packed"): p2, ("w2", "weight_scale"): s2}[("w2" if wn == "w2" else "w13", kind)]
        rows = meta.shape[0]
        return t[rows:] if wn == "w3" else (t[:rows] if wn == "w1" else t)

    def __contains__(self, name: object) -> bool:
        return name in self._t

    def __len__(self) -> int:
        return len(self._t)

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def keys(self):
        return self._t.keys()

    def items(self):
        return self._t.items()

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of decoder layer ``i`` keyed relative to ``language_model.model.layers.{i}.``."""
        p = f"{layout.prefix_for(self.config)}layers.{i}."
        return {k[len(p):]: v for k, v in self._t.items() if k.startswith(p)}

    def experts(self, i: int, expert_range: tuple[int, int] | None = None) -> ExpertWeights:
        """Routed experts of MoE layer ``i`` stacked per the op contract (cached).

        Args:
            i: 0-based MoE layer.
            expert_range: half-open global ids ``(first, end)``; default the range these weights hold.
        Raises:
            CheckpointError: not a MoE layer, or an expert tensor is not loaded.
        """
        cfg = self.config
        if not cfg.is_moe_layer(i):
            raise CheckpointError(f"layer {i} has no routed experts (dense or out of range)")
        first, end = self.expert_range if expert_range is None else _check_range(cfg, expert_range)
        key = (i, first, end)
        if key in self._experts:
            return self._experts[key]
        for (j, a, b), ew in self._experts.items():  # a sub-range of an existing stack: slice, no copy
            if j == i and a <= first and end <= b:
                lay = ew.kernel_layout
                out = ExpertWeights(end - first, first, **{k: v[first - a:end - a] for k, v in ew.tensors().items()},
                                    kernel_layout=None if lay is None else lay.experts(first - a, end - a))
                self._experts[key] = out
                return out
        stacks: dict[str, torch.Tensor] = {}
        per: dict[str, list[torch.Tensor]] = {}
        for e in range(first, end):
            for s in layout.expert_specs(cfg, i, e):
                _, wn, kind = _parse_expert(s.name)
                per.setdefault(f"{wn}.{kind}", []).append(self[s.name])
        for wkind, ts in per.items():
            wn, kind = wkind.split(".")
            if wn == "w3":
                continue
            st = torch.stack(ts)
            if wn == "w1":
                st = torch.cat([st, torch.stack(per[f"w3.{kind}"])], dim=1)
            stacks[self._field(wn, kind)] = st
        E = end - first
        if (first, end) == self.expert_range:  # re-point per-expert names at the stacks: hold memory once
            for e in range(first, end):
                for s in layout.expert_specs(cfg, i, e):
                    _, wn, kind = _parse_expert(s.name)  # rows as held (a TP rank may hold an I-slice)
                    self._t[s.name] = self._slot(stacks, wn, kind, e - first, self._t[s.name].shape[0])
                    self._views.add(s.name)
        out = self._make_experts(stacks, E, first)
        self._experts[key] = out
        return out

    def stack_experts(self) -> None:
        """Stack every MoE layer whose experts this object holds as separate per-expert tensors (of its whole
        expert range) into the :class:`ExpertWeights` stacks now (:meth:`experts` does it on first use); the
        per-expert names become views into the stacks, so the experts are held once."""
        first = self.expert_range[0]
        for i in range(self.config.num_hidden_layers):
            if self.config.is_moe_layer(i) and (i, *self.expert_range) not in self._experts and \
                    all(sp.name in self._t for sp in layout.expert_specs(self.config, i, first)):
                self.experts(i)

    def cast(self, device: str | torch.device, dtype: torch.dtype) -> "Weights":
        """These weights on ``device`` with their floating-point tensors in ``dtype`` — the engine's copy.

        FP32-stored tensors that the kernels read in fp32 (:data:`FP32_TENSORS`: the KDA conv weights, ``A_log``,
        ``dt_bias``, ``o_norm`` and the router bias) stay fp32; packed MXFP4 (uint8) stays packed. Tensors
        already on ``device`` in the target dtype are shared, not copied, and so are the expert stacks (built here
        first where a MoE layer's experts are held as separate tensors; an expert's per-name tensor stays a view
        into its stack: memory is held once).
        """
        dev = torch.device(device)
        self.stack_experts()  # stack each MoE layer here first: its experts held once

        def target(name: str, t: torch.Tensor) -> torch.dtype:
            if not t.is_floating_point() or (t.dtype == torch.float32 and keep_fp32(name)):
                return t.dtype
            return dtype

        out = Weights(self.config, {}, self.expert_range)
        out._released = dict(self._released)
        for (i, a, b), ew in self._experts.items():
            moved = {k: v if v.is_meta else v.to(dev, target("", v)) for k, v in ew.tensors().items()}
            lay = None if ew.kernel_layout is None else ew.kernel_layout.to(dev)
            out._experts[(i, a, b)] = ExpertWeights(ew.num_experts, ew.first_expert, **moved, kernel_layout=lay)
        for name, t in self._t.items():
            if name in self._views:
                continue
            out._t[name] = t.to(dev, target(name, t))
        for (i, a, b), ew in out._experts.items():  # per-expert names as views into the moved stacks
            if (a, b) == self.expert_range:
                stacks = ew.tensors()
                for e in range(a, b):
                    for s in layout.expert_specs(self.config, i, e):
                        _, wn, kind = _parse_expert(s.name)
                        out._t[s.name] = out._slot(stacks, wn, kind, e - a, self._t[s.name].shape[0])
                        out._views.add(s.name)
        for name in self._views:  # views of stacks this object does not hold whole
            if name not in out._t:
                t = self._t[name]
                out._t[name] = t.to(dev, target(name, t))
        return out

    def use_kernel_layout(self, make: Callable[[ExpertWeights], Any], room: Callable[[int], bool] | None = None,
                          progress: Progress | None = None) -> dict:
        """Move every held MoE layer's MXFP4 experts into the grouped GEMM's tiled layout, in place, layer by layer.

        For each MoE layer whose whole-range stack is held here, quantized and not yet converted: ``make(ew)``
        (``k3rocm.kernels.moe.ops.kernel_layout``, with its byte-for-byte read-back check) builds the layout on
        the stacks' device; it is attached to every :class:`ExpertWeights` of the layer (sub-ranges as views);
        then the four checkpoint-layout stacks and the per-expert tensors that view them are released (meta
        tensors of the same shapes: this object stops referencing their storage, which is freed unless another
        holder keeps it). Values do not change: :meth:`get` and :meth:`ExpertWeights.expert_mxfp4` read a
        released expert back from the tiled bytes (the fp32 oracle does so per expert).

        Args:
            make: ``ExpertWeights -> layout`` (raises on a failed check: nothing of that layer is released).
            room: ``room(nbytes)`` -> whether the device has space for ~``nbytes`` more (the repack's
                temporaries); the conversion stops at the first layer without room (that layer and the rest
                stay in the checkpoint layout). None: no check.
            progress: ``progress(layers_done, layers_total, name)`` after each layer.
        Returns:
            ``{"layers": converted now, "already": converted before, "total": quantized MoE layers held,
            "bytes": tiled bytes made now, "seconds": repack seconds (device), "stopped": "" or why the
            conversion stopped early}``.
        """
        cfg = self.config
        first, end = self.expert_range
        todo = [i for i in range(cfg.num_hidden_layers)
                if (i, first, end) in self._experts and self._experts[(i, first, end)].quantized]
        out = {"layers": 0, "already": 0, "total": len(todo), "bytes": 0, "seconds": 0.0, "stopped": ""}
        for n, i in enumerate(todo):
            ew = self._experts[(i, first, end)]
            if ew.kernel_layout is not None:
                out["already"] += 1
                continue
            need = int(1.05 * ew.nbytes()) + (768 << 20)  # the tiled copy (+ padding) and the chunked temporaries
            why = ""
            if room is not None and not room(need):
                why = f"~{need / 1e9:.2f} GB needed"
            else:
                try:
                    lay = make(ew)
                except torch.OutOfMemoryError:  # nothing of this layer was released: it stays as it was
                    why = "out of device memory during the repack"
            if why:
                out["stopped"] = (f"no room on the device for layer {i}'s tiled copy ({why} while the checkpoint layout "
                                  "is held); it and later layers stay in the checkpoint layout")
                break
            for (j, a, b), other in self._experts.items():
                if j != i:
                    continue
                other.kernel_layout = lay if (a, b) == (first, end) else lay.experts(a - first, b - first)
                for f in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
                    t = getattr(other, f)
                    setattr(other, f, torch.empty(t.shape, dtype=t.dtype, device="meta"))
            for e in range(first, end):
                for sp in layout.expert_specs(cfg, i, e):
                    t = self._t.get(sp.name)
                    if t is not None and not t.is_meta:
                        self._t[sp.name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                        self._released[sp.name] = (i, first, end, e - first)
            out["layers"] += 1
            out["bytes"] += lay.nbytes
            out["seconds"] += lay.repack_s
            if progress is not None:
                progress(n + 1, len(todo), f"layer {i}")
        return out

    def nbytes(self) -> int:
        """Bytes of tensor data held (each stacked expert buffer and kernel layout counted once; released stacks
        hold none)."""
        n = sum(t.numel() * t.element_size() for k, t in self._t.items() if k not in self._views and not t.is_meta)
        seen: set[int] = set()
        for (i, a, b), ew in self._experts.items():
            ts = [t for t in ew.tensors().values() if not t.is_meta]
            if ew.kernel_layout is not None:
                ts += [ew.kernel_layout.w13.data, ew.kernel_layout.w2.data]
            for t in ts:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    n += t.untyped_storage().nbytes()
        return n

    def __repr__(self) -> str:
        return f"Weights({self.config.name}, {len(self._t)} tensors, {self.nbytes() / 1e6:.1f} MB)"


def load_weights(path: str | Path, device: str | torch.device = "cpu", **kwargs: Any) -> Weights:
    """``Weights.from_checkpoint(open_checkpoint(path), device, **kwargs)`` (validates the directory first)."""
    return Weights.from_checkpoint(open_checkpoint(path), device=device, **kwargs)


__all__ = ["Weights", "ExpertWeights", "load_weights", "as_weights", "keep_fp32", "FP32_TENSORS"]
