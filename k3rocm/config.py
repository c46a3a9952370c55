"""K3Config: the Kimi K3 text model's configuration, parsed from the HF ``config.json``.

Sources: the official ``moonshotai/Kimi-K3`` ``config.json`` (shipped as ``k3rocm/presets/kimi-k3.json``)
and transformers' ``KimiLinearConfig`` for the field names of the ``kimi_linear`` text model.

Two model families share this class (:attr:`K3Config.family`):

* ``"k3"`` — Kimi K3: Block Attention Residuals, Stable LatentMoE, SiTU-GLU, full-rank output gate,
  K3's bounded decay gate ``g = lower_bound * sigmoid(exp(A_log) * (raw + dt_bias))``.
* ``"kimi_linear"`` — Kimi-Linear-48B-A3B (the smaller released sibling): residual stream, plain MoE,
  SiLU-GLU, low-rank output gate, decay ``g = -exp(A_log) * softplus(raw + dt_bias)``.

Layer indices in this API are 0-based; ``linear_attn_config`` lists are 1-based as in the file.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from k3rocm.errors import ConfigError

PRESETS = ("k3", "k3-tiny", "k3-tiny-tp8", "k3-prefix-N", "kimi-linear-48b-a3b")
#: ``model_type`` of the K3 wrapper and of its text model (the released config.json; K3_FACTS §2)
K3_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
# far above any real model; a larger count is a typo that would only exhaust memory listing the tensors
MAX_LAYERS = 100_000
MAX_EXPERTS = 65_536

# text_config fields with one supported value (K3_FACTS §5; the released config.json): anything else would run
# another model than the one k3rocm implements, so it is refused instead of ignored
_FIXED_FIELDS: tuple[tuple[str, tuple, str], ...] = (
    ("moe_router_activation_func", ("sigmoid",), "the router scores experts with a sigmoid"),
    ("num_expert_group", (1,), "no expert groups in top-k"),
    ("topk_group", (1,), "no expert groups in top-k"),
    # (use_grouped_topk is not checked: with one expert group, grouped and plain top-k choose the same experts)
    ("topk_method", ("noaux_tc",), "top-k of the sigmoid scores plus e_score_correction_bias, weights from the "
                                   "uncorrected scores"),
    ("moe_layer_freq", (1,), "every layer after first_k_dense_replace is MoE"),
    ("mla_use_nope", (True,), "gated NoPE MLA"),
    ("latent_moe_use_norm", (True,), "the latent RMSNorm of Stable LatentMoE"),
    ("rope_scaling", (None,), "no RoPE scaling"),
    ("num_nextn_predict_layers", (0,), "no multi-token-prediction layers: their tensors would be neither planned, "
                                       "loaded nor run"),
)


@dataclass(frozen=True)
class QuantConfig:
    """The compressed-tensors quantization block (``text_config.quantization_config``).

    Only ``mxfp4-pack-quantized`` (E2M1 weights, E8M0 ``uint8`` scales, group 32) is accepted.
    ``ignore`` holds the regexes (``re:`` prefix) / names of modules left unquantized.
    """

    format: str
    group_size: int
    ignore: tuple[str, ...]
    raw: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class K3Config:
    """Parsed text config of a Kimi K3 (or Kimi-Linear) checkpoint.

    Field names are the HF config's. ``raw`` keeps the whole original document (wrapper included)
    so that a writer can reproduce it byte-for-byte and a report can hash it.

    Raises:
        ConfigError: from :meth:`from_dict` / :meth:`from_file` when a field is missing or inconsistent
            (e.g. no ``linear_attn_config.full_attn_layers``: defaulting it would silently run all-KDA).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    first_k_dense_replace: int
    rms_norm_eps: float
    # MLA
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    full_attn_layers: tuple[int, ...]  # 1-based, as in the file
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None  # latent width (K3); None = plain MoE
    moe_renormalize: bool
    routed_scaling_factor: float
    # activation / residuals
    hidden_act: str
    activation_situ_beta: float
    activation_situ_linear_beta: float
    attn_res_block_size: int | None  # None = ordinary residual stream
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    tie_word_embeddings: bool
    quant: QuantConfig | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    name: str = "custom"

    # ------------------------------------------------------------------ layer structure
    def layer_type(self, i: int) -> str:
        """``"mla"`` or ``"kda"`` for 0-based layer ``i`` (MLA iff ``i+1`` in ``full_attn_layers``)."""
        if not 0 <= i < self.num_hidden_layers:
            raise ConfigError(f"layer index {i} out of range 0..{self.num_hidden_layers - 1}")
        return "mla" if (i + 1) in self.full_attn_layers else "kda"

    @property
    def layer_types(self) -> list[str]:
        """Per-layer token mixer, 0-based: ``["kda", "kda", "kda", "mla", ...]``."""
        return [self.layer_type(i) for i in range(self.num_hidden_layers)]

    def is_moe_layer(self, i: int) -> bool:
        """True when layer ``i`` (0-based) has a MoE channel mixer (``i >= first_k_dense_replace``)."""
        return i >= self.first_k_dense_replace and self.num_experts > 0

    def is_write_layer(self, i: int) -> bool:
        """Block AttnRes write layer: ``i % attn_res_block_size == 0`` (K3_FACTS §5)."""
        return self.attn_res_block_size is not None and i % self.attn_res_block_size == 0

    @property
    def num_kda_layers(self) -> int:
        return sum(t == "kda" for t in self.layer_types)

    @property
    def num_mla_layers(self) -> int:
        return sum(t == "mla" for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def kda_proj_size(self) -> int:
        """KDA q/k/v/g width = ``kda_num_heads * kda_head_dim`` (12288 for K3)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key head dim = nope + rope (192 for K3; softmax scale 192^-0.5)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer = kv_lora_rank + qk_rope_head_dim (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the merged shared-expert MLP = num_shared_experts * moe_intermediate_size."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def expert_in_size(self) -> int:
        """Input width of a routed expert: the latent width (K3) or hidden_size (plain MoE)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def experts_quantized(self) -> bool:
        """True when routed experts are stored as packed MXFP4 (``weight_packed``/``weight_scale``)."""
        return self.quant is not None

    @property
    def num_attn_res_bank_rows(self) -> int:
        """Bank rows at the end of the stack: embedding + one per completed block (8 for K3)."""
        if self.attn_res_block_size is None:
            return 0
        return len([i for i in range(self.num_hidden_layers) if self.is_write_layer(i)])

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the whole config document (for reports)."""
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_file(cls, path: str | Path) -> "K3Config":
        """Parse a ``config.json``. Raises ConfigError naming the file on any problem."""
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"{path}: is a directory, not a file; config.json must be the checkpoint's JSON config "
                              "file - replace the directory with the released config.json")
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found; pass a checkpoint directory that has one") from None
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise ConfigError(f"{path}: not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              "fix or re-download the file") from None
        try:
            return cls.from_dict(doc, name=identify(doc) or path.resolve().parent.name)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, doc: dict[str, Any], name: str = "custom") -> "K3Config":
        """Parse a config document: the K3 wrapper (``text_config`` inside) or a bare text config.

        Every field is checked for its JSON type and range before use (sizes and counts positive, token ids
        inside the vocabulary, top-k within the expert count, finite floats), so a malformed field is one
        line naming it rather than a crash or a wrong model later.

        Raises:
            ConfigError: one line ``<field> is <value>; it must be ... - fix config.json`` for the first
                malformed, missing or inconsistent field.
        """
        if not isinstance(doc, dict):
            raise ConfigError(f"the document is a JSON {_json_type(doc)}, not an object; config.json must be "
                              "one JSON object (see the official config.json)")
        text = doc.get("text_config", doc)
        if not isinstance(text, dict):
            raise ConfigError(f"text_config is a JSON {_json_type(text)}, not an object; it must hold the text "
                              "model's fields - fix config.json")
        archs = doc.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"architectures is {_short(archs)}; it must be a list of class names such as "
                              "[\"KimiK3ForConditionalGeneration\"] - fix config.json")
        if "text_config" not in doc and ("KimiK3ForConditionalGeneration" in archs
                                         or doc.get("model_type") == K3_MODEL_TYPE):
            # the K3 wrapper without its text model: every field below would be reported missing one by one
            raise ConfigError("text_config is missing; a Kimi K3 config.json (KimiK3ForConditionalGeneration) keeps "
                              "the text model's fields there - restore it from the released config.json")
        # model_type names the model the file describes: another one (llama, deepseek_v3, ...) would be run as K3
        wrapper = text is not doc
        for where, mt, want in (("", doc.get("model_type"), K3_MODEL_TYPE if wrapper else TEXT_MODEL_TYPE),
                                ("text_config", text.get("model_type") if wrapper else None, TEXT_MODEL_TYPE)):
            if mt is not None and mt != want:
                raise ConfigError(f"{_dot(where, 'model_type')} is {_short(mt)}; k3rocm runs only Kimi K3 "
                                  f"(model_type {K3_MODEL_TYPE!r} with text_config.model_type {TEXT_MODEL_TYPE!r}) and "
                                  f"Kimi-Linear ({TEXT_MODEL_TYPE!r}) - pass a Kimi K3 checkpoint, or fix config.json "
                                  "from the released config.json")
        if "KimiK3ForConditionalGeneration" in archs or "attn_res_block_size" in text:
            family = "k3"
        elif text.get("model_type") == "kimi_linear":
            family = "kimi_linear"
        else:
            raise ConfigError(
                f"model_type {_short(text.get('model_type'))} / architectures {_short(archs)} is neither Kimi K3 nor "
                "kimi_linear; pass a Kimi K3 (or Kimi-Linear) checkpoint")
        # field names as the file spells them: inside text_config for the K3 wrapper, bare for a text config
        TC = "" if text is doc else "text_config"
        LAC = _dot(TC, "linear_attn_config")

        def bad(where: str, key: str, v: Any, must: str) -> ConfigError:
            return ConfigError(f"{_dot(where, key)} is {_short(v)}; it must be {must} - fix config.json")

        def req(key: str, d: dict = text, where: str = TC) -> Any:
            if key not in d or d[key] is None:
                raise ConfigError(f"{_dot(where, key)} is missing; the K3 config.json defines it - add it to "
                                  "config.json")
            return d[key]

        def num(v: Any, key: str, kind: type, where: str = TC) -> Any:
            # JSON numbers only: no strings, no booleans; an integer field also takes an integral float
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if ok and isinstance(v, float):
                ok = math.isfinite(v) and (kind is float or v.is_integer())
            if not ok:
                raise bad(where, key, v, "an integer" if kind is int else "a finite number")
            return kind(v)

        def ival(key: str, d: dict = text, where: str = TC, default: Any = ..., lo: int = 1,
                 hi: int | None = None, must: str | None = None) -> int:
            """An integer field in lo..hi (default: positive); ``default`` when absent/null, if given."""
            if default is not ... and d.get(key) is None:
                return default
            v = num(req(key, d, where), key, int, where)
            if v < lo or (hi is not None and v > hi):
                if must is None:
                    must = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"at least {lo}") \
                        if hi is None else f"an integer in {lo}..{hi}"
                raise bad(where, key, v, must)
            return v

        def opt_ival(key: str, d: dict = text, where: str = TC, what: str = "") -> int | None:
            """A positive integer, or null/absent for None."""
            if d.get(key) is None:
                return None
            return ival(key, d, where, must=f"a positive integer, or null {what}".rstrip())

        def fval(key: str, default: float, d: dict = text, where: str = TC, sign: int = 1) -> float:
            """A finite float; ``sign`` 1: > 0, -1: < 0, 0: any."""
            if d.get(key) is None:
                return default
            v = num(d[key], key, float, where)
            if (sign > 0 and v <= 0) or (sign < 0 and v >= 0):
                raise bad(where, key, v, f"a {'positive' if sign > 0 else 'negative'} number "
                                         f"(the default is {default})")
            return v

        def bval(key: str, default: bool, d: dict = text, where: str = TC) -> bool:
            v = d.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise bad(where, key, v, "true or false")
            return v

        def ilist(v: Any, key: str) -> tuple[int, ...]:
            if not isinstance(v, list):
                raise bad(LAC, key, v, "a list of 1-based layer indices")
            return tuple(num(x, key, int, LAC) for x in v)

        lac = text.get("linear_attn_config")
        if lac is None:
            raise ConfigError(f"{LAC} is missing; cannot tell KDA from MLA layers - add it to config.json "
                              "(see the official config.json)")
        if not isinstance(lac, dict):
            raise bad(TC, "linear_attn_config", lac, "an object (full_attn_layers, kda_layers, num_heads, ...)")
        if lac.get("full_attn_layers") is None or (not lac["full_attn_layers"] and lac.get("kda_layers") is None):
            raise ConfigError(f"{LAC}.full_attn_layers is missing; refusing to default it (that would silently "
                              "run every layer as KDA) - add it to config.json")
        L = ival("num_hidden_layers", hi=MAX_LAYERS, must=f"a positive integer up to {MAX_LAYERS} (K3 has 93)")
        full = ilist(lac["full_attn_layers"], "full_attn_layers")
        if any(not 1 <= x <= L for x in full) or len(set(full)) != len(full):
            raise bad(LAC, "full_attn_layers", list(full),
                      f"distinct 1-based layer indices in 1..{L} (num_hidden_layers {L})")
        if lac.get("use_full_rank_gate") not in (None, True):
            raise ConfigError(f"{LAC}.use_full_rank_gate is {json.dumps(lac.get('use_full_rank_gate'))[:60]}; "
                              "k3rocm implements only true (KDA's per-channel forget gate), as in the released "
                              "config.json - this checkpoint is a model variant k3rocm does not run")
        kda = lac.get("kda_layers")
        if kda is not None:
            kda_set, full_set = set(ilist(kda, "kda_layers")), set(full)
            if kda_set & full_set or (kda_set | full_set) != set(range(1, L + 1)):
                raise ConfigError(f"{LAC}.kda_layers and full_attn_layers must partition 1..{L} (overlap "
                                  f"{sorted(kda_set & full_set)}, missing "
                                  f"{sorted(set(range(1, L + 1)) - kda_set - full_set)}) - fix config.json")

        quant = None
        qc = text.get("quantization_config")
        if qc is not None:
            QC = _dot(TC, "quantization_config")
            if not isinstance(qc, dict):
                raise bad(TC, "quantization_config", qc, "an object (compressed-tensors' mxfp4-pack-quantized)")
            fmt = qc.get("format")
            if fmt != "mxfp4-pack-quantized":
                raise ConfigError(f"{QC}.format {_short(fmt)} is not supported (only compressed-tensors "
                                  "'mxfp4-pack-quantized'); use the released config.json")
            groups = qc.get("config_groups") or {}
            if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
                raise bad(QC, "config_groups", groups, "an object of group objects (each with weights.group_size)")
            if not groups:
                raise ConfigError(f"{QC}.config_groups is missing; MXFP4 needs a group with weights.group_size "
                                  "32 - use the released config.json")
            for gname, g in groups.items():
                w = g.get("weights") or {}
                if not isinstance(w, dict):
                    raise bad(f"{QC}.config_groups.{gname}", "weights", w, "an object with group_size 32")
                if w.get("group_size") != 32 or isinstance(w.get("group_size"), bool):
                    raise bad(f"{QC}.config_groups.{gname}.weights", "group_size", w.get("group_size"),
                              "32 (MXFP4 scales one E8M0 byte per 32 elements; use the released config.json)")
            ignore = qc.get("ignore") or []
            if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
                raise bad(QC, "ignore", ignore, "a list of module names / 're:' regexes")
            quant = QuantConfig(format=fmt, group_size=32, ignore=tuple(ignore), raw=qc)
        elif doc.get("quantization_config") is not None and "text_config" in doc:
            raise ConfigError("quantization_config sits at the top level; K3 keeps it inside text_config - "
                              "move it there")

        # fields whose other values would change what the model computes, in ways k3rocm does not implement:
        # refuse them by name rather than run a different model silently (absent / null = the supported value)
        for key, ok, what in _FIXED_FIELDS:
            if key in text and text[key] is not None and text[key] not in ok:
                raise ConfigError(f"{TC}.{key} is {json.dumps(text[key])[:60]}; k3rocm implements only "
                                  f"{' or '.join(json.dumps(o) for o in ok)} ({what}), as in the released "
                                  "config.json - this checkpoint is a model variant k3rocm does not run")
        if quant is not None:
            if qc.get("quant_method", "compressed-tensors") != "compressed-tensors":
                raise ConfigError(f"{_dot(TC, 'quantization_config')}.quant_method is {_short(qc.get('quant_method'))}; "
                                  "k3rocm reads only compressed-tensors' mxfp4-pack-quantized experts - use the "
                                  "released config.json")
            for gname, g in (qc.get("config_groups") or {}).items():
                w = g.get("weights") or {}
                for key, want in (("num_bits", 4), ("type", "float")):
                    if key in w and (w[key] != want or isinstance(w[key], bool)):
                        raise ConfigError(f"{_dot(TC, 'quantization_config')}.config_groups.{gname}.weights.{key} "
                                          f"is {_short(w[key])}; MXFP4 (E2M1) needs {want!r} - use the released "
                                          "config.json")
        want_act = "situ" if family == "k3" else "silu"
        act = req("hidden_act") if family == "k3" or text.get("hidden_act") is not None else "silu"
        if act != want_act:
            raise bad(TC, "hidden_act", act, f"{want_act!r} ({'Kimi K3' if family == 'k3' else 'Kimi-Linear'} "
                                             "uses only that activation)")
        vocab = ival("vocab_size")
        # both families are mixtures of experts: a config without routed experts is not a model k3rocm runs (its
        # MoE layers would silently become tensors "missing" from the checkpoint)
        n_exp = ival("num_experts", hi=MAX_EXPERTS,
                     must=f"an integer in 1..{MAX_EXPERTS} (the routed experts of each MoE layer; K3 has 896)")
        n_shared = ival("num_shared_experts", default=0, lo=0)
        topk = ival("num_experts_per_token", hi=n_exp,
                    must=f"in 1..{n_exp} (at least one and at most {_dot(TC, 'num_experts')})")
        moe_i = ival("moe_intermediate_size", must="a positive integer (the width of each expert)")

        def token_id(key: str) -> int:
            v = text.get(key, doc.get(key))
            if v is None:
                return 0
            return ival(key, {key: v}, TC if key in text else "", lo=0,
                        hi=vocab - 1, must=f"a token id in 0..{vocab - 1} ({_dot(TC, 'vocab_size')} {vocab})")

        cfg = cls(
            family=family,
            vocab_size=vocab,
            hidden_size=ival("hidden_size"),
            num_hidden_layers=L,
            num_attention_heads=ival("num_attention_heads"),
            intermediate_size=ival("intermediate_size"),
            first_k_dense_replace=ival("first_k_dense_replace", default=0, lo=0, hi=L,
                                       must=f"an integer in 0..{L} (dense layers before the MoE layers)"),
            rms_norm_eps=fval("rms_norm_eps", 1e-5),
            q_lora_rank=(ival("q_lora_rank") if family == "k3"  # K3's MLA always has the query low-rank path
                         else opt_ival("q_lora_rank", what="(no query low-rank projection)")),
            kv_lora_rank=ival("kv_lora_rank"),
            qk_nope_head_dim=ival("qk_nope_head_dim"),
            qk_rope_head_dim=ival("qk_rope_head_dim"),
            v_head_dim=ival("v_head_dim"),
            full_attn_layers=full,
            kda_num_heads=ival("num_heads", lac, LAC),
            kda_head_dim=ival("head_dim", lac, LAC),
            short_conv_kernel_size=ival("short_conv_kernel_size", lac, LAC, 4),
            gate_lower_bound=(fval("gate_lower_bound", -5.0, lac, LAC, sign=-1) if family == "k3" else 0.0),
            num_experts=n_exp,
            num_experts_per_token=topk,
            num_shared_experts=n_shared,
            moe_intermediate_size=moe_i,
            routed_expert_hidden_size=opt_ival("routed_expert_hidden_size", what="(plain MoE)"),
            moe_renormalize=bval("moe_renormalize", True),
            routed_scaling_factor=fval("routed_scaling_factor", 1.0),
            hidden_act=act,
            activation_situ_beta=fval("activation_situ_beta", 4.0),
            activation_situ_linear_beta=fval("activation_situ_linear_beta", 25.0),
            attn_res_block_size=opt_ival("attn_res_block_size", what="(ordinary residual stream)"),
            bos_token_id=token_id("bos_token_id"),
            eos_token_id=token_id("eos_token_id"),
            pad_token_id=token_id("pad_token_id"),
            tie_word_embeddings=bval("tie_word_embeddings", False),
            quant=quant,
            raw=copy.deepcopy(doc),
            name=name,
        )
        cfg._check(TC)
        return cfg

    def _check(self, tc: str = "text_config") -> None:  # tc: "" for a bare text config
        """Cross-field rules (each field is already in range). Raises ConfigError naming the field."""
        if self.family == "k3" and self.quant is not None:
            for key, w in (("routed_expert_hidden_size" if self.routed_expert_hidden_size else "hidden_size",
                            self.expert_in_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if w % 32:
                    raise ConfigError(f"{_dot(tc, key)} is {w}, not a multiple of the MXFP4 group size 32 (the routed "
                                      "experts are MXFP4) - fix config.json")

    def to_dict(self) -> dict:
        """The full config document (wrapper included) as parsed; ``json.dump`` it to write config.json."""
        return copy.deepcopy(self.raw)


def _dot(where: str, key: str) -> str:
    """A field's dotted name: ``text_config.hidden_size``, or ``hidden_size`` at the top level."""
    return f"{where}.{key}" if where else key


def _json_type(v: Any) -> str:
    """JSON's name for the type of a parsed value (``list`` -> ``array``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string"}.get(type(v), "number")


def _short(v: Any, limit: int = 60) -> str:
    """``repr`` of a config value cut to ``limit`` characters, on one line (for error messages)."""
    r = repr(v).replace("\n", " ")
    return r if len(r) <= limit else r[:limit - 3] + "..."


# ---------------------------------------------------------------------- presets
def _official_doc() -> dict:
    return json.loads(resources.files("k3rocm").joinpath("presets/kimi-k3.json").read_text())


def _tiny_doc() -> dict:
    """The ``k3-tiny`` preset: same format as the official file, tiny widths (issue grid / golden data)."""
    off = _official_doc()
    t = copy.deepcopy(off["text_config"])
    t.update(
        vocab_size=512, hidden_size=128, num_hidden_layers=13, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=384, attn_res_block_size=3, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=16, num_experts_per_token=4, num_shared_experts=2,
        moe_intermediate_size=64, routed_expert_hidden_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    t.pop("initializer_range", None)
    t["linear_attn_config"].update(
        full_attn_layers=[4, 8, 12, 13], kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11], num_heads=4, head_dim=32)
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
        "text_config": t,
    }


def _tiny_tp8_doc() -> dict:
    """``k3-tiny-tp8``: k3-tiny with 8 KDA and 8 MLA heads and 32 routed experts, the smallest K3-format model
    that splits at TP8/EP8 (one head and 4 experts per rank) — the layout of K3 on 8 GPUs, testable on a CPU."""
    doc = _tiny_doc()
    t = doc["text_config"]
    t.update(num_attention_heads=8, num_key_value_heads=8, num_experts=32)
    t["linear_attn_config"].update(num_heads=8)
    return doc


def _prefix_doc(n: int, where: str = "") -> dict:
    """``k3-prefix-N``: the first N official layers (layer types kept) + official embedding/head/norms.

    ``where`` names what gave the name (e.g. ``"--preset"``) at the start of the error line."""
    doc = _official_doc()
    t = doc["text_config"]
    L = t["num_hidden_layers"]
    if not 1 <= n <= L:
        raise ConfigError(f"{where + ' ' if where else 'preset '}k3-prefix-{n}: N must be in 1..{L} (the official "
                          f"K3 has {L} layers); pass k3-prefix-1 to k3-prefix-{L}, or k3 for the whole model")
    lac = t["linear_attn_config"]
    lac["full_attn_layers"] = [x for x in lac["full_attn_layers"] if x <= n]
    lac["kda_layers"] = [x for x in range(1, n + 1) if x not in lac["full_attn_layers"]]
    t["num_hidden_layers"] = n
    return doc


_KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 9216, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
    },
}


def identify(doc: Any) -> str | None:
    """The preset a config document is exactly (``k3``, ``k3-tiny``, ``k3-prefix-N``), else None.

    Any JSON value is accepted (a malformed document is simply no preset); raises nothing.
    """
    if not isinstance(doc, dict):
        return None
    if doc == _official_doc():
        return "k3"
    if doc == _tiny_doc():
        return "k3-tiny"
    if doc == _tiny_tp8_doc():
        return "k3-tiny-tp8"
    text = doc.get("text_config")
    n = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if isinstance(n, int) and 1 <= n < 93:
        try:
            if doc == _prefix_doc(n):
                return f"k3-prefix-{n}"
        except ConfigError:
            pass
    return None


def preset(name: str, where: str = "") -> K3Config:
    """Build a preset config by name: ``k3``, ``k3-tiny``, ``k3-tiny-tp8``, ``k3-prefix-N`` (N = 1..93),
    ``kimi-linear-48b-a3b``.

    Args:
        where: what gave ``name`` (a CLI caller passes its flag, ``"--preset"``); it starts the error line, so
            the message names the flag only when the name came from one.
    Raises:
        ConfigError: unknown name (the message lists the known ones), or ``k3-prefix-N`` with N outside 1..93.
    """
    m = re.fullmatch(r"k3-prefix-(-?\d+)", name)
    if name == "k3":
        doc = _official_doc()
    elif name == "k3-tiny":
        doc = _tiny_doc()
    elif name == "k3-tiny-tp8":
        doc = _tiny_tp8_doc()
    elif m:
        doc = _prefix_doc(int(m.group(1)), where)
    elif name == "kimi-linear-48b-a3b":
        doc = copy.deepcopy(_KIMI_LINEAR_48B)
    else:
        raise ConfigError(f"{where + ': ' if where else ''}unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return K3Config.from_dict(doc, name=name)
