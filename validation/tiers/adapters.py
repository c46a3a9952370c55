"""How the tiers drive a model: one forward with per-layer records, teacher-forced layers, the oracle's
sensitivity to rounding, serving with captured logits, greedy continuations and seeded inputs.

The models are :class:`k3rocm.model.model.K3Model` (oracle or engine ops) and
:class:`k3rocm.runtime.engine.Engine`, or objects with the same methods.
"""

from __future__ import annotations

import torch

from k3rocm.model.probe import flat_batch, forward_layers, perturbed_logits, rel_rms
from k3rocm.runtime.serve import RemoteModel
from k3rocm.validation.session import Session
from k3rocm.validation.tiers.numerics import logits_compare


def model_forward(model, ids, num_layers: int, shadow=None):
    """One causal forward (no cache) of ``ids`` ``[B, T]`` int64 with per-layer records, optionally with a
    teacher-forced ``shadow`` (:func:`k3rocm.model.probe.forward_layers`). A model of a multi-rank layout
    (:class:`k3rocm.runtime.serve.RemoteModel`) runs it on every rank; rank 0 keeps the result."""
    if isinstance(model, RemoteModel):
        return model.forward_layers(ids, num_layers, shadow)
    return forward_layers(model, ids, num_layers, shadow)


def oracle_forward(model, ids):
    """fp32 oracle forward; see :func:`model_forward`."""
    return model_forward(model, ids, model.cfg.num_hidden_layers)


def teacher_forced_layers(model, oracle, ids) -> list[dict]:
    """Each layer of ``model`` run on the oracle's own input to that layer, compared with the oracle's output.

    ``ids`` ``[B, T]`` int64. Both objects need the layer-by-layer API (``embed`` / ``run_layer``). Errors do
    not compound across layers: a random-weight test model amplifies any rounding end to end (see
    :func:`oracle_sensitivity`), while a per-layer error here points at the layer that is wrong.
    Returns ``[{"attn_out": rel_rms, "mlp_out": rel_rms}, ...]`` per layer (one oracle pass,
    :func:`model_forward` with ``shadow=model``).
    """
    _, layers = model_forward(oracle, ids, oracle.cfg.num_hidden_layers, shadow=model)
    return [lay["teacher_forced"] for lay in layers]


def golden_teacher_forced(model, ids, golden: dict, num_layers: int):
    """Each sublayer of ``model`` run on the golden's own input to it, compared with the golden's output.

    The golden file holds every sublayer's output (``layerNN.attn_out`` / ``layerNN.mlp_out`` ``[B, T, D]``), and
    that is all the state needs: the AttnRes bank and prefix (or the residual stream) are sums of the embedding
    and those outputs. So each sublayer runs on the state built from the golden's outputs before it, its own
    output is recorded, and the golden's output is what the state carries on (``LayerState.perturb``). Errors
    do not compound with depth (a random-weight model amplifies fp32 round-off about 2x per layer end to end).
    A sublayer the file lacks carries the model's own output on.

    Args:
        ids: ``[B, T]`` int64, the golden's ``input_ids``. golden: name -> tensor (the golden file).
    Returns:
        ``(logits [B, T, V] fp32 from the golden's sublayer outputs, [(name, rel_rms), ...] per sublayer the file
        holds, in order)``.
    """
    B, T = ids.shape
    names = [f"layer{i:02d}.{n}" for i in range(num_layers) for n in ("attn_out", "mlp_out")]
    errs: list[tuple[str, float]] = []
    k = [0]

    def force(out):
        name = names[k[0]]
        k[0] += 1
        if name not in golden:
            return out
        g = golden[name].reshape(B * T, -1).to(device=out.device, dtype=out.dtype)
        errs.append((name, rel_rms(out, g)))
        return g
    with torch.no_grad():
        st = model.embed(ids.reshape(-1), flat_batch(B, T), record=False)
        st.perturb = force
        for i in range(num_layers):
            model.run_layer(i, st)
        logits = model.final(st).view(B, T, -1).float()
    return logits, errs


def router_margin_recorder(router, cfg):
    """``(router', margins)``: ``router'`` is ``router`` (the ``moe_router`` op) that also records, per call, the
    per-token top-k margin: the k-th minus the (k+1)-th biased score (``sigmoid(x W^T) + bias``, the quantity the
    top-k is taken over; K3_FACTS §5). A margin near 0 is a near-tie, where a rounding difference may flip which
    expert is chosen. ``margins`` (a list) receives ``(moe_layer_number, [T] fp32 margins)`` in call order;
    ``cfg`` gives ``num_experts_per_token``. Raises what ``router`` raises."""
    margins: list[tuple[int, torch.Tensor]] = []

    def rec(x, gate_weight, bias, top_k, *a, **kw):
        with torch.no_grad():
            sc = torch.sigmoid(x.float() @ gate_weight.float().t())
            if bias is not None:
                sc = sc + bias.float()
            if top_k < sc.shape[-1]:
                v = sc.topk(top_k + 1, dim=-1).values
                margins.append((len(margins), (v[:, top_k - 1] - v[:, top_k]).cpu()))
        return router(x, gate_weight, bias, top_k, *a, **kw)
    return rec, margins


def oracle_sensitivity(oracle, ids, ref_logits, rel: float = 2.0 ** -9) -> dict:
    """How much the fp32 oracle's own logits move under rounding-sized errors of relative size ``rel``.

    The embeddings and every sublayer output (each token mixer and channel mixer, before it is added to the
    residual prefix / stream) are multiplied elementwise by ``1 + u``, ``u`` uniform in ``[-rel, rel]`` (fixed
    seed). An engine makes rounding errors of its own precision at every projection (bf16: 2^-9 per rounding;
    fp32: about sqrt(D) x 2^-24 per dot product of length D), so an end-to-end comparison can never be tighter
    than the model's response to such errors. Perturbing every sublayer, not only the embeddings, also lets a
    MoE router see errors of that size at its own input (its top-k flips near-tied experts, a discontinuous
    response). Random-weight test models (k3-tiny) amplify such errors to O(1) logit changes; a trained model
    barely moves. Returns :func:`logits_compare` of the perturbed run against ``ref_logits`` ``[B, T, V]``.
    """
    if isinstance(oracle, RemoteModel):
        logits = oracle.perturbed_logits(ids, rel)
    else:
        logits = perturbed_logits(oracle, ids, rel)
    return logits_compare(logits, ref_logits)


def serve_with_logits(engine, prompt: list[int], n: int):
    """Serve one request of ``prompt`` for ``n`` greedy tokens through the engine's own path (prefill
    chunk, then decode steps on the KDA slot pool and paged MLA cache, CUDA/HIP graphs when on) and
    capture the logits it sampled from. Returns ``(tokens [n] list, logits [n, V] fp32 cpu)``.

    Works on ``k3rocm.runtime.engine.Engine`` (``add_request``/``step``; logits recorded by
    :meth:`~k3rocm.runtime.engine.Engine.recording`) and on K3Model-like objects (``new_cache``/``prefill``/
    ``decode``).
    """
    if hasattr(engine, "add_request"):
        rows = []
        with engine.recording():  # whole-vocabulary logits of every sampled row, on every rank of a layout
            rid = engine.add_request(list(prompt), n, ignore_eos=True)
            while engine.has_unfinished():
                if engine.step():
                    rows.append(engine.last_logits[-1])
        toks = list(engine.seqs[rid].output)
        return toks, (torch.stack(rows) if rows else torch.zeros(0))
    cache = engine.new_cache(1, len(prompt) + n + 1)
    with torch.no_grad():
        last = engine.prefill(torch.tensor([prompt]), cache)[:, -1].float()
        toks, rows = [], []
        for step in range(n):
            rows.append(last[0].cpu())
            tok = last.argmax(-1)
            toks.append(int(tok))
            if step + 1 < n:
                last = engine.decode(tok, cache).float()
    return toks, torch.stack(rows)


def layer_absmax(layer: dict) -> float:
    """A layer record's ``absmax`` (see :func:`model_forward`), NaN when it has none."""
    v = layer.get("absmax")
    return float(v) if v is not None else float("nan")


def greedy_continuation(model, prompt, n: int) -> list[int]:
    """Greedy continuation of ``prompt`` ``[1, L]`` by ``n`` tokens through the model's cache path."""
    out = model.generate_greedy(prompt, n)
    return [int(x) for x in torch.as_tensor(out).reshape(-1)[-n:]]


def random_ids(session: Session, batch: int, length: int):
    """Seeded (``--seed``) random token ids ``[batch, length]`` int64 in the session's vocabulary, avoiding
    BOS/EOS/pad."""
    cfg = session.config
    g = torch.Generator().manual_seed(int(session.opts.seed))
    special = {cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id}
    lo = 3 if cfg.vocab_size > 16 else 0
    ids = torch.randint(lo, cfg.vocab_size, (batch, length), generator=g)
    for s in special:
        ids[ids == s] = (s + 7) % cfg.vocab_size
    return ids
