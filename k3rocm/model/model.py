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
from typing import Any, Callable, Mapping, Sequence

import torch

from k3rocm.config import K3Config
from k3rocm.errors import ConfigError
from k3rocm.model.common import MATMUL_DTYPES, matmul_dtype
from k3rocm.model.decoder import Decoder, LayerState, Parallel
from k3rocm.model.layer import Batch, K3Cache, WeightView, kda_mixer, mla_mixer, resolve_ops
from k3rocm.model.weights import as_weights

__all__ = ["K3Model", "LayerState", "strict_fp32"]


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


class K3Model(Decoder):
    """The fp32 oracle model: the :class:`~k3rocm.model.decoder.Decoder` skeleton with the oracle's batch form
    (a :class:`~k3rocm.model.layer.Batch` over a :class:`~k3rocm.model.layer.K3Cache`, or no cache).

    Args:
        cfg: a :class:`~k3rocm.config.K3Config` (family ``"k3"`` or ``"kimi_linear"``).
        weights: a ``Weights`` object or a ``Mapping[str, Tensor]`` of full checkpoint names (this rank's
            slices under tensor/expert parallelism), or a :class:`~k3rocm.model.layer.WeightView`.
        ops: op table overrides (see :func:`~k3rocm.model.layer.resolve_ops`).
        moe_mode: ``"a16w4"`` (activations as given) or ``"a8w4"`` (MXFP8 E4M3 activations) for MXFP4 experts.
        prefix / head: checkpoint name prefix and lm_head name (K3 defaults; ``model.`` / ``lm_head.weight``
            for a bare Kimi-Linear checkpoint).
        matmul_dtype: None (default: the fp32 oracle, every projection widened to fp32) or ``torch.bfloat16`` /
            ``torch.float16``: the public entry points then run inside
            :func:`k3rocm.model.common.matmul_dtype`, so dense projections whose weights are stored in that
            dtype multiply in it with fp32 accumulation — the serving engine's math, for comparing with it.
        par: the parallel context (default one rank; :class:`k3rocm.runtime.dist.TPGroup` for one rank of a
            TP/EP layout: the TP/EP oracle, with the same collectives as the distributed engine).
    Raises:
        ConfigError: unknown ``moe_mode``, op names or ``matmul_dtype``.
        CheckpointError: (lazily) a tensor the config needs is missing from ``weights``.
    """

    def __init__(self, cfg: K3Config, weights: Any, ops: Mapping[str, Callable] | None = None,
                 moe_mode: str = "a16w4", prefix: str = "language_model.model.",
                 head: str = "language_model.lm_head.weight", matmul_dtype: torch.dtype | None = None,
                 par: Parallel | None = None):
        if moe_mode not in ("a16w4", "a8w4"):
            raise ConfigError(f"moe_mode {moe_mode!r} is not 'a16w4' or 'a8w4'")
        if matmul_dtype is not None and matmul_dtype not in MATMUL_DTYPES:
            raise ConfigError(f"K3Model matmul_dtype {matmul_dtype} is not bfloat16, float16 or None; "
                              "pass one of those")
        self.matmul_dtype = matmul_dtype
        w = weights if isinstance(weights, WeightView) else WeightView(as_weights(cfg, weights), prefix, head)
        super().__init__(cfg, w, resolve_ops(ops), par=par, moe_mode=moe_mode)

    def _mix(self, batch: Batch):
        """The oracle's batch form: each token mixer on the whole ``batch`` (through its cache, if any)."""
        def mix(i: int, x: torch.Tensor) -> torch.Tensor:
            fn = kda_mixer if self.cfg.layer_type(i) == "kda" else mla_mixer
            return fn(x, self.w, i, self.mixer_cfg, self.ops, batch)
        return mix

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
        return Decoder.embed(self, ids.to(self.w("embed_tokens.weight").device), batch, record)

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

    @_scoped
    def run_attn(self, i: int, state: LayerState) -> LayerState:
        """First half of decoder layer ``i``: (AttnRes attention side ->) ``input_layernorm`` -> token mixer
        (KDA or MLA) -> added to the prefix / stream; recorded as ``layerNN.attn_out`` ``[T, hidden]`` fp32.
        Raises ConfigError when called out of order."""
        return self.attn(i, state, self._mix(state.batch))

    @_scoped
    def run_mlp(self, i: int, state: LayerState) -> LayerState:
        """Second half of decoder layer ``i``: (AttnRes MLP side ->) ``post_attention_layernorm`` -> channel
        mixer (dense MLP or LatentMoE) -> added; recorded as ``layerNN.mlp_out``. Raises ConfigError when
        called out of order (before :meth:`run_attn` of the same layer)."""
        return self.mlp(i, state)

    @_scoped
    def final_hidden(self, state: LayerState) -> torch.Tensor:
        """``[T, hidden]`` fp32 after the output AttnRes (K3) and the final ``norm``."""
        return self.hidden_out(state)

    @_scoped
    def final(self, state: LayerState) -> torch.Tensor:
        """Logits ``[T, vocab]`` fp32 = lm_head(norm(output AttnRes over bank + prefix))."""
        return self.logits(self.final_hidden(state))

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

        State tensors live on the device of the weights (this rank's KDA heads under TP; the MLA latent is
        whole on every rank); lengths and block table stay on the CPU.
        """
        dev = self.w("embed_tokens.weight").device
        return K3Cache.empty(self.mixer_cfg, batch, max_len, block_size, device=dev)

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
