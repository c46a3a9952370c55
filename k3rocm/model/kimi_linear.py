"""fp32 oracle for the Kimi-Linear family (``model_type: kimi_linear``, e.g. Kimi-Linear-48B-A3B).

The smaller released sibling of K3 shares the token mixers but differs (transformers
``models/kimi_linear/modeling_kimi_linear.py``; Kimi-Linear tech report):

* an ordinary pre-norm residual stream (no Block Attention Residuals);
* plain MoE: sigmoid router with ``e_score_correction_bias`` (one expert group), top-k renormalised ×
  ``routed_scaling_factor`` (2.446), bf16 experts on the hidden state (no latent projections), + shared
  experts; SiLU-GLU everywhere;
* KDA output gate low-rank ``g_b_proj(g_a_proj(x))``; decay ``g = -exp(A_log[h]) * softplus(raw + dt_bias)``;
  ``A_log`` stored ``[1, 1, H, 1]``;
* MLA without q_lora (``q_proj``) and without output gate.

The same :class:`~k3rocm.model.model.K3Model` runs it (``cfg.family == "kimi_linear"``); this module adds the
config bridge and the name mapping from transformers' ``KimiLinearForCausalLM`` state dict to the released
checkpoint names the oracle reads (``model.layers.{i}.self_attn.q_conv1d.weight``,
``model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

from k3rocm.config import K3Config
from k3rocm.errors import CheckpointError, ConfigError
from k3rocm.model.model import K3Model

__all__ = ["PREFIX", "LM_HEAD", "config_from_hf", "hf_to_checkpoint_names", "KimiLinearModel"]

PREFIX = "model."
LM_HEAD = "lm_head.weight"


def _get(c: Any, name: str, default: Any = None) -> Any:
    if isinstance(c, Mapping):
        return c.get(name, default)
    return getattr(c, name, default)


def config_from_hf(hf: Any) -> K3Config:
    """Our :class:`K3Config` (family ``kimi_linear``) from a transformers ``KimiLinearConfig`` or its dict.

    Reads transformers' attribute names (``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``,
    ``layer_types``, ``mlp_layer_types``, ``num_local_experts``, ``n_shared_experts``, ``n_group``, ...) and
    writes the released config.json names (``linear_attn_config``, ``num_experts``, ...).

    Raises:
        ConfigError: a feature the oracle does not implement (grouped top-k with more than one group,
            MoE layers that are not a dense prefix then all sparse, an unknown layer type).
    """
    L = int(_get(hf, "num_hidden_layers"))
    lt = list(_get(hf, "layer_types") or [])
    if len(lt) != L or any(t not in ("full_attention", "linear_attention") for t in lt):
        raise ConfigError(f"layer_types {lt} must list 'full_attention'/'linear_attention' for all {L} layers")
    mlp = list(_get(hf, "mlp_layer_types") or ["dense"] + ["sparse"] * (L - 1))
    k_dense = next((i for i, t in enumerate(mlp) if t != "dense"), L)
    if mlp != ["dense"] * k_dense + ["sparse"] * (L - k_dense):
        raise ConfigError(f"mlp_layer_types {mlp}: only a dense prefix followed by MoE layers is supported")
    n_group = int(_get(hf, "n_group", 1) or 1)
    if n_group != 1:
        raise ConfigError(f"n_group {n_group}: grouped top-k routing over several groups is not implemented")
    eos = _get(hf, "eos_token_id", 0)
    doc = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": int(_get(hf, "vocab_size")), "hidden_size": int(_get(hf, "hidden_size")),
        "num_hidden_layers": L, "num_attention_heads": int(_get(hf, "num_attention_heads")),
        "num_key_value_heads": int(_get(hf, "num_key_value_heads") or _get(hf, "num_attention_heads")),
        "intermediate_size": int(_get(hf, "intermediate_size")), "first_k_dense_replace": k_dense,
        "hidden_act": str(_get(hf, "hidden_act", "silu")), "rms_norm_eps": float(_get(hf, "rms_norm_eps", 1e-5)),
        "q_lora_rank": _get(hf, "q_lora_rank"), "kv_lora_rank": int(_get(hf, "kv_lora_rank")),
        "qk_nope_head_dim": int(_get(hf, "qk_nope_head_dim")), "qk_rope_head_dim": int(_get(hf, "qk_rope_head_dim")),
        "v_head_dim": int(_get(hf, "v_head_dim")),
        "num_experts": int(_get(hf, "num_local_experts", _get(hf, "num_experts", 0))),
        "num_experts_per_token": int(_get(hf, "num_experts_per_tok", _get(hf, "num_experts_per_token", 0))),
        "num_shared_experts": int(_get(hf, "n_shared_experts", _get(hf, "num_shared_experts", 0)) or 0),
        "moe_intermediate_size": int(_get(hf, "moe_intermediate_size")),
        "moe_renormalize": bool(_get(hf, "norm_topk_prob", _get(hf, "moe_renormalize", True))),
        "routed_scaling_factor": float(_get(hf, "routed_scaling_factor", 1.0)),
        "tie_word_embeddings": bool(_get(hf, "tie_word_embeddings", False)),
        "bos_token_id": _get(hf, "bos_token_id", 0), "eos_token_id": eos[0] if isinstance(eos, list) else eos,
        "pad_token_id": _get(hf, "pad_token_id", 0),
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, t in enumerate(lt) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(lt) if t == "linear_attention"],
            "num_heads": int(_get(hf, "linear_num_heads")), "head_dim": int(_get(hf, "linear_head_dim")),
            "short_conv_kernel_size": int(_get(hf, "linear_conv_kernel_dim", 4)),
        },
    }
    return K3Config.from_dict(doc, name="kimi-linear (transformers)")


_RENAME = [
    (re.compile(r"\.self_attn\.forget_gate\.(f_a_proj|f_b_proj)\."), r".self_attn.\1."),
    (re.compile(r"\.self_attn\.forget_gate\.(dt_bias|A_log)$"), r".self_attn.\1"),
    (re.compile(r"\.mlp\.(gate\.weight|gate\.e_score_correction_bias|shared_experts\..*)$"), r".block_sparse_moe.\1"),
]


def hf_to_checkpoint_names(state_dict: Mapping[str, torch.Tensor], cfg: K3Config) -> dict[str, torch.Tensor]:
    """Map a transformers ``KimiLinearForCausalLM.state_dict()`` to the released checkpoint names.

    The inverse of transformers' ``conversion_mapping["kimi_linear"]``: ``self_attn.conv1d.weight``
    ``[3P, 1, W]`` -> ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` ``[P, 1, W]``; ``self_attn.forget_gate.*`` ->
    ``self_attn.*``; ``mlp.experts.gate_up_proj`` ``[E, 2I, D]`` -> ``block_sparse_moe.experts.{e}.w1/w3.weight``
    (gate rows first), ``mlp.experts.down_proj`` ``[E, D, I]`` -> ``…w2.weight``; ``mlp.gate`` /
    ``mlp.shared_experts`` of MoE layers -> ``block_sparse_moe.…``. Tensors are the same objects or views
    (no copies).

    Raises:
        CheckpointError: a conv or expert tensor has an unexpected shape.
    """
    out: dict[str, torch.Tensor] = {}
    P, I = cfg.kda_proj_size, cfg.moe_intermediate_size
    for name, t in state_dict.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.self_attn\.)conv1d\.weight", name)
        if m:
            if t.shape[0] != 3 * P:
                raise CheckpointError(f"{name}: shape {tuple(t.shape)} is not [3*{P}, 1, W]")
            for j, c in enumerate("qkv"):
                out[f"{m.group(1)}{c}_conv1d.weight"] = t[j * P:(j + 1) * P]
            continue
        m = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m:
            base = f"{m.group(1)}block_sparse_moe.experts."
            if m.group(2) == "gate_up_proj":
                if t.shape[1] != 2 * I:
                    raise CheckpointError(f"{name}: shape {tuple(t.shape)} is not [E, 2*{I}, D]")
                for e in range(t.shape[0]):
                    out[f"{base}{e}.w1.weight"] = t[e, :I]
                    out[f"{base}{e}.w3.weight"] = t[e, I:]
            else:
                for e in range(t.shape[0]):
                    out[f"{base}{e}.w2.weight"] = t[e]
            continue
        new = name
        for pat, rep in _RENAME:
            new = pat.sub(rep, new)
        out[new] = t
    return out


class KimiLinearModel(K3Model):
    """:class:`K3Model` for a Kimi-Linear checkpoint (names ``model.…`` and ``lm_head.weight``).

    Args:
        cfg: a ``kimi_linear`` :class:`K3Config` (``preset("kimi-linear-48b-a3b")``, :func:`config_from_hf`,
            or ``K3Config.from_file`` of a released config.json).
        weights: mapping / Weights with the released checkpoint names (see :func:`hf_to_checkpoint_names`).
        ops: op table overrides.
    Raises:
        ConfigError: ``cfg`` is not of the ``kimi_linear`` family.
    """

    def __init__(self, cfg: K3Config, weights: Any, ops: Mapping[str, Callable] | None = None):
        if cfg.family != "kimi_linear":
            raise ConfigError(f"config {cfg.name!r} is family {cfg.family!r}; KimiLinearModel needs 'kimi_linear'")
        super().__init__(cfg, weights, ops, prefix=PREFIX, head=LM_HEAD)
