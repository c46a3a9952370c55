"""Block AttnRes bookkeeping of the layer stack (k3rocm.model.layer: attn_side / mlp_side / final_aggregate)
against a hand-written list-of-rows reference (K3_FACTS §5): each side is one ``attn_res_norm`` call
(aggregation + the following RMSNorm, the bank append on a write layer) that reads the bank in place."""

from __future__ import annotations

import torch

from k3rocm.config import preset
from k3rocm.model import attnres as A
from k3rocm.model.common import rms_norm
from k3rocm.model.layer import AttnResState, attn_side, final_aggregate, mlp_side


def _reference(cfg, x, ws, nws, outs):
    """The stack with the bank as a plain list, every aggregation over ``torch.stack`` then the RMSNorm (the
    definition); returns the normed mixer inputs and the normed final aggregation."""
    bank, prefix, eps, xs = [], x, cfg.rms_norm_eps, []
    for i in range(cfg.num_hidden_layers):
        h = prefix if i == 0 else A.attn_res(torch.stack(bank + [prefix]), ws[2 * i], eps)
        if cfg.is_write_layer(i):
            bank.append(prefix)
            prefix = torch.zeros_like(h)
        x1 = rms_norm(h, nws[2 * i], eps)
        prefix = prefix + outs[2 * i] * x1
        x2 = rms_norm(A.attn_res(torch.stack(bank + [prefix]), ws[2 * i + 1], eps), nws[2 * i + 1], eps)
        prefix = prefix + outs[2 * i + 1] * x2
        xs += [x1, x2]
    return xs, rms_norm(A.attn_res(torch.stack(bank + [prefix]), ws[-1], eps), nws[-1], eps)


def test_stack_matches_reference_and_reads_bank_in_place():
    cfg = preset("k3-tiny")
    g = torch.Generator().manual_seed(0)
    T, D, L = 3, 16, cfg.num_hidden_layers
    x = torch.randn(T, D, generator=g)
    ws = [torch.randn(D, generator=g) for _ in range(2 * L + 1)]
    nws = [1 + 0.1 * torch.randn(D, generator=g) for _ in range(2 * L + 1)]
    outs = [torch.randn(T, D, generator=g) for _ in range(2 * L)]
    ref_x, ref_final = _reference(cfg, x, ws, nws, outs)

    seen = []

    def op(bank, num_rows, prefix, weight, norm_weight, eps, append=False):
        seen.append((bank, append))
        return A.attn_res_norm(bank, num_rows, prefix, weight, norm_weight, eps, append=append)

    ops = {"attn_res_norm": op}
    st = AttnResState([], x)
    written = {}
    for i in range(L):
        x1 = attn_side(st, i, ws[2 * i], nws[2 * i], cfg, ops)
        torch.testing.assert_close(x1, ref_x[2 * i], atol=0, rtol=0)
        st.prefix = st.prefix + outs[2 * i] * x1
        x2 = mlp_side(st, ws[2 * i + 1], nws[2 * i + 1], cfg, ops)
        torch.testing.assert_close(x2, ref_x[2 * i + 1], atol=0, rtol=0)
        st.prefix = st.prefix + outs[2 * i + 1] * x2
        for r, row in enumerate(st.bank):  # a row, once written, never changes
            written.setdefault(r, row.clone())
            assert torch.equal(row, written[r])
    torch.testing.assert_close(final_aggregate(st, ws[-1], nws[-1], cfg, ops), ref_final, atol=0, rtol=0)
    assert len(st.bank) == cfg.num_attn_res_bank_rows
    # one call per side, each on the bank's own storage (no stacked copy); the op itself appended every row
    assert len(seen) == 2 * L + 1
    assert all(b.data_ptr() == st.bank[0].data_ptr() for b, _ in seen)
    assert sum(a for _, a in seen) == cfg.num_attn_res_bank_rows
    # a cloned state (separate row tensors) and a row-selected one still aggregate the same
    clone = AttnResState([b.clone() for b in st.bank], st.prefix.clone())
    torch.testing.assert_close(final_aggregate(clone, ws[-1], nws[-1], cfg, ops), ref_final, atol=0, rtol=0)
    sel = torch.tensor([2, 0])
    part = AttnResState([b[sel] for b in st.bank], st.prefix[sel])
    torch.testing.assert_close(final_aggregate(part, ws[-1], nws[-1], cfg, ops), ref_final[sel], atol=0, rtol=0)
