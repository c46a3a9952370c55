"""Triton short causal depthwise conv + SiLU for KDA prefill (kernel 4, FP32 weights), with conv state in/out.

Oracle: :func:`k3rocm.model.kda.short_conv` (same signature). Packed sequences (``cu_seqlens``) are handled by
a per-token sequence id, so one launch serves any mix of lengths, including length 1 (whose output window
reaches into the initial conv state).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune

from . import configs as C


@_interp.kjit
def _conv_fwd_kernel(x, w, y, state_in, cu, tok_seq, TT, NCH,
                     HAS_STATE: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[t, c] = SiLU(sum_i w[c, i] * x[t - (W-1) + i, c]), inputs before a sequence start from state_in."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mt = offs_t < TT
    mc = offs_c < NCH
    n = tl.load(tok_seq + offs_t, mask=mt, other=0)
    start = tl.load(cu + n, mask=mt, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(W):
        src = offs_t - (W - 1) + i
        inseq = src >= start
        m2 = mt[:, None] & mc[None, :]
        xv = tl.load(x + src[:, None].to(tl.int64) * NCH + offs_c[None, :], mask=m2 & inseq[:, None], other=0.0)
        xv = xv.to(tl.float32)
        if HAS_STATE:
            sp = (W - 1) + src - start  # position inside the W-1 saved inputs (valid when not inseq)
            sv = tl.load(state_in + (n[:, None].to(tl.int64) * NCH + offs_c[None, :]) * (W - 1) + sp[:, None],
                         mask=m2 & (~inseq)[:, None], other=0.0)
            xv += sv.to(tl.float32)
        wv = tl.load(w + offs_c * W + i, mask=mc, other=0.0).to(tl.float32)
        acc += xv * wv[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(y + offs_t[:, None].to(tl.int64) * NCH + offs_c[None, :], out.to(y.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@_interp.kjit
def _conv_state_kernel(x, state_in, state_out, cu, NCH,
                       HAS_STATE: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr):
    """state_out[n, c, j] = the input at position end-(W-1)+j of sequence n (from state_in before its start)."""
    n = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs_c < NCH
    start = tl.load(cu + n)
    end = tl.load(cu + n + 1)
    base = (n.to(tl.int64) * NCH + offs_c) * (W - 1)
    for j in tl.static_range(W - 1):
        p = end - (W - 1) + j + 0 * offs_c  # broadcast to the channel vector
        v = tl.load(x + p.to(tl.int64) * NCH + offs_c, mask=mc & (p >= start), other=0.0).to(tl.float32)
        if HAS_STATE:
            sp = (W - 1) + p - start
            v += tl.load(state_in + base + sp, mask=mc & (p < start), other=0.0).to(tl.float32)
        tl.store(state_out + base + j, v, mask=mc)


def seq_table(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu [N+1] int32, tok_seq [B*T] int32)`` for a batch flattened to packed form (no host sync)."""
    if cu_seqlens is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    else:
        if B != 1:
            raise ConfigError(f"short_conv/kda: cu_seqlens needs B = 1 (packed), got B = {B}; pack along T")
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
    pos = torch.arange(B * T, device=device, dtype=torch.int32)
    tok_seq = (torch.searchsorted(cu[1:].contiguous(), pos, right=True)).to(torch.int32)
    return cu, tok_seq


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton causal depthwise conv + SiLU; contract of :func:`k3rocm.model.kda.short_conv`.

    Args:
        x: ``[B, T, C]`` fp32 / bf16 / fp16; weight ``[C, 1, W]`` fp32; conv_state ``[N, C, W-1]`` or None;
        cu_seqlens: ``[N+1]`` int32 (B = 1) or None.
        out_dtype: dtype of ``y`` (fp32 by the oracle's contract; bf16 for the engine).
        config: one entry of ``configs("conv")`` to force (tests); default: tuned.
    Returns:
        ``(y [B, T, C] out_dtype, final_state [N, C, W-1] fp32)``.
    Raises:
        ConfigError: shape mismatch.
    """
    B, T, NCH = x.shape
    if weight.dim() != 3 or weight.shape[0] != NCH or weight.shape[1] != 1:
        raise ConfigError(f"short_conv: weight shape {tuple(weight.shape)} must be [C={NCH}, 1, W]")
    W = weight.shape[-1]
    cu, tok_seq = seq_table(B, T, cu_seqlens, x.device)
    N = cu.numel() - 1
    if conv_state is not None and tuple(conv_state.shape) != (N, NCH, W - 1):
        raise ConfigError(f"short_conv: conv_state shape {tuple(conv_state.shape)} != [N={N}, C={NCH}, W-1={W - 1}]")
    xc = x.contiguous()
    wc = weight.reshape(NCH, W).to(torch.float32).contiguous()
    st = conv_state.contiguous() if conv_state is not None else xc  # dummy pointer when absent
    y = C.empty(B, T, NCH, dtype=out_dtype, device=x.device)
    fin = C.empty(N, NCH, W - 1, dtype=torch.float32, device=x.device)
    TT = B * T

    def launch(cfg):
        meta, opts = tune.split(cfg)
        if TT > 0:
            grid = (triton.cdiv(TT, meta["BLOCK_T"]), triton.cdiv(NCH, meta["BLOCK_C"]))
            _interp.launch(_conv_fwd_kernel, grid, xc, wc, y, st, cu, tok_seq, TT, NCH, HAS_STATE=conv_state is not None, W=W,
                                   **meta, **opts)

    cands = [config] if config is not None else tune.configs(C.CONV)
    # bounded specialisation: the token count enters the key as a power of two
    launch(tune.pick("kda_conv", (tune.pow2(TT), NCH, W, x.dtype, conv_state is not None), cands, launch))
    if N > 0:
        bc = 128
        _interp.launch(_conv_state_kernel, (N, triton.cdiv(NCH, bc)), xc, st, fin, cu, NCH, HAS_STATE=conv_state is not None, W=W,
                                                     BLOCK_C=bc)
    return y, fin
