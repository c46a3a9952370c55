"""The Kimi-Linear oracle against transformers' ``KimiLinearForCausalLM`` (fp32, CPU, same weights).

transformers runs KDA on CPU without flash-linear-attention: its ``chunk_kda`` / ``fused_recurrent_kda`` and
``causal_conv1d`` hub kernels fall back to the pure-PyTorch reference functions in
``modeling_kimi_linear.py`` when the kernel packages are absent (it logs that it fell back). MLA runs with
eager attention. All random weights are rounded to bf16 values so that the bf16 expert storage of the
family is exact.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3rocm.config import preset  # noqa: E402
from k3rocm.errors import ConfigError  # noqa: E402
from k3rocm.model.kimi_linear import KimiLinearModel, config_from_hf, hf_to_checkpoint_names  # noqa: E402

REL = 1e-5
RELEASED_FULL_ATTN = [4, 8, 12, 16, 20, 24, 27]  # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes: one intra-op thread is fastest and avoids OpenMP spin-waiting on a shared 2-core runner."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_hf_config() -> KimiLinearConfig:
    hc = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2, num_local_experts=8,
        linear_head_dim=16, linear_num_heads=4, routed_scaling_factor=2.446,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hc._attn_implementation = "eager"
    return hc


@pytest.fixture(scope="module")
def pair():
    hc = _tiny_hf_config()
    torch.manual_seed(0)
    hf = KimiLinearForCausalLM(hc).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            s = p.shape
            if n.endswith("A_log"):
                v = torch.empty(s).uniform_(1, 16, generator=g).log()
            elif n.endswith("dt_bias") or "conv1d" in n:
                v = 0.5 * torch.randn(s, generator=g)
            elif "embed" in n:
                v = torch.randn(s, generator=g)
            elif p.dim() == 1:
                v = 1 + 0.1 * torch.randn(s, generator=g)
            else:
                v = torch.randn(s, generator=g) / math.sqrt(s[-1])
            p.copy_(v.bfloat16().float())
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_((0.05 * torch.randn(b.shape, generator=g)).bfloat16().float())
    cfg = config_from_hf(hc)
    sd = hf.state_dict()
    weights = hf_to_checkpoint_names(sd, cfg)
    # the experts go back to their released storage dtype, bf16 (exact: the values are bf16-representable)
    weights = {k: (v.bfloat16() if ".experts." in k else v) for k, v in weights.items()}
    return hf, KimiLinearModel(cfg, weights), cfg


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def test_names_and_config_bridge(pair):
    hf, model, cfg = pair
    assert cfg.family == "kimi_linear" and cfg.layer_types == ["kda", "kda", "kda", "mla", "kda"]
    assert cfg.first_k_dense_replace == 1 and cfg.q_lora_rank is None and cfg.attn_res_block_size is None
    w = model.w.source
    assert "model.layers.1.self_attn.q_conv1d.weight" in w and "model.layers.1.self_attn.A_log" in w
    assert w["model.layers.2.block_sparse_moe.experts.7.w3.weight"].shape == (32, 64)
    assert torch.equal(w["model.layers.2.block_sparse_moe.experts.5.w1.weight"].float(),
                       hf.model.layers[2].mlp.experts.gate_up_proj[5, :32])
    assert not any(".forget_gate." in k or k.endswith("self_attn.conv1d.weight") or ".mlp.experts." in k for k in w)
    with pytest.raises(ConfigError):
        KimiLinearModel(preset("k3-tiny"), w)


def test_logits_match_transformers(pair):
    hf, model, _ = pair
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = model.forward(ids)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = _rel(out, ref)
    assert err <= REL, f"relative error vs transformers {err:.3e}"
    assert float(ref.std()) > 0.1  # a non-trivial model


def test_decode_matches_transformers(pair):
    """Our cache path (short_conv state + kda_prefill on one token; absorbed MLA decode) vs the full HF forward."""
    hf, model, _ = pair
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128, (L,), generator=g) for L in (6, 3)]
    new = torch.randint(0, 128, (2, 8), generator=g)
    cache = model.new_cache(2, max_len=16, block_size=4)
    pre = model.prefill(prompts, cache)
    dec = torch.stack([model.decode(new[:, j], cache) for j in range(8)], 1)
    for n in range(2):
        seq = torch.cat([prompts[n], new[n]]).unsqueeze(0)
        with torch.no_grad():
            ref = hf(seq).logits[0].float()
        assert _rel(torch.cat([pre[n], dec[n]]), ref) <= REL


def test_preset_matches_transformers_and_release():
    """``preset("kimi-linear-48b-a3b")`` == transformers' defaults + the released layer map (eos checked apart)."""
    full = RELEASED_FULL_ATTN
    hc = KimiLinearConfig(linear_attn_config=dict(
        full_attn_layers=full, kda_layers=[i for i in range(1, 28) if i not in full], num_heads=32, head_dim=128,
        short_conv_kernel_size=4))
    ref, ours = config_from_hf(hc), preset("kimi-linear-48b-a3b")
    diff = {f.name: (getattr(ours, f.name), getattr(ref, f.name)) for f in dataclasses.fields(ref)
            if f.name not in ("raw", "name", "eos_token_id") and getattr(ours, f.name) != getattr(ref, f.name)}
    assert not diff, f"preset vs transformers (ours, theirs): {diff}"


def test_preset_eos_token():
    assert preset("kimi-linear-48b-a3b").eos_token_id == KimiLinearConfig().eos_token_id == 163586


def test_layout_matches_transformers_state_dict():
    """The checkpoint layout of the kimi_linear family names exactly the tensors transformers' model holds."""
    from k3rocm.checkpoint.layout import counts, iter_specs

    hc = _tiny_hf_config()
    model = KimiLinearForCausalLM(hc)
    cfg = config_from_hf(hc)
    got = {n: tuple(t.shape) for n, t in hf_to_checkpoint_names(model.state_dict(), cfg).items()}
    want = {s.name: s.shape for s in iter_specs(cfg)}
    assert set(want) == set(got), set(want) ^ set(got)
    assert {n: s for n, s in want.items() if got[n] != s} == {}
    assert counts(cfg)["params"] == sum(t.numel() for t in model.state_dict().values())
    # the released sibling: ~48B total, ~3B activated per token (model card)
    big = counts(preset("kimi-linear-48b-a3b"))
    assert 47e9 < big["params"] < 50e9 and 2.8e9 < big["params_activated"] < 3.3e9
