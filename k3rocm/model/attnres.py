"""fp32 oracle of Block Attention Residuals (K3_FACTS §5), the op the ``attn_res`` kernels mirror.

Block AttnRes replaces the residual stream. Per forward pass the model keeps a *bank* of at most
``num_attn_res_bank_rows`` rows per token (the embedding, then one row per completed block) and a running
*prefix* (the current block's partial sum). Before each token mixer and each channel mixer it aggregates
the sources V = [bank rows..., prefix]:

    key_j   = RMSNorm_without_weight(v_j, eps)           (eps = rms_norm_eps, 1e-5 for K3)
    score_j = <key_j, w>,  w = res_norm.weight * res_proj.weight[0]   (folded once at load)
    p       = softmax_j(score)                           (over sources, fp32)
    out     = sum_j p_j v_j                              (raw values, not the keys)

then applies the following RMSNorm (``input_layernorm`` / ``post_attention_layernorm``; after the last
layer the model ``norm``). Layer i is a *write layer* iff ``i % attn_res_block_size == 0``: after its
attention-side aggregation the prefix is appended to the bank and restarts (the attention output becomes
the new prefix). Source: K3_FACTS §5; Kimi "Attention Residuals" (Moonshot AI, 2026), Block AttnRes.

All functions compute in fp32 and return fp32; only :func:`attn_res_norm` with ``append=True`` writes
(into the bank, in place).
"""

from __future__ import annotations

from typing import Callable

import torch

from k3rocm.errors import ConfigError
from k3rocm.model.common import rms_norm
from k3rocm.numerics import check_addend

__all__ = ["attn_res", "attn_res_norm", "fold_res_weight", "AttnResStack", "run_attnres_stack"]


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def fold_res_weight(res_norm_weight: torch.Tensor, res_proj_weight: torch.Tensor) -> torch.Tensor:
    """Fold ``*_res_norm.weight`` [D] and ``*_res_proj.weight`` [1, D] into the query ``w`` [D] fp32 (K3_FACTS §5).

    Raises:
        ConfigError: shapes are not [D] and [1, D] (or [D]).
    """
    n, p = _f32(res_norm_weight), _f32(res_proj_weight)
    if n.dim() != 1 or p.numel() != n.numel():
        raise ConfigError(f"AttnRes norm weight {tuple(n.shape)} and proj weight {tuple(p.shape)} must be [D] and [1, D]")
    return n * p.reshape(-1)


def attn_res(sources: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Block AttnRes aggregation over ``S`` sources (the registry's ``attn_res`` op).

    Args:
        sources: ``[S, T, D]`` (bank rows then prefix), any float dtype.
        weight: ``[D]`` folded query ``res_norm.weight * res_proj.weight[0]`` (:func:`fold_res_weight`).
        eps: RMSNorm eps of the keys (``rms_norm_eps``).
    Returns:
        ``[T, D]`` fp32 = sum_j softmax_j(<rms_norm(v_j), weight>) v_j.
    Raises:
        ConfigError: ``S == 0`` or the widths disagree.
    """
    v = _f32(sources)
    if v.dim() != 3 or v.shape[0] == 0 or weight.shape[-1] != v.shape[-1]:
        raise ConfigError(f"attn_res: sources {tuple(v.shape)} must be [S>0, T, D] and weight [D={v.shape[-1]}], "
                          f"got weight {tuple(weight.shape)}")
    keys = rms_norm(v, None, eps)
    score = torch.einsum("std,d->st", keys, _f32(weight))
    p = torch.softmax(score, dim=0)
    return torch.einsum("st,std->td", p, v)


def attn_res_norm(bank: torch.Tensor, num_rows: int, prefix: torch.Tensor, weight: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, append: bool = False,
                  norm_eps: float | None = None, addend: torch.Tensor | None = None,
                  prefix_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused AttnRes step: aggregate ``bank[:num_rows]`` + ``prefix``, then the following RMSNorm.

    This is what the ``attn_res`` Triton kernel computes in one pass. With ``addend`` the prefix source is
    ``prefix + addend`` (the sublayer output not yet added, K3_FACTS §5 "prefix += out", one fp32 add), stored into
    ``prefix_out``: the decoder's add and the next aggregation in one step, the same values as adding first.

    Args:
        bank: ``[R_max, T, D]`` bank storage (rows ``>= num_rows`` are not read).
        num_rows: live bank rows (0 at layer 0).
        prefix: ``[T, D]`` the current block's partial sum (at layer 0 the embedding).
        weight: ``[D]`` folded AttnRes query.
        norm_weight: ``[D]`` weight of the RMSNorm that follows (``input_layernorm``,
            ``post_attention_layernorm`` or the model ``norm``).
        eps: RMSNorm eps of the keys; norm_eps: eps of the following RMSNorm (default ``eps``).
        append: write layer: also store ``prefix`` as bank row ``num_rows`` (in place, in the bank's dtype).
        addend: ``[T, D]`` (any float dtype) added to ``prefix`` in fp32 before it is read; None: nothing added.
        prefix_out: ``[T, D]`` fp32, receives ``prefix + addend`` (required with ``addend``; must not overlap
            ``prefix``, ``addend`` or the bank).
    Returns:
        ``(h [T, D], h_normed [T, D])`` fp32, new tensors (never views of the bank).
    Raises:
        ConfigError: ``append`` with a full bank, ``num_rows`` out of range, shapes that disagree, ``addend``
            without ``prefix_out`` (or either of another shape than ``prefix``, or ``prefix_out`` not fp32).
    """
    R_max = bank.shape[0]
    if not 0 <= num_rows <= R_max or (append and num_rows >= R_max):
        raise ConfigError(f"attn_res_norm: num_rows={num_rows} (append={append}) does not fit a bank of {R_max} rows; "
                          f"size the bank with K3Config.num_attn_res_bank_rows")
    if bank.shape[1:] != prefix.shape:
        raise ConfigError(f"attn_res_norm: bank rows {tuple(bank.shape[1:])} and prefix {tuple(prefix.shape)} differ")
    if addend is not None:
        check_addend(prefix, addend, prefix_out, bank)
        prefix_out.copy_(_f32(prefix) + _f32(addend))
        prefix = prefix_out
    src = torch.cat([_f32(bank[:num_rows]), _f32(prefix)[None]], dim=0)
    h = attn_res(src, weight, eps)
    hn = rms_norm(h, norm_weight, eps if norm_eps is None else norm_eps)
    if append:
        bank[num_rows].copy_(prefix.to(bank.dtype))
    return h, hn


AttnResFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AttnResStack:
    """Weights of a stack's AttnRes parts, for :func:`run_attnres_stack`.

    Attributes:
        attn_w, mlp_w: ``[L, D]`` folded queries of ``self_attention_res_*`` / ``mlp_res_*``.
        input_norm, post_norm: ``[L, D]`` ``input_layernorm`` / ``post_attention_layernorm`` weights.
        out_w: ``[D]`` folded ``output_attn_res_*``; final_norm: ``[D]`` model ``norm``.
        block_size: ``attn_res_block_size``; eps: ``rms_norm_eps``.
    """

    def __init__(self, attn_w, mlp_w, input_norm, post_norm, out_w, final_norm, block_size: int, eps: float):
        self.attn_w, self.mlp_w, self.input_norm, self.post_norm = attn_w, mlp_w, input_norm, post_norm
        self.out_w, self.final_norm, self.block_size, self.eps = out_w, final_norm, block_size, eps

    @property
    def num_layers(self) -> int:
        return self.attn_w.shape[0]

    @property
    def bank_rows(self) -> int:
        """Rows a bank needs: one per write layer (layer i with ``i % block_size == 0``)."""
        return len(range(0, self.num_layers, self.block_size))

    @classmethod
    def random(cls, num_layers: int, hidden: int, block_size: int, eps: float = 1e-5,
               generator: torch.Generator | None = None) -> "AttnResStack":
        """Random weights with realistic spread (norm weights ~1, folded queries ~N(0, 1/D))."""
        g = generator
        L, D = num_layers, hidden

        def r(*shape, s=1.0, m=0.0):
            return m + s * torch.randn(*shape, generator=g)
        return cls(r(L, D, s=D ** -0.5 * 4), r(L, D, s=D ** -0.5 * 4), r(L, D, s=0.1, m=1.0), r(L, D, s=0.1, m=1.0),
                   r(D, s=D ** -0.5 * 4), r(D, s=0.1, m=1.0), block_size, eps)


def run_attnres_stack(embed: torch.Tensor, stack: AttnResStack,
                      mixer: Callable[[int, str, torch.Tensor], torch.Tensor],
                      step: AttnResFn = attn_res_norm, bank_dtype: torch.dtype = torch.float32,
                      trace: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Drive the Block AttnRes bookkeeping of a whole stack (K3_FACTS §5), with stand-in mixers.

    Per layer i: attention side ``h, x = step(bank, rows, prefix, attn_w[i], input_norm[i], eps,
    append=is_write(i))``; on a write layer rows += 1 and the prefix restarts; ``prefix += mixer(i, "attn", x)``;
    MLP side ``h, x = step(bank, rows, prefix, mlp_w[i], post_norm[i], eps)``; ``prefix += mixer(i, "mlp", x)``.
    After the last layer ``step(bank, rows, prefix, out_w, final_norm, eps)``.

    Args:
        embed: ``[T, D]`` token embeddings (the first prefix).
        stack: the AttnRes weights.
        mixer: ``mixer(layer, "attn"|"mlp", normed_input [T, D]) -> [T, D]``; a stand-in for KDA/MLA/MoE.
        step: the fused step to test (default the oracle :func:`attn_res_norm`); same signature.
        bank_dtype: dtype of the bank storage.
        trace: if a list, ``(layer, side, h, x)`` of every step is appended (fp32 copies).
    Returns:
        ``(h_final [T, D], normed [T, D])``: the output aggregation and the model-``norm``-ed hidden state.
    """
    T, D = embed.shape
    bank = torch.full((stack.bank_rows, T, D), float("nan"), dtype=bank_dtype, device=embed.device)
    rows = 0
    prefix = _f32(embed).clone()
    for i in range(stack.num_layers):
        write = i % stack.block_size == 0
        h, x = step(bank, rows, prefix, stack.attn_w[i], stack.input_norm[i], stack.eps, append=write)
        if trace is not None:
            trace.append((i, "attn", _f32(h).clone(), _f32(x).clone()))
        if write:
            rows += 1
            prefix = _f32(mixer(i, "attn", x))
        else:
            prefix = prefix + _f32(mixer(i, "attn", x))
        h, x = step(bank, rows, prefix, stack.mlp_w[i], stack.post_norm[i], stack.eps, append=False)
        if trace is not None:
            trace.append((i, "mlp", _f32(h).clone(), _f32(x).clone()))
        prefix = prefix + _f32(mixer(i, "mlp", x))
    h, x = step(bank, rows, prefix, stack.out_w, stack.final_norm, stack.eps, append=False)
    return _f32(h), _f32(x)
