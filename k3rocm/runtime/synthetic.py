"""Synthetic weights: random tensors made directly in device memory for one rank of a placement (no checkpoint).

``--synthetic`` times the step of a model that is not on disk (the official 93-layer K3 as one rank of a
TP16/EP16 layout: ~100 GB, one H200) with **random weights: its outputs mean nothing** (no correctness claim
can be made from them). The tensors are exactly those the loader gives that rank (:func:`synthetic_weights`:
same names, local shapes and dtypes as ``placement.ranks[r].tensors``), filled on the device with
``torch.randn`` / ``torch.randint`` (no host round trip), in ranges that keep activations finite over every
layer (K3_FACTS §2-§5):

* bf16 projections: ``N(0, 1/fan_in)`` (``fan_in`` = the full input width, also for a column-split slice);
  the ones writing back into the residual (``o_proj``, ``down_proj``, ``routed_expert_up_proj``) further
  scaled by ``1/sqrt(2 L)`` (L layers), embedding rows ``N(0, 1)``;
* MXFP4 experts: uniform random E2M1 codes (two per byte, rms 2.93 over the 16 codes) and one E8M0 exponent
  per 32-value group, ``127 + round(log2(1 / (2.93 sqrt(fan_in))))``, so a weight's rms is about
  ``1/sqrt(fan_in)`` (``w2`` further by ``1/sqrt(2 L)``);
* norms 1, AttnRes pseudo-queries ``N(0, 0.02²)``, router bias 0, KDA ``A_log`` = log U(1, 16), ``dt_bias``
  ``N(0, 0.1²)``, short-conv taps ``N(0, 1/4)``, ``o_norm`` 1.

Collectives of the other ranks cannot run in one process: :class:`k3rocm.runtime.dist.ProjectedGroup` counts
them (the same accounting as the real group) and :func:`collective_projection` turns the counts into time
over the profile's link bandwidth (``projected``). :func:`tpot_projection` carries a measured step over to
another profile by the ratio of the two step floors (``StepRoofline``, HBM-bandwidth bound at decode).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from k3rocm.checkpoint.reader import DTYPES
from k3rocm.config import K3Config
from k3rocm.errors import ConfigError, HardwareError
from k3rocm.model.weights import Weights
from k3rocm.mx import E2M1_VALUES
from k3rocm.runtime.dist import ProjectedGroup
from k3rocm.runtime.plan import EXPERT_RE, Placement, ShardSlice

__all__ = ["RANDOM_WEIGHTS_NOTE", "SyntheticIndex", "synthetic_weights", "e8m0_exponent", "collective_projection",
           "tpot_projection", "check_rank"]

RANDOM_WEIGHTS_NOTE = ("RANDOM WEIGHTS (--synthetic): outputs are of random tensors and mean nothing; only "
                       "shapes, finiteness and timings are evidence, never correctness")
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))  # rms over the 16 codes: 2.93
MX_GROUP = 32
_OUT_PROJ = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class SyntheticIndex:
    """Stands where a checkpoint index would: the tensor set is the config's layout, nothing is on disk.

    Attributes:
        config: the model config. tensors: the number of tensors of the layout.
    """

    config: K3Config
    tensors: int

    path = "<synthetic>"

    def __len__(self) -> int:
        return self.tensors

    def is_official(self) -> bool:
        """Never: random weights have none of the release's known answers."""
        return False


def e8m0_exponent(fan_in: int, extra: float = 1.0) -> int:
    """The E8M0 scale byte (``127 + e``) giving random E2M1 codes an rms of ``extra / sqrt(fan_in)``."""
    return 127 + round(math.log2(extra / (E2M1_RMS * math.sqrt(max(fan_in, 1)))))


def check_rank(placement: Placement | tuple[int, int], rank: int) -> None:
    """Raises ConfigError (one line) when ``rank`` is not a rank of ``placement`` — a :class:`Placement`, or the
    layout ``(tp, ep)`` before it is planned (one process per rank: world = tp; ``ep`` None: not named, the line
    says ``TP<tp>`` alone)."""
    tp, ep, world = ((placement.tp, placement.ep, placement.world) if isinstance(placement, Placement)
                     else (placement[0], placement[1], placement[0]))
    if not 0 <= int(rank) < world:
        layout = f"TP{tp}" if ep is None else f"TP{tp}/EP{ep}"
        raise ConfigError(f"--rank {rank} is not a rank of the {layout} layout (ranks 0..{world - 1})")


def _fill(name: str, sl: ShardSlice, t: torch.Tensor, gen: torch.Generator, cfg: K3Config) -> None:
    resid = 1.0 / math.sqrt(2 * max(cfg.num_hidden_layers, 1))
    if t.numel() == 0:
        return
    if name.endswith("weight_packed"):
        t.random_(0, 256, generator=gen)  # in place on the device: no second buffer
    elif name.endswith("weight_scale"):
        fan_in = sl.shape[-1] * MX_GROUP  # one scale per 32 inputs
        t.fill_(e8m0_exponent(fan_in, resid if ".w2." in name else 1.0))
    elif name.endswith(("norm.weight", "layernorm.weight")):
        t.fill_(1.0)
    elif name.endswith("_res_proj.weight"):
        t.normal_(0.0, 0.02, generator=gen)
    elif name.endswith("e_score_correction_bias"):
        t.zero_()
    elif name.endswith("A_log"):
        t.uniform_(0.0, math.log(16.0), generator=gen)
    elif name.endswith("dt_bias"):
        t.normal_(0.0, 0.1, generator=gen)
    elif "conv1d" in name:
        t.normal_(0.0, 0.5, generator=gen)
    elif name.endswith("embed_tokens.weight"):
        t.normal_(0.0, 1.0, generator=gen)
    else:  # projections [out, in]
        std = 1.0 / math.sqrt(sl.shape[-1])
        if name.endswith(_OUT_PROJ):
            std *= resid
        t.normal_(0.0, std, generator=gen)


def synthetic_weights(cfg: K3Config, placement: Placement, rank: int, device: str | torch.device = "cpu",
                      seed: int = 0, progress: Progress | None = None) -> Weights:
    """Random weights of rank ``rank`` of ``placement``, made on ``device`` (see the module docstring).

    Returns:
        :class:`Weights` holding exactly the tensors ``placement.ranks[rank].tensors`` names, each of its local
        shape and stored dtype (BF16 / F32 / U8 packed E2M1 codes and E8M0 scales), expert range = the rank's.
    Raises:
        ConfigError: ``rank`` outside the layout.
        HardwareError: the rank's bytes do not fit the free memory of ``device``.
    """
    check_rank(placement, rank)
    rp = placement.ranks[rank]
    dev = torch.device(device)
    total = rp.weights_bytes
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if total > free:
            raise HardwareError(f"rank {rank} of TP{placement.tp}/EP{placement.ep} holds {total / 1e9:.1f} GB of "
                                f"weights, {free / 1e9:.1f} GB free on {dev}; use a larger --tp or a smaller preset")
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))
    tensors: dict[str, torch.Tensor] = {}
    # routed experts: one buffer per (layer, w1|w3 -> w13 / w2, packed / scale), laid out as the stacks the engine
    # builds ([E, rows, cols], w1 rows then w3 rows), each expert's tensors views into it: the stacking copy
    # then reuses same-sized blocks layer after layer instead of leaving ~100 GB of small freed blocks behind
    groups: dict[tuple[str, str, str], list[tuple[int, str, str, ShardSlice]]] = {}
    done, last = 0, 0.0

    def tick(nbytes: int, name: str) -> None:
        nonlocal done, last
        done += nbytes
        now = time.monotonic()
        if progress is not None and now - last > 0.5:
            progress(done, total, name)
            last = now

    for name, sl in rp.tensors.items():
        m = EXPERT_RE.search(name)
        if m is not None:
            stem, e, wn, kind = name[:m.start()], int(m.group(1)), m.group(2), name.rsplit(".", 1)[1]
            groups.setdefault((stem, "w2" if wn == "w2" else "w13", kind), []).append((e, wn, name, sl))
            continue
        t = torch.empty(sl.local_shape, dtype=DTYPES[sl.dtype][0], device=dev)
        _fill(name, sl, t, gen, cfg)
        tensors[name] = t
        tick(sl.nbytes, name)
    for members in groups.values():
        experts = sorted({e for e, *_ in members})
        by = {(e, wn): (name, sl) for e, wn, name, sl in members}
        parts = [wn for wn in ("w1", "w3", "w2") if (experts[0], wn) in by]
        name0, sl0 = by[(experts[0], parts[0])]
        rows = [by[(experts[0], wn)][1].local_shape[0] for wn in parts]
        buf = torch.empty((len(experts), sum(rows), *sl0.local_shape[1:]), dtype=DTYPES[sl0.dtype][0], device=dev)
        _fill(name0, sl0, buf, gen, cfg)
        for j, e in enumerate(experts):
            r0 = 0
            for wn, r in zip(parts, rows):
                name, sl = by[(e, wn)]
                tensors[name] = buf[j, r0:r0 + r]
                r0 += r
        tick(buf.numel() * buf.element_size(), name0)
    if progress is not None:
        progress(total, total, "synthetic weights")
    return Weights.from_tensors(cfg, tensors, (rp.expert_first, rp.expert_stop) if rp.expert_stop > rp.expert_first
                                else None)


def collective_projection(group: ProjectedGroup, link_bandwidth: float, rows: int) -> dict[str, dict]:
    """Projected collectives of one step of ``rows`` tokens, from what ``group`` counted so far.

    Per collective name: calls per step = counted calls / the calls of the ``greedy`` pick (one per sampling
    step; else as counted), bytes per step = calls per step x ``rows`` x the bytes of one row
    (:attr:`ProjectedGroup.row_bytes`), seconds per step = :meth:`ProjectedGroup.projected_seconds` of those
    bytes (one call at a time).

    Returns:
        ``{name: {"calls", "bytes", "seconds"}}`` per step, plus ``"total"``.
    """
    snap = group.stats.snapshot()
    steps = max(int(snap.get("greedy", {}).get("calls", 0)), 1)
    out: dict[str, dict] = {}
    tot = {"calls": 0.0, "bytes": 0.0, "seconds": 0.0}
    for name, v in snap.items():
        calls = v["calls"] / steps
        b = calls * rows * group.row_bytes.get(name, 0.0)
        d = {"calls": calls, "bytes": b, "seconds": group.projected_seconds(name, b, link_bandwidth)}
        out[name] = d
        for k in tot:
            tot[k] += d[k]
    out["total"] = tot
    return out


def tpot_projection(measured_step_s: float, here: Placement, target: Placement, batch: int, context: int,
                    target_collective_s: float) -> dict:
    """TPOT of ``target`` projected from a step measured on ``here``'s rank: ``measured x floor_target /
    floor_here`` (the same fraction of the decode floor, :meth:`StepRoofline.decode`) ``+`` the target's
    projected collectives.

    Returns:
        ``{"tpot_s", "floor_here_s", "floor_target_s", "ratio", "collectives_s"}``.
    """
    fh = here.roofline.decode(batch, context)["floor_s"]
    ft = target.roofline.decode(batch, context)["floor_s"]
    ratio = ft / fh if fh > 0 else float("nan")
    return {"tpot_s": measured_step_s * ratio + target_collective_s, "floor_here_s": fh, "floor_target_s": ft,
            "ratio": ratio, "collectives_s": target_collective_s}
