"""Block AttnRes bookkeeping of the layer stack (k3rocm.model.layer: attn_side / mlp_side / final_aggregate)
against a hand-written list-of-rows reference (K3_FACTS §5), and that the aggregations read the bank in place."""

from __future__ import annotations

import torch

from k3rocm.config import preset
from k3rocm.model import attnres as A
from k3rocm.model.layer import AttnResState, attn_side, final_aggregate, mlp_side


def _reference(cfg, x, ws, outs):
    """The stack with the bank as a plain list and every aggregation over ``torch.stack`` (the definition)."""
    bank, prefix, eps, hs = [], x, cfg.rms_norm_eps, []
    for i in range(cfg.num_hidden_layers):
        h = prefix if i == 0 else A.attn_res(torch.stack(bank + [prefix]), ws[2 * i], eps)
        if cfg.is_write_layer(i):
            bank.append(prefix)
            prefix = torch.zeros_like(h)
        prefix = prefix + outs[2 * i] * h
        h2 = A.attn_res(torch.stack(bank + [prefix]), ws[2 * i + 1], eps)
        prefix = prefix + outs[2 * i + 1] * h2
        hs += [h, h2]
    return hs, A.attn_res(torch.stack(bank + [prefix]), ws[-1], eps)


def test_stack_matches_reference_and_reads_bank_in_place():
    cfg = preset("k3-tiny")
    g = torch.Generator().manual_seed(0)
    T, D, L = 3, 16, cfg.num_hidden_layers
    x = torch.randn(T, D, generator=g)
    ws = [torch.randn(D, generator=g) for _ in range(2 * L + 1)]
    outs = [torch.randn(T, D, generator=g) for _ in range(2 * L)]
    ref_h, ref_final = _reference(cfg, x, ws, outs)

    seen = []

    def op(sources, weight, eps):
        seen.append(sources)
        return A.attn_res(sources, weight, eps)

    ops = {"attn_res": op}
    st = AttnResState([], x)
    written = {}
    for i in range(L):
        h = attn_side(st, i, ws[2 * i], cfg, ops)
        torch.testing.assert_close(h, ref_h[2 * i], atol=0, rtol=0)
        st.prefix = st.prefix + outs[2 * i] * h
        h2 = mlp_side(st, ws[2 * i + 1], cfg, ops)
        torch.testing.assert_close(h2, ref_h[2 * i + 1], atol=0, rtol=0)
        st.prefix = st.prefix + outs[2 * i + 1] * h2
        for r, row in enumerate(st.bank):  # a row, once written, never changes
            written.setdefault(r, row.clone())
            assert torch.equal(row, written[r])
    torch.testing.assert_close(final_aggregate(st, ws[-1], cfg, ops), ref_final, atol=0, rtol=0)
    assert len(st.bank) == cfg.num_attn_res_bank_rows
    # every aggregation read the bank's own storage (no stacked copy of the sources)
    assert all(s.data_ptr() == st.bank[0].data_ptr() for s in seen)
    # a cloned state (separate row tensors) and a row-selected one still aggregate the same
    clone = AttnResState([b.clone() for b in st.bank], st.prefix.clone())
    torch.testing.assert_close(final_aggregate(clone, ws[-1], cfg, ops), ref_final, atol=0, rtol=0)
    sel = torch.tensor([2, 0])
    part = AttnResState([b[sel] for b in st.bank], st.prefix[sel])
    torch.testing.assert_close(final_aggregate(part, ws[-1], cfg, ops), ref_final[sel], atol=0, rtol=0)
