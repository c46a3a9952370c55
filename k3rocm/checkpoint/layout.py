"""Tensor names, shapes and dtypes of a Kimi K3 checkpoint, derived from a :class:`K3Config`.

This module is the single source of truth for "which tensors a checkpoint of this config holds":
the writer writes exactly these, the reader checks exactly these, the planner and the parameter /
byte counts sum over these. Source: K3_FACTS §3 (checked against the released index and the
``k3-tiny-golden`` checkpoint written by Moonshot's layout).

Conventions:
* names carry the released prefix ``language_model.model.`` (``language_model.lm_head.weight`` for
  the head); vision tensors (``vision_tower.``, ``mm_projector.``) are recognised and skipped;
* routed experts of an MXFP4 config are ``experts.{e}.w{1,2,3}.weight_packed`` ``[out, in/2]`` U8
  (element 2i in the low nibble) and ``weight_scale`` ``[out, in/32]`` U8 (E8M0);
* FP32: ``q/k/v_conv1d.weight``, ``A_log``, ``dt_bias``, ``o_norm.weight``,
  ``gate.e_score_correction_bias``; everything else BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Iterator

from k3rocm.config import K3Config

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")

DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F16": 2, "F8_E4M3": 1, "I64": 8}


@dataclass(frozen=True)
class TensorSpec:
    """One expected checkpoint tensor.

    Attributes:
        name: full checkpoint name.
        shape: stored shape (packed shape for ``weight_packed``).
        dtype: safetensors dtype string (``BF16``, ``F32``, ``U8``).
        part: ``"expert"`` (routed-expert tensor) or ``"trunk"`` (everything else in the text model).
        layer: 0-based layer index, or -1 for model-level tensors.
        params: logical parameter count (packed MXFP4: 2 per byte; scales: 0).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    part: str
    layer: int
    params: int

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


def prefix_for(cfg: K3Config) -> str:
    """Name prefix of decoder tensors: ``language_model.model.`` (K3) or ``model.`` (Kimi-Linear release)."""
    return PREFIX if cfg.family == "k3" else "model."


def lm_head_for(cfg: K3Config) -> str:
    """Name of the output head: ``language_model.lm_head.weight`` (K3) or ``lm_head.weight`` (Kimi-Linear)."""
    return LM_HEAD if cfg.family == "k3" else "lm_head.weight"


def is_vision(name: str) -> bool:
    """True for the vision tower / projector tensors the toolkit skips."""
    return name.startswith(VISION_PREFIXES)


def _bf16(name: str, shape: tuple[int, ...], layer: int, part: str = "trunk") -> TensorSpec:
    return TensorSpec(name, shape, "BF16", part, layer, prod(shape))


def _f32(name: str, shape: tuple[int, ...], layer: int) -> TensorSpec:
    return TensorSpec(name, shape, "F32", "trunk", layer, prod(shape))


def expert_specs(cfg: K3Config, layer: int, e: int) -> list[TensorSpec]:
    """The tensors of routed expert ``e`` in MoE layer ``layer``: w1 (gate), w3 (up) ``[I, D]``, w2 ``[D, I]``.

    D = ``cfg.expert_in_size`` (latent 3584 for K3), I = ``moe_intermediate_size`` (3072).
    """
    D, I = cfg.expert_in_size, cfg.moe_intermediate_size
    base = f"{prefix_for(cfg)}layers.{layer}.block_sparse_moe.experts.{e}."
    out = []
    for w, (o, i) in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
        if cfg.experts_quantized:
            out.append(TensorSpec(f"{base}{w}.weight_packed", (o, i // 2), "U8", "expert", layer, o * i))
            out.append(TensorSpec(f"{base}{w}.weight_scale", (o, i // 32), "U8", "expert", layer, 0))
        else:
            out.append(_bf16(f"{base}{w}.weight", (o, i), layer, "expert"))
    return out


def layer_specs(cfg: K3Config, i: int, with_experts: bool = True) -> list[TensorSpec]:
    """Every tensor of 0-based decoder layer ``i``, in a stable order.

    K3 family as in K3_FACTS §3. Kimi-Linear family (the released 48B-A3B layout, as transformers'
    ``KimiLinearForCausalLM`` maps it): no AttnRes tensors, KDA with a low-rank output gate
    (``g_a_proj`` [K, H], ``g_b_proj`` [H*K, K]) and ``A_log`` [1, 1, heads, 1], MLA with a full-rank
    ``q_proj`` and no output gate, plain MoE with BF16 ``experts.{e}.w{1,2,3}.weight``.
    """
    if cfg.family == "kimi_linear":
        return _kimi_linear_layer_specs(cfg, i, with_experts)
    H = cfg.hidden_size
    p = f"{PREFIX}layers.{i}."
    out = [_bf16(f"{p}input_layernorm.weight", (H,), i), _bf16(f"{p}post_attention_layernorm.weight", (H,), i)]
    if cfg.attn_res_block_size is not None:
        out += [_bf16(f"{p}self_attention_res_norm.weight", (H,), i),
                _bf16(f"{p}self_attention_res_proj.weight", (1, H), i),
                _bf16(f"{p}mlp_res_norm.weight", (H,), i),
                _bf16(f"{p}mlp_res_proj.weight", (1, H), i)]
    a = f"{p}self_attn."
    if cfg.layer_type(i) == "kda":
        P, Dh = cfg.kda_proj_size, cfg.kda_head_dim
        out += _kda_qkv_specs(cfg, a, i) + _kda_gate_specs(cfg, a, i)
        out += [_f32(f"{a}A_log", (Dh,), i), _f32(f"{a}dt_bias", (P,), i), _f32(f"{a}o_norm.weight", (Dh,), i),
                _bf16(f"{a}g_proj.weight", (P, H), i), _bf16(f"{a}o_proj.weight", (H, P), i)]
    else:
        nh, vd = cfg.num_attention_heads, cfg.v_head_dim
        out += _mla_qkv_specs(cfg, a, i)
        out += [_bf16(f"{a}g_proj.weight", (nh * vd, H), i), _bf16(f"{a}o_proj.weight", (H, nh * vd), i)]
    out += _channel_specs(cfg, p, i, with_experts)
    return out


def _kda_qkv_specs(cfg: K3Config, a: str, i: int) -> list[TensorSpec]:
    """KDA q, k, v projections ``[P, H]`` and their short convolutions ``[P, 1, W]`` (prefix ``a``), both
    families."""
    H, P, W = cfg.hidden_size, cfg.kda_proj_size, cfg.short_conv_kernel_size
    return ([_bf16(f"{a}{x}_proj.weight", (P, H), i) for x in "qkv"]
            + [_f32(f"{a}{x}_conv1d.weight", (P, 1, W), i) for x in "qkv"])


def _kda_gate_specs(cfg: K3Config, a: str, i: int) -> list[TensorSpec]:
    """KDA forget-gate low-rank projections ``f_a`` ``[K, H]``, ``f_b`` ``[P, K]`` and the beta projection
    ``b_proj`` ``[heads, H]`` (prefix ``a``), both families."""
    H, P, Dh, Hk = cfg.hidden_size, cfg.kda_proj_size, cfg.kda_head_dim, cfg.kda_num_heads
    return [_bf16(f"{a}f_a_proj.weight", (Dh, H), i), _bf16(f"{a}f_b_proj.weight", (P, Dh), i),
            _bf16(f"{a}b_proj.weight", (Hk, H), i)]


def _mla_qkv_specs(cfg: K3Config, a: str, i: int) -> list[TensorSpec]:
    """MLA query (low-rank ``q_a`` / norm / ``q_b`` with ``q_lora_rank``, else a full-rank ``q_proj``) and the
    joint latent ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` (prefix ``a``), both families."""
    H, nh, qr, kr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    if qr:
        out = [_bf16(f"{a}q_a_proj.weight", (qr, H), i), _bf16(f"{a}q_a_layernorm.weight", (qr,), i),
               _bf16(f"{a}q_b_proj.weight", (nh * cfg.qk_head_dim, qr), i)]
    else:
        out = [_bf16(f"{a}q_proj.weight", (nh * cfg.qk_head_dim, H), i)]
    return out + [_bf16(f"{a}kv_a_proj_with_mqa.weight", (kr + cfg.qk_rope_head_dim, H), i),
                  _bf16(f"{a}kv_a_layernorm.weight", (kr,), i),
                  _bf16(f"{a}kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kr), i)]


def _channel_specs(cfg: K3Config, p: str, i: int, with_experts: bool) -> list[TensorSpec]:
    """Channel mixer of layer ``i`` (prefix ``p``): router, latent projections (Stable LatentMoE only),
    merged shared experts, routed experts — or the dense MLP before ``first_k_dense_replace``."""
    H = cfg.hidden_size
    if not cfg.is_moe_layer(i):
        I = cfg.intermediate_size
        return [_bf16(f"{p}mlp.gate_proj.weight", (I, H), i), _bf16(f"{p}mlp.up_proj.weight", (I, H), i),
                _bf16(f"{p}mlp.down_proj.weight", (H, I), i)]
    m = f"{p}block_sparse_moe."
    E, Lt, S = cfg.num_experts, cfg.expert_in_size, cfg.shared_intermediate_size
    out = [_bf16(f"{m}gate.weight", (E, H), i), _f32(f"{m}gate.e_score_correction_bias", (E,), i)]
    if cfg.routed_expert_hidden_size is not None:
        out += [_bf16(f"{m}routed_expert_down_proj.weight", (Lt, H), i),
                _bf16(f"{m}routed_expert_norm.weight", (Lt,), i),
                _bf16(f"{m}routed_expert_up_proj.weight", (H, Lt), i)]
    if S:
        out += [_bf16(f"{m}shared_experts.gate_proj.weight", (S, H), i),
                _bf16(f"{m}shared_experts.up_proj.weight", (S, H), i),
                _bf16(f"{m}shared_experts.down_proj.weight", (H, S), i)]
    if with_experts:
        for e in range(E):
            out += expert_specs(cfg, i, e)
    return out


def _kimi_linear_layer_specs(cfg: K3Config, i: int, with_experts: bool) -> list[TensorSpec]:
    H = cfg.hidden_size
    p = f"model.layers.{i}."
    a = f"{p}self_attn."
    out = [_bf16(f"{p}input_layernorm.weight", (H,), i), _bf16(f"{p}post_attention_layernorm.weight", (H,), i)]
    if cfg.layer_type(i) == "kda":
        P, Dh, Hk = cfg.kda_proj_size, cfg.kda_head_dim, cfg.kda_num_heads
        out += _kda_qkv_specs(cfg, a, i)
        out += [_f32(f"{a}dt_bias", (P,), i), _f32(f"{a}A_log", (1, 1, Hk, 1), i)]
        out += _kda_gate_specs(cfg, a, i)
        out += [_bf16(f"{a}g_a_proj.weight", (Dh, H), i), _bf16(f"{a}g_b_proj.weight", (P, Dh), i),
                _f32(f"{a}o_norm.weight", (Dh,), i), _bf16(f"{a}o_proj.weight", (H, P), i)]
    else:
        nh, vd = cfg.num_attention_heads, cfg.v_head_dim
        out += _mla_qkv_specs(cfg, a, i)
        out.append(_bf16(f"{a}o_proj.weight", (H, nh * vd), i))
    out += _channel_specs(cfg, p, i, with_experts)
    return out


def model_specs(cfg: K3Config) -> list[TensorSpec]:
    """Model-level tensors: embedding, final AttnRes (K3), final norm, lm_head."""
    H, V = cfg.hidden_size, cfg.vocab_size
    pre = prefix_for(cfg)
    out = [_bf16(f"{pre}embed_tokens.weight", (V, H), -1), _bf16(f"{pre}norm.weight", (H,), -1)]
    if cfg.attn_res_block_size is not None:
        out += [_bf16(f"{PREFIX}output_attn_res_norm.weight", (H,), -1),
                _bf16(f"{PREFIX}output_attn_res_proj.weight", (1, H), -1)]
    if not cfg.tie_word_embeddings:
        out.append(_bf16(lm_head_for(cfg), (V, H), -1))
    return out


def iter_specs(cfg: K3Config) -> Iterator[TensorSpec]:
    """All expected text tensors, model-level first then layer by layer (497,052 for the official K3)."""
    yield from model_specs(cfg)
    for i in range(cfg.num_hidden_layers):
        yield from layer_specs(cfg, i)


@lru_cache(maxsize=8)
def _summary(cfg: K3Config) -> dict[str, int]:
    # Count without materialising 494k expert specs: one expert's specs times the expert count.
    n_t = p_t = b_t = n_e = p_e = b_e = 0
    act = 0
    for s in model_specs(cfg):
        n_t += 1; p_t += s.params; b_t += s.nbytes
        if not s.name.endswith("embed_tokens.weight"):
            act += s.params
    for i in range(cfg.num_hidden_layers):
        for s in layer_specs(cfg, i, with_experts=False):
            n_t += 1; p_t += s.params; b_t += s.nbytes; act += s.params
        if cfg.is_moe_layer(i):
            one = expert_specs(cfg, i, 0)
            E, k = cfg.num_experts, cfg.num_experts_per_token
            n_e += E * len(one); p_e += E * sum(s.params for s in one); b_e += E * sum(s.nbytes for s in one)
            act += k * sum(s.params for s in one)
    return {"tensors_trunk": n_t, "tensors_expert": n_e, "params_trunk": p_t, "params_expert": p_e,
            "bytes_trunk": b_t, "bytes_expert": b_e, "params_activated": act}


def counts(cfg: K3Config) -> dict[str, int]:
    """Exact counts for a config (K3_FACTS §2 for the official one).

    Returns a dict with ``tensors`` (text tensors), ``tensors_expert``, ``params`` (text parameters),
    ``params_activated`` (per token: lm_head counted, input embedding not, top-k routed experts),
    ``params_expert``, ``bytes`` (text tensor data bytes), ``bytes_expert``, ``bytes_trunk``.
    Official K3: params 2,779,484,478,208; activated 104,189,614,848; bytes_expert 1,446,456,066,048;
    bytes_trunk 113,509,540,864; tensors 497,052.
    """
    s = _summary(cfg)
    return {"tensors": s["tensors_trunk"] + s["tensors_expert"], "tensors_expert": s["tensors_expert"],
            "params": s["params_trunk"] + s["params_expert"], "params_expert": s["params_expert"],
            "params_activated": s["params_activated"], "bytes": s["bytes_trunk"] + s["bytes_expert"],
            "bytes_expert": s["bytes_expert"], "bytes_trunk": s["bytes_trunk"]}


# Vision bytes of the official release (not derivable from the text config; K3_FACTS §2).
OFFICIAL_VISION_BYTES = 894_717_952
OFFICIAL_VISION_TENSORS = 168
