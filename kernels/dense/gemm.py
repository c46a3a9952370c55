"""Triton skinny GEMM for the decode step's dense projections: ``y [M, N] fp32 = x [M, K] @ W [N, K]^T`` with
bf16 / fp16 operands, fp32 accumulation, for few rows (M up to a few dozen: a decode step's tokens).

Why: at decode a projection is a weight stream. A K3 rank's graphed decode step (TP16 / EP16, 53 rows, H200,
2026-12-04, docs/BENCHMARKS.md "Tokens per step") spent ~7.4 ms of its 34.4 ms of device time in cuBLAS
projections and their split-K reductions, at ~2.2 TB/s on average (2.9 – 3.0 TB/s on the latent MoE down / up
projections, 1.7 – 2.1 TB/s on the small ones) against ~4.2 TB/s of copy bandwidth.

Form ("swap AB"): the weight rows are the matrix unit's M side (``BLOCK_N`` of them a program, 64 / 128: a whole
wgmma / MFMA tile) and the tokens its N side (``BLOCK_M``, 16 – 64: one row pads to 16), so a few tokens waste no
multiplier rows on padding. K is cut into ``SPLIT_K`` ranges on the grid's second axis for enough programs per
multiprocessor; the partial tiles go to a workspace and the program that arrives last for a tile (an atomic
counter, acquire / release) adds them in split order 0, 1, ... and writes ``y``: deterministic, one launch, no
fp32 atomics on ``y``. It resets the counter, so the counter buffer is zero again for the next launch (launches on
one stream; two streams must not share it concurrently).

Formula: plain matrix product (fp32 accumulation of exact bf16 / fp16 products); the oracle is
``x.float() @ W.float().T``.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from k3rocm.errors import ConfigError
from k3rocm.kernels import _interp, tune
from k3rocm.kernels.isa import specialize
from k3rocm.kernels.target import interpreting, multiprocessors

__all__ = ["skinny_gemm", "fastest_gemm", "SKINNY_CONFIGS", "COUNTERS", "auto_split", "VENDOR"]


# M (token rows) not specialised on (== 1, % 16): a new row count never compiles while serving
@partial(JITFunction, do_not_specialize=("M",))
def _skinny_gemm_kernel(x, w, y, ws, cnt, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, F32: tl.constexpr = 0):
    """One ``[BLOCK_N weight rows, BLOCK_M tokens]`` tile of ``y^T`` over K range ``pid(1)`` of ``SPLIT_K``.
    ``F32`` = 1: the tiles widened to fp32 and multiplied in IEEE fp32 (the interpreter, whose 16-bit ``tl.dot``
    is not exact; the products of bf16 / fp16 values are exact in fp32 either way)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K  # K per split, whole BLOCK_K steps
    k_lo = pid_s * per
    k_hi = tl.minimum(K, k_lo + per)
    wp = w + rn.to(tl.int64)[:, None] * stride_wn
    xp = x + rm.to(tl.int64)[:, None] * stride_xm
    nmask = (rn < N)[:, None]
    mmask = (rm < M)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        km = (kk < k_hi)[None, :]
        wt = tl.load(wp + kk[None, :], mask=nmask & km, other=0.0)
        xt = tl.load(xp + kk[None, :], mask=mmask & km, other=0.0)
        if F32:
            acc += tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(wt, tl.trans(xt))
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    om = (rm < M)[:, None] & (rn < N)[None, :]
    yp = y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if SPLIT_K == 1:
        tl.store(yp, out, mask=om)
    else:
        mn = M.to(tl.int64) * N
        off = rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(ws + pid_s * mn + off, out, mask=om)
        tl.debug_barrier()  # every lane's partial before the release below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in tl.static_range(SPLIT_K):  # split order, whoever arrived last: the same sum every run
                s += tl.load(ws + j * mn + off, mask=om, other=0.0, cache_modifier=".cg")
            tl.store(yp, s, mask=om)
            tl.atomic_xchg(cnt + tile, 0, sem="relaxed")


_W = dict(num_stages=1)
#: per backend, best first within each ``max_rows`` band (rows = M, the tokens); all candidates until a GPU has
#: timed them against the vendor GEMM (gpu-runs/bench_dense.py)
#: ``SPLIT_K`` 0: chosen per shape by :func:`auto_split` (a power of two up to 16)
SKINNY_CONFIGS = {
    "cuda": [dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=256, SPLIT_K=0, max_rows=16, candidate=True, num_warps=4,
                  num_stages=4),
             dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=256, SPLIT_K=2, max_rows=16, candidate=True, num_warps=4,
                  num_stages=4),
             dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=4, max_rows=16, candidate=True, num_warps=4,
                  num_stages=6),
             dict(BLOCK_N=64, BLOCK_M=32, BLOCK_K=128, SPLIT_K=0, max_rows=32, candidate=True, num_warps=4,
                  num_stages=5),
             dict(BLOCK_N=64, BLOCK_M=64, BLOCK_K=128, SPLIT_K=0, max_rows=64, candidate=True, num_warps=4,
                  num_stages=4),
             dict(BLOCK_N=64, BLOCK_M=64, BLOCK_K=128, SPLIT_K=2, max_rows=64, candidate=True, num_warps=4,
                  num_stages=4),
             dict(BLOCK_N=128, BLOCK_M=64, BLOCK_K=64, SPLIT_K=1, max_rows=64, candidate=True, num_warps=4,
                  num_stages=6),
             dict(BLOCK_N=64, BLOCK_M=64, BLOCK_K=128, SPLIT_K=4, max_rows=64, candidate=True, num_warps=4,
                  num_stages=4),
             dict(BLOCK_N=128, BLOCK_M=64, BLOCK_K=64, SPLIT_K=1, candidate=True, num_warps=8, num_stages=4)],
    "hip": [dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=0, max_rows=16, candidate=True, num_warps=4,
                 num_stages=2, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
            dict(BLOCK_N=64, BLOCK_M=64, BLOCK_K=64, SPLIT_K=0, max_rows=64, candidate=True, num_warps=4,
                 num_stages=2, waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1),
            dict(BLOCK_N=128, BLOCK_M=64, BLOCK_K=64, SPLIT_K=1, candidate=True, num_warps=8, num_stages=2,
                 waves_per_eu=0, matrix_instr_nonkdim=16, kpack=1)],
    # the interpreter: the CUDA tiles, K steps and splits (launch options dropped)
    "interpreter": [],
}
SKINNY_CONFIGS["interpreter"] = [dict(c) for c in SKINNY_CONFIGS["cuda"]]

#: per device: a zeroed int32 counter buffer of the split-K tiles (each launch leaves it zero again)
COUNTERS: dict[str, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 16


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > _COUNTER_SLOTS:
        raise ConfigError(f"skinny_gemm: {tiles} output tiles exceed the counter buffer's {_COUNTER_SLOTS}; use "
                          "a larger BLOCK_N / BLOCK_M or the vendor GEMM for this shape")
    key = str(device)
    buf = COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ConfigError("skinny_gemm: first call inside a CUDA graph capture; run it once before capturing "
                              "(the counter buffer is allocated and zeroed then)")
        buf = COUNTERS[key] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def _n_sm(device: torch.device) -> int:
    """Multiprocessors (CUs) of ``device``; 4 in the interpreter (so the test shapes take several splits)."""
    return 4 if interpreting() or device.type != "cuda" else multiprocessors(device)


def auto_split(M: int, N: int, K: int, meta: dict, n_sm: int, most: int = 16) -> int:
    """``SPLIT_K`` of a config that leaves it 0: the smallest power of two that gives at least two programs a
    multiprocessor (``n_sm``), at most ``most`` and at most the K steps there are. Shapes with few weight rows (a
    TP rank's 768-row slice: 12 tiles of 64) need many splits to fill the GPU; wide ones (7,168 rows: 112 tiles)
    need one or two."""
    tiles = triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(M, meta["BLOCK_M"])
    steps = triton.cdiv(K, meta["BLOCK_K"])
    s = 1
    while tiles * s < 2 * n_sm and s * 2 <= min(most, steps):
        s *= 2
    return s


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``x @ weight^T`` in fp32 for few rows (the module docstring says how).

    Args:
        x: ``[M, K]`` bf16 or fp16 (last dim contiguous); M >= 0.
        weight: ``[N, K]`` of x's dtype (HF layout, last dim contiguous).
        config: one entry of :data:`SKINNY_CONFIGS` (default: the tuned pick for the shape; serving's untimed mode
            takes the first entry whose ``max_rows`` fits M).
    Returns:
        ``y [M, N]`` fp32, new.
    Raises:
        ConfigError: not 2-D, K or dtypes that disagree, a dtype other than bf16 / fp16, a non-contiguous last dim,
            more output tiles than the counter buffer holds, or the first call inside a graph capture.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ConfigError(f"skinny_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and "
                          "[N, K] with the same K")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"skinny_gemm: x {x.dtype} / weight {weight.dtype} must both be bf16 or both fp16")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ConfigError("skinny_gemm: x and weight need a contiguous last dim")
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    interp = interpreting()

    def run(c):
        meta, opts = tune.split(c)
        if not meta["SPLIT_K"]:
            meta["SPLIT_K"] = auto_split(M, N, K, meta, _n_sm(x.device))
        grid = (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], triton.cdiv(M, meta["BLOCK_M"]))
        ws = y
        cnt = y
        if meta["SPLIT_K"] > 1:
            ws = torch.empty(meta["SPLIT_K"], M, N, dtype=torch.float32, device=x.device)
            cnt = _counters(x.device, grid[0] * grid[2])
        _interp.launch(_skinny_gemm_kernel, grid, x, weight, y, ws, cnt, M, N, K, x.stride(0), weight.stride(0),
                       y.stride(0), F32=1 if interp else 0, **meta, **opts)

    if config is not None:
        run(config)
        return y
    table = tune.configs(SKINNY_CONFIGS, candidates=True)
    fits = [c for c in table if M <= c.get("max_rows", M)]
    cfg = tune.pick("skinny_gemm", (tune.pow2(M), N, K, x.dtype), fits, run)
    run(cfg)
    return y


def isa_case(block_m: int = 16, split_k: int = 2, backend_opts: dict | None = None) -> tuple:
    """``(name, kernel, signature, constexprs, expects_matrix, {backend: options})`` of the first CUDA / HIP entry
    at ``BLOCK_M = block_m`` for the ahead-of-time check."""
    sig = dict(x="*bf16", w="*bf16", y="*fp32", ws="*fp32", cnt="*i32", M="i32", N="i32", K="i32",
               stride_xm="i32", stride_wn="i32", stride_ym="i32", BLOCK_N="constexpr", BLOCK_M="constexpr",
               BLOCK_K="constexpr", SPLIT_K="constexpr", F32="constexpr")
    # a K3 projection (7168 -> 3584, the latent down projection); M (the token count) is never specialised
    sig = specialize(sig, dict(N=3584, K=7168, stride_xm=7168, stride_wn=7168, stride_ym=3584))
    first = {be: next((c for c in SKINNY_CONFIGS[be] if c["BLOCK_M"] == block_m), SKINNY_CONFIGS[be][0])
             for be in ("cuda", "hip")}
    # each backend compiles its own entry's tiles (a backend's "constexprs" replace the case's there)
    tiles = {be: dict(BLOCK_N=c["BLOCK_N"], BLOCK_M=block_m, BLOCK_K=c["BLOCK_K"], SPLIT_K=split_k, F32=0)
             for be, c in first.items()}
    consts = tiles["cuda"]
    opts = {be: dict(tune.split(cf, interp=False)[1], constexprs=tiles[be]) for be, cf in first.items()}
    return (f"skinny_gemm_m{block_m}_s{split_k}", _skinny_gemm_kernel, sig, consts, True, opts)


#: the vendor GEMM as a candidate of :func:`fastest_gemm` (first: what an untimed pick takes)
VENDOR: dict = dict(VENDOR=1)


def fastest_gemm(x: torch.Tensor, weight: torch.Tensor, vendor) -> torch.Tensor:
    """``x @ weight^T`` in fp32 by whichever of the vendor GEMM and :func:`skinny_gemm`'s configs is faster at this
    shape: a timed pick (``tune.pick``, key ``(pow2(M), N, K, dtype)``, timed as graph replays, the way the engine
    runs its steps) among :data:`VENDOR` and the skinny configs whose row band fits M. The vendor GEMM comes first,
    so an untimed pick (tune mode ``"first"`` / ``"frozen"``, ``K3ROCM_TUNE=0``, inside a capture) keeps it.
    Measured per shape (1 x H100, 2026-12-07, docs/BENCHMARKS.md, ``gpu-runs/bench_dense.py``): the skinny GEMM
    wins on the K3 rank's KDA input projection (0.68 - 0.72 x the vendor time at 16 - 64 rows), the latent down
    projection (0.92 - 0.95 x) and MLA q_a | kv_a (0.80 - 0.94 x), and loses on the small ones (KDA o_proj, the
    shared expert) and on the latent up projection: hence a pick per shape, not a switch.

    Args:
        x: ``[M, K]`` bf16 / fp16; weight ``[N, K]`` of its dtype (last dims contiguous).
        vendor: ``vendor(x, weight) -> [M, N] fp32``, the caller's vendor GEMM.
    Returns:
        ``[M, N]`` fp32.
    Raises:
        ConfigError: as :func:`skinny_gemm`, where a skinny config is the pick.
    """
    M, K = x.shape
    N = weight.shape[0]
    if x.device.type != "cuda" or M == 0:
        return vendor(x, weight)
    fits = [c for c in tune.configs(SKINNY_CONFIGS, candidates=True) if M <= c.get("max_rows", M)]
    out: list = []

    def run(c):
        out[:] = [vendor(x, weight) if c is VENDOR else skinny_gemm(x, weight, config=c)]

    cfg = tune.pick("dense_gemm", (tune.pow2(M), N, K, x.dtype), [VENDOR] + fits, run, graphed=True)
    run(cfg)
    return out[0]
