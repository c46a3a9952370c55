"""Count the torch (aten) ops one engine step issues, per layer and per calling k3rocm line.

The H200 profile of a K3 rank's decode step lists ~3,000 small torch kernels (casts, copies, adds, norms,
fills) beside the big ones; each costs ~2 us even graph-replayed. This script shows where each comes from: it
builds an :class:`~k3rocm.runtime.engine.Engine`, runs the prefill of ``--batch`` prompts eagerly, then
counts every aten op of the next ``--steps`` steps under a
:class:`torch.utils._python_dispatch.TorchDispatchMode`, keyed by

* the **layer** and side the decoder was running (``L3.attn`` / ``L3.mlp``; ``head`` = embedding, output
  AttnRes, norm and lm_head; ``step`` = the engine's own work outside the forward);
* the **op-table entry** it ran inside (``op:moe_experts`` ...) or ``glue`` (the model's own torch code
  between the ops: :mod:`k3rocm.model.layer`, ``common``, ``decoder``, the engine). On the CPU the op entries
  are the torch oracle functions, which the GPU replaces by Triton kernels, so only the ``glue`` rows (and
  on a GPU run with ``--kernels triton`` the wrappers' own torch work) carry over to the profile;
* the aten op, with its dtypes for the casts (``_to_copy f32->bf16``, ``copy_ f32->f32``), and the innermost
  k3rocm source line that issued it (``k3rocm/model/common.py:182 linear``).

Graphs replay what they captured, so the ops are counted on the eager path (``cuda_graphs=False``): a decode
step's eager ``_forward`` is the code the decode graph captures. On the CPU ``linear`` widens its bf16
product with ``.float()``; a GPU with ``torch.mm(out_dtype=fp32)`` does not (these rows say ``cpu-only``).

Usage::

    # CPU, the embedded k3-tiny, bf16 weights and bf16 matmuls (the engine's GPU precision path)
    python gpu-runs/count_ops.py --steps 2 --batch 4
    # GPU, one rank of K3 at TP16/EP16 with random weights, Triton kernels
    python gpu-runs/count_ops.py --device cuda --kernels triton --synthetic --preset k3 --profile h200-8 \\
        --tp 16 --ep 16 --batch 8 --steps 1 --json out/ops.json

Output: a table per (scope, aten op) of calls per step and per layer, the top sites, and with ``--json`` every
count. ``--max-glue-casts N`` exits 1 when the decode steps issue more than N fp32 -> low-precision casts per
layer outside the op table (a regression check).
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from k3rocm.config import K3Config, preset  # noqa: E402

# aten ops that move or allocate rather than compute: never interesting as "the step's math"
_SKIP = {"detach", "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "reshape", "expand",
         "as_strided", "slice", "select", "split", "split_with_sizes", "alias", "permute", "empty", "empty_like",
         "empty_strided", "lift_fresh", "unbind", "narrow", "is_same_size", "_local_scalar_dense", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous", "stride", "size", "numel",
         "set_", "record_stream", "_has_compatible_shallow_copy_type", "resolve_conj", "resolve_neg"}
_SRC = [str(ROOT / d) + os.sep for d in ("k3rocm", "kernels")]
_SHORT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64,
          "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool}
_NAME = {v: k for k, v in _SHORT.items()}


def _dt(d) -> str:
    return _NAME.get(d, str(d).replace("torch.", ""))


class Where:
    """The decoder position and op-table entry the counter attributes an op to (set by the wrappers)."""

    def __init__(self):
        self.scope = "step"
        self.op: str | None = None


def _site() -> str | None:
    """Innermost frame of k3rocm source (``k3rocm/...`` or ``kernels/...``) as ``path:line func``; None for an op
    that Triton's interpreter issues while it runs a kernel on the CPU (no such op exists on a GPU)."""
    f = sys._getframe(2)
    site = None
    while f is not None:
        fn = f.f_code.co_filename
        if "triton" in fn and "interpreter" in fn:
            return None
        if site is None and any(fn.startswith(s) for s in _SRC):
            site = f"{os.path.relpath(fn, ROOT)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return site or "?"


def _describe(func, args, kwargs) -> str:
    """The aten op's name, with dtypes for casts and copies (what tells a bf16 cast from a plain copy)."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        src = args[0].dtype if isinstance(args[0], torch.Tensor) else None
        dst = kwargs.get("dtype") or src
        return f"_to_copy {_dt(src)}->{_dt(dst)}"
    if name == "copy_":
        a, b = args[0], args[1]
        return f"copy_ {_dt(b.dtype)}->{_dt(a.dtype)}"
    if name in ("add", "mul", "sub", "div", "cat", "clone", "rms_norm", "_fused_rms_norm", "native_layer_norm",
                "where", "sigmoid", "tanh", "zeros_like", "fill_", "zero_"):
        t = next((x for x in (args[0] if name == "cat" else args) if isinstance(x, torch.Tensor)), None)
        if t is not None:
            return f"{name} {_dt(t.dtype)}"
    return name


class Counter(TorchDispatchMode):
    """Counts aten ops by (scope, op entry or glue, op description, site)."""

    def __init__(self, where: Where):
        super().__init__()
        self.where = where
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in _SKIP:
            site = _site()
            if site is not None:
                op = f"op:{self.where.op}" if self.where.op else "glue"
                self.counts[(self.where.scope, op, _describe(func, args, kwargs), site)] += 1
        return func(*args, **kwargs)


def instrument(engine, where: Where) -> None:
    """Wrap the engine's decoder halves and op table so :class:`Where` follows the forward."""
    dec = engine.dec
    for meth, side in (("attn", "attn"), ("mlp", "mlp")):
        orig = getattr(dec, meth)

        def wrapped(i, *a, _orig=orig, _side=side, **k):
            prev, where.scope = where.scope, f"L{i}.{_side}"
            try:
                return _orig(i, *a, **k)
            finally:
                where.scope = prev
        setattr(dec, meth, wrapped)
    for meth in ("embed", "hidden_out", "local_logits"):
        orig = getattr(dec, meth)

        def wrapped(*a, _orig=orig, **k):
            prev, where.scope = where.scope, "head"
            try:
                return _orig(*a, **k)
            finally:
                where.scope = prev
        setattr(dec, meth, wrapped)
    for name, fn in list(engine.ops.items()):
        def op(*a, _fn=fn, _name=name, **k):
            prev, where.op = where.op, where.op or _name
            try:
                return _fn(*a, **k)
            finally:
                where.op = prev
        # keep the capabilities the mixers read from a signature (layer._takes): forward the wrapped signature
        engine.ops[name] = functools.wraps(fn)(op)


def build_engine(args):
    """The engine of the command line: the embedded k3-tiny (or ``--checkpoint``), or ``--synthetic`` weights of
    one rank of ``--preset`` on ``--profile`` at ``--tp``/``--ep``."""
    from k3rocm.runtime.engine import Engine

    dtype = _SHORT[args.dtype]
    mm = None if args.matmul_dtype == "none" else _SHORT[args.matmul_dtype]
    # on the CPU, --kernels triton runs the Triton wrappers and kernels in Triton's interpreter
    # (TRITON_INTERPRET=1): the engine is built on the torch ops, then its op table is swapped
    interp = args.device == "cpu" and args.kernels == "triton"
    if interp and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu --kernels triton needs TRITON_INTERPRET=1 (Triton's interpreter)")
    kw = dict(device=args.device, dtype=dtype, matmul_dtype=mm, kv_dtype=_SHORT[args.kv_dtype], max_batch=args.batch, block_size=16,
              max_num_batched_tokens=max(args.batch * args.prompt_len, 8), max_model_len=args.max_model_len,
              cuda_graphs=False, kernels=None if interp else args.kernels)
    if args.synthetic:
        from k3rocm.profiles import load_profile
        from k3rocm.runtime.dist import ProjectedGroup
        from k3rocm.runtime.plan import plan
        from k3rocm.runtime.synthetic import synthetic_weights

        cfg = preset(args.preset)
        from k3rocm.runtime.plan import scaled_profile

        prof = load_profile(args.profile)
        if args.tp and args.tp > prof.device_count:  # one rank of a layout wider than one node, as bench does
            prof = scaled_profile(prof, args.tp, args.ep)
        pl = plan(cfg, prof, tp=args.tp, ep=args.ep, strict=False)
        w = synthetic_weights(cfg, pl, args.rank, device=args.device, seed=0)
        par = ProjectedGroup(pl, args.rank, args.device) if pl.world > 1 else None
        return cfg, _interp_ops(Engine(cfg, w, par=par, **kw), interp)
    from k3rocm.model.weights import load_weights

    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        from k3rocm.checkpoint.embedded import default_checkpoint
        ckpt = default_checkpoint()
    cfg = K3Config.from_file(ckpt / "config.json")
    return cfg, _interp_ops(Engine(cfg, load_weights(ckpt), **kw), interp)


def _interp_ops(eng, interp: bool):
    """``eng`` with its op table swapped to the registry's Triton implementations (when ``interp``)."""
    if interp:
        from k3rocm.runtime import registry

        for op in list(eng.ops):
            fn = registry.implementations(op)["triton"].fn
            eng.ops[op] = eng._static_split_plan(fn) if op == "mla_decode" else fn
            eng.op_impls[op] = "triton (interpreter)"
    return eng


def count(args) -> dict:
    """Run the engine and count; returns ``{"steps": n, "layers": L, "counts": [[scope, op, what, site, calls]]}``
    (calls summed over the counted steps)."""
    torch.manual_seed(0)
    cfg, eng = build_engine(args)
    where = Where()
    instrument(eng, where)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]
    for p in prompts:
        eng.add_request(p, args.steps + args.skip + 2, ignore_eos=True)
    # the prefill steps (uncounted unless --count-prefill) until every sequence decodes
    counter = Counter(where)
    counted = 0
    skipped = 0
    while eng.has_unfinished() and counted < args.steps:
        if not args.count_prefill and _all_decode(eng) and skipped < args.skip:
            eng.step()  # the first decode step builds the decode-only memos (kv_b splits)
            skipped += 1
        elif args.count_prefill or _all_decode(eng):
            with counter:
                eng.step()
            counted += 1
            if not args.count_prefill and eng.step_log[-1].num_prefill_tokens:
                raise SystemExit("a counted step carried prefill tokens; raise --max-model-len or lower --batch")
        else:
            eng.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    rows = [[*k, v] for k, v in sorted(counter.counts.items(), key=lambda kv: -kv[1])]
    return {"steps": counted, "layers": cfg.num_hidden_layers, "batch": args.batch,
            "config": args.preset if args.synthetic else "checkpoint", "device": args.device,
            "kernels": eng.op_impls, "layer_types": list(cfg.layer_types),
            "moe": [bool(cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)], "counts": rows}


def _all_decode(eng) -> bool:
    """Whether the next step is decode rows only: every unfinished sequence has its prompt cached."""
    from k3rocm.runtime.scheduler import Status

    seqs = [s for s in eng.seqs.values() if s.status != Status.FINISHED]
    return bool(seqs) and all(s.num_computed >= len(s.prompt) for s in seqs)


def glue_casts_per_layer(res: dict) -> float:
    """fp32 -> bf16/fp16 casts per step per layer issued outside the op table (``glue``) in the layers."""
    n = sum(c for scope, op, what, _site, c in res["counts"]
            if op == "glue" and scope.startswith("L") and what.startswith(("_to_copy f32->bf16", "_to_copy f32->f16")))
    return n / max(1, res["steps"]) / res["layers"]


def _kind(scope: str, types: list[str], moe: list[bool]) -> str:
    """``KDA`` / ``MLA`` (a token-mixer side), ``MoE`` / ``dense`` (a channel-mixer side), else the scope."""
    if not scope.startswith("L"):
        return scope
    i, side = scope[1:].split(".")
    if side == "attn":
        return types[int(i)].upper()
    return "MoE" if moe[int(i)] else "dense"


def report(res: dict, top: int) -> str:
    """The counts as text: per aten op calls per step by layer side kind (per layer of that kind), totals, and
    the top sites outside the op table (and inside it, for Triton wrappers)."""
    steps = max(1, res["steps"])
    types, moe = res["layer_types"], res["moe"]
    n_kind = collections.Counter([t.upper() for t in types] + ["MoE" if m else "dense" for m in moe])
    kinds = [k for k in ("KDA", "MLA", "MoE", "dense") if n_kind[k]] + ["head", "step"]
    n_kind.update({"head": 1, "step": 1})
    table: dict = collections.defaultdict(collections.Counter)
    sites = collections.Counter()
    for scope, op, what, site, c in res["counts"]:
        where = "glue" if op == "glue" else "ops"
        table[(where, what)][_kind(scope, types, moe)] += c
        sites[(where, what, site)] += c
    out = [f"{res['config']}: {res['steps']} counted decode step(s) of {res['batch']} rows, {res['layers']} layers "
           f"({', '.join(f'{n_kind[k]} {k}' for k in kinds[:-2])}), device {res['device']}, kernels "
           f"{sorted(set(res['kernels'].values()))}",
           "calls per step per layer of each kind (head, step: per step); glue = the model's torch code, "
           "ops = inside the op table",
           "", f"{'where':5} {'aten op':26}" + "".join(f"{k:>8}" for k in kinds)]
    tot = collections.Counter()
    for (where, what), per in sorted(table.items(), key=lambda kv: (kv[0][0], -sum(kv[1].values()))):
        out.append(f"{where:5} {what:26}" + "".join(
            f"{per[k] / steps / n_kind[k]:8.2f}" if per[k] else f"{'':8}" for k in kinds))
        for k in kinds:
            tot[(where, k)] += per[k]
    for where in ("glue", "ops"):
        out.append(f"{where:5} {'= all':26}" + "".join(f"{tot[(where, k)] / steps / n_kind[k]:8.2f}" for k in kinds))
    g = sum(v for (w, _), v in tot.items() if w == "glue") / steps
    o = sum(v for (w, _), v in tot.items() if w == "ops") / steps
    out.append(f"per step: glue {g:.0f}, inside ops {o:.0f}")
    for where in ("glue", "ops"):
        if where == "ops" and set(res["kernels"].values()) == {"torch"}:
            continue  # the torch oracle functions: replaced by kernels on a GPU
        out += ["", f"top {top} sites {'outside' if where == 'glue' else 'inside'} the op table (calls per step):"]
        rows = [(k, c) for k, c in sites.items() if k[0] == where]
        for (_, what, site), c in sorted(rows, key=lambda kv: -kv[1])[:top]:
            cpu = ("  (cpu-only: a GPU writes fp32 from the GEMM)" if "common.py" in site and " linear" in site
                   and what == "_to_copy bf16->f32" else "")
            out.append(f"{c / steps:8.1f}  {what:24} {site}{cpu}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kernels", default=None, help="registry override, e.g. triton or torch (default: the "
                                                    "engine's choice for the device)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"), help="engine weight dtype")
    ap.add_argument("--matmul-dtype", default="bf16", choices=("bf16", "f16", "none"))
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the embedded k3-tiny)")
    ap.add_argument("--synthetic", action="store_true", help="random weights of one rank of --preset")
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--ep", type=int, default=None)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4, help="concurrent sequences (decode rows per step)")
    ap.add_argument("--prompt-len", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="decode steps counted")
    ap.add_argument("--skip", type=int, default=1, help="decode steps run before counting")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "f32"), help="MLA latent cache dtype (a GPU "
                                                                             "engine's default: bf16)")
    ap.add_argument("--count-prefill", action="store_true", help="count from the first step (prefill included)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write every count here")
    ap.add_argument("--max-glue-casts", type=float, default=None,
                    help="exit 1 if the decode steps cast fp32 -> low precision more often than this per layer "
                         "outside the op table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = count(args)
    print(report(res, args.top))
    casts = glue_casts_per_layer(res)
    print(f"\nglue fp32->low-precision casts per layer per step: {casts:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.max_glue_casts is not None and casts > args.max_glue_casts:
        print(f"FAIL: {casts:.2f} > --max-glue-casts {args.max_glue_casts}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
