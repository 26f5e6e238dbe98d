"""Qwen3.5 (dense, HF `qwen3_5`) <-> megatron-core: the name table and config fields.

Layers are Gated DeltaNet (`linear_attention`) or gated full attention (`full_attention`), each
with a SwiGLU MLP (transformers 5.19 models/qwen3_5, built on Qwen3-Next's modules):

- DeltaNet layer: HF `linear_attn.in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` are
  megatron-core GatedDeltaNet's one `self_attention.in_proj` (rows stacked in that order:
  family_table.DeltaNetInProj), `conv1d.weight` [2 Kd + Vd, 1, kernel], `dt_bias`, `A_log`,
  `norm.weight` (the gated output RMSNorm over one value head: megatron `out_norm`, weight used
  as stored, not zero-centred) and `out_proj`;
- full-attention layer: `q_proj` yields a query and an output gate per head
  (family_table.GatedQKV), q/k RMSNorms per head, `o_proj`;
- every other RMSNorm (input, post-attention, q/k, final) is zero-centred: HF stores w and
  applies (1 + w); its weight is copied as stored (the megatron model applies (1 + w) too).

Two layouts hold the same language model: `Qwen3_5ForCausalLM` (config model_type
`qwen3_5_text`; tensors `model.layers.*`, `model.embed_tokens`, `model.norm`, `lm_head`) and the
published `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`, the text model's fields under
`text_config`; tensors `model.language_model.*`, `lm_head`, the vision tower `model.visual.*`
and the multi-token-prediction head `mtp.*`, which transformers does not load). Conversion takes
the language model; an export writes it back into the source's layout and config (only the text
fields a spec holds change) and carries every other tensor of the source over unchanged
(megatron_io). A model with megatron-core MTP or vision parameters is refused by name.
"""

from __future__ import annotations

import copy

from megatron_ba.conversion import hf_config
from megatron_ba.conversion.family_table import Copy, DeltaNetInProj, FamilyTable, GatedQKV
from megatron_ba.conversion.qwen2 import ATTENTION_AND_MLP, TOP
from megatron_ba.megatron.model import ModelSpec
from megatron_ba.model_shape import ModelShape, qwen3_5_text_config

LAYER = {k: v for k, v in ATTENTION_AND_MLP.items() if k != "self_attention.linear_qkv.bias"}
LAYER["self_attention.linear_qkv.weight"] = GatedQKV(
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"
)
LAYER["self_attention.q_layernorm.weight"] = Copy("self_attn.q_norm.weight")
LAYER["self_attention.k_layernorm.weight"] = Copy("self_attn.k_norm.weight")
LINEAR_LAYER = {
    "self_attention.in_proj.weight": DeltaNetInProj(
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight",
    ),
    "self_attention.conv1d.weight": Copy("linear_attn.conv1d.weight"),
    "self_attention.dt_bias": Copy("linear_attn.dt_bias"),
    "self_attention.A_log": Copy("linear_attn.A_log"),
    "self_attention.out_norm.weight": Copy("linear_attn.norm.weight"),
    "self_attention.out_proj.weight": Copy("linear_attn.out_proj.weight"),
}
# Tensors of a Qwen3.5 checkpoint that are not the language model: carried, never converted.
CARRIED = ("model.visual.", "mtp.")
# megatron-core's names for those parts (GPTModel's `mtp` block, a multimodal model's vision
# encoder and projection), refused by name.
REFUSED = {
    "mtp.": "the multi-token-prediction head (HF mtp.*)",
    "vision_model.": "the vision tower (HF model.visual.*)",
    "vision_projection.": "the vision tower's projection (HF model.visual.merger.*)",
}
CONDITIONAL_PREFIX = "model.language_model."

TABLE = FamilyTable(
    family="qwen3_5",
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    top=TOP,
    layer=LAYER,
    optional={},
    linear_layer=LINEAR_LAYER,
    carried=CARRIED,
    refused=REFUSED,
)
LAYER_TYPES = {1: "linear_attention", 0: "full_attention"}


def hf_prefix(cfg: dict) -> str:
    """The language model's HF prefix in the layout `cfg` describes."""
    nested = isinstance(cfg.get("text_config"), dict)
    if nested or cfg.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
        return CONDITIONAL_PREFIX
    return "model."


def check_config(cfg: dict) -> dict:
    """The text config of `cfg`, after refusing what the megatron model here does not build
    (each by its field)."""
    text = qwen3_5_text_config(cfg)
    where = f"config.json ({cfg.get('model_type')})"
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {text['hidden_act']!r} is not supported (silu)")
    if text.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported (no o_proj bias here)")
    if not text.get("attn_output_gate", True):
        raise ValueError(
            f"{where}: attn_output_gate=false: transformers' Qwen3.5 attention always gates "
            "(q_proj holds a query and a gate per head)"
        )
    rope_type = (text.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{where}: rope_parameters.rope_type {rope_type!r} (default only)")
    return text


def spec_from_config(cfg: dict, **changes):
    """The ModelSpec of a Qwen3.5 config.json, either layout (ModelShape.from_hf_config reads
    the shape; the dtype and initialisation as every family reads them)."""
    text = check_config(cfg)
    shape = ModelShape.from_hf_config(cfg)
    fields = dict(
        init_std=float(text.get("initializer_range", 0.02)),
        params_dtype=hf_config.dtype(cfg),
    )
    return ModelSpec.of(shape, **{**fields, **changes})


def check_spec(spec, family: str) -> None:
    want = dict(
        family=family,
        qk_layernorm=True,
        qkv_bias=False,
        attention_output_gate=True,
        norm_zero_centered=True,
    )
    got = {k: getattr(spec, k) for k in want}
    if got != want or spec.linear_attention_pattern is None:
        raise ValueError(
            f"spec: a {family} model has {want} and a linear_attention_pattern; got {got}, "
            f"linear_attention_pattern={spec.linear_attention_pattern}"
        )


def text_fields(spec) -> dict:
    """The text config's fields a spec holds (common to the dense and MoE families)."""
    fields = hf_config.common_config_fields(spec, TABLE)
    for key in ("architectures", "model_type", "dtype", "intermediate_size"):
        del fields[key]
    fields.update(
        head_dim=spec.head_dim,
        attention_bias=False,
        layer_types=[LAYER_TYPES[t] for t in spec.linear_attention_pattern],
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
    )
    return fields


def config_from_spec(spec, base: dict | None = None) -> dict:
    check_spec(spec, "qwen3_5")
    return merged_config(spec, base, TABLE, dense_fields, spec_from_config)


def dense_fields(spec) -> dict:
    return {**text_fields(spec), "intermediate_size": spec.ffn_hidden_size}


def merged_config(spec, base: dict | None, table: FamilyTable, fields_of, read_spec) -> dict:
    """`base` (either layout) with the text fields `fields_of(spec)` set where it keeps them (its
    text_config when nested), a field it lacks only where the spec changes what its absence
    means (`read_spec(base)`: the family's reader); from scratch (the text layout) without."""
    fields = fields_of(spec)
    if base is None:
        cfg = {"architectures": [table.architecture], "model_type": table.model_type}
        cfg.update(attention_dropout=0.0, **fields, partial_rotary_factor=spec.rotary_percent)
        text = cfg
    else:
        cfg = copy.deepcopy(base)
        text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        implied = fields_of(read_spec(base))
        text.update({k: v for k, v in fields.items() if k in text or implied.get(k) != v})
        if text is not cfg and "tie_word_embeddings" in cfg:
            cfg["tie_word_embeddings"] = spec.tie_word_embeddings
    _set_rope(text, spec)
    hf_config.set_dtype(cfg, spec.params_dtype)
    return cfg


def _set_rope(text: dict, spec) -> None:
    """rope_parameters (and the top-level copies transformers 5 writes) with the spec's theta and
    rotary fraction; values the spec agrees with are kept as the source wrote them."""
    params = dict(text.get("rope_parameters") or {})
    params.setdefault("rope_type", "default")
    for key, value in (("rope_theta", spec.rope_theta), ("partial_rotary_factor", None)):
        value = spec.rotary_percent if value is None else value
        if params.get(key) is None or float(params[key]) != float(value):
            params[key] = value
        if key in text and float(text[key]) != float(value):
            text[key] = value
    text["rope_parameters"] = params
