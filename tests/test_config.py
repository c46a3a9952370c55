"""K3Config against the official config.json and K3_FACTS §1-3 (every number re-derived from the layout)."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path

import pytest
from tests.helpers import OFFICIAL_CONFIG

from k3rocm.checkpoint import layout
from k3rocm.config import K3Config, preset
from k3rocm.errors import ConfigError

OFFICIAL = OFFICIAL_CONFIG


def _official_doc() -> dict:
    return json.loads(resources.files("k3rocm").joinpath("presets/kimi-k3.json").read_text())


@pytest.fixture(scope="module")
def k3() -> K3Config:
    return preset("k3")


def test_official_config_parses_unchanged(k3):
    packaged = _official_doc()
    assert k3.to_dict() == packaged
    shared = json.loads(OFFICIAL.read_text())
    assert packaged == shared  # the packaged copy is the released file
    cfg = K3Config.from_file(OFFICIAL)
    assert cfg.to_dict() == shared and cfg.config_hash() == k3.config_hash()
    assert k3.family == "k3" and k3.hidden_size == 7168 and k3.vocab_size == 163840
    assert (k3.bos_token_id, k3.eos_token_id, k3.pad_token_id) == (163584, 163586, 163839)
    assert k3.num_hidden_layers == 93 and k3.rms_norm_eps == 1e-5
    assert k3.kda_num_heads == 96 and k3.kda_head_dim == 128 and k3.kda_proj_size == 12288
    assert k3.qk_head_dim == 192 and k3.mla_cache_width == 576 and k3.v_head_dim == 128
    assert k3.num_experts == 896 and k3.num_experts_per_token == 16 and k3.expert_in_size == 3584
    assert k3.moe_intermediate_size == 3072 and k3.shared_intermediate_size == 6144
    assert k3.intermediate_size == 33792 and k3.gate_lower_bound == -5.0
    assert (k3.activation_situ_beta, k3.activation_situ_linear_beta) == (4.0, 25.0)
    assert k3.quant is not None and k3.quant.format == "mxfp4-pack-quantized" and k3.quant.group_size == 32
    assert "quantization_config" not in k3.to_dict() and "quantization_config" in k3.to_dict()["text_config"]


def test_exact_counts(k3):
    c = layout.counts(k3)
    assert c["params"] == 2_779_484_478_208
    assert c["params_activated"] == 104_189_614_848
    assert c["bytes_expert"] == 1_446_456_066_048
    assert c["bytes_trunk"] == 113_509_540_864
    assert c["tensors"] == 497_220 - layout.OFFICIAL_VISION_TENSORS == 497_052
    assert c["tensors_expert"] == 494_592 == 92 * 896 * 6
    # the release's 1,560,936,091,448 bytes on disk = text data + vision data + 96 safetensors headers
    # (~152 header bytes per tensor: names, dtypes, shapes, offsets)
    headers = 1_560_936_091_448 - c["bytes"] - layout.OFFICIAL_VISION_BYTES
    assert headers == 75_766_584 and 100 < headers / 497_220 < 200
    assert c["params_expert"] / c["params"] == pytest.approx(0.9796, abs=5e-5)
    # per expert: 3 x 3584 x 3072 params, 17,547,264 bytes in MXFP4 (0.53125 B/param)
    one = layout.expert_specs(k3, 1, 0)
    assert sum(s.params for s in one) == 33_030_144 == 3 * 3584 * 3072
    assert sum(s.nbytes for s in one) == 17_547_264 == 33_030_144 * 0.53125
    # the fast summary agrees with a full walk of the tensor list
    n = b = p = 0
    for s in layout.iter_specs(k3):
        n += 1
        b += s.nbytes
        p += s.params
    assert (n, b, p) == (c["tensors"], c["bytes"], c["params"])


def test_layer_types_and_write_layers(k3):
    mla = [i for i in range(93) if k3.layer_type(i) == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]
    assert mla[:3] == [3, 7, 11] and mla[-2:] == [91, 92]
    assert k3.num_mla_layers == 24 and k3.num_kda_layers == 69
    assert k3.layer_types[0] == "kda" and k3.layer_types[92] == "mla"
    assert [i for i in range(93) if k3.is_write_layer(i)] == list(range(0, 85, 12))
    assert k3.num_attn_res_bank_rows == 8
    assert not k3.is_moe_layer(0) and all(k3.is_moe_layer(i) for i in range(1, 93)) and k3.num_moe_layers == 92
    with pytest.raises(ConfigError):
        k3.layer_type(93)


def test_k3_tiny_equals_golden_config(golden_ckpt):
    tiny = preset("k3-tiny")
    text = (golden_ckpt / "config.json").read_text()
    assert tiny.to_dict() == json.loads(text)
    assert json.dumps(tiny.to_dict(), indent=2) == text  # byte for byte, as the writer writes it
    assert [i for i in range(13) if tiny.layer_type(i) == "mla"] == [3, 7, 11, 12]
    assert K3Config.from_file(golden_ckpt / "config.json").layer_types == tiny.layer_types


def test_prefix_presets(k3):
    p13 = preset("k3-prefix-13")
    assert p13.num_hidden_layers == 13 and p13.layer_types == k3.layer_types[:13]
    assert p13.num_mla_layers == 3 and p13.num_moe_layers == 12
    c13, ck = layout.counts(p13), layout.counts(k3)
    # the first 13 layers' experts are 12/92 of all experts; trunk keeps embedding + head
    assert c13["bytes_expert"] * 92 == ck["bytes_expert"] * 12
    assert preset("k3-prefix-93").layer_types == k3.layer_types
    assert layout.counts(preset("k3-prefix-93")) == ck
    assert preset("k3-prefix-1").num_moe_layers == 0
    for bad in ("k3-prefix-0", "k3-prefix-94", "k3-huge"):
        with pytest.raises(ConfigError):
            preset(bad)


def test_kimi_linear_preset():
    kl = preset("kimi-linear-48b-a3b")
    assert kl.family == "kimi_linear" and kl.attn_res_block_size is None and not kl.experts_quantized
    assert kl.num_hidden_layers == 27 and kl.hidden_size == 2304 and kl.num_experts == 256
    assert [i for i in range(27) if kl.layer_type(i) == "mla"] == [3, 7, 11, 15, 19, 23, 26]
    assert kl.q_lora_rank is None and kl.gate_lower_bound == 0.0 and kl.routed_scaling_factor == 2.446


def test_refuses_config_without_full_attn_layers():
    doc = _official_doc()
    del doc["text_config"]["linear_attn_config"]["full_attn_layers"]
    with pytest.raises(ConfigError, match="full_attn_layers"):
        K3Config.from_dict(doc)
    doc = _official_doc()
    del doc["text_config"]["linear_attn_config"]
    with pytest.raises(ConfigError, match="linear_attn_config"):
        K3Config.from_dict(doc)


def test_model_type_and_text_config_say_what_is_wrong():
    """model_type must be K3's (the released file: kimi_k3 around a kimi_linear text model); a K3 wrapper without
    text_config is refused as that, not as its first missing field."""
    doc = _official_doc()
    doc["model_type"] = "llama"
    with pytest.raises(ConfigError, match=r"^model_type is 'llama'; k3rocm runs only Kimi K3 \(model_type 'kimi_k3'"):
        K3Config.from_dict(doc)
    doc = _official_doc()
    del doc["text_config"]
    with pytest.raises(ConfigError, match="^text_config is missing; "):
        K3Config.from_dict(doc)
    bare = copy.deepcopy(_official_doc()["text_config"])  # a bare text config is kimi_linear's
    assert K3Config.from_dict(bare).family == "k3"
    bare["model_type"] = "llama"
    with pytest.raises(ConfigError, match="^model_type is 'llama'"):
        K3Config.from_dict(bare)


def test_refuses_quantization_config_at_top_level():
    doc = _official_doc()
    doc["quantization_config"] = doc["text_config"].pop("quantization_config")
    with pytest.raises(ConfigError, match="top level"):
        K3Config.from_dict(doc)


def test_refuses_inconsistent_configs():
    doc = _official_doc()
    doc["text_config"]["linear_attn_config"]["kda_layers"] = [1, 2, 3]
    with pytest.raises(ConfigError, match="partition"):
        K3Config.from_dict(doc)
    doc = _official_doc()
    doc["text_config"]["linear_attn_config"]["full_attn_layers"] = [4, 4, 94]
    with pytest.raises(ConfigError, match="full_attn_layers"):
        K3Config.from_dict(doc)
    doc = copy.deepcopy(_official_doc())
    doc["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(ConfigError, match="mxfp4"):
        K3Config.from_dict(doc)
    doc = _official_doc()
    del doc["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        K3Config.from_dict(doc)


def test_from_file_names_the_preset_it_is(tmp_path):
    src = OFFICIAL_CONFIG
    assert K3Config.from_file(src).name == "k3"
    doc = json.loads(src.read_text())
    doc["text_config"]["rms_norm_eps"] = 1e-6  # no longer the release: named after its directory
    d = tmp_path / "my-k3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(doc))
    assert K3Config.from_file(d / "config.json").name == "my-k3"
    from k3rocm.config import identify
    assert identify(preset("k3-tiny").to_dict()) == "k3-tiny"
    assert identify(preset("k3-prefix-13").to_dict()) == "k3-prefix-13"


@pytest.mark.parametrize("path, value, needle", [
    (("text_config", "rms_norm_eps"), None, None),  # absent-like: the documented default
    (("text_config", "rms_norm_eps"), "1e-5", "rms_norm_eps"),
    (("text_config", "hidden_size"), "abc", "hidden_size"),
    (("text_config", "hidden_size"), True, "hidden_size"),
    (("text_config", "num_experts"), [16], "num_experts"),
    (("text_config", "num_experts"), "16", "num_experts"),
    (("text_config", "num_hidden_layers"), -1, "num_hidden_layers"),
    (("text_config", "linear_attn_config", "full_attn_layers"), "4,8", "full_attn_layers"),
    (("text_config", "quantization_config"), [1], "quantization_config"),
])
def test_wrongly_typed_fields_are_one_line_config_errors(path, value, needle):
    """A field of the wrong JSON type is a ConfigError naming the field, never a TypeError/ValueError."""
    from k3rocm.errors import ConfigError

    doc = preset("k3-tiny").to_dict()
    d = doc
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    if needle is None:
        assert K3Config.from_dict(doc).rms_norm_eps == 1e-5
        return
    with pytest.raises(ConfigError, match=needle) as e:
        K3Config.from_dict(doc)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------- malformed fields through the CLI
_T, _L, _Q = ("text_config",), ("text_config", "linear_attn_config"), ("text_config", "quantization_config")
# (path of the field in config.json, bad value, the dotted field name the one error line must start with)
_BAD_FIELDS = [
    ((), [1, 2], None),  # the whole document
    (("text_config",), [1, 2], "text_config"),
    (("text_config",), None, "text_config"),
    (("architectures",), 5, "architectures"),
    (_T + ("num_experts",), -16, "text_config.num_experts"),
    (_T + ("num_experts",), 0, "text_config.num_experts"),  # K3 is a mixture of experts: no "0 = dense"
    (("model_type",), "llama", "model_type"),  # another model than K3: refused, never run as K3
    (_T + ("model_type",), "llama", "text_config.model_type"),
    (_T + ("num_experts",), "16", "text_config.num_experts"),
    (_T + ("num_experts",), 2**70, "text_config.num_experts"),  # would exhaust memory listing the tensors
    (_T + ("num_experts_per_token",), 0, "text_config.num_experts_per_token"),
    (_T + ("num_experts_per_token",), -4, "text_config.num_experts_per_token"),
    (_T + ("num_experts_per_token",), 64, "text_config.num_experts_per_token"),
    (_T + ("num_shared_experts",), -2, "text_config.num_shared_experts"),
    (_T + ("moe_intermediate_size",), 0, "text_config.moe_intermediate_size"),
    (_T + ("moe_intermediate_size",), -64, "text_config.moe_intermediate_size"),
    (_T + ("moe_intermediate_size",), 48, "text_config.moe_intermediate_size"),  # not MXFP4 groups of 32
    (_T + ("routed_expert_hidden_size",), -64, "text_config.routed_expert_hidden_size"),
    (_T + ("routed_expert_hidden_size",), 0, "text_config.routed_expert_hidden_size"),
    (_T + ("routed_expert_hidden_size",), 40, "text_config.routed_expert_hidden_size"),
    (_T + ("hidden_size",), 0, "text_config.hidden_size"),
    (_T + ("hidden_size",), -128, "text_config.hidden_size"),
    (_T + ("hidden_size",), 128.5, "text_config.hidden_size"),
    (_T + ("hidden_size",), True, "text_config.hidden_size"),
    (_T + ("vocab_size",), 0, "text_config.vocab_size"),
    (_T + ("vocab_size",), None, "text_config.vocab_size"),
    (_T + ("num_hidden_layers",), 0, "text_config.num_hidden_layers"),
    (_T + ("num_hidden_layers",), -13, "text_config.num_hidden_layers"),
    (_T + ("num_hidden_layers",), [13], "text_config.num_hidden_layers"),
    (_T + ("num_hidden_layers",), 10**12, "text_config.num_hidden_layers"),  # would exhaust memory
    (_T + ("num_attention_heads",), 0, "text_config.num_attention_heads"),
    (_T + ("intermediate_size",), -384, "text_config.intermediate_size"),
    (_T + ("first_k_dense_replace",), -1, "text_config.first_k_dense_replace"),
    (_T + ("first_k_dense_replace",), 14, "text_config.first_k_dense_replace"),
    (_T + ("rms_norm_eps",), 0, "text_config.rms_norm_eps"),
    (_T + ("rms_norm_eps",), -1e-5, "text_config.rms_norm_eps"),
    (_T + ("rms_norm_eps",), "1e-5", "text_config.rms_norm_eps"),
    (_T + ("q_lora_rank",), -64, "text_config.q_lora_rank"),
    (_T + ("q_lora_rank",), 0, "text_config.q_lora_rank"),
    (_T + ("q_lora_rank",), None, "text_config.q_lora_rank"),  # K3's MLA always has the query low-rank path
    (_T + ("kv_lora_rank",), 0, "text_config.kv_lora_rank"),
    (_T + ("qk_nope_head_dim",), -32, "text_config.qk_nope_head_dim"),
    (_T + ("qk_rope_head_dim",), 0, "text_config.qk_rope_head_dim"),
    (_T + ("v_head_dim",), "32", "text_config.v_head_dim"),
    (_T + ("routed_scaling_factor",), -1.0, "text_config.routed_scaling_factor"),
    (_T + ("activation_situ_beta",), 0, "text_config.activation_situ_beta"),
    (_T + ("activation_situ_linear_beta",), "25", "text_config.activation_situ_linear_beta"),
    (_T + ("attn_res_block_size",), -3, "text_config.attn_res_block_size"),
    (_T + ("attn_res_block_size",), 0, "text_config.attn_res_block_size"),
    (_T + ("bos_token_id",), -1, "text_config.bos_token_id"),
    (_T + ("eos_token_id",), 512, "text_config.eos_token_id"),  # vocab_size is 512
    (_T + ("pad_token_id",), "0", "text_config.pad_token_id"),
    (_T + ("moe_renormalize",), "false", "text_config.moe_renormalize"),
    (_T + ("tie_word_embeddings",), 1, "text_config.tie_word_embeddings"),
    (_T + ("hidden_act",), "silu", "text_config.hidden_act"),
    (_T + ("hidden_act",), ["situ"], "text_config.hidden_act"),
    (_T + ("linear_attn_config",), None, "text_config.linear_attn_config"),
    (_T + ("linear_attn_config",), [4, 8], "text_config.linear_attn_config"),
    (_L + ("num_heads",), 0, "text_config.linear_attn_config.num_heads"),
    (_L + ("head_dim",), -32, "text_config.linear_attn_config.head_dim"),
    (_L + ("short_conv_kernel_size",), 0, "text_config.linear_attn_config.short_conv_kernel_size"),
    (_L + ("gate_lower_bound",), 5.0, "text_config.linear_attn_config.gate_lower_bound"),
    (_L + ("gate_lower_bound",), "-5", "text_config.linear_attn_config.gate_lower_bound"),
    (_L + ("full_attn_layers",), [4, 8, 12, 99], "text_config.linear_attn_config.full_attn_layers"),
    (_L + ("full_attn_layers",), [0, 4, 8, 12], "text_config.linear_attn_config.full_attn_layers"),
    (_L + ("full_attn_layers",), "4,8", "text_config.linear_attn_config.full_attn_layers"),
    (_L + ("full_attn_layers",), None, "text_config.linear_attn_config.full_attn_layers"),
    (_L + ("kda_layers",), [1, 2], "text_config.linear_attn_config.kda_layers"),
    (_L + ("kda_layers",), {"1": 1}, "text_config.linear_attn_config.kda_layers"),
    (_Q, [1], "text_config.quantization_config"),
    (_Q + ("format",), "nvfp4-pack-quantized", "text_config.quantization_config.format"),
    (_Q + ("config_groups",), [1], "text_config.quantization_config.config_groups"),
    (_Q + ("config_groups",), {}, "text_config.quantization_config.config_groups"),
    (_Q + ("config_groups", "group_0", "weights"), [32], "text_config.quantization_config.config_groups.group_0"
                                                         ".weights"),
    (_Q + ("config_groups", "group_0", "weights", "group_size"), 16,
     "text_config.quantization_config.config_groups.group_0.weights.group_size"),
    (_Q + ("ignore",), "lm_head", "text_config.quantization_config.ignore"),
    # values that would run another model than the one implemented: refused by name, never ignored
    (_T + ("moe_router_activation_func",), "softmax", "text_config.moe_router_activation_func"),
    (_T + ("num_expert_group",), 4, "text_config.num_expert_group"),
    (_T + ("topk_group",), 2, "text_config.topk_group"),
    (_T + ("topk_method",), "greedy", "text_config.topk_method"),
    (_T + ("moe_layer_freq",), 2, "text_config.moe_layer_freq"),
    (_T + ("mla_use_nope",), False, "text_config.mla_use_nope"),
    (_T + ("latent_moe_use_norm",), False, "text_config.latent_moe_use_norm"),
    (_T + ("rope_scaling",), {"type": "yarn", "factor": 4.0}, "text_config.rope_scaling"),
    (_T + ("num_nextn_predict_layers",), 1, "text_config.num_nextn_predict_layers"),
    (_L + ("use_full_rank_gate",), False, "text_config.linear_attn_config.use_full_rank_gate"),
    (_Q + ("quant_method",), "gptq", "text_config.quantization_config.quant_method"),
    (_Q + ("config_groups", "group_0", "weights", "num_bits"), 8,
     "text_config.quantization_config.config_groups.group_0.weights.num_bits"),
]


def _cli(*args: str):
    from click.testing import CliRunner

    from k3rocm.cli.main import cli

    return CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def golden_copy(golden_ckpt, tmp_path_factory) -> Path:
    """One copy of the golden checkpoint; each case copies it again and edits config.json."""
    import shutil

    return Path(shutil.copytree(golden_ckpt, tmp_path_factory.mktemp("golden") / "ck"))


def test_golden_copy_inspects_cleanly(golden_copy):
    """The control for the table below: the unmodified copy passes ``checkpoint inspect``."""
    r = _cli("checkpoint", "inspect", "--checkpoint", str(golden_copy), "--json")
    assert r.exit_code == 0, r.output + r.stderr
    assert json.loads(r.stdout)["tensors"] == 1492


@pytest.mark.parametrize("path, value, field_name", _BAD_FIELDS,
                         ids=[".".join(p[1:] or p or ("doc",)) + f"={v!r}" for p, v, _ in _BAD_FIELDS])
def test_malformed_config_field_is_one_line_naming_it(golden_copy, tmp_path, path, value, field_name):
    """``checkpoint inspect`` on a copy with one malformed config.json field: exit 2, one ``error:`` line on
    stderr that names the file and starts with that field (not another one), no traceback."""
    import shutil

    ck = Path(shutil.copytree(golden_copy, tmp_path / "ck"))
    cfg_file = ck / "config.json"
    doc = json.loads(cfg_file.read_text())
    if not path:
        doc = value
    else:
        d = doc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    cfg_file.write_text(json.dumps(doc))
    r = _cli("checkpoint", "inspect", "--checkpoint", str(ck))
    assert r.exit_code == 2, (r.exit_code, r.exception, r.output, r.stderr)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.output
    prefix = f"error: {cfg_file}: "
    assert lines[0].startswith(prefix), lines[0]
    body = lines[0][len(prefix):]
    if field_name is None:
        assert "JSON array" in body and "object" in body, body
    else:
        assert body.startswith(field_name + " "), body
    assert "fix config.json" in body or "add it to config.json" in body or "released config.json" in body \
        or "official config.json" in body, body


def test_config_file_nested_too_deep_or_huge_number(tmp_path):
    """JSON that Python's parser rejects past its limits (nesting depth, digits) is a one-line ConfigError."""
    f = tmp_path / "config.json"
    for text in ("[" * 100_000 + "]" * 100_000, '{"vocab_size": ' + "9" * 5000 + "}"):
        f.write_text(text)
        with pytest.raises(ConfigError, match="not valid JSON") as e:
            K3Config.from_file(f)
        assert "\n" not in str(e.value) and str(f) in str(e.value)


@pytest.mark.parametrize("n", [0, 94, -1])
def test_prefix_out_of_range_names_the_range_and_only_a_flag_it_was_given(n):
    """The library line names the valid range and the layer count; a flag only when the caller says the name
    came from one (the CLI passes ``--preset``)."""
    with pytest.raises(ConfigError) as e:
        preset(f"k3-prefix-{n}")
    msg = str(e.value)
    assert msg.startswith(f"preset k3-prefix-{n}: N must be in 1..93 (the official K3 has 93 layers); ") and \
        "--preset" not in msg, msg
    with pytest.raises(ConfigError) as e:
        preset(f"k3-prefix-{n}", "--preset")
    assert str(e.value).startswith(f"--preset k3-prefix-{n}: N must be in 1..93"), str(e.value)
    with pytest.raises(ConfigError, match=r"^--preset: unknown preset 'k3-huge'; choose one of k3, "):
        preset("k3-huge", "--preset")
