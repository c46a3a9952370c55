"""KDA Triton kernels: short conv (prefill), chunked prefill, fused decode; registered as ``triton`` impls.

* ``short_conv``  -> :func:`conv.short_conv`
* ``kda_prefill`` -> :func:`prefill.kda_prefill` (gate form ``"k3"``, ``lower_bound >= -10``)
* ``kda_decode``  -> :func:`decode.kda_decode`

Per-backend launch configurations live in :mod:`configs`; :func:`isa_cases` lists every kernel for the
ahead-of-time ISA check (``k3rocm kernels isa``).
"""

from __future__ import annotations

from k3rocm.kernels import tune
from k3rocm.kernels.isa import specialize

from . import configs
from .conv import _conv_fwd_kernel, _conv_state_kernel, short_conv
from .decode import _decode_kernel, _split_norm_kernel, _split_prep_kernel, _split_state_kernel, kda_decode
from .prefill import (BC, BT, SEG_BK, SEG_BV, _gate_kernel, _gate_ps_kernel, _intra_kernel, _local_kernel, _out_kernel,
                      _seg_combine_kernel, _seg_kernel, _solve_kernel, _state_kernel, _wu_kernel, kda_prefill)

__all__ = ["short_conv", "kda_prefill", "kda_decode", "configs", "isa_cases", "TRITON_IMPLS"]


def _prefill_supports(**shape) -> bool:
    return shape.get("gate_form", "k3") == "k3" and shape.get("lower_bound", -5.0) >= -10.0


#: the ``triton`` implementations of this family: ``(op, fn, supports or None, note)``
TRITON_IMPLS = (
    ("short_conv", short_conv, None, "Triton causal depthwise conv + SiLU, varlen, conv state in/out"),
    ("kda_prefill", kda_prefill, _prefill_supports,
     f"Triton chunked WY/UT KDA, chunk {BT}, 16x16 sub-blocks, bf16 operands, fp32 state"),
    ("kda_decode", kda_decode, None, "Triton fused KDA decode (conv, gate, L2, state step, gated RMSNorm)"),
)


def _opts(table: dict) -> dict:
    """Compile options per backend for a kernel table: the first config of each backend list, launch options only."""
    return {be: tune.split(table[be][0], interp=False)[1] for be in ("hip", "cuda")}


def isa_cases(dtype: str = "bf16", K: int = 128) -> list[tuple]:
    """Every KDA kernel at the K3 head size, for ahead-of-time compilation.

    Returns ``(name, fn, signature, constexprs, expects_matrix, options_by_backend)`` tuples. The ``prefill_*``
    kernels are compiled as the split form runs them (``prefill.PRODUCTS["split"]``): split-bf16 operands on the
    matrix unit (``OPD = WOPD = UOPD = WHOPD = 1``), the UT solve's block products at the backend's default fp32
    precision (``PREC = None``); the ``*_f16`` cases as ``prefill.PRODUCTS["fp16"]`` — the default for bf16 / fp16
    inputs and the serving engine — runs them (fp16 intermediates, one fp16 product in w / u / w h / the state step /
    the output and the pair blocks j < i, ``OPD = 5``).
    """
    p = f"*{dtype}"
    b = "*fp32"  # the prefill's intermediate buffers
    h = "*fp16"  # the same under prefill.PRODUCTS "fp16"
    conv_sig = dict(x=p, w="*fp32", y=p, state_in="*fp32", cu="*i32", tok_seq="*i32", TT="i32", NCH="i32",
                    HAS_STATE="constexpr", W="constexpr", BLOCK_T="constexpr", BLOCK_C="constexpr")
    # the conv's channels (q|k|v of H heads, 3 H K) are a multiple of 16 for every head count; TT (tokens) varies
    conv_sig = specialize(conv_sig, dict(NCH=3 * 12 * K))
    cs_sig = dict(x=p, state_in="*fp32", state_out="*fp32", cu="*i32", NCH="i32", HAS_STATE="constexpr",
                  W="constexpr", BLOCK_C="constexpr")
    cs_sig = specialize(cs_sig, dict(NCH=3 * 12 * K))
    gate_sig = dict(q=p, k=p, draw=p, A_log="*fp32", dt_bias="*fp32", chunk_tok="*i32", chunk_len="*i32",
                    gbuf="*fp32", qg=b, kg=b, glast="*fp32", scale="fp32", lower_bound="fp32", H="i32",
                    K="constexpr", BT="constexpr", KG2="constexpr", QG2="constexpr", CS="constexpr")
    intra_sig = dict(q=p, k=p, braw=p, chunk_tok="*i32", chunk_len="*i32", gbuf="*fp32", aqk=b, abuf="*fp32",
                     scale="fp32", H="i32", K="constexpr", BT="constexpr", BC="constexpr", OPD="constexpr",
                     INNER="constexpr", RT="constexpr")
    solve_sig = dict(abuf="*fp32", mbuf="*fp32", chunk_tok="*i32", chunk_len="*i32", H="i32", BT="constexpr",
                     BC="constexpr", PREC="constexpr")
    wu_sig = dict(k=p, v=p, braw=p, gbuf="*fp32", mbuf="*fp32", w=b, u=b, chunk_tok="*i32", chunk_len="*i32",
                  H="i32", K="constexpr", V="constexpr", BT="constexpr", WOPD="constexpr", UOPD="constexpr",
                  INNER="constexpr", W2="constexpr", SV="constexpr", abuf="*fp32", BC="constexpr", PREC="constexpr")
    state_sig = dict(kg=b, w=b, u=b, glast="*fp32", h0="*fp32", hbuf=b, vnew=b, ht="*fp32", seq_chunk="*i32",
                     chunk_tok="*i32", chunk_len="*i32", H="i32", HAS_H0="constexpr", K="constexpr", V="constexpr",
                     BT="constexpr", BV="constexpr", OPD="constexpr", PF="constexpr", WHOPD="constexpr",
                     INNER="constexpr", SPL="constexpr", FO="constexpr", qg=b, aqk=b, o=p, OOPD="constexpr",
                     RB="constexpr", one="fp32")
    out_sig = dict(qg=b, aqk=b, hbuf=b, vnew=b, o=p, chunk_tok="*i32", chunk_len="*i32", H="i32", K="constexpr",
                   V="constexpr", BT="constexpr", BV="constexpr", BK="constexpr", OPD="constexpr", INNER="constexpr",
                   Q2="constexpr")
    seg_sig = dict(kg=b, w=b, u=b, glast="*fp32", pq="*fp32", seg_chunk="*i32", chunk_tok="*i32", chunk_len="*i32",
                   H="i32", K="constexpr", V="constexpr", BT="constexpr", BV="constexpr", OPD="constexpr",
                   WHOPD="constexpr", RB="constexpr", one="fp32")
    local_sig = dict(q=p, k=p, v=p, draw=p, braw=p, A_log="*fp32", dt_bias="*fp32", chunk_tok="*i32",
                     chunk_len="*i32", gbuf="*fp32", qg=h, kg=h, glast="*fp32", aqk=h, abuf=h, mbuf=h, w=h, u=h,
                     scale="fp32", lower_bound="fp32", H="i32", K="constexpr", V="constexpr", BT="constexpr",
                     BC="constexpr", OPD="constexpr", WOPD="constexpr", UOPD="constexpr", PREC="constexpr",
                     KG2="constexpr", QG2="constexpr", W2="constexpr", CS="constexpr")
    comb_sig = dict(pq="*fp32", h0="*fp32", hstart="*fp32", ht="*fp32", seq_seg="*i32", H="i32", HAS_H0="constexpr",
                    K="constexpr", V="constexpr", BV="constexpr", BK="constexpr")
    dec_sig = dict(q_raw=p, k_raw=p, v_raw=p, d_raw=p, b_raw=p, g_raw=p, wq="*fp32", wk="*fp32", wv="*fp32",
                   A_log="*fp32", dt_bias="*fp32", onw="*fp32", conv_pool="*fp32", state_pool="*fp32",
                   slot_ids="*i32", out=p, H="i32", sq="i32", sk="i32", sv="i32", sd="i32", sb="i32", sg="i32",
                   scale="fp32", lower_bound="fp32", eps="fp32",
                   K="constexpr", V="constexpr", W="constexpr", WP="constexpr", BV="constexpr", PRE="constexpr", WIN="constexpr")
    prep_sig = dict(q_raw=p, k_raw=p, v_raw=p, d_raw=p, b_raw=p, wq="*fp32", wk="*fp32", wv="*fp32",
                    A_log="*fp32", dt_bias="*fp32", conv_pool="*fp32", slot_ids="*i32", vec="*fp32", sca="*fp32",
                    H="i32", sq="i32", sk="i32", sv="i32", sd="i32", sb="i32", scale="fp32", lower_bound="fp32",
                    K="constexpr", W="constexpr", WP="constexpr")
    sst_sig = dict(vec="*fp32", sca="*fp32", state_pool="*fp32", slot_ids="*i32", ob="*fp32", H="i32",
                   K="constexpr", V="constexpr", BV="constexpr", EV="constexpr")
    norm_sig = dict(ob="*fp32", g_raw=p, onw="*fp32", slot_ids="*i32", out=p, H="i32", sg="i32", eps="fp32",
                    V="constexpr")
    split = next(c for c in configs.DECODE["cuda"] if c.get("SPLIT"))
    cc = configs.CONV["cuda"][0]
    # the plain loop's cases at the first entry without the output in the loop (the split form's untimed pick)
    st = next(c for c in configs.STATE["cuda"] if not c.get("FO"))
    st_opts = {be: tune.split(next(c for c in configs.STATE[be] if not c.get("FO")), interp=False)[1]
               for be in ("hip", "cuda")}
    ot = configs.OUT["cuda"][0]
    spl = next(c for c in configs.STATE["cuda"] if c.get("candidate"))
    fo = next(c for c in configs.STATE["cuda"] if c.get("FO"))
    bv = configs.DECODE["hip"][0]["BV"]
    sg = {be: next(c for c in configs.STATE[be] if c.get("SEG")) for be in ("hip", "cuda")}
    return [
        ("short_conv", _conv_fwd_kernel, conv_sig,
         dict(HAS_STATE=True, W=4, BLOCK_T=cc["BLOCK_T"], BLOCK_C=cc["BLOCK_C"]), False, _opts(configs.CONV)),
        ("conv_state", _conv_state_kernel, cs_sig, dict(HAS_STATE=True, W=4, BLOCK_C=128), False, {}),
        ("prefill_gate", _gate_kernel, gate_sig, dict(K=K, BT=BT, KG2=0, QG2=0, CS=0), False, _opts(configs.GATE)),
        ("prefill_intra", _intra_kernel, intra_sig, dict(K=K, BT=BT, BC=BC, OPD=1, INNER=0, RT=0), True,
         _opts(configs.INTRA)),
        ("prefill_solve", _solve_kernel, solve_sig, dict(BT=BT, BC=BC, PREC=None), True, _opts(configs.SOLVE)),
        ("prefill_wu", _wu_kernel, wu_sig, dict(K=K, V=K, BT=BT, WOPD=1, UOPD=1, INNER=0, W2=0, SV=0, BC=BC, PREC=None), True,
         _opts(configs.WU)),
        ("prefill_state", _state_kernel, state_sig,
         dict(HAS_H0=True, K=K, V=K, BT=BT, BV=st["BV"], OPD=1, PF=st["PF"], WHOPD=1, INNER=0, SPL=0, FO=0, OOPD=1, RB=0), True,
         st_opts),
        # w / kg stored split (prefill.PRODUCTS "pre"): their writers and the state pass's split loop at the first
        # state candidate's options
        ("prefill_gate_kg2", _gate_kernel, dict(gate_sig, kg="*bf16", qg="*bf16"), dict(K=K, BT=BT, KG2=1, QG2=1, CS=0), False,
         _opts(configs.GATE)),
        ("prefill_wu_w2", _wu_kernel, dict(wu_sig, w="*bf16"),
         dict(K=K, V=K, BT=BT, WOPD=1, UOPD=1, INNER=0, W2=1, SV=0, BC=BC, PREC=None), True, _opts(configs.WU)),
        ("prefill_state_spl", _state_kernel, dict(state_sig, w="*bf16", kg="*bf16"),
         dict(HAS_H0=True, K=K, V=K, BT=BT, BV=spl["BV"], OPD=1, PF=0, WHOPD=1, INNER=0, SPL=1, FO=0, OOPD=1, RB=0), True,
         {be: tune.split(next(c for c in configs.STATE[be] if c.get("candidate")) if be == "cuda"
                         else configs.STATE[be][0], interp=False)[1] for be in ("hip", "cuda")}),
        # the FO candidates: the output in the state loop (qg split too), at the CUDA table's first FO tile with each
        # backend's first FO entry's launch options
        ("prefill_state_fo", _state_kernel, dict(state_sig, w="*bf16", kg="*bf16", qg="*bf16"),
         dict(HAS_H0=True, K=K, V=K, BT=BT, BV=fo["BV"], OPD=1, PF=0, WHOPD=1, INNER=0, SPL=1, FO=1, OOPD=1, RB=0), True,
         {be: tune.split(next(c for c in configs.STATE[be] if c.get("FO")), interp=False)[1]
          for be in ("hip", "cuda")}),
        # prefill.PRODUCTS "fp16": the intermediates in fp16 and one fp16 product each in w / u / w h / the state
        # step / the output and the pair blocks below the diagonal (OPD 5), the diagonal pair blocks split
        ("prefill_gate_f16", _gate_kernel, dict(gate_sig, qg=h, kg=h), dict(K=K, BT=BT, KG2=0, QG2=0, CS=0), False,
         _opts(configs.GATE)),
        # the gate's candidates with the cumulative sum as three bf16 products on the matrix unit (CS = 1), fp16
        # outputs, at the first CS entry's options of each backend
        ("prefill_gate_cs", _gate_kernel, dict(gate_sig, qg=h, kg=h), dict(K=K, BT=BT, KG2=0, QG2=0, CS=1), True,
         {be: tune.split(next(c for c in configs.GATE[be] if c.get("CS")), interp=False)[1]
          for be in ("hip", "cuda")}),
        # the persistent gate (PS entries): the CS gate's work in a loop over (chunk, head) items, at the first PS
        # entry's options of each backend
        ("prefill_gate_ps", _gate_ps_kernel, dict(gate_sig, qg=h, kg=h, n_items="i32"),
         dict(K=K, BT=BT, KG2=0, QG2=0, CS=1), True,
         {be: tune.split(next(c for c in configs.GATE[be] if c.get("PS")), interp=False)[1]
          for be in ("hip", "cuda")}),
        ("prefill_intra_f16", _intra_kernel, dict(intra_sig, aqk=h, abuf=h), dict(K=K, BT=BT, BC=BC, OPD=5, INNER=0, RT=0),
         True, _opts(configs.INTRA)),
        ("prefill_solve_f16", _solve_kernel, dict(solve_sig, abuf=h, mbuf=h), dict(BT=BT, BC=BC, PREC=None), True,
         _opts(configs.SOLVE)),
        ("prefill_wu_f16", _wu_kernel, dict(wu_sig, mbuf=h, w=h, u=h, abuf=h),
         dict(K=K, V=K, BT=BT, WOPD=5, UOPD=5, INNER=0, W2=0, SV=0, BC=BC, PREC=None), True, _opts(configs.WU)),
        # the UT solve and w / u in one program (SV entries): fp16 products, the solve's fp32 ones
        ("prefill_wu_sv_f16", _wu_kernel, dict(wu_sig, mbuf=h, w=h, u=h, abuf=h),
         dict(K=K, V=K, BT=BT, WOPD=5, UOPD=5, INNER=0, W2=0, SV=1, BC=BC, PREC=None), True,
         {be: tune.split(next(c for c in configs.WU[be] if c.get("SV")), interp=False)[1] for be in ("hip", "cuda")}),
        # the gate, A / Aqk, the UT solve and w / u in one program (the intra table's LC entries), fp16 form with
        # the CS gate: bf16 products (the gate's cumulative sum), fp16 ones and the solve's fp32 ones
        ("prefill_local_f16", _local_kernel, local_sig,
         dict(K=K, V=K, BT=BT, BC=BC, OPD=5, WOPD=5, UOPD=5, PREC=None, KG2=0, QG2=0, W2=0, CS=1), True,
         {be: tune.split(next(c for c in configs.INTRA[be] if c.get("LC")), interp=False)[1]
          for be in ("hip", "cuda")}),
        ("prefill_state_f16", _state_kernel, dict(state_sig, kg=h, w=h, u=h, hbuf=h, vnew=h),
         dict(HAS_H0=True, K=K, V=K, BT=BT, BV=st["BV"], OPD=5, PF=st["PF"], WHOPD=5, INNER=0, SPL=0, FO=0, OOPD=5, RB=0),
         True, st_opts),
        ("prefill_state_f16_fo", _state_kernel, dict(state_sig, kg=h, w=h, u=h, hbuf=h, vnew=h, qg=h, aqk=h),
         dict(HAS_H0=True, K=K, V=K, BT=BT, BV=fo["BV"], OPD=5, PF=0, WHOPD=5, INNER=0, SPL=0, FO=1, OOPD=5, RB=0), True,
         {be: tune.split(next(c for c in configs.STATE[be] if c.get("FO")), interp=False)[1]
          for be in ("hip", "cuda")}),
        # the segmented state pass (SEG entries): the runs' affine maps at the first SEG entry's tile and options
        # (fp16 tiles, one fp16 product each) and the IEEE fp32 chaining of the runs' initial states
        ("prefill_seg_f16", _seg_kernel, dict(seg_sig, kg=h, w=h, u=h),
         dict(K=K, V=K, BT=BT, BV=sg["cuda"]["BV"], OPD=5, WHOPD=5, RB=1), True,
         {be: tune.split(sg[be], interp=False)[1] for be in ("hip", "cuda")}),
        ("prefill_seg_combine", _seg_combine_kernel, comb_sig,
         dict(HAS_H0=True, K=K, V=K, BV=SEG_BV, BK=SEG_BK), False, _opts(configs.SEG_COMBINE)),
        ("prefill_out_f16", _out_kernel, dict(out_sig, qg=h, aqk=h, hbuf=h, vnew=h),
         dict(K=K, V=K, BT=BT, BV=ot["BV"], BK=ot["BK"], OPD=5, INNER=0, Q2=0), True, _opts(configs.OUT)),
        ("prefill_out", _out_kernel, out_sig, dict(K=K, V=K, BT=BT, BV=ot["BV"], BK=ot["BK"], OPD=1, INNER=0, Q2=0), True,
         _opts(configs.OUT)),
        ("decode", _decode_kernel, dec_sig, dict(K=K, V=K, W=4, WP=4, BV=bv, PRE=0, WIN=0), False,
         _opts(configs.DECODE)),
        # the three-launch decode (SPLIT configs): prologue and norm at their fixed warps, the state grid at the
        # first SPLIT config's tile
        ("decode_split_prep", _split_prep_kernel, prep_sig, dict(K=K, W=4, WP=4), False,
         {"hip": dict(num_warps=4), "cuda": dict(num_warps=4)}),
        ("decode_split_state", _split_state_kernel, sst_sig, dict(K=K, V=K, BV=split["BV"], EV=0), False,
         {be: tune.split(next(c for c in configs.DECODE[be] if c.get("SPLIT")), interp=False)[1]
          for be in ("hip", "cuda")}),
        # the EV entry: the state tile's load and store evict-first
        ("decode_split_state_ev", _split_state_kernel, sst_sig, dict(K=K, V=K, BV=split["BV"], EV=1), False,
         {be: tune.split(next(c for c in configs.DECODE[be] if c.get("SPLIT")), interp=False)[1]
          for be in ("hip", "cuda")}),
        ("decode_split_norm", _split_norm_kernel, norm_sig, dict(V=K), False,
         {"hip": dict(num_warps=1), "cuda": dict(num_warps=1)}),
    ]
