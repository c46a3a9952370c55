"""Write a random-weight checkpoint of any :class:`~k3rocm.config.K3Config` in the released on-disk layout.

Layout (K3_FACTS §2-4, checked byte for byte against the ``k3-tiny-golden`` checkpoint):

* ``config.json`` = ``json.dumps(cfg.to_dict(), indent=2)`` (the wrapper with ``text_config``);
* ``model.safetensors.index.json`` = ``{"metadata": {"total_size": N}, "weight_map": {name: shard}}``
  (``indent=2``, names sorted), ``total_size`` = sum of tensor data bytes;
* shards ``model-{i:05d}-of-{n:06d}.safetensors`` (the release's own spelling, e.g.
  ``model-00001-of-000096``), each holding whole decoder layers in order (so one MoE layer's experts sit
  in one shard) and the model-level tensors (embedding, final norms, lm_head) in the last shard;
* inside a shard, the safetensors serialisation of the ``safetensors`` library: header
  ``{"__metadata__":{"format":"pt"}, ...}`` (compact JSON, tensors ordered by dtype F32, BF16, U8 then
  name, space-padded to a multiple of 8 bytes), then the data in the same order.

Shards are streamed tensor by tensor, so a full-width ``k3-prefix-2`` (~17 GB) needs memory for one
tensor at a time, not one shard. Everything is written into a temporary directory beside ``out_dir`` and
renamed at the end: a failure leaves nothing half-written under ``out_dir``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch

from k3rocm import mx
from k3rocm.checkpoint import layout
from k3rocm.checkpoint.layout import TensorSpec
from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError, ConfigError, HardwareError, environment_error, size_text

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SHARD_TARGET_BYTES = 20 * 10**9

# safetensors orders a shard's tensors by dtype (larger enum first) then name; for the dtypes a
# checkpoint holds: I64 > F32 > BF16 > F16 > F8 > U8 (checked against safetensors.torch.save_file).
_DTYPE_ORDER = {"I64": 0, "F32": 1, "BF16": 2, "F16": 3, "F8_E4M3": 4, "U8": 5}
_TORCH_DTYPE = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8,
                "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64}

Progress = Callable[[int, int, str], None]


def shard_name(i: int, n: int) -> str:
    """Release spelling of shard ``i`` (1-based) of ``n``: ``model-00001-of-000096.safetensors``."""
    return f"model-{i:05d}-of-{n:06d}.safetensors"


def default_num_shards(cfg: K3Config) -> int:
    """Shards for a checkpoint: about one per 20 GB, at least 2 (as the golden k3-tiny), at most one per layer."""
    total = layout.counts(cfg)["bytes"]
    return max(1, min(cfg.num_hidden_layers, max(2, math.ceil(total / SHARD_TARGET_BYTES))))


def _units(cfg: K3Config) -> list[list[TensorSpec]]:
    """Indivisible groups of tensors, in file order: each decoder layer (its experts included), then the
    embedding, the small model-level tensors (final norms / AttnRes), the lm_head."""
    units = [layout.layer_specs(cfg, i) for i in range(cfg.num_hidden_layers)]
    model = layout.model_specs(cfg)
    embed = [s for s in model if s.name.endswith("embed_tokens.weight")]
    head = [s for s in model if s.name == layout.LM_HEAD]
    rest = [s for s in model if s not in embed and s not in head]
    return units + [u for u in (embed, rest, head) if u]


def plan_shards(cfg: K3Config, num_shards: int | None = None) -> list[list[TensorSpec]]:
    """Assign every tensor of ``layout.iter_specs(cfg)`` to a shard.

    Units (see :func:`_units`: whole decoder layers, then embedding / final norms / lm_head) go to
    shards in order; shard ``k`` is closed before a unit that would take the running total past
    ``(k+1)/n`` of all bytes, or when the units left are needed one per remaining shard. So one MoE
    layer's experts always share a shard, and this reproduces the golden k3-tiny split
    (layers 0-5 | layers 6-12 + model-level tensors); the official 96 shards are one unit each.

    Returns:
        ``n`` lists of specs, each in the safetensors on-disk order.
    Raises:
        ConfigError: ``num_shards`` outside ``1..(layers + model-level units)``.
    """
    units = _units(cfg)
    n = default_num_shards(cfg) if num_shards is None else int(num_shards)
    if not 1 <= n <= len(units):
        raise ConfigError(f"shard count {n} must be in 1..{len(units)} for {cfg.name} (a shard holds whole "
                          "layers; --shards)")
    sizes = [sum(s.nbytes for s in u) for u in units]
    total = sum(sizes)
    shards: list[list[TensorSpec]] = [[] for _ in range(n)]
    k, cum, in_shard = 0, 0, 0
    for i, u in enumerate(units):
        units_left = len(units) - i
        shards_left_after = n - 1 - k
        if in_shard and k < n - 1 and (cum + sizes[i] > total * (k + 1) / n or units_left <= shards_left_after):
            k += 1
            in_shard = 0
        shards[k].extend(u)
        cum += sizes[i]
        in_shard += 1
    return [sorted(sh, key=lambda s: (_DTYPE_ORDER[s.dtype], s.name)) for sh in shards]


def shard_header(specs: Iterable[TensorSpec]) -> bytes:
    """The safetensors header bytes (8-byte length + padded JSON) for ``specs`` in the given order."""
    hdr: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        hdr[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js


# ------------------------------------------------------------------------------- random weights
def _generator(seed: int, name: str) -> torch.Generator:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def random_tensor(spec: TensorSpec, seed: int, kda_num_heads: int | None = None) -> torch.Tensor:
    """Deterministic random values for a trunk tensor (realistic scales, close to the golden k3-tiny's), stored dtype.

    norms ~ 1 + N(0, 0.1^2); ``A_log`` = log U(1, 16) (exp(A_log) in 1..16) for the first ``kda_num_heads``
    entries, 0 for the unused rest (K3_FACTS §3); ``dt_bias`` ~ N(0, 0.1^2); conv weights ~ N(0, 1/W);
    ``e_score_correction_bias`` ~ N(0, 0.05^2); embedding ~ N(0, 1); AttnRes pseudo-queries ``*_res_proj``
    ~ N(0, 0.5^2); every other matrix (projections, lm_head) ~ N(0, 1/in) with ``in`` = last dim.
    """
    g = _generator(seed, spec.name)
    shape, n = spec.shape, spec.name
    if n.endswith("A_log"):
        v = torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))
        if kda_num_heads is not None:
            v[kda_num_heads:] = 0.0
    elif n.endswith("dt_bias"):
        v = 0.1 * torch.randn(shape, generator=g)
    elif n.endswith("e_score_correction_bias"):
        v = 0.05 * torch.randn(shape, generator=g)
    elif "conv1d" in n:
        v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    elif len(shape) == 1:  # every other vector is a norm weight
        v = 1.0 + 0.1 * torch.randn(shape, generator=g)
    elif n.endswith("embed_tokens.weight"):
        v = torch.randn(shape, generator=g)
    elif n.endswith("_res_proj.weight"):
        v = 0.5 * torch.randn(shape, generator=g)
    else:
        v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return v.to(_TORCH_DTYPE[spec.dtype])


def random_expert_weight(name: str, out_features: int, in_features: int, seed: int,
                         scale_rule: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``(weight_packed [out, in/2] u8, weight_scale [out, in/32] u8)`` of N(0, 1/in) values.

    ``name`` is the weight's base name (``...experts.{e}.w1``); both tensors come from one draw.
    """
    g = _generator(seed, name)
    w = torch.randn((out_features, in_features), generator=g) / math.sqrt(in_features)
    return mx.quantize_mxfp4(w, scale_rule)


# E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}: RMS of a uniformly drawn code (K3_FACTS §4)
_E2M1_CODE_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)

EXPERT_INITS = ("gaussian", "codes")


def random_expert_codes(name: str, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 ``(weight_packed [out, in/2] u8, weight_scale [out, in/32] u8)`` drawn directly in the format.

    Every E2M1 code uniform over the 16 codes (both nibbles of each byte); each E8M0 group exponent is
    ``floor(log2(sigma / r))`` or one more, uniformly, with ``sigma = in^-1/2`` and ``r`` the RMS of a uniform
    code (2.93), so the dequantized RMS is close to the ``gaussian`` init's N(0, 1/in). No float draw and no
    quantization: about 100 x faster, for full-width presets whose experts are most of the bytes.
    """
    g = _generator(seed, name)
    # 8 code bytes per int64 draw (in_features is a multiple of 32, so the bytes split evenly)
    packed = torch.randint(-2**63, 2**63 - 1, (out_features * in_features // 16,), generator=g,
                           dtype=torch.int64).view(torch.uint8).view(out_features, in_features // 2)
    e0 = math.floor(math.log2(1.0 / math.sqrt(in_features) / _E2M1_CODE_RMS)) + 127
    n = out_features * (in_features // mx.GROUP)
    bits = torch.randint(-2**63, 2**63 - 1, (-(-n // 8),), generator=g, dtype=torch.int64).view(torch.uint8)[:n]
    scale = (bits & 1).add_(e0).view(out_features, in_features // mx.GROUP)
    return packed, scale


class _ExpertCache:
    """Draw each expert weight once (``init``: ``gaussian`` quantized, or ``codes``) and hand out its packed
    and scale tensors."""

    def __init__(self, seed: int, init: str = "gaussian"):
        self.seed = seed
        self.init = init
        self.base: str | None = None
        self.pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, spec: TensorSpec) -> torch.Tensor:
        base, kind = spec.name.rsplit(".", 1)
        if base != self.base:
            packed_shape = spec.shape if kind == "weight_packed" else None
            out = spec.shape[0]
            in_f = (packed_shape[1] * 2) if packed_shape else spec.shape[1] * mx.GROUP
            draw = random_expert_codes if self.init == "codes" else random_expert_weight
            self.pair = draw(base, out, in_f, self.seed)
            self.base = base
        assert self.pair is not None
        return self.pair[0] if kind == "weight_packed" else self.pair[1]


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()).cast("B")


# ------------------------------------------------------------------------------- writer
def write_checkpoint(cfg: K3Config, out_dir: str | Path, seed: int = 0, num_shards: int | None = None,
                     progress: Progress | None = None, expert_init: str = "gaussian") -> Path:
    """Write a deterministic random-weight checkpoint of ``cfg`` into ``out_dir``.

    Args:
        cfg: any config ``layout.iter_specs`` understands (k3-tiny, k3-prefix-N, full K3, ...).
        out_dir: target directory; must not exist or be empty.
        seed: weights are a pure function of (seed, tensor name).
        num_shards: shard count (default :func:`default_num_shards`).
        progress: called as ``progress(bytes_done, bytes_total, tensor_name)`` after each tensor.
        expert_init: ``"gaussian"`` (N(0, 1/in) quantized to MXFP4 with the ``even`` scale rule) or
            ``"codes"`` (:func:`random_expert_codes`: format-level draws, ~100 x faster for full widths).
    Returns:
        ``out_dir`` as a Path.
    Raises:
        CheckpointError: ``out_dir`` exists and is not an empty directory, or the disk write fails (a path
            problem: no permission, a directory where a file goes).
        HardwareError: the disk has too little free space (checked before anything is written), or it runs out,
            fails or is read-only while writing (exit 3, as every "no space" error).
        ConfigError: bad ``num_shards`` or ``expert_init``.
    """
    if expert_init not in EXPERT_INITS:
        raise ConfigError(f"expert_init {expert_init!r} is not one of {', '.join(EXPERT_INITS)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: is a file, not a directory; choose a new directory for the checkpoint")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: already exists and is not empty; remove it or choose another directory")
    if any(p.exists() and not p.is_dir() for p in out.parents):
        raise CheckpointError(f"{out}: a parent path is a file, not a directory; choose another location")
    shards = plan_shards(cfg, num_shards)
    n = len(shards)
    total = sum(s.nbytes for sh in shards for s in sh)
    require_free_space(_written_bytes(cfg, shards), out.parent, f"{out}: {cfg.name}",
                       "free space there or write it to another disk"
                       + ("" if cfg.name == "k3-tiny" else ", or choose a smaller preset"))
    created = [q for q in out.parents if not q.exists()]  # deepest first: removed again if the write fails
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        os.chmod(tmp, 0o755)
    except OSError as e:
        _remove_empty(created)
        raise CheckpointError(f"{out}: cannot create the checkpoint there ({e.strerror or e}); "
                              "choose a writable directory") from None
    except BaseException:  # Ctrl-C / SIGTERM: no empty parent directory left behind
        _remove_empty(created)
        raise
    try:
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=2))
        weight_map: dict[str, str] = {}
        done = 0
        experts = _ExpertCache(seed, expert_init)
        for k, specs in enumerate(shards):
            name = shard_name(k + 1, n)
            with open(tmp / name, "wb") as f:
                f.write(shard_header(specs))
                for s in specs:
                    t = experts.get(s) if s.part == "expert" and s.dtype == "U8" else random_tensor(s, seed, cfg.kda_num_heads)
                    if tuple(t.shape) != s.shape:
                        raise CheckpointError(f"internal: {s.name} generated with shape {tuple(t.shape)}, "
                                              f"layout says {s.shape}")
                    f.write(_bytes_of(t))
                    weight_map[s.name] = name
                    done += s.nbytes
                    if progress is not None:
                        progress(done, total, s.name)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        # no space, quota, I/O error, read-only medium: the environment's (exit 3); any other: the path's (exit 2)
        cls = HardwareError if environment_error(e) else CheckpointError
        raise cls(f"{out}: writing the checkpoint failed ({e.strerror or e}); nothing was kept - check free space "
                  "and permissions") from None
    except BaseException:  # Ctrl-C / SIGTERM included: the partial files and the parents made for them go
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    return out


def require_free_space(need: int, where: str | Path, what: str, hint: str) -> None:
    """Refuse up front to write ``need`` bytes under ``where`` when its file system has less free space.

    ``where`` need not exist yet: its nearest existing ancestor is measured, and named in the message. Sizes are
    shown with :func:`k3rocm.errors.size_text` (exact byte counts when the two would read the same). Nothing is
    checked when the free space cannot be read.

    Args:
        need: bytes about to be written.
        where: the directory they go to.
        what: what needs them; starts the line (e.g. ``"/data/ck: k3-tiny"``).
        hint: what to do; ends the line.
    Raises:
        HardwareError: too little free space (exit 3, as a "no space" error met while writing).
    """
    probe = Path(where)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if need > free:
        a, b = size_text(need), size_text(free)
        if a == b:
            a, b = f"{need:,} bytes", f"{free:,} bytes"
        raise HardwareError(f"{what} needs {a} but {probe} has {b} free; {hint}")


def checkpoint_nbytes(cfg: K3Config, num_shards: int | None = None) -> int:
    """Bytes :func:`write_checkpoint` writes for ``cfg``: tensor data, shard headers, config.json and the index."""
    return _written_bytes(cfg, plan_shards(cfg, num_shards))


def _written_bytes(cfg: K3Config, shards: list[list[TensorSpec]]) -> int:
    """:func:`checkpoint_nbytes` of a planned split (the index's size estimated: one line per tensor)."""
    index = sum(len(s.name) + len(shard_name(1, len(shards))) + 12 for sh in shards for s in sh) + 64
    return (sum(s.nbytes for sh in shards for s in sh) + sum(len(shard_header(sh)) for sh in shards)
            + len(json.dumps(cfg.to_dict(), indent=2)) + index)


def _remove_empty(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` (deepest first) while it is empty: the parent directories a failed or interrupted
    write created, so it leaves nothing behind. Stops at the first that is not empty or cannot be removed;
    raises nothing."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break


__all__ = ["write_checkpoint", "plan_shards", "shard_header", "shard_name", "default_num_shards",
           "random_tensor", "random_expert_weight", "require_free_space", "checkpoint_nbytes", "INDEX_NAME",
           "CONFIG_NAME"]
