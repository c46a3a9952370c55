"""Router in Triton: FP32 logits, sigmoid, biased top-k with lowest-id ties, unbiased renormalised weights
(K3_FACTS §5 step 1; oracle ``k3rocm.model.moe.moe_router``).

Logit products: bf16 x bf16 with fp32 accumulation; fp32 x and the bf16 gate (the engine: activations fp32,
``gate.weight`` BF16) as ``SPLIT_X``: x split exactly into three bf16 parts (hi + mid + lo carry x's 24
mantissa bits) each multiplied with the bf16 gate on the matrix unit — the products are exact in fp32, so the
logits are fp32 math up to summation order, without widening the 12.8 MB gate to fp32 per call or running
IEEE fp32 dots (FMA on sm_90: 148 µs per call at 4 tokens on an H200, vs one gate read); both fp32: IEEE fp32
products (the validation path).

Two kernels: ``router_logits_kernel`` (grid: token tiles x expert tiles x K splits, partial sums to an fp32
buffer ``[S, T, E]``; splits give enough programs at 64 tokens, where one tile of tokens would read the
whole 12.8 MB gate alone) and ``router_topk_kernel`` (one program per token: sums the splits in a fixed order,
so results are deterministic, then k rounds of one int64 max over (order-preserving score bits, reversed
expert id): the highest biased score, lowest id among equals, in one reduction per pick).

Fused routing (``ops.moe_route``): the same top-k kernel with ``DISPATCH`` also writes each token's row of
a local-expert membership matrix ``[T, E_loc]`` int32. Then, in two levels (acq_rel atomic counters, each
reset by the program that saw it complete, so the launch is capturable and repeatable): the last program of
each group of BLOCK_T tokens ranks its group's pairs inside the group and counts them per expert
(:func:`group_ranks`, the groups in parallel); the last group to finish groups all pairs by local expert
(:func:`bucket_pairs`) with the outputs of ``ops.dispatch_gpu``: the sorted row of pair (t, j) with local
expert e is start(e) + the pairs of e in earlier groups (an exclusive prefix over the group counts, fixed
order) + the tokens before t in its group that picked e; a token picks an expert at most once, so this is the
stable order (ascending pair index) of the torch path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3rocm.kernels.isa import specialize
from k3rocm.kernels.moe.gemm import pair_keys, write_block_table


@triton.jit
def router_logits_kernel(x_ptr, w_ptr, part_ptr, T, E, D, K_PER_SPLIT, stride_x, stride_w, stride_ps, stride_pt,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr = False, SPLIT_X: tl.constexpr = 0):
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    rt = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    re = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rk = tl.arange(0, BLOCK_K)
    tmask = rt < T
    emask = re < E
    k_lo = pid_s * K_PER_SPLIT
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    x_ptrs = x_ptr + rt[:, None].to(tl.int64) * stride_x + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + re[None, :].to(tl.int64) * stride_w + (k_lo + rk)[:, None]
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        kmask = (k_lo + k0 + rk) < D
        x = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & emask[None, :], other=0.0)
        if SPLIT_X == 1:  # fp32 x, bf16 gate: x = hi + mid + lo in bf16, three exact bf16 products
            xh = x.to(tl.bfloat16)
            r = x - xh.to(tl.float32)
            xm = r.to(tl.bfloat16)
            xl = (r - xm.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(xl, w, acc)
            acc = tl.dot(xm, w, acc)
            acc = tl.dot(xh, w, acc)
        elif SPLIT_X == 2:  # the same split multiplied in IEEE fp32 (the interpreter, whose bf16 tl.dot is wrong)
            xh = x.to(tl.bfloat16).to(tl.float32)
            r = x - xh
            xm = r.to(tl.bfloat16).to(tl.float32)
            xl = (r - xm).to(tl.bfloat16).to(tl.float32)
            wf = w.to(tl.float32)
            acc = tl.dot(xl, wf, acc, input_precision="ieee")
            acc = tl.dot(xm, wf, acc, input_precision="ieee")
            acc = tl.dot(xh, wf, acc, input_precision="ieee")
        elif IEEE:  # fp32 inputs: full fp32 products (never TF32, which flips marginal picks)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    p_ptrs = part_ptr + pid_s * stride_ps + rt[:, None].to(tl.int64) * stride_pt + re[None, :]
    tl.store(p_ptrs, acc, mask=tmask[:, None] & emask[None, :])


# int64 key of a (biased score, expert) lane: the fp32 bits made order-preserving as a signed int (negative
# floats: flip the 31 low bits) in the high word, BLOCK_E - 1 - id in the low word; the max key is the
# highest score and, among bitwise-equal scores, the lowest id. Chosen lanes drop to PICKED.
PICKED = tl.constexpr(-9223372036854775807)


@triton.jit
def group_ranks(member_ptr, rowpos_ptr, gcount_ptr, g, T, num_local, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """Token group ``g`` (tokens ``g*BLOCK_T ..``, one program): the rank of each of its (token, local expert)
    pairs among the group's earlier tokens (rowpos ``[T, num_local]`` int32, written where member is 1) and
    the group's pairs per local expert (gcount row g, ``[G, num_local]`` int32). Loads of the member rows
    other programs wrote are volatile (no stale cache lines after the counter handshake)."""
    rl = tl.arange(0, BLOCK_L)
    tt = g * BLOCK_T + tl.arange(0, BLOCK_T)
    m = (tt < T)[:, None] & (rl < num_local)[None, :]
    off = tt[:, None].to(tl.int64) * num_local + rl[None, :]
    tile = tl.load(member_ptr + off, mask=m, other=0, volatile=True)
    tl.store(rowpos_ptr + off, tl.cumsum(tile, 0) - tile, mask=m & (tile != 0))
    tl.store(gcount_ptr + g * num_local + rl, tl.sum(tile, axis=0), mask=rl < num_local)


@triton.jit
def bucket_pairs(ids_ptr, rowpos_ptr, gcount_ptr, T, G, first, num_local, sorted_ptr, pos_ptr, counts_ptr,
                 offsets_ptr, bexp_ptr, bstart_ptr, UB, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_KOUT: tl.constexpr, BLOCK_UB: tl.constexpr,
                 BLOCK_PT: tl.constexpr):
    """Group the T*TOPK (token, slot) pairs by local expert, in one program, from the G groups' ranks and
    counts (:func:`group_ranks`): the contract of ``ops.dispatch_gpu``.

    The sorted row of a local pair (t, e) is start(e) + the pairs of e in the groups before t's group (an
    exclusive prefix over gcount's rows, fixed order, written back in place) + its rank inside the group: the
    number of tokens before t that picked e (a token picks an expert at most once), i.e. the stable order
    (ascending pair index) of the torch path. ids ``[T, TOPK]`` int32 global ids. Writes sorted ``[P]`` (local
    pairs by expert, then the other ranks' pairs, each group in ascending pair index), pos ``[P]`` (-1
    off-rank), counts ``[num_local]`` int64, offsets ``[num_local + 1]`` int64, block_expert / block_start
    ``[UB]`` int32 (``ceil(count / BLOCK_M)`` blocks per expert in expert order; the rest -1 / 0).
    BLOCK_L >= num_local + 1; gcount is read in tiles of BLOCK_T groups, the pairs in tiles of BLOCK_PT tokens.
    """
    rl = tl.arange(0, BLOCK_L)
    lm = rl < num_local
    rg = tl.arange(0, BLOCK_T)
    run = tl.zeros((BLOCK_L,), dtype=tl.int32)
    for g0 in range(0, G, BLOCK_T):
        gg = g0 + rg
        m = (gg < G)[:, None] & lm[None, :]
        ptrs = gcount_ptr + gg[:, None] * num_local + rl[None, :]
        c = tl.load(ptrs, mask=m, other=0, volatile=True)
        tl.store(ptrs, tl.cumsum(c, 0) - c + run[None, :], mask=m)
        run += tl.sum(c, axis=0)
    counts = run
    start = tl.cumsum(counts, 0) - counts  # exclusive: start[num_local] = all local pairs
    total = tl.sum(counts, axis=0)
    tl.store(counts_ptr + rl, counts.to(tl.int64), mask=lm)
    tl.store(offsets_ptr + rl, start.to(tl.int64), mask=rl <= num_local)
    tl.debug_barrier()  # the prefix and the offsets before any lane gathers them
    rt = tl.arange(0, BLOCK_PT)
    rk = tl.arange(0, BLOCK_KOUT)
    mk = rk < TOPK
    off_run = total
    for t0 in range(0, T, BLOCK_PT):
        tt = t0 + rt
        pm = (tt < T)[:, None] & mk[None, :]
        pidx = tt[:, None] * TOPK + rk[None, :]
        e = tl.load(ids_ptr + pidx, mask=pm, other=0, volatile=True) - first
        valid = (e >= 0) & (e < num_local) & pm
        off = tl.where(pm & (valid == 0), 1, 0)
        off_tok = tl.sum(off, axis=1)
        off_rank = tl.cumsum(off, 1) - off + (tl.cumsum(off_tok, 0) - off_tok)[:, None] + off_run
        off_run += tl.sum(off_tok, axis=0)
        before = tl.load(gcount_ptr + (tt // BLOCK_T)[:, None] * num_local + e, mask=valid, other=0, volatile=True)
        inside = tl.load(rowpos_ptr + tt[:, None].to(tl.int64) * num_local + e, mask=valid, other=0, volatile=True)
        first_row = tl.load(offsets_ptr + e, mask=valid, other=0, volatile=True).to(tl.int32)
        row = tl.where(valid, first_row + before + inside, off_rank)
        tl.store(sorted_ptr + row, pidx, mask=pm)
        tl.store(pos_ptr + pidx, tl.where(valid, row, -1), mask=pm)
    write_block_table(bexp_ptr, bstart_ptr, UB, rl, lm, counts, start, BLOCK_M, BLOCK_UB)


@triton.jit
def router_topk_kernel(part_ptr, bias_ptr, ids_ptr, wts_ptr, E, stride_ps, stride_pt, scaling,
                       member_ptr, rowpos_ptr, gcount_ptr, done_ptr, T, first, num_local, sorted_ptr, pos_ptr,
                       counts_ptr, offsets_ptr, bexp_ptr, bstart_ptr, UB,
                       SPLITS: tl.constexpr, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_KOUT: tl.constexpr, DISPATCH: tl.constexpr = False,
                       BLOCK_M: tl.constexpr = 16, BLOCK_T: tl.constexpr = 16, BLOCK_L: tl.constexpr = 16,
                       BLOCK_UB: tl.constexpr = 16, BLOCK_PT: tl.constexpr = 16, SORT: tl.constexpr = False):
    """One program per token: logits = sum of the SPLITS partials (fixed order), sigmoid, biased top-TOPK
    (lowest id among equal biased scores), weights = unbiased scores [renormalised] x scaling.

    ``SORT`` (without ``DISPATCH``, where ``tl.topk`` exists): the picks by one ``tl.topk`` of the keys instead of
    TOPK max rounds; the keys are unique (expert id in the low word), so the picks and their order are the same.

    ``DISPATCH``: also the membership row of the token ``[T, num_local]`` int32; the last program of each
    group of BLOCK_T tokens runs :func:`group_ranks` for its group, and the last group to finish runs
    :func:`bucket_pairs` (acq_rel counters: done_ptr[1 + g] per group, done_ptr[0] over the groups, each reset
    to 0 by the program that saw it complete, so every launch starts from zeros and the launch is capturable
    and repeatable). The dispatch arguments are unused otherwise."""
    t = tl.program_id(0)
    re = tl.arange(0, BLOCK_E)
    emask = re < E
    row = part_ptr + t.to(tl.int64) * stride_pt
    logit = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # unrolled: the SPLITS loads are independent (one memory round trip)
        logit += tl.load(row + s * stride_ps + re, mask=emask, other=0.0)
    score = tl.sigmoid(logit)
    if HAS_BIAS:
        biased = score + tl.load(bias_ptr + re, mask=emask, other=0.0)
    else:
        biased = score
    biased = tl.where(emask, biased, float("-inf"))
    bits = biased.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - re).to(tl.int64)
    rj = tl.arange(0, BLOCK_KOUT)
    mj = rj < TOPK
    if SORT:  # tl.topk (a partial bitonic sort) of the unique keys: the same picks in the same order, no rounds
        top = tl.topk(key, BLOCK_KOUT)
        ids = BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)
    else:
        ids = tl.zeros((BLOCK_KOUT,), dtype=tl.int32)
        for j in range(TOPK):
            m = tl.max(key, axis=0)
            idx = BLOCK_E - 1 - (m & 0xFFFFFFFF).to(tl.int32)
            ids = tl.where(rj == j, idx, ids)
            key = tl.where(re == idx, PICKED, key)
    # the picked logits again, summed in the same order (bitwise the same fp32 values)
    lg = tl.zeros((BLOCK_KOUT,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        lg += tl.load(row + s * stride_ps + ids, mask=mj, other=0.0)
    wts = tl.where(mj, tl.sigmoid(lg), 0.0)
    if RENORM:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    wts = wts * scaling
    tl.store(ids_ptr + t * TOPK + rj, ids, mask=mj)
    tl.store(wts_ptr + t * TOPK + rj, wts, mask=mj)
    if DISPATCH:
        local = re - first
        tl.store(member_ptr + t.to(tl.int64) * num_local + local, tl.where(key == PICKED, 1, 0),
                 mask=emask & (local >= 0) & (local < num_local))
        tl.debug_barrier()  # every lane's stores before the release below
        g = t // BLOCK_T
        arrived = tl.atomic_add(done_ptr + 1 + g, 1, sem="acq_rel")
        if arrived == tl.minimum(T - g * BLOCK_T, BLOCK_T) - 1:
            tl.debug_barrier()
            group_ranks(member_ptr, rowpos_ptr, gcount_ptr, g, T, num_local, BLOCK_T, BLOCK_L)
            tl.atomic_xchg(done_ptr + 1 + g, 0, sem="relaxed")
            tl.debug_barrier()  # the group's ranks and counts before the release below
            num_groups = (T + BLOCK_T - 1) // BLOCK_T
            groups_done = tl.atomic_add(done_ptr, 1, sem="acq_rel")
            if groups_done == num_groups - 1:
                tl.debug_barrier()
                bucket_pairs(ids_ptr, rowpos_ptr, gcount_ptr, T, num_groups, first, num_local, sorted_ptr, pos_ptr,
                             counts_ptr, offsets_ptr, bexp_ptr, bstart_ptr, UB, TOPK, BLOCK_M, BLOCK_T, BLOCK_L,
                             BLOCK_KOUT, BLOCK_UB, BLOCK_PT)
                tl.atomic_xchg(done_ptr, 0, sem="relaxed")


@triton.jit
def router_topk_small_kernel(part_ptr, bias_ptr, ids_ptr, wts_ptr, E, stride_ps, stride_pt, scaling, T, first,
                             num_local, sorted_ptr, pos_ptr, counts_ptr, offsets_ptr, bexp_ptr, bstart_ptr, UB,
                             SPLITS: tl.constexpr, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_KOUT: tl.constexpr, BLOCK_TT: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_UB: tl.constexpr):
    """Fused routing of a decode-sized batch in ONE program (``T <= BLOCK_TT`` tokens): the top-k of
    :func:`router_topk_kernel` for every token at once (a ``[BLOCK_TT, BLOCK_E]`` key tile, each pick one row-wise
    max), then the grouping by local expert straight from the tile — no membership matrix through memory, no
    counters, no second phase. The contract of ``DISPATCH`` (and of ``ops.dispatch_gpu``): ids ``[T, TOPK]``, weights,
    sorted ``[P]`` (local pairs by expert, each expert's in ascending pair index, then the other ranks' pairs in
    ascending pair index), pos ``[P]`` (-1 off-rank), counts / offsets (int64), the ``UB`` block table.

    Each token's scores, picks and weights are computed as in :func:`router_topk_kernel` (splits summed in order,
    the same int64 keys, the weights renormalised over a 1-D row), so the tensors are the same. A lane's pick round
    ``order[t, e]`` gives its slot j: a local pair (t, e) goes to row start(e) + (tokens before t that picked e)."""
    rt = tl.arange(0, BLOCK_TT)
    re = tl.arange(0, BLOCK_E)
    tm = rt < T
    emask = re < E
    rows = part_ptr + rt[:, None].to(tl.int64) * stride_pt + re[None, :]
    m2 = tm[:, None] & emask[None, :]
    logit = tl.zeros((BLOCK_TT, BLOCK_E), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        logit += tl.load(rows + s * stride_ps, mask=m2, other=0.0)
    score = tl.sigmoid(logit)
    if HAS_BIAS:
        biased = score + tl.load(bias_ptr + re, mask=emask, other=0.0)[None, :]
    else:
        biased = score
    biased = tl.where(m2, biased, float("-inf"))
    bits = biased.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - re)[None, :].to(tl.int64)
    rj = tl.arange(0, BLOCK_KOUT)
    mj = rj < TOPK
    ids = tl.zeros((BLOCK_TT, BLOCK_KOUT), dtype=tl.int32)
    order = tl.full((BLOCK_TT, BLOCK_E), -1, tl.int32)
    for j in range(TOPK):
        m = tl.max(key, axis=1)
        idx = BLOCK_E - 1 - (m & 0xFFFFFFFF).to(tl.int32)
        ids = tl.where(rj[None, :] == j, idx[:, None], ids)
        hit = re[None, :] == idx[:, None]
        order = tl.where(hit, j, order)
        key = tl.where(hit, PICKED, key)
    pm = tm[:, None] & mj[None, :]
    lrow = part_ptr + rt[:, None].to(tl.int64) * stride_pt + ids
    lg = tl.zeros((BLOCK_TT, BLOCK_KOUT), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        lg += tl.load(lrow + s * stride_ps, mask=pm, other=0.0)
    wts = tl.where(pm, tl.sigmoid(lg), 0.0)
    pidx = rt[:, None] * TOPK + rj[None, :]
    tl.store(ids_ptr + pidx, ids, mask=pm)
    for t in range(0, T):  # per token: the 1-D row and its sum, as the one-program-per-token kernel reduces it
        w1 = tl.sum(tl.where(rt[:, None] == t, wts, 0.0), axis=0)  # row t (one nonzero term per lane: exact)
        if RENORM:
            w1 = w1 / (tl.sum(w1, axis=0) + 1e-20)
        tl.store(wts_ptr + t * TOPK + rj, w1 * scaling, mask=mj)
    # grouping: local lanes of the tile (lane e is global expert e, local index e - first)
    loc = re - first
    lanes = (loc >= 0) & (loc < num_local) & emask
    member = ((order >= 0) & tm[:, None] & lanes[None, :]).to(tl.int32)
    counts = tl.sum(member, axis=0)
    start = tl.cumsum(counts, 0) - counts  # non-local lanes count 0: the local experts' start rows
    total = tl.sum(counts, axis=0)
    tl.store(counts_ptr + loc, counts.to(tl.int64), mask=lanes)
    tl.store(offsets_ptr + loc, start.to(tl.int64), mask=lanes)
    tl.store(offsets_ptr + num_local, total.to(tl.int64))
    row = start[None, :] + tl.cumsum(member, 0) - member  # + tokens before t that picked e
    pair = rt[:, None] * TOPK + order
    tl.store(sorted_ptr + row, pair, mask=member != 0)
    tl.store(pos_ptr + pair, row, mask=member != 0)
    lid = ids - first
    off = tl.where(pm & ((lid < 0) | (lid >= num_local)), 1, 0)
    off_tok = tl.sum(off, axis=1)
    off_row = tl.cumsum(off, 1) - off + (tl.cumsum(off_tok, 0) - off_tok)[:, None] + total
    tl.store(sorted_ptr + off_row, pidx, mask=off != 0)
    tl.store(pos_ptr + pidx, tl.full((BLOCK_TT, BLOCK_KOUT), -1, tl.int32), mask=off != 0)
    write_block_table(bexp_ptr, bstart_ptr, UB, loc, lanes, counts, start, BLOCK_M, BLOCK_UB)


def topk_small_isa_case(tokens: int = 4, warps: int = 8) -> tuple:
    """``(name, kernel, signature, constexprs, expects_matrix, {backend: options})`` of the one-program routing
    (:func:`router_topk_small_kernel`) at K3 size (896 experts, top-16, 16 splits) for up to ``tokens`` tokens at
    ``warps`` warps. Compiled ahead of time (2026-12-07): 4 tokens at 8 warps are spill-free on gfx950 and gfx942
    (8 tokens spill 16 - 28 VGPRs there at 4 or 8 warps); sm_90 compiles 8 tokens at 4 or 8 warps."""
    sig = {"part_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "wts_ptr": "*fp32", "E": "i32",
           "stride_ps": "i32", "stride_pt": "i32", "scaling": "fp32", "T": "i32", "first": "i32", "num_local": "i32",
           "sorted_ptr": "*i32", "pos_ptr": "*i32", "counts_ptr": "*i64", "offsets_ptr": "*i64", "bexp_ptr": "*i32",
           "bstart_ptr": "*i32", "UB": "i32"}
    consts = {"SPLITS": 16, "TOPK": 16, "HAS_BIAS": True, "RENORM": True, "BLOCK_E": 1024, "BLOCK_KOUT": 16,
              "BLOCK_TT": tokens, "BLOCK_M": 16, "BLOCK_UB": 256}
    sig.update({c: "constexpr" for c in consts})
    sig = specialize(sig, dict(E=896, stride_ps=tokens * 896, stride_pt=896, first=0, num_local=896))
    return (f"router_topk_small_t{tokens}", router_topk_small_kernel, sig, consts, False,
            {"hip": {"num_warps": warps}, "cuda": {"num_warps": warps}})


def pair_tokens(bucket_tokens: int) -> int:
    """Tokens per tile of the final pair pass of :func:`bucket_pairs` for a group of ``bucket_tokens`` tokens
    (BLOCK_PT): four groups' worth, 1024 pair lanes at top-16 with the CUDA group of 16, 256 with HIP's 4."""
    return 4 * bucket_tokens


def topk_isa_case(dispatch: bool, bucket_tokens: int = 4, sort: bool = False) -> tuple:
    """``(name, kernel, signature, constexprs, expects_matrix, {backend: options})`` of the top-k launch at K3
    size (896 experts, top-16, 8 splits) as ``ops`` makes it; ``dispatch``: the fused-routing variant that
    groups up to 512 tokens (8192 pairs, 16-row blocks) in tiles of ``bucket_tokens`` tokens, as
    ``ops.moe_route`` launches it (``configs.ROUTER_BUCKET_TOKENS``); ``sort``: the picks by ``tl.topk`` (``SORT``,
    without ``dispatch``)."""
    sig = {"part_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "wts_ptr": "*fp32", "E": "i32",
           "stride_ps": "i32", "stride_pt": "i32", "scaling": "fp32", "member_ptr": "*i32", "rowpos_ptr": "*i32",
           "gcount_ptr": "*i32", "done_ptr": "*i32", "T": "i32", "first": "i32", "num_local": "i32", "sorted_ptr": "*i32",
           "pos_ptr": "*i32", "counts_ptr": "*i64", "offsets_ptr": "*i64", "bexp_ptr": "*i32",
           "bstart_ptr": "*i32", "UB": "i32"}
    consts = {"SPLITS": 8, "TOPK": 16, "HAS_BIAS": True, "RENORM": True, "BLOCK_E": 1024, "BLOCK_KOUT": 16,
              "DISPATCH": dispatch, "BLOCK_M": 16, "BLOCK_T": bucket_tokens, "BLOCK_L": 1024, "BLOCK_UB": 2048,
              "BLOCK_PT": pair_tokens(bucket_tokens), "SORT": sort}
    sig.update({c: "constexpr" for c in consts})
    # K3's 896 experts, all local from expert 0, partials of 64 tokens (the token and block counts vary)
    sig = specialize(sig, dict(E=896, stride_ps=64 * 896, stride_pt=896, first=0, num_local=896))
    warps = 8 if dispatch else 4
    return (f"router_topk{f'_dispatch_t{bucket_tokens}' if dispatch else ''}{'_sort' if sort else ''}",
            router_topk_kernel, sig, consts, False,
            {"hip": {"num_warps": warps}, "cuda": {"num_warps": warps}})


@triton.jit
def group_pairs_kernel(ids_ptr, first, num_local, P, sorted_ptr, pos_ptr, counts_ptr, offsets_ptr, bexp_ptr,
                       bstart_ptr, UB, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_J: tl.constexpr):
    """The grouping of ``ops.dispatch_gpu`` with one program per key instead of one program for all: program
    ``e`` (grid ``num_local + 1``) places the pairs of local expert ``e``; program ``num_local`` the pairs of the
    other ranks (sorted after all local pairs) and the empty tail of the block table.

    ids ``[P]`` int32 global expert ids (flat t*k+j). Every program counts all keys (``tl.histogram`` per tile of
    BLOCK_P pairs; key = id - first, other ranks' pairs key ``num_local``, lanes past P the spare bin
    ``BLOCK_E - 1``, so BLOCK_E >= num_local + 2), takes its start row (exclusive prefix of the counts) and its
    first M block (exclusive prefix of ``ceil(count / BLOCK_M)``), then walks the pairs in ascending index: a pair
    of its key goes to row start + (earlier pairs of the key), an exclusive ``tl.cumsum`` of the key's mask. So
    the rows are the stable counting sort of ``moe_dispatch_kernel`` and the torch path, with no counter, no
    scratch and no program waiting on another: every program's work is two passes over the P ids (4 KB at 64
    tokens x top-16). Writes sorted ``[P]``, pos ``[P]`` (-1 off-rank), counts ``[num_local]`` / offsets
    ``[num_local + 1]`` int64, block_expert / block_start ``[UB]`` int32 (blocks past the last: -1 / 0); BLOCK_J
    block-table slots are written per step."""
    e = tl.program_id(0)
    re = tl.arange(0, BLOCK_E)
    rq = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        rp = p0 + rq
        counts += tl.histogram(pair_keys(ids_ptr, rp, rp < P, first, num_local, BLOCK_E - 1), BLOCK_E)
    counts = tl.where(re <= num_local, counts, 0)
    start = tl.cumsum(counts, 0) - counts
    blocks = tl.where(re < num_local, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    first_block = tl.cumsum(blocks, 0) - blocks
    mine = re == e
    my_start = tl.sum(tl.where(mine, start, 0), axis=0)
    my_count = tl.sum(tl.where(mine, counts, 0), axis=0)
    my_block = tl.sum(tl.where(mine, first_block, 0), axis=0)
    local = e < num_local
    run = my_start
    for p0 in range(0, P, BLOCK_P):
        rp = p0 + rq
        m = rp < P
        hit = (pair_keys(ids_ptr, rp, m, first, num_local, BLOCK_E - 1) == e) & m
        h = hit.to(tl.int32)
        row = run + tl.cumsum(h, 0) - h
        tl.store(sorted_ptr + row, rp, mask=hit)
        tl.store(pos_ptr + rp, tl.where(local, row, -1), mask=hit)
        run += tl.sum(h, axis=0)
    rj = tl.arange(0, BLOCK_J)
    if local:
        tl.store(counts_ptr + e, my_count.to(tl.int64))
        tl.store(offsets_ptr + e, my_start.to(tl.int64))
        nb = (my_count + BLOCK_M - 1) // BLOCK_M
        for j0 in range(0, nb, BLOCK_J):
            j = j0 + rj
            mb = (j < nb) & (my_block + j < UB)
            tl.store(bexp_ptr + my_block + j, tl.full((BLOCK_J,), 0, tl.int32) + e, mask=mb)
            tl.store(bstart_ptr + my_block + j, my_start + j * BLOCK_M, mask=mb)
    else:
        tl.store(offsets_ptr + num_local, my_start.to(tl.int64))  # all local pairs
        used = tl.sum(blocks, axis=0)
        for j0 in range(used, UB, BLOCK_J):
            j = j0 + rj
            tl.store(bexp_ptr + j, tl.full((BLOCK_J,), -1, tl.int32), mask=j < UB)
            tl.store(bstart_ptr + j, tl.zeros((BLOCK_J,), dtype=tl.int32), mask=j < UB)


def group_isa_case(num_local: int = 56, pairs: int = 1024) -> tuple:
    """``(name, kernel, signature, constexprs, expects_matrix, {backend: options})`` of the per-expert grouping
    (:func:`group_pairs_kernel`) as ``ops`` launches it for ``num_local`` local experts and ``pairs`` pairs (64
    tokens x top-16 on a K3 rank of EP16 by default)."""
    sig = {"ids_ptr": "*i32", "first": "i32", "num_local": "i32", "P": "i32", "sorted_ptr": "*i32",
           "pos_ptr": "*i32", "counts_ptr": "*i64", "offsets_ptr": "*i64", "bexp_ptr": "*i32", "bstart_ptr": "*i32",
           "UB": "i32"}
    consts = {"BLOCK_M": 16, "BLOCK_P": group_block_p(pairs), "BLOCK_E": triton.next_power_of_2(num_local + 2),
              "BLOCK_J": 16}
    sig.update({c: "constexpr" for c in consts})
    sig = specialize(sig, dict(num_local=num_local))
    return (f"group_pairs_l{num_local}", group_pairs_kernel, sig, consts, False,
            {"hip": {"num_warps": 4}, "cuda": {"num_warps": 4}})


def group_block_p(pairs: int) -> int:
    """Pairs per tile of :func:`group_pairs_kernel`: all of them up to 1024 (64 tokens at top-16), else 1024."""
    return min(1024, triton.next_power_of_2(max(1, pairs)))
