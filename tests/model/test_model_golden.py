"""The fp32 oracle model against external golden data (k3-tiny, computed by Moonshot's released code).

The golden README states the agreement expected of an independent fp32 implementation: logits within
~2e-3 absolute, per-layer outputs within ~1e-3 relative RMS, the same argmax wherever the top-2 margin
exceeds 1e-2, the same 8 greedy tokens. The random k3-tiny model is chaotic at the fp32 noise level (a
1e-7 relative perturbation of the embedding table alone moves its logits by 1e-3..3e-3), so the logits
bound used here is 3e-3.
"""

from __future__ import annotations

import pytest
import torch

from k3rocm.config import K3Config
from k3rocm.errors import ConfigError
from k3rocm.model.model import K3Model

LOGITS_ABS = 3e-3
LAYER_REL_RMS = 1e-3
MARGIN = 1e-2


@pytest.fixture(scope="module")
def golden(golden_dir):
    from safetensors.torch import load_file

    return load_file(str(golden_dir / "golden.safetensors"))


@pytest.fixture(scope="module")
def weights(golden_ckpt):
    """The golden checkpoint through the toolkit's reader (index + headers validated, MXFP4 kept packed)."""
    from k3rocm.model.weights import load_weights

    w = load_weights(golden_ckpt)
    w.bytes_at_load = w.nbytes()
    return w


@pytest.fixture(scope="module")
def model(weights, golden_ckpt):
    cfg = K3Config.from_file(golden_ckpt / "config.json")
    return K3Model(cfg, weights)


@pytest.fixture(scope="module")
def run(model, golden):
    return model.forward(golden["input_ids"], return_layers=True)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def test_golden_logits(run, golden, weights):
    logits, _ = run
    assert weights.nbytes() == weights.bytes_at_load  # experts stayed packed, held once (no dequantized copy kept)
    ref = golden["logits"]
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert torch.isfinite(logits).all()
    err = float((logits - ref).abs().max())
    assert err <= LOGITS_ABS, f"logits max abs error {err:.3e} > {LOGITS_ABS}"
    # a wrong model is far off: the logits themselves are O(1)
    assert float(ref.abs().max()) > 100 * LOGITS_ABS


def test_golden_every_layer(run, golden):
    _, outs = run
    L = 13
    names = [f"layer{i:02d}.{s}" for i in range(L) for s in ("attn_out", "mlp_out")]
    assert sorted(outs) == sorted(names)
    worst = {n: _rel_rms(outs[n], golden[n]) for n in names}
    bad = {n: e for n, e in worst.items() if not e <= LAYER_REL_RMS}
    assert not bad, f"layers above {LAYER_REL_RMS} relative RMS: {bad}"


def test_golden_argmax_where_margin(run, golden):
    logits, _ = run
    mask = golden["logits_top1_margin"] > MARGIN
    assert mask.sum() >= 40  # most positions are decisive
    assert torch.equal(logits.argmax(-1)[mask], golden["logits"].argmax(-1)[mask])


def test_golden_greedy(model, golden):
    toks = model.generate_greedy(golden["greedy_prompt"], 8)
    assert toks.tolist() == golden["greedy_tokens"].tolist()


def test_layer_by_layer_equals_forward(model, golden):
    ids = golden["input_ids"][1]
    st = model.embed(ids, record=True)
    for i in range(model.cfg.num_hidden_layers):
        model.run_layer(i, st)
        if i == 4:  # write layers 0 and 3 have made two bank rows, none aliasing another or the prefix
            assert len(st.res.bank) == 2
            ptrs = {r.data_ptr() for r in st.res.bank} | {st.res.prefix.data_ptr()}
            assert len(ptrs) == 3
    assert len(st.res.bank) == model.cfg.num_attn_res_bank_rows == 5
    logits = model.final(st)
    full = model.forward(ids.unsqueeze(0))[0]
    assert torch.equal(logits, full)
    with pytest.raises(ConfigError):
        model.run_layer(3, model.embed(ids))
    with pytest.raises(ConfigError):
        model.embed(torch.tensor([0, model.cfg.vocab_size]))


def test_a8w4_mode_runs_and_stays_close(model, golden, run):
    """A8W4 (MXFP8 E4M3 activations into the MXFP4 experts) is a different, nearby model.

    Compared at the first MoE layer (layer 1), whose inputs are still identical in both modes: E4M3 keeps
    3 mantissa bits, so the layer output moves by a few percent (3.9% measured). (The logits are not
    compared: the random model is chaotic and routing flips downstream.)
    """
    a8_logits, a8 = K3Model(model.cfg, model.w, moe_mode="a8w4").forward(golden["input_ids"], return_layers=True)
    a16 = run[1]
    assert torch.isfinite(a8_logits).all()
    assert torch.equal(a8["layer01.attn_out"], a16["layer01.attn_out"])
    d = _rel_rms(a8["layer01.mlp_out"], a16["layer01.mlp_out"])
    assert 1e-3 < d < 1e-1, f"A8W4 vs A16W4 layer01.mlp_out relative RMS difference {d:.3e}"
    with pytest.raises(ConfigError):
        K3Model(model.cfg, model.w, moe_mode="fp8")


@pytest.mark.gpu
def test_golden_on_gpu(golden_ckpt, golden):
    """The same golden checks with the weights on a GPU (true fp32 there: TF32 is switched off by the model)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm GPU")
    from k3rocm.model.weights import load_weights

    m = K3Model(K3Config.from_file(golden_ckpt / "config.json"), load_weights(golden_ckpt, device="cuda"))
    logits, outs = m.forward(golden["input_ids"].cuda(), return_layers=True)
    assert logits.is_cuda
    err = float((logits.cpu() - golden["logits"]).abs().max())
    assert err <= LOGITS_ABS, f"GPU logits max abs error {err:.3e}"
    worst = max(_rel_rms(v.cpu(), golden[k]) for k, v in outs.items())
    assert worst <= LAYER_REL_RMS
    assert m.generate_greedy(golden["greedy_prompt"], 8).tolist() == golden["greedy_tokens"].tolist()
