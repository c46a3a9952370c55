"""K3Model: the fp32 oracle of the whole Kimi K3 text model (and, via the same class, Kimi-Linear).

With ``matmul_dtype=torch.bfloat16`` the same class runs the serving engine's dense-projection math
(bf16 operands, fp32 accumulation) instead; the default (None) is the fp32 oracle.

``K3Model(cfg, weights, ops=None)`` runs the decoder on flat varlen tokens with the ops of an op table
(``ops``: op name -> callable, default the oracle functions of :mod:`k3rocm.model`). Everything is fp32;
weights are read from ``weights`` by name and widened per use, routed MXFP4 experts stay packed and are
dequantized per expert on the fly inside ``moe_experts`` (never a second full copy).

Sources: K3_FACTS §5 (forward pass, Block Attention Residuals), transformers ``modeling_kimi_linear.py``
(residual-stream family). The layer-by-layer API (:meth:`K3Model.embed`, :meth:`K3Model.run_layer`,
:meth:`K3Model.final`) lets a validator check one layer at a time.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from k3rocm.config import K3Config
from k3rocm.errors import ConfigError
from k3rocm.model.common import MATMUL_DTYPES, f32, linear, matmul_dtype, rms_norm
from k3rocm.model.layer import (AttnResState, Batch, K3Cache, WeightView, attn_side, dense_mlp, final_aggregate,
                                fold_res_weight, kda_mixer, mla_mixer, mlp_side, moe_block, resolve_ops)

__all__ = ["K3Model", "LayerState", "strict_fp32"]


@dataclass
class LayerState:
    """Hidden state of one step between layers (flat tokens).

    Attributes:
        batch: the :class:`~k3rocm.model.layer.Batch` (cu_seqlens, cache, slots, start positions).
        res: Block AttnRes state (K3) or None.
        hidden: ``[T, hidden]`` residual stream (kimi_linear) or None.
        record: when True, :meth:`K3Model.run_layer` stores ``layerNN.attn_out`` / ``layerNN.mlp_out`` ``[T, hidden]``
            in ``outputs``.
        outputs: recorded per-layer outputs.
        next_layer: index of the next layer to run.
        mid: True between :meth:`K3Model.run_attn` and :meth:`K3Model.run_mlp` of ``next_layer`` (its token
            mixer ran, its channel mixer is pending).
        perturb: optional ``f(out) -> out`` applied to every sublayer output (token mixer, channel mixer)
            before it is added to the residual prefix / stream; None: none. Used to measure how the model
            responds to rounding of a given size at every sublayer (validation's ``oracle_sensitivity``).
    """

    batch: Batch
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
        res = None if self.res is None else AttnResState([b.clone() for b in self.res.bank], self.res.prefix.clone())
        hid = None if self.hidden is None else self.hidden.clone()
        return LayerState(self.batch, res=res, hidden=hid, record=record, next_layer=self.next_layer, mid=self.mid)


@contextlib.contextmanager
def strict_fp32():
    """Run with true fp32 GEMMs and convolutions on GPUs (no TF32), restoring the previous settings."""
    mm, cd = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, cd


def _scoped(fn: Callable) -> Callable:
    """Run a public entry point of :class:`K3Model` inside ``matmul_dtype(self.matmul_dtype)``.

    The scope is always set, None included, so the fp32 oracle stays fp32 even when called from inside
    another scope (e.g. an engine step)."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with matmul_dtype(self.matmul_dtype):
            return fn(self, *args, **kwargs)
    return run


def _cu(lengths: Sequence[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32)


class K3Model:
    """fp32 oracle model.

    Args:
        cfg: a :class:`~k3rocm.config.K3Config` (family ``"k3"`` or ``"kimi_linear"``).
        weights: a ``Weights`` object or a ``Mapping[str, Tensor]`` of full checkpoint names, or a
            :class:`~k3rocm.model.layer.WeightView`.
        ops: op table overrides (see :func:`~k3rocm.model.layer.resolve_ops`).
        moe_mode: ``"a16w4"`` (activations as given) or ``"a8w4"`` (MXFP8 E4M3 activations) for MXFP4 experts.
        prefix / head: checkpoint name prefix and lm_head name (K3 defaults; ``model.`` / ``lm_head.weight``
            for a bare Kimi-Linear checkpoint).
        matmul_dtype: None (default: the fp32 oracle, every projection widened to fp32) or ``torch.bfloat16`` /
            ``torch.float16``: the public entry points then run inside
            :func:`k3rocm.model.common.matmul_dtype`, so dense projections whose weights are stored in that
            dtype multiply in it with fp32 accumulation — the serving engine's math, for comparing with it.
    Raises:
        ConfigError: unknown ``moe_mode``, op names or ``matmul_dtype``.
        CheckpointError: (lazily) a tensor the config needs is missing from ``weights``.
    """

    def __init__(self, cfg: K3Config, weights: Any, ops: Mapping[str, Callable] | None = None,
                 moe_mode: str = "a16w4", prefix: str = "language_model.model.",
                 head: str = "language_model.lm_head.weight", matmul_dtype: torch.dtype | None = None):
        if moe_mode not in ("a16w4", "a8w4"):
            raise ConfigError(f"moe_mode {moe_mode!r} is not 'a16w4' or 'a8w4'")
        if matmul_dtype is not None and matmul_dtype not in MATMUL_DTYPES:
            raise ConfigError(f"K3Model matmul_dtype {matmul_dtype} is not bfloat16, float16 or None; "
                              "pass one of those")
        self.matmul_dtype = matmul_dtype
        self.cfg = cfg
        self.w = weights if isinstance(weights, WeightView) else WeightView(weights, prefix, head)
        self.ops = resolve_ops(ops)
        self.moe_mode = moe_mode
        self.attn_res = cfg.attn_res_block_size is not None
        # AttnRes score vectors norm.weight ⊙ proj.weight, folded once per layer on first use (K3_FACTS §5),
        # so that weights holding only some layers can still run those layers.
        self._folded: dict[str, torch.Tensor] = {}

    def _res_weight(self, prefix: str) -> torch.Tensor:
        """Folded AttnRes score vector ``[D]`` fp32 for ``prefix`` (e.g. ``layers.3.mlp_res``, ``output_attn_res``)."""
        w = self._folded.get(prefix)
        if w is None:
            w = fold_res_weight(self.w(prefix + "_norm.weight"), self.w(prefix + "_proj.weight"))
            self._folded[prefix] = w
        return w

    # ------------------------------------------------------------------ layer-by-layer API
    @_scoped
    def embed(self, token_ids: torch.Tensor, batch: Batch | None = None, record: bool = False) -> LayerState:
        """Start a step: token ids ``[T]`` (flat, packed per ``batch.cu_seqlens``) -> :class:`LayerState`.

        ``batch`` defaults to one sequence of T tokens, no cache.
        Raises ConfigError for ids outside ``0 .. vocab_size-1``.
        """
        ids = torch.as_tensor(token_ids).reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ConfigError(f"token ids must lie in 0..{self.cfg.vocab_size - 1} "
                              f"(got {int(ids.min())}..{int(ids.max())})")
        if batch is None:
            batch = Batch(_cu([ids.numel()]))
        if int(batch.cu_seqlens[-1]) != ids.numel():
            raise ConfigError(f"cu_seqlens ends at {int(batch.cu_seqlens[-1])} but {ids.numel()} token ids were given")
        table = self.w("embed_tokens.weight")
        x = f32(table[ids.to(table.device)])
        if self.attn_res:
            return LayerState(batch, res=AttnResState([], x), record=record)
        return LayerState(batch, hidden=x, record=record)

    def _mixer(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.cfg.layer_type(i) == "kda":
            return kda_mixer(x, self.w, i, self.cfg, self.ops, batch)
        return mla_mixer(x, self.w, i, self.cfg, self.ops, batch)

    def _channel(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_moe_layer(i):
            return moe_block(x, self.w, i, self.cfg, self.ops, self.moe_mode)
        return dense_mlp(x, self.w, f"layers.{i}.mlp.", self.cfg)

    @_scoped
    def run_layer(self, i: int, state: LayerState) -> LayerState:
        """Run decoder layer ``i`` (0-based) on ``state`` in place and return it: :meth:`run_attn` then
        :meth:`run_mlp`.

        K3 (K3_FACTS §5): attention-side AttnRes -> ``input_layernorm`` -> token mixer -> prefix += out;
        MLP-side AttnRes -> ``post_attention_layernorm`` -> channel mixer -> prefix += out.
        kimi_linear: pre-norm residual stream. Raises ConfigError when layers are run out of order.
        """
        self.run_attn(i, state)
        return self.run_mlp(i, state)

    def _order(self, i: int, state: LayerState, mid: bool, what: str) -> None:
        if i != state.next_layer or state.mid != mid:
            at = f"layer {state.next_layer}'s {'channel' if state.mid else 'token'} mixer"
            raise ConfigError(f"{what}({i}) called but {at} is next; run layers (and their halves) in order")

    @_scoped
    def run_attn(self, i: int, state: LayerState) -> LayerState:
        """First half of decoder layer ``i``: (AttnRes attention side ->) ``input_layernorm`` -> token mixer
        (KDA or MLA) -> added to the prefix / stream; recorded as ``layerNN.attn_out`` ``[T, hidden]`` fp32.
        Raises ConfigError when called out of order."""
        self._order(i, state, False, "run_attn")
        x = (attn_side(state.res, i, self._res_weight(f"layers.{i}.self_attention_res"), self.cfg, self.ops)
             if self.attn_res else state.hidden)
        a = self._mixer(i, rms_norm(x, self.w(f"layers.{i}.input_layernorm.weight"), self.cfg.rms_norm_eps),
                        state.batch)
        self._add(state, f"layer{i:02d}.attn_out", a)
        state.mid = True
        return state

    @_scoped
    def run_mlp(self, i: int, state: LayerState) -> LayerState:
        """Second half of decoder layer ``i``: (AttnRes MLP side ->) ``post_attention_layernorm`` -> channel
        mixer (dense MLP or LatentMoE) -> added; recorded as ``layerNN.mlp_out``. Raises ConfigError when
        called out of order (before :meth:`run_attn` of the same layer)."""
        self._order(i, state, True, "run_mlp")
        x = mlp_side(state.res, self._res_weight(f"layers.{i}.mlp_res"), self.cfg, self.ops) if self.attn_res \
            else state.hidden
        m = self._channel(i, rms_norm(x, self.w(f"layers.{i}.post_attention_layernorm.weight"), self.cfg.rms_norm_eps))
        self._add(state, f"layer{i:02d}.mlp_out", m)
        state.mid = False
        state.next_layer = i + 1
        return state

    @staticmethod
    def _add(state: LayerState, name: str, out: torch.Tensor) -> None:
        if state.perturb is not None:
            out = state.perturb(out)
        if state.res is not None:
            state.res.prefix = state.res.prefix + out
        else:
            state.hidden = state.hidden + out
        if state.record:
            state.outputs[name] = out

    @_scoped
    def final_hidden(self, state: LayerState) -> torch.Tensor:
        """``[T, hidden]`` fp32 after the output AttnRes (K3) and the final ``norm``."""
        if state.next_layer != self.cfg.num_hidden_layers:
            raise ConfigError(f"final() after {state.next_layer} of {self.cfg.num_hidden_layers} layers; run them all")
        h = (final_aggregate(state.res, self._res_weight("output_attn_res"), self.cfg, self.ops) if self.attn_res
             else state.hidden)
        return rms_norm(h, self.w("norm.weight"), self.cfg.rms_norm_eps)

    @_scoped
    def final(self, state: LayerState) -> torch.Tensor:
        """Logits ``[T, vocab]`` fp32 = lm_head(norm(output AttnRes over bank + prefix))."""
        head = self.w("embed_tokens.weight") if self.cfg.tie_word_embeddings else self.w.head()
        return linear(self.final_hidden(state), head)

    def _run(self, ids: torch.Tensor, batch: Batch, record: bool = False) -> tuple[torch.Tensor, dict]:
        with strict_fp32():
            st = self.embed(ids, batch, record)
            for i in range(self.cfg.num_hidden_layers):
                self.run_layer(i, st)
            return self.final(st), st.outputs

    # ------------------------------------------------------------------ whole-model API
    @_scoped
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, return_layers: bool = False):
        """One causal forward, no cache: input_ids ``[B, T]`` int -> logits ``[B, T, vocab]`` fp32.

        With ``return_layers``: ``(logits, {"layerNN.attn_out": [B, T, hidden], "layerNN.mlp_out": ...})``.
        The B rows are independent sequences (packed varlen internally).
        """
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ConfigError(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
        B, T = ids.shape
        logits, outs = self._run(ids.reshape(-1), Batch(_cu([T] * B)), record=return_layers)
        logits = logits.view(B, T, -1)
        if return_layers:
            return logits, {k: v.view(B, T, -1) for k, v in outs.items()}
        return logits

    __call__ = forward

    def new_cache(self, batch: int, max_len: int = 1024, block_size: int = 16) -> K3Cache:
        """Empty decode cache for ``batch`` sequences (KDA conv + recurrent state, MLA latent cache).

        State tensors live on the device of the weights; lengths and block table stay on the CPU.
        """
        dev = self.w("embed_tokens.weight").device
        return K3Cache.empty(self.cfg, batch, max_len, block_size, device=dev)

    @_scoped
    @torch.no_grad()
    def prefill(self, ids, cache: K3Cache):
        """Run prompts through the model, appending them to ``cache`` (slot n = sequence n).

        Args:
            ids: ``[B, T]`` int tensor, or a list of B 1-D sequences of any lengths (0 allowed); B must equal
                ``cache.batch``. Sequences continue from what the cache already holds.
        Returns:
            logits ``[B, T, vocab]`` fp32 (tensor input) or a list of ``[L_n, vocab]`` fp32 tensors (list input).
        """
        as_tensor = isinstance(ids, torch.Tensor)
        seqs = [torch.as_tensor(s).reshape(-1).to(torch.int64) for s in (ids if not as_tensor or ids.dim() == 2
                                                                          else ids.unsqueeze(0))]
        if len(seqs) != cache.batch:
            raise ConfigError(f"prefill got {len(seqs)} sequences for a cache of {cache.batch}")
        lens = [s.numel() for s in seqs]
        over = [n for n, L in enumerate(lens) if int(cache.lengths[n]) + L > cache.max_len]
        if over:
            raise ConfigError(f"prefill: sequence {over[0]} would hold {int(cache.lengths[over[0]]) + lens[over[0]]} "
                              f"tokens, over the cache capacity {cache.max_len}; "
                              "create the cache with a larger max_len")
        batch = Batch(_cu(lens), cache=cache, slots=torch.arange(cache.batch), start_pos=cache.lengths.clone())
        flat = torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.int64)
        logits, _ = self._run(flat, batch)
        cache.lengths += torch.tensor(lens, dtype=torch.int64)
        parts = list(torch.split(logits, lens))
        if as_tensor:
            return torch.stack(parts) if ids.dim() == 2 else parts[0].unsqueeze(0)
        return parts

    @_scoped
    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, cache: K3Cache) -> torch.Tensor:
        """One decode step: token_ids ``[B]`` (one new token per cached sequence) -> logits ``[B, vocab]`` fp32.

        Uses the decode ops (``kda_decode``, ``mla_cache_write`` + absorbed ``mla_decode``) and advances
        ``cache.lengths``. Raises ConfigError when a sequence has an empty cache (prefill it first).
        """
        ids = torch.as_tensor(token_ids).reshape(-1).to(torch.int64)
        if ids.numel() != cache.batch:
            raise ConfigError(f"decode got {ids.numel()} tokens for a cache of {cache.batch} sequences")
        if bool((cache.lengths == 0).any()):
            raise ConfigError("decode on a sequence with an empty cache; prefill at least one token first")
        if bool((cache.lengths >= cache.max_len).any()):
            raise ConfigError(f"decode: a sequence already holds {cache.max_len} tokens, the cache capacity; "
                              "create the cache with a larger max_len")
        batch = Batch(_cu([1] * cache.batch), cache=cache, slots=torch.arange(cache.batch),
                      start_pos=cache.lengths.clone(), decode=True)
        logits, _ = self._run(ids, batch)
        cache.lengths += 1
        return logits

    @_scoped
    @torch.no_grad()
    def generate_greedy(self, prompt_ids, n: int, max_len: int | None = None) -> torch.Tensor:
        """Greedy continuation: prompt ``[L]`` or ``[B, L]`` -> ``n`` new tokens ``[n]`` or ``[B, n]`` int64.

        Prefill the prompt, take the argmax of the last position, then ``n - 1`` decode steps.
        """
        p = torch.as_tensor(prompt_ids).to(torch.int64)
        single = p.dim() == 1
        p = p.unsqueeze(0) if single else p
        B, L = p.shape
        cache = self.new_cache(B, max_len or (L + n + 1))
        last = self.prefill(p, cache)[:, -1]
        out = []
        for step in range(n):
            tok = last.argmax(-1).cpu()
            out.append(tok)
            if step + 1 < n:
                last = self.decode(tok, cache)
        toks = torch.stack(out, -1) if out else torch.zeros(B, 0, dtype=torch.int64)
        return toks[0] if single else toks
