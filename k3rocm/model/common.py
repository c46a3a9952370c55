"""Shared fp32 building blocks of the oracle model: norms, gated activations, safe softplus.

Every function widens its inputs to fp32, computes in fp32, returns fp32 and never modifies its
inputs. The one scoped exception is :func:`linear` inside a :func:`matmul_dtype` context (the serving
engine's bf16 GEMMs): operands stay in the low-precision dtype, accumulation and the result are fp32.
Sources: K3_FACTS §5 (RMSNorm eps 1e-5, KDA L2 norm eps 1e-6, SiTU-GLU with
``activation_situ_beta`` 4.0 / ``activation_situ_linear_beta`` 25.0), the Kimi-Linear HF modelling
code (SiLU-GLU, softplus decay gate).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.nn.functional as F

from k3rocm.errors import ConfigError

__all__ = ["f32", "rms_norm", "l2_norm", "situ_glu", "silu_glu", "glu", "softplus", "linear", "linear_lp", "matmul_input",
           "matmul_dtype", "current_matmul_dtype", "fp32_out_supported", "MATMUL_DTYPES"]

# dtypes a matmul_dtype context accepts (None = off: fp32 math)
MATMUL_DTYPES = (torch.bfloat16, torch.float16)

# operand dtype of linear() in the current context; a ContextVar, so each thread (and asyncio task) has its own
_MATMUL_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("k3rocm_matmul_dtype",
                                                                                   default=None)
# (device type, index) -> whether torch.mm(a, b, out_dtype=torch.float32) works there on bf16/fp16 operands
_FP32_OUT: dict[tuple[str, int], bool] = {}


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
    # torch's own RMSNorm: the same formula (bit-identical on the CPU), one fused kernel where the backend has one
    # instead of six elementwise / reduction launches (~200 calls in a K3 rank's step)
    return F.rms_norm(x, (x.shape[-1],), None if weight is None else f32(weight), eps)


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


def glu(g: torch.Tensor, u: torch.Tensor, act: str = "situ", beta: float = 4.0, beta_lin: float = 25.0,
        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The GLU activation of a dense / shared-expert MLP (the ``glu`` op of :data:`k3rocm.model.ops.ORACLE_OPS`):
    :func:`situ_glu` (``act="situ"``, K3) or :func:`silu_glu` (``"silu"``, kimi_linear), computed in fp32 and
    returned in ``out_dtype`` (fp32 by default; the engine asks for the down projection's operand dtype, which that
    projection would round to anyway).

    Args:
        g, u: gate / up pre-activations ``[T, I]`` (any float dtype; column views of one product are fine).
    Returns:
        ``[T, I]`` in ``out_dtype``.
    Raises:
        ConfigError: ``act`` is neither "situ" nor "silu", or g and u differ in shape.
    """
    if g.shape != u.shape:
        raise ConfigError(f"glu: gate {tuple(g.shape)} and up {tuple(u.shape)} differ in shape")
    if act == "situ":
        h = situ_glu(g, u, beta, beta_lin)
    elif act == "silu":
        h = silu_glu(g, u)
    else:
        raise ConfigError(f"glu: act {act!r} is not one of situ, silu")
    return h if out_dtype == torch.float32 else h.to(out_dtype)


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU (Kimi-Linear MLPs / experts): ``silu(g) * u`` in fp32. Shapes ``[..., I]``."""
    return F.silu(f32(g)) * f32(u)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """Overflow-safe softplus ``log(1 + exp(x))`` in fp32 (torch's thresholded form, threshold 20).

    Used by the Kimi-Linear decay gate ``-exp(A_log) * softplus(raw + dt_bias)``.
    """
    return F.softplus(f32(x))


@contextlib.contextmanager
def matmul_dtype(dtype: torch.dtype | None) -> Iterator[torch.dtype | None]:
    """Scope in which :func:`linear` multiplies in ``dtype`` (bf16/fp16) when the weight is stored in it.

    ``None`` switches the low-precision path off inside the scope (fp32 math, as outside any scope). The
    setting lives in a :class:`contextvars.ContextVar`: it is restored on exit (also on an exception), nests,
    and never leaks into other threads (a new thread starts with no scope, i.e. fp32 math).

    Args:
        dtype: ``torch.bfloat16``, ``torch.float16`` or None.
    Raises:
        ConfigError: any other dtype.
    """
    if dtype is not None and dtype not in MATMUL_DTYPES:
        raise ConfigError(f"matmul_dtype {dtype} is not bfloat16, float16 or None; pass one of those")
    token = _MATMUL_DTYPE.set(dtype)
    try:
        yield dtype
    finally:
        _MATMUL_DTYPE.reset(token)


def current_matmul_dtype() -> torch.dtype | None:
    """The operand dtype of :func:`linear` in the current context (None = fp32 math)."""
    return _MATMUL_DTYPE.get()


def _dev_key(device: torch.device) -> tuple[str, int]:
    return device.type, device.index if device.index is not None else torch.cuda.current_device()


def fp32_out_supported(device: torch.device | str) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` on bf16 operands works on ``device`` (probed once).

    The probe (CUDA/ROCm only; CPU is always False) multiplies a ``[16, 64]`` bf16 matrix of ones, whose first
    column is ``1 + 2^-7``, by the transpose of a ``[16, 64]`` matrix of ones (a weight as :func:`linear` passes
    it): every entry must come back fp32 and exactly ``64 + 2^-7`` (a bf16-rounded product would give 64). Any error or a wrong value means unsupported. The
    answer is cached per device. While a CUDA graph is being captured an unprobed device answers False without
    caching (the probe reads back to the host, which a capture forbids); the engine probes before capturing.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    key = _dev_key(dev)
    ok = _FP32_OUT.get(key)
    if ok is not None:
        return ok
    if torch.cuda.is_current_stream_capturing():
        return False
    try:
        a = torch.ones(16, 64, dtype=torch.bfloat16, device=dev)
        a[:, 0] = 1.0 + 2.0 ** -7
        w = torch.ones(16, 64, dtype=torch.bfloat16, device=dev)
        y = torch.mm(a, w.t(), out_dtype=torch.float32)
        ok = y.dtype == torch.float32 and bool((y == 64.0 + 2.0 ** -7).all())
    except (RuntimeError, TypeError, NotImplementedError):  # kwarg unknown to this torch, or no kernel here
        ok = False
    _FP32_OUT[key] = ok
    return ok


def matmul_input(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """``x`` as :func:`linear` would multiply it with each of ``weights``: rounded once to the
    :func:`matmul_dtype` scope's dtype when every weight is stored in it (the low-precision path), else ``x``
    itself (fp32 math, the oracle: unchanged, no copy).

    Rounding an input that feeds several projections once, and passing the result to each :func:`linear`,
    gives bit for bit the products of rounding it per projection (``.to`` of a tensor already in the dtype is
    free), one cast kernel instead of one per projection.

    Args:
        x: ``[..., in]`` any float dtype. weights: ``[out_i, in]`` each (at least one).
    Returns:
        ``x`` (same tensor) or a new ``[..., in]`` tensor of the scope's dtype.
    Raises:
        ConfigError: no weight given.
    """
    if not weights:
        raise ConfigError("matmul_input: name the weights that read x (at least one)")
    dt = _MATMUL_DTYPE.get()
    if dt is None or any(w.dtype != dt for w in weights):
        return x
    return x.to(dt)


def linear_lp(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` for a consumer that rounds its input to the :func:`matmul_dtype` scope's dtype anyway:
    inside the scope (weight stored in its dtype ``d``) the product comes out in ``d``, fp32 accumulation rounded
    once to ``d`` by the GEMM itself, instead of an fp32 product and a separate cast; elsewhere exactly
    :func:`linear` (fp32). x ``[..., in]``, weight ``[out, in]`` -> ``[..., out]``.

    On the CPU this is bit for bit ``linear(x, weight).to(d)`` (the CPU product is ``d`` already). On a GPU the
    GEMM rounds its fp32 accumulators to nearest even as ``.to(d)`` does, so it equals that expression unless
    the BLAS sums in another order for a ``d`` output than for an fp32 one (a split-K kernel, whose partial sums
    torch lets cuBLAS keep in ``d``: ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``) —
    a difference of the order of one rounding to ``d``, the rounding the consumer applies anyway.
    """
    dt = _MATMUL_DTYPE.get()
    if dt is None or weight.dtype != dt:
        return linear(x, weight)
    lead = x.shape[:-1]
    y = F.linear(x.reshape(-1, x.shape[-1]).to(dt), weight)
    return y.reshape(*lead, weight.shape[0])


#: an experimental replacement for the vendor GEMM of :func:`linear`'s low-precision path at few rows:
#: ``[fn, max_rows]`` with ``fn(a [M, K], weight [N, K]) -> [M, N] fp32`` (``k3rocm.kernels.dense.skinny_gemm``)
#: used when ``M <= max_rows``; ``fn`` None (the default): the vendor GEMM always. Set only by the GPU scripts that
#: time the engine with the Triton skinny GEMM (``gpu-runs/prof_steps.py``, ``DENSE_GEMM=triton``) until that
#: kernel is measured faster; nothing in the package sets it
DENSE_GEMM: list = [None, 64]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)``, returned fp32. x ``[..., in]``, weight ``[out, in]`` (HF layout) -> ``[..., out]``.

    Default (no :func:`matmul_dtype` scope, or a weight of another dtype than the scope's): both operands are
    widened to fp32 and multiplied in fp32 — exact widening of bf16-stored weights, the oracle's math.

    Inside ``matmul_dtype(d)`` with ``weight.dtype == d`` (the serving engine's bf16/fp16 weights): ``x`` is
    rounded to ``d`` and multiplied with the stored weight as is (no fp32 copy of the weight), accumulating in
    fp32. On CUDA/ROCm the product is written in fp32 by ``torch.mm(..., out_dtype=torch.float32)`` when the
    backend supports it (:func:`fp32_out_supported`), so it is not rounded to ``d``; elsewhere (CPU, older
    torch) the ``d`` product is widened, i.e. rounded once to ``d`` (relative error <= 2^-8 for bf16).
    ``bias`` is added in fp32. An ``x`` already in ``d`` (:func:`matmul_input`) is used as is: no cast.
    """
    dt = _MATMUL_DTYPE.get()
    if dt is None or weight.dtype != dt:
        return F.linear(f32(x), f32(weight), None if bias is None else f32(bias))
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1]).to(dt)
    fn, rows = DENSE_GEMM
    if fn is not None and 0 < a.shape[0] <= rows and weight.stride(-1) == 1 and a.stride(-1) == 1:
        y = fn(a, weight)
    elif a.device.type == "cuda" and a.shape[0] and fp32_out_supported(a.device):
        y = torch.mm(a, weight.t(), out_dtype=torch.float32)
    else:
        y = F.linear(a, weight).float()
    y = y.reshape(*lead, weight.shape[0])
    if bias is not None:
        y = y + f32(bias)
    return y
