"""Triton MLA kernels: prefill (flash attention, shared k_rope), paged latent-cache write, absorbed split-K decode.

``TRITON_IMPLS`` lists the ``triton`` implementations of ``mla_prefill``, ``mla_decode`` and
``mla_cache_write`` for :mod:`k3rocm.runtime.registry`. Oracles: :mod:`k3rocm.model.mla`.
"""

from __future__ import annotations

from .decode import (CACHE_WRITE_CONFIGS, DECODE_CONFIGS, REDUCE_CONFIGS, _mla_cache_write_kernel,
                     _mla_decode_merge_kernel, _mla_decode_split_kernel, mla_cache_write, mla_decode)
from .prefill import (PREFILL_CONFIGS, _mla_prefill_kernel, expand_cached_context, isa_signature, mla_prefill,
                      mla_prefill_chunked, pad_dim)

__all__ = ["mla_prefill", "mla_prefill_chunked", "expand_cached_context", "mla_decode", "mla_cache_write", "PREFILL_CONFIGS", "DECODE_CONFIGS", "REDUCE_CONFIGS",
           "CACHE_WRITE_CONFIGS", "isa_cases", "TRITON_IMPLS"]


#: the ``triton`` implementations of this family: ``(op, fn, supports or None, note)``
TRITON_IMPLS = (
    ("mla_prefill", mla_prefill, None, "Triton flash attention, shared k_rope, fused gate"),
    ("mla_decode", mla_decode, None,
     "Triton absorbed split-K decode over the paged 576-wide cache + merge/W_vc/gate kernel"),
    ("mla_cache_write", mla_cache_write, None, "Triton paged slot write (bf16 / FP8 + scale)"),
)


def _decode_split_sig(cache: str, q: str, block_h: int, block_n: int, R: int = 512, DR: int = 64, xcd: int = 1):
    # strides as the JIT sees them at K3 TP8 (12 heads, one query, page 64; see prefill.isa_signature)
    N, H = 64, 12
    sig = {"QL": q, "QR": q, "CACHE": cache, "BT": "*i32", "CL": "*i32", "PART": "*fp32", "LSE": "*fp32"}
    strides = dict(stride_qln=R, stride_qlt=R, stride_qlh=N * R, stride_qrn=H * DR, stride_qrt=H * DR,
                   stride_qrh=DR, stride_cb=64 * (R + DR), stride_cs=R + DR, stride_bt=512)
    for s in ("H", "TQ", "ROWS", "NSEQ", "min_chunk", "n_groups", "n_splits"):
        sig[s] = "i32"
    sig["qk_scale"] = "fp32"
    sig["out_scale"] = "fp32"
    consts = dict(strides, R=R, DR=DR, BR=pad_dim(R), BDR=pad_dim(DR), PAGE=64, BLOCK_H=block_h, BLOCK_N=block_n, IS_FP8=cache.startswith("*fp8"), XCD=xcd)
    sig.update({k: "constexpr" for k in consts})
    return sig, consts


def isa_cases() -> list[tuple]:
    """Every MLA kernel at K3 dims for ``kernels isa``: ``(name, fn, signature, constexprs, expects_matrix, options)``."""
    cases = []
    sig, consts, opts = isa_signature("bf16", has_gate=True)
    cases.append(("mla_prefill_bf16_gate", _mla_prefill_kernel, sig, consts, True, opts))
    # head dims that are not powers of two (padded and masked in the kernel)
    sig, consts, opts = isa_signature("bf16", has_gate=True, dn=96, dr=32, dv=96)
    cases.append(("mla_prefill_bf16_gate_d96_32_96", _mla_prefill_kernel, sig, consts, True, opts))
    for cfg in DECODE_CONFIGS["hip"]:  # the HIP configs' tiles; CUDA compiles the same tiles
        sig, consts = _decode_split_sig("*bf16", "*bf16", cfg["BLOCK_H"], cfg["BLOCK_N"])
        opts = {"cuda": {"num_warps": cfg["num_warps"], "num_stages": 2},
                "hip": {k: v for k, v in cfg.items() if not k.startswith("BLOCK")}}
        # the launch options in the name too: two HIP configs may share a tile and differ in warps or stages
        cases.append((f"mla_decode_split_bf16_h{cfg['BLOCK_H']}_n{cfg['BLOCK_N']}_w{cfg['num_warps']}"
                      f"s{cfg.get('num_stages', 1)}", _mla_decode_split_kernel, sig, consts, True, opts))
    cfg = DECODE_CONFIGS["hip"][0]  # the die-ordered linear grid of MI300 / MI355X (xcd_count() = 8)
    sig, consts = _decode_split_sig("*bf16", "*bf16", cfg["BLOCK_H"], cfg["BLOCK_N"], xcd=8)
    cases.append(("mla_decode_split_bf16_xcd8", _mla_decode_split_kernel, sig, consts, True,
                  {"cuda": {"num_warps": cfg["num_warps"], "num_stages": 2},
                   "hip": {k: v for k, v in cfg.items() if not k.startswith("BLOCK")}}))
    cfg = DECODE_CONFIGS["hip"][0]  # a rank and rope width that are not powers of two
    sig, consts = _decode_split_sig("*bf16", "*bf16", cfg["BLOCK_H"], cfg["BLOCK_N"], R=384, DR=32)
    cases.append(("mla_decode_split_bf16_r384_dr32", _mla_decode_split_kernel, sig, consts, True,
                  {"cuda": {"num_warps": cfg["num_warps"], "num_stages": 2},
                   "hip": {k: v for k, v in cfg.items() if not k.startswith("BLOCK")}}))
    sig = {"PART": "*fp32", "LSE": "*fp32", "WVC": "*bf16", "G": "*bf16", "O": "*bf16"}
    for s in ("H", "TQ", "ROWS", "NSEQ", "num_splits"):
        sig[s] = "i32"
    rc = REDUCE_CONFIGS["cuda"][0]
    consts = dict(stride_wh=512 * 128, stride_wr=128, stride_gn=12 * 128, stride_gt=12 * 128, stride_on=12 * 128,
                  stride_ot=12 * 128, stride_oh=128,
                  R=512, DV=128, BDV=128, BLOCK_M=rc["BLOCK_M"], BLOCK_R=rc["BLOCK_R"], HAS_GATE=True)
    sig.update({k: "constexpr" for k in consts})
    cases.append(("mla_decode_merge_bf16", _mla_decode_merge_kernel, sig, consts, True,
                  {"cuda": {"num_warps": 4, "num_stages": 2}, "hip": {"num_warps": 4, "num_stages": 1}}))
    sig = {"CACHE": "*bf16", "SLOT": "*i64", "LAT": "*bf16", "KR": "*bf16", "inv_scale": "fp32"}
    consts = dict(stride_cb=64 * 576, stride_cs=576, stride_lt=512, stride_kt=64, block_size=64,
                  R=512, DR=64, BR=512, BDR=64, IS_FP8=False, FP8_LIM=0.0)
    sig.update({k: "constexpr" for k in consts})
    cases.append(("mla_cache_write_bf16", _mla_cache_write_kernel, sig, consts, False,
                  {"cuda": {"num_warps": 4}, "hip": {"num_warps": 4}}))
    return cases
