"""How the tiers drive a model: one forward with per-layer records, teacher-forced layers, the oracle's
sensitivity to rounding, serving with captured logits, greedy continuations and seeded inputs.

The models are :class:`k3rocm.model.model.K3Model` (oracle or engine ops) and
:class:`k3rocm.runtime.engine.Engine`, or objects with the same methods.
"""

from __future__ import annotations

import torch

from k3rocm.model.probe import forward_layers, perturbed_logits
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
