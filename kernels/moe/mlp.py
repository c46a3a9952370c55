"""The GLU activation of the dense and shared-expert MLPs in one Triton launch (the ``glu`` op).

``h = act(g, u)`` per element, fp32 math, written in the output dtype: SiTU-GLU (K3_FACTS §5:
``beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin)``, tanh as ``2*sigmoid(2y) - 1`` like the grouped
GEMM's epilogue) or SiLU-GLU (kimi_linear: ``g*sigmoid(g)*u``). The torch oracle issues about nine elementwise
kernels per call (and the down projection one more cast); this is one. ``g`` / ``u`` may be column views of one
gate|up product (row strides given). Oracle: :func:`k3rocm.model.common.glu`.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp
from k3rocm.kernels.moe.gemm import _situ

#: columns per program (a row of I = 6,144 / 16 (K3 shared experts at TP16) is 1-2 programs)
BLOCK_I = 1024


# compiled mode (as _interp.kjit); the row count and strides are not specialised on, so a new batch size never
# compiles while serving
@partial(JITFunction, do_not_specialize=("T", "I", "stride_g", "stride_u", "stride_o"))
def glu_kernel(G, U, O, T, I, stride_g, stride_u, stride_o, ACT: tl.constexpr, BETA: tl.constexpr,
               BETA_LIN: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(G + t * stride_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + t * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    if ACT == "situ":
        h = _situ(g, u, BETA, BETA_LIN)
    else:
        h = g * tl.sigmoid(g) * u
    tl.store(O + t * stride_o + c, h.to(O.dtype.element_ty), mask=ok)


def glu(g: torch.Tensor, u: torch.Tensor, act: str = "situ", beta: float = 4.0, beta_lin: float = 25.0,
        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton GLU activation; contract of :func:`k3rocm.model.common.glu`.

    Args:
        g, u: ``[T, I]`` float (fp32 / bf16 / fp16), unit column stride (row strides free: column views of one
            product are read in place).
        out_dtype: fp32, bf16 or fp16.
    Returns:
        ``[T, I]`` new tensor in ``out_dtype``.
    Raises:
        ConfigError: other shapes / ranks, a non-unit column stride, an unknown ``act`` or ``out_dtype``.
    """
    if g.dim() != 2 or g.shape != u.shape:
        raise ConfigError(f"glu (triton): gate {tuple(g.shape)} and up {tuple(u.shape)} must be one [T, I] shape")
    if act not in ("situ", "silu"):
        raise ConfigError(f"glu (triton): act {act!r} is not one of situ, silu")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"glu (triton): out_dtype {out_dtype} is not fp32, bf16 or fp16")
    if g.stride(1) != 1 or u.stride(1) != 1:
        raise ConfigError("glu (triton): gate and up need a unit column stride")
    T, I = g.shape
    out = torch.empty(T, I, dtype=out_dtype, device=g.device)
    if T == 0 or I == 0:
        return out
    block = min(BLOCK_I, triton.next_power_of_2(I))
    _interp.launch(glu_kernel, (T, triton.cdiv(I, block)), g, u, out, T, I, g.stride(0), u.stride(0), out.stride(0),
                   ACT=act, BETA=float(beta), BETA_LIN=float(beta_lin), BLOCK=block, num_warps=4)
    return out


def isa_case() -> tuple:
    """``kernels isa`` case: SiTU-GLU of fp32 gate/up column views into bf16 (the engine's shared-expert path)."""
    sig = {"G": "*fp32", "U": "*fp32", "O": "*bf16", "T": "i32", "I": "i32", "stride_g": "i32", "stride_u": "i32",
           "stride_o": "i32", "ACT": "constexpr", "BETA": "constexpr", "BETA_LIN": "constexpr", "BLOCK": "constexpr"}
    return ("glu_situ_bf16", glu_kernel, sig, {"ACT": "situ", "BETA": 4.0, "BETA_LIN": 25.0, "BLOCK": BLOCK_I}, False,
            {"hip": {"num_warps": 4}, "cuda": {"num_warps": 4}})
