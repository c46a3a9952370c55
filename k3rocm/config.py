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
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from k3rocm.errors import ConfigError

PRESETS = ("k3", "k3-tiny", "k3-prefix-N", "kimi-linear-48b-a3b")


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
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found; pass a checkpoint directory that has one") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e}); fix or re-download the file") from None
        try:
            return cls.from_dict(doc, name=identify(doc) or path.resolve().parent.name)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, doc: dict[str, Any], name: str = "custom") -> "K3Config":
        """Parse a config document: the K3 wrapper (``text_config`` inside) or a bare text config."""
        if not isinstance(doc, dict):
            raise ConfigError("config is not a JSON object")
        text = doc.get("text_config", doc)
        if not isinstance(text, dict):
            raise ConfigError("text_config is not an object")
        archs = doc.get("architectures") or []
        if "KimiK3ForConditionalGeneration" in archs or "attn_res_block_size" in text:
            family = "k3"
        elif text.get("model_type") == "kimi_linear":
            family = "kimi_linear"
        else:
            raise ConfigError(
                f"model_type {text.get('model_type')!r} / architectures {archs} is neither Kimi K3 nor kimi_linear")

        def req(key: str, d: dict = text, where: str = "text_config") -> Any:
            if key not in d or d[key] is None:
                raise ConfigError(f"{where}.{key} is missing; the K3 config.json defines it")
            return d[key]

        def num(v: Any, key: str, kind: type, where: str = "text_config") -> Any:
            # JSON numbers only: no strings, no booleans; an integer field also takes an integral float
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if ok and kind is int and isinstance(v, float):
                ok = v.is_integer()
            if not ok:
                what = "an integer" if kind is int else "a number"
                raise ConfigError(f"{where}.{key} is {v!r}; it must be {what} (see the official config.json)")
            return kind(v)

        def ival(key: str, d: dict = text, where: str = "text_config", default: Any = ...) -> int:
            if default is not ... and d.get(key) is None:
                return default
            return num(req(key, d, where), key, int, where)

        def fval(key: str, default: float, d: dict = text, where: str = "text_config") -> float:
            return default if d.get(key) is None else num(d[key], key, float, where)

        def ilist(v: Any, key: str) -> tuple[int, ...]:
            if not isinstance(v, list):
                raise ConfigError(f"text_config.linear_attn_config.{key} is {v!r}; it must be a list of "
                                  "1-based layer indices")
            return tuple(num(x, key, int, "text_config.linear_attn_config") for x in v)

        lac = text.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise ConfigError("text_config.linear_attn_config is missing; cannot tell KDA from MLA layers")
        if lac.get("full_attn_layers") is None or (not lac["full_attn_layers"] and lac.get("kda_layers") is None):
            raise ConfigError("text_config.linear_attn_config.full_attn_layers is missing; refusing to "
                              "default it (that would silently run every layer as KDA)")
        L = ival("num_hidden_layers")
        if L < 1:
            raise ConfigError(f"text_config.num_hidden_layers is {L}; it must be at least 1")
        full = ilist(lac["full_attn_layers"], "full_attn_layers")
        if any(not 1 <= x <= L for x in full) or len(set(full)) != len(full):
            raise ConfigError(f"linear_attn_config.full_attn_layers {list(full)} must be distinct 1-based "
                              f"indices in 1..{L}")
        kda = lac.get("kda_layers")
        if kda is not None:
            kda_set, full_set = set(ilist(kda, "kda_layers")), set(full)
            if kda_set & full_set or (kda_set | full_set) != set(range(1, L + 1)):
                raise ConfigError("linear_attn_config.kda_layers and full_attn_layers must partition "
                                  f"1..{L} (overlap {sorted(kda_set & full_set)}, "
                                  f"missing {sorted(set(range(1, L + 1)) - kda_set - full_set)})")

        quant = None
        qc = text.get("quantization_config")
        if qc is not None:
            if not isinstance(qc, dict):
                raise ConfigError(f"text_config.quantization_config is {qc!r}; it must be an object "
                                  "(compressed-tensors' mxfp4-pack-quantized)")
            fmt = qc.get("format")
            if fmt != "mxfp4-pack-quantized":
                raise ConfigError(f"text_config.quantization_config.format {fmt!r} is not supported "
                                  "(only compressed-tensors 'mxfp4-pack-quantized')")
            groups = qc.get("config_groups") or {}
            gsz = {((g.get("weights") or {}).get("group_size")) for g in groups.values()}
            if gsz != {32}:
                raise ConfigError(f"quantization_config group_size {sorted(map(str, gsz))} is not 32 (MXFP4)")
            quant = QuantConfig(format=fmt, group_size=32, ignore=tuple(qc.get("ignore") or ()), raw=qc)
        elif doc.get("quantization_config") is not None and "text_config" in doc:
            raise ConfigError("quantization_config sits at the top level; K3 keeps it inside text_config")

        latent = text.get("routed_expert_hidden_size")
        cfg = cls(
            family=family,
            vocab_size=ival("vocab_size"),
            hidden_size=ival("hidden_size"),
            num_hidden_layers=L,
            num_attention_heads=ival("num_attention_heads"),
            intermediate_size=ival("intermediate_size"),
            first_k_dense_replace=ival("first_k_dense_replace", default=0),
            rms_norm_eps=fval("rms_norm_eps", 1e-5),
            q_lora_rank=(ival("q_lora_rank") if text.get("q_lora_rank") else None),
            kv_lora_rank=ival("kv_lora_rank"),
            qk_nope_head_dim=ival("qk_nope_head_dim"),
            qk_rope_head_dim=ival("qk_rope_head_dim"),
            v_head_dim=ival("v_head_dim"),
            full_attn_layers=full,
            kda_num_heads=ival("num_heads", lac, "text_config.linear_attn_config"),
            kda_head_dim=ival("head_dim", lac, "text_config.linear_attn_config"),
            short_conv_kernel_size=ival("short_conv_kernel_size", lac, "text_config.linear_attn_config", 4),
            gate_lower_bound=(fval("gate_lower_bound", -5.0, lac, "text_config.linear_attn_config") if family == "k3" else 0.0),
            num_experts=ival("num_experts", default=0),
            num_experts_per_token=ival("num_experts_per_token", default=0),
            num_shared_experts=ival("num_shared_experts", default=0),
            moe_intermediate_size=ival("moe_intermediate_size", default=0),
            routed_expert_hidden_size=(num(latent, "routed_expert_hidden_size", int) if latent else None),
            moe_renormalize=bool(text.get("moe_renormalize", True)),
            routed_scaling_factor=fval("routed_scaling_factor", 1.0),
            hidden_act=str(text.get("hidden_act", "silu")),
            activation_situ_beta=fval("activation_situ_beta", 4.0),
            activation_situ_linear_beta=fval("activation_situ_linear_beta", 25.0),
            attn_res_block_size=(ival("attn_res_block_size") if text.get("attn_res_block_size") else None),
            bos_token_id=num(text.get("bos_token_id", doc.get("bos_token_id")) or 0, "bos_token_id", int),
            eos_token_id=num(text.get("eos_token_id", doc.get("eos_token_id")) or 0, "eos_token_id", int),
            pad_token_id=num(text.get("pad_token_id", doc.get("pad_token_id")) or 0, "pad_token_id", int),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            quant=quant,
            raw=copy.deepcopy(doc),
            name=name,
        )
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ConfigError(f"num_experts_per_token {self.num_experts_per_token} must be in 1..{self.num_experts}")
        if self.family == "k3" and self.quant is not None:
            for w in (self.expert_in_size, self.moe_intermediate_size):
                if w % 32:
                    raise ConfigError(f"expert width {w} is not a multiple of the MXFP4 group size 32")
        if self.family == "k3" and self.hidden_act != "situ":
            raise ConfigError(f"hidden_act {self.hidden_act!r}: Kimi K3 uses 'situ'")
        if self.kda_head_dim <= 0 or self.kda_num_heads <= 0:
            raise ConfigError("linear_attn_config.num_heads and head_dim must be positive")

    def to_dict(self) -> dict:
        """The full config document (wrapper included) as parsed; ``json.dump`` it to write config.json."""
        return copy.deepcopy(self.raw)


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


def _prefix_doc(n: int) -> dict:
    """``k3-prefix-N``: the first N official layers (layer types kept) + official embedding/head/norms."""
    doc = _official_doc()
    t = doc["text_config"]
    L = t["num_hidden_layers"]
    if not 1 <= n <= L:
        raise ConfigError(f"k3-prefix-{n}: N must be in 1..{L}")
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


def identify(doc: dict) -> str | None:
    """The preset a config document is exactly (``k3``, ``k3-tiny``, ``k3-prefix-N``), else None."""
    if not isinstance(doc, dict):
        return None
    if doc == _official_doc():
        return "k3"
    if doc == _tiny_doc():
        return "k3-tiny"
    n = (doc.get("text_config") or {}).get("num_hidden_layers")
    if isinstance(n, int) and 1 <= n < 93:
        try:
            if doc == _prefix_doc(n):
                return f"k3-prefix-{n}"
        except ConfigError:
            pass
    return None


def preset(name: str) -> K3Config:
    """Build a preset config by name: ``k3``, ``k3-tiny``, ``k3-prefix-N`` (N = 1..93), ``kimi-linear-48b-a3b``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    m = re.fullmatch(r"k3-prefix-(\d+)", name)
    if name == "k3":
        doc = _official_doc()
    elif name == "k3-tiny":
        doc = _tiny_doc()
    elif m:
        doc = _prefix_doc(int(m.group(1)))
    elif name == "kimi-linear-48b-a3b":
        doc = copy.deepcopy(_KIMI_LINEAR_48B)
    else:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return K3Config.from_dict(doc, name=name)
