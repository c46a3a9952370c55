"""The small torch ops of an engine decode step, per layer side (the ~2 us kernels of the H200 profile; the
counting tool is ``gpu-runs/count_ops.py``): on the CPU bf16 engine (bf16 weights, bf16 matmuls, bf16 latent
cache, the torch ops), outside the op table,

* every fp32 -> bf16 cast is one operand of one GEMM: the mixer inputs are rounded once (the KDA and MLA
  projections, the MoE down projection and shared experts share one), nothing is rounded per projection;
* no same-dtype copy (``clone`` / ``copy_``: the ``.contiguous()`` of views a kernel reads by stride);
* the decode rows' MLA cache slots are made once per step, not once per MLA layer;
* a decode-only step reads the final AttnRes bank in place (no gather of the sampled rows).

The counts are exact, so a cast or copy put back into a layer function fails here."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3rocm.runtime.engine import Engine

from tests.helpers import load_ckpt

BF16 = torch.bfloat16


class _Ops(TorchDispatchMode):
    """aten ops by (layer side kind, op description) outside the engine's op table."""

    def __init__(self, eng: Engine):
        super().__init__()
        self.scope, self.inside = "step", 0
        self.counts: collections.Counter = collections.Counter()
        cfg, dec = eng.cfg, eng.dec
        for meth in ("attn", "mlp"):
            orig = getattr(dec, meth)

            def run(i, *a, _orig=orig, _meth=meth, **k):
                kind = (cfg.layer_type(i).upper() if _meth == "attn" else "MoE" if cfg.is_moe_layer(i) else "dense")
                self.scope = kind
                try:
                    return _orig(i, *a, **k)
                finally:
                    self.scope = "head"
            setattr(dec, meth, run)
        for name, fn in list(eng.ops.items()):
            def op(*a, _fn=fn, **k):
                self.inside += 1
                try:
                    return _fn(*a, **k)
                finally:
                    self.inside -= 1
            eng.ops[name] = op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside:
            name = func.overloadpacket.__name__
            if name == "_to_copy":
                name = f"cast {args[0].dtype}->{kwargs.get('dtype')}"
            self.counts[(self.scope, name)] += 1
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def counted(golden_ckpt):
    """(config, counts of one decode step of 4 rows) after prefill and one uncounted decode step."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, w = load_ckpt(golden_ckpt)
        eng = Engine(cfg, w, device="cpu", dtype=BF16, matmul_dtype=BF16, kv_dtype=BF16, block_size=4,
                     max_model_len=32, max_batch=4, max_num_batched_tokens=32)
        g = torch.Generator().manual_seed(7)
        for L in (3, 6, 1, 9):
            eng.add_request(torch.randint(3, cfg.vocab_size, (L,), generator=g).tolist(), 4, ignore_eos=True)
        eng.step()  # every prompt in one prefill step
        eng.step()  # the first decode step builds the decode-only memos (kv_b splits)
        assert eng.step_log[-1].num_decode == 4 and not eng.step_log[-1].num_prefill_tokens
        mode = _Ops(eng)
        with mode:
            eng.step()
        assert eng.step_log[-1].num_decode == 4 and not eng.step_log[-1].num_prefill_tokens
    finally:
        torch.set_num_threads(n)
    return cfg, mode.counts


def _per_kind(cfg, counts, name):
    """Calls of aten op ``name`` per layer side of each kind in one step."""
    n = collections.Counter([t.upper() for t in cfg.layer_types] +
                            ["MoE" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)])
    return {k: counts[(k, name)] / n[k] for k in ("KDA", "MLA", "MoE", "dense")}


def test_one_cast_per_gemm_operand(counted):
    cfg, counts = counted
    casts = _per_kind(cfg, counts, f"cast {torch.float32}->{BF16}")
    mms = _per_kind(cfg, counts, "mm")
    # KDA: the normed input (for q|k|v|g|b|f_a), f_a (for f_b), the decode output (o_proj): 3 GEMMs, 3 casts.
    # MLA: the normed input (q_a|kv_a and g_proj), the normed q_a (q_b), the gated output (o_proj): 4 GEMMs.
    # MoE: x once (down projection and shared gate|up), the normed latent (up); the down projection writes the
    # experts' bf16 input itself and the ``glu`` op the shared GLU's (the down projection's operand dtype: on a GPU
    # the Triton op stores bf16, no cast). dense: the normed input (gate|up).
    assert casts == {"KDA": 3, "MLA": 3, "MoE": 2, "dense": 1}, casts
    assert mms == {"KDA": 3, "MLA": 4, "MoE": 4, "dense": 2}, mms


def test_no_copies_and_per_step_slots(counted):
    cfg, counts = counted
    # (the engine's own host-side step preparation, scope "step", is not a layer's)
    copies = {k: v for k, v in counts.items()
              if k[0] != "step" and k[1] in ("clone", "copy_", "contiguous", "cat", "stack")}
    assert not copies, copies
    mla = sum(t == "mla" for t in cfg.layer_types)
    assert mla > 1
    # the decode rows' cache slots (one block-table gather) once per step, in the first MLA layer
    assert sum(v for (k, name), v in counts.items() if name == "gather") == 1
    # after the last layer (scope "head": output AttnRes, norm, lm_head) no gather of sampled rows
    assert not counts[("head", "index")] and not counts[("head", "stack")]
