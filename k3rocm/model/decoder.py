"""The one decoder skeleton: the order of a Kimi K3 layer, shared by every model that runs one.

K3_FACTS §5, per decoder layer ``i`` (Block Attention Residuals instead of a residual stream):

1. attention-side AttnRes aggregation over the bank rows + the running prefix (layer 0: the embedding);
   on a write layer the prefix becomes a bank row and restarts at zero;
2. ``input_layernorm`` -> token mixer (KDA or gated MLA) -> prefix += out;
3. MLP-side AttnRes aggregation -> ``post_attention_layernorm`` -> channel mixer (dense SiTU-GLU or Stable
   LatentMoE) -> prefix += out;

then the output AttnRes over every row, the final ``norm`` and the lm_head. The Kimi-Linear family runs the
same order on a pre-norm residual stream instead.

:class:`Decoder` is that order, once. The fp32 oracle (:class:`k3rocm.model.model.K3Model`), the serving
engine (:class:`k3rocm.runtime.engine.Engine`) and each rank of a tensor/expert-parallel layout run it and
differ only in

* the **ops table** (op name -> callable: the oracle functions, or the registry's kernels);
* the **parallel context** (:class:`Parallel`: identity on one rank; :class:`k3rocm.runtime.dist.TPGroup`
  across ranks), which owns every collective: the sum of the token mixers' ``o_proj`` partials, of the dense
  MLP and of the latent MoE (routed + shared partials, reduced before the latent norm), the vocabulary-parallel
  embedding and the distributed greedy pick over the vocabulary slices;
* the **batch form**: the token mixer is a callable ``mix(i, x) -> out`` given by the caller (prefill chunks
  and decode rows on a cache, or one plain causal forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from k3rocm.config import K3Config
from k3rocm.errors import ConfigError
from k3rocm.model.attnres import fold_res_weight
from k3rocm.model.common import f32, linear, rms_norm
from k3rocm.model.layer import (AttnResState, Batch, WeightView, attn_side, dense_mlp, final_aggregate, local_config,
                                mixer_input_dtype, mlp_side, moe_block, takes_addend)

__all__ = ["Parallel", "LayerState", "Decoder", "Mixer"]

#: ``mix(layer, x) -> out``: the token mixer of one batch form; x ``[T, hidden]`` fp32 after
#: ``input_layernorm``, out ``[T, hidden]`` (a rank's partial sum under tensor parallelism)
Mixer = Callable[[int, torch.Tensor], torch.Tensor]


class Parallel:
    """The parallel context of one rank that owns every collective of the decoder: here the identity (one
    rank, nothing to reduce). :class:`k3rocm.runtime.dist.TPGroup` is the multi-rank one.

    Attributes:
        tp: tensor-parallel degree (heads and intermediate sizes are split by it).
        world: ranks in the layout. rank: this rank.
        vocab_start, vocab_stop: the vocabulary rows of the embedding / lm_head this rank holds (None: all).
    """

    tp: int = 1
    world: int = 1
    rank: int = 0
    vocab_start: int | None = None
    vocab_stop: int | None = None
    stats: Any = None  # collective counts (:class:`k3rocm.runtime.dist.CommStats`); None: no collectives

    def reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """Sum of ``t`` over the ranks (``name``: which collective, for the per-step byte count)."""
        return t

    def embed_rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of token ids ``[T]`` int64 from this rank's rows ``table [V_local, hidden]``:
        ``[T, hidden]`` fp32. One rank holds every row."""
        return f32(table[ids])

    def agree_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the ranks (e.g. cache slots every rank can hold)."""
        return [int(v) for v in values]

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits ``[N, V]`` from this rank's slice ``[N, V_local]``."""
        return local

    def greedy(self, local: torch.Tensor) -> torch.Tensor:
        """Greedy token ids ``[N]`` int64 from this rank's logits slice ``[N, V_local]``: the argmax over the
        whole vocabulary, lowest id on ties."""
        return local.argmax(-1)


@dataclass
class LayerState:
    """Hidden state of one step between layers (flat tokens).

    Attributes:
        batch: the :class:`~k3rocm.model.layer.Batch` (cu_seqlens, cache, slots, start positions), or None
            where the batch form carries its own description (the engine's step).
        res: Block AttnRes state (K3) or None.
        hidden: ``[T, hidden]`` residual stream (kimi_linear) or None.
        record: when True, sublayer outputs are stored as ``layerNN.attn_out`` / ``layerNN.mlp_out``
            ``[T, hidden]`` in ``outputs``.
        outputs: recorded per-layer outputs.
        next_layer: index of the next layer to run.
        mid: True between the token mixer and the channel mixer of ``next_layer``.
        perturb: optional ``f(out) -> out`` applied to every sublayer output (token mixer, channel mixer)
            before it is added to the residual prefix / stream; None: none. Used to measure how the model
            responds to rounding of a given size at every sublayer (validation's ``oracle_sensitivity``).
    """

    batch: Batch | None
    res: AttnResState | None = None
    hidden: torch.Tensor | None = None
    record: bool = False
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    next_layer: int = 0
    mid: bool = False
    perturb: Callable[[torch.Tensor], torch.Tensor] | None = None

    def clone(self, record: bool = True) -> "LayerState":
        """A copy of the residual state (AttnRes bank and prefix, or the stream) that can be run on separately:
        same batch and position (``next_layer``, ``mid``), fresh ``outputs``, no ``perturb``."""
        res = None if self.res is None else AttnResState(
            [b.clone() for b in self.res.bank],
            self.res.base.clone() if self.res.pending is None else self.res.base + self.res.pending)
        hid = None if self.hidden is None else self.hidden.clone()
        return LayerState(self.batch, res=res, hidden=hid, record=record, next_layer=self.next_layer, mid=self.mid)


class Decoder:
    """The order of a K3 (or Kimi-Linear) decoder, on flat varlen tokens, with one ops table and one parallel
    context; the token mixer of each step comes from its batch form (:data:`Mixer`).

    Args:
        cfg: the full model config.
        weights: a :class:`WeightView` over this rank's :class:`~k3rocm.model.weights.Weights`.
        ops: the op table (every name of :data:`k3rocm.model.ops.ORACLE_OPS`).
        par: the parallel context (default: one rank).
        moe_mode: ``"a16w4"`` or ``"a8w4"`` for MXFP4 experts.
    Attributes:
        mixer_cfg: the config the token mixers and the caches see: ``cfg`` with this rank's head counts.
    Raises:
        ConfigError: a head count not divisible by ``par.tp``; a TP layout of a non-K3 family.
    """

    def __init__(self, cfg: K3Config, weights: WeightView, ops: Mapping[str, Callable], par: Parallel | None = None,
                 moe_mode: str = "a16w4"):
        self.cfg = cfg
        self.w = weights
        self.ops = ops  # shared, not copied: the owner (an engine) may swap an op in place
        self.par = par or Parallel()
        if self.par.world > 1 and cfg.family != "k3":
            raise ConfigError("the tensor/expert-parallel decoder supports the K3 family (AttnRes + LatentMoE) only")
        self.mixer_cfg = local_config(cfg, self.par.tp)
        self.moe_mode = moe_mode
        self.attn_res = cfg.attn_res_block_size is not None

    # ------------------------------------------------------------------ pieces
    def res_weight(self, prefix: str) -> torch.Tensor:
        """Folded AttnRes score vector ``[D]`` fp32 for ``prefix`` (e.g. ``layers.3.mlp_res``,
        ``output_attn_res``): ``norm.weight ⊙ proj.weight`` (K3_FACTS §5), folded on first use so that weights
        holding only some layers can still run those layers."""
        return self.w.derived("res." + prefix, lambda: fold_res_weight(self.w(prefix + "_norm.weight"),
                                                                      self.w(prefix + "_proj.weight")))

    def embed(self, ids: torch.Tensor, batch: Batch | None, record: bool = False) -> LayerState:
        """Token ids ``[T]`` int64 (on the weights' device) -> the starting :class:`LayerState`.

        Vocabulary-parallel: the parallel context looks the ids up in this rank's rows (zeros elsewhere) and sums
        the rows over the ranks (:meth:`Parallel.embed_rows`)."""
        x = self.par.embed_rows(self.w("embed_tokens.weight"), ids)
        if self.attn_res:
            return LayerState(batch, res=AttnResState([], x), record=record)
        return LayerState(batch, hidden=x, record=record)

    def _order(self, i: int, state: LayerState, mid: bool, what: str) -> None:
        if i != state.next_layer or state.mid != mid:
            at = f"layer {state.next_layer}'s {'channel' if state.mid else 'token'} mixer"
            raise ConfigError(f"{what}({i}) called but {at} is next; run layers (and their halves) in order")

    def _add(self, state: LayerState, name: str, out: torch.Tensor) -> None:
        if state.perturb is not None:
            out = state.perturb(out)
        if state.res is not None and takes_addend(self.ops):
            # added by the next aggregation in its own launch where the AttnRes op can (attn_res_norm's addend,
            # AttnResState.pending): one launch less every half-layer
            state.res.settle()  # (never two pending: the one before is added first)
            state.res.pending = out
        elif state.res is not None:
            state.res.prefix = state.res.prefix + out
        else:
            state.hidden = state.hidden + out
        if state.record:
            state.outputs[name] = out

    def channel(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Channel mixer of layer ``i`` on x ``[T, hidden]`` (after ``post_attention_layernorm``), summed over
        the ranks: Stable LatentMoE (routed partials reduced before the latent norm) or the dense GLU MLP."""
        if self.cfg.is_moe_layer(i):
            return moe_block(x, self.w, i, self.cfg, self.ops, self.moe_mode,
                             reduce=self.par.reduce if self.par.world > 1 else None)
        return self.par.reduce(dense_mlp(x, self.w, f"layers.{i}.mlp.", self.cfg, self.ops), "mlp")

    # ------------------------------------------------------------------ the layer order
    def attn(self, i: int, state: LayerState, mix: Mixer) -> LayerState:
        """First half of layer ``i``: (AttnRes attention side ->) ``input_layernorm`` -> ``mix`` -> summed over
        the ranks -> added to the prefix / stream (recorded as ``layerNN.attn_out``).
        Raises ConfigError when called out of order."""
        self._order(i, state, False, "run_attn")
        nw = self.w(f"layers.{i}.input_layernorm.weight")
        # on the low-precision path the AttnRes side writes the mixer input in the matmul dtype, which every
        # projection reading it rounds to anyway (layer.mixer_input_dtype); the oracle's stays fp32
        x = (attn_side(state.res, i, self.res_weight(f"layers.{i}.self_attention_res"), nw, self.cfg, self.ops,
                       out_dtype=mixer_input_dtype(self.w, i, self.mixer_cfg, "attn"))
             if self.attn_res else rms_norm(state.hidden, nw, self.cfg.rms_norm_eps))
        a = mix(i, x)
        self._add(state, f"layer{i:02d}.attn_out", self.par.reduce(a, "attn"))
        state.mid = True
        return state

    def mlp(self, i: int, state: LayerState) -> LayerState:
        """Second half of layer ``i``: (AttnRes MLP side ->) ``post_attention_layernorm`` -> :meth:`channel` ->
        added (recorded as ``layerNN.mlp_out``). Raises ConfigError when called out of order."""
        self._order(i, state, True, "run_mlp")
        nw = self.w(f"layers.{i}.post_attention_layernorm.weight")
        x = (mlp_side(state.res, self.res_weight(f"layers.{i}.mlp_res"), nw, self.cfg, self.ops,
                      out_dtype=mixer_input_dtype(self.w, i, self.mixer_cfg, "mlp"))
             if self.attn_res else rms_norm(state.hidden, nw, self.cfg.rms_norm_eps))
        m = self.channel(i, x)
        self._add(state, f"layer{i:02d}.mlp_out", m)
        state.mid = False
        state.next_layer = i + 1
        return state

    def layers(self, state: LayerState, mix: Mixer) -> LayerState:
        """Every layer from ``state.next_layer`` on, in order."""
        for i in range(state.next_layer, self.cfg.num_hidden_layers):
            if not state.mid:
                self.attn(i, state, mix)
            self.mlp(i, state)
        return state

    def hidden_out(self, state: LayerState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, hidden]`` fp32 after the output AttnRes (K3) and the final ``norm``, for the token rows ``rows``
        (default all). Raises ConfigError before the last layer has run."""
        if state.next_layer != self.cfg.num_hidden_layers:
            raise ConfigError(f"final() after {state.next_layer} of {self.cfg.num_hidden_layers} layers; run them all")
        if self.attn_res:
            r = state.res
            res = r if rows is None else AttnResState([b[rows] for b in r.bank], r.base[rows],
                                                      None if r.pending is None else r.pending[rows])
            return final_aggregate(res, self.res_weight("output_attn_res"), self.w("norm.weight"), self.cfg, self.ops)
        h = state.hidden if rows is None else state.hidden[rows]
        return rms_norm(h, self.w("norm.weight"), self.cfg.rms_norm_eps)

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's logits slice ``[N, V_local]`` fp32 = h ``[N, hidden]`` × its lm_head rows."""
        head = self.w("embed_tokens.weight") if self.cfg.tie_word_embeddings else self.w.head()
        return linear(h, head)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary logits ``[N, V]`` fp32 (gathered over the ranks' vocabulary slices)."""
        return self.par.gather_vocab(self.local_logits(h))

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy ids ``[N]`` int64: each rank's top-1 over its vocabulary slice, then one small exchange; the
        logits are never gathered whole."""
        return self.par.greedy(self.local_logits(h))
