"""Shared fp32 building blocks of the oracle model: norms, gated activations, safe softplus.

Every function widens its inputs to fp32, computes in fp32, returns fp32 and never modifies its
inputs. Sources: K3_FACTS §5 (RMSNorm eps 1e-5, KDA L2 norm eps 1e-6, SiTU-GLU with
``activation_situ_beta`` 4.0 / ``activation_situ_linear_beta`` 25.0), the Kimi-Linear HF modelling
code (SiLU-GLU, softplus decay gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["f32", "rms_norm", "l2_norm", "situ_glu", "silu_glu", "softplus", "linear"]


def f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as fp32 (no copy when it already is fp32)."""
    return x if x.dtype == torch.float32 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * weight``, in fp32.

    Args:
        x: ``[..., D]`` any float dtype.
        weight: ``[D]`` or None (no affine scale, as in the AttnRes keys, K3_FACTS §5).
        eps: added to the mean square (HF ``rms_norm_eps``, 1e-5 for K3).
    Returns:
        ``[..., D]`` fp32.
    """
    x = f32(x)
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * f32(weight)
    return y


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2 normalisation over the last dim: ``x * rsqrt(sum(x^2) + eps)`` in fp32 (KDA q/k, K3_FACTS §5).

    Args:
        x: ``[..., K]`` any float dtype.
        eps: added to the sum of squares (1e-6, as FLA's ``l2norm``).
    Returns:
        ``[..., K]`` fp32.
    """
    x = f32(x)
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> torch.Tensor:
    """SiTU-GLU (K3_FACTS §5): ``a = beta*tanh(g/beta)*sigmoid(g)``; ``u' = beta_lin*tanh(u/beta_lin)``; ``a*u'``.

    The sigmoid takes the uncapped ``g``. ``|out| <= beta*beta_lin`` (100 for K3).

    Args:
        g: gate pre-activation ``[..., I]``; u: up pre-activation ``[..., I]`` (any float dtype).
        beta: ``activation_situ_beta``; beta_lin: ``activation_situ_linear_beta``.
    Returns:
        ``[..., I]`` fp32.
    """
    g, u = f32(g), f32(u)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return a * (beta_lin * torch.tanh(u / beta_lin))


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU (Kimi-Linear MLPs / experts): ``silu(g) * u`` in fp32. Shapes ``[..., I]``."""
    return F.silu(f32(g)) * f32(u)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """Overflow-safe softplus ``log(1 + exp(x))`` in fp32 (torch's thresholded form, threshold 20).

    Used by the Kimi-Linear decay gate ``-exp(A_log) * softplus(raw + dt_bias)``.
    """
    return F.softplus(f32(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` in fp32. x ``[..., in]``, weight ``[out, in]`` (HF layout). Returns ``[..., out]``."""
    return F.linear(f32(x), f32(weight), None if bias is None else f32(bias))
