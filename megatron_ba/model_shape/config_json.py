"""A Hugging Face config.json read into ModelShape's fields (ModelShape.from_hf_config).

    fields = shape_fields(json.loads(Path("config.json").read_text()), name="config.json")

Qwen2 / Qwen2.5 / Qwen3 (and their mixtures of experts) are read from the top level; Qwen3.5
(model types qwen3_5, qwen3_5_moe and their _text variants) from its text model, nested under
`text_config` in the released ConditionalGeneration layout. Pure Python, like the shape itself;
this module knows no ModelShape, so the shape can use it without an import cycle.
"""

from __future__ import annotations

from typing import Any

from megatron_ba.rope_scaling import RopeScaling, rope_scaling_from_hf


def shape_fields(cfg: dict, name: str = "model") -> dict[str, Any]:
    """ModelShape's fields from a Hugging Face Qwen2 / Qwen3 / Qwen3.5 config.json (a dict;
    Qwen3.5's ConditionalGeneration layout keeps its text model under `text_config`)."""
    if _is_qwen3_5(cfg):
        return _qwen3_5_fields(cfg, name)
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in (*need, "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"--model {name}: config.json lacks {', '.join(missing)}")
    heads = int(cfg["num_attention_heads"])
    qwen3 = str(cfg.get("model_type", "")).startswith("qwen3")
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if experts and not cfg.get("moe_intermediate_size"):
        raise ValueError(f"--model {name}: config.json has experts but no moe_intermediate_size")
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=float(
            cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 1e6
        ),
        rope_scaling=_rope_scaling_or_none(cfg, name),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("attention_bias", not qwen3)),
        family=_family(cfg, qwen3),
        qk_layernorm=qwen3,
        kv_channels=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        moe_router_topk=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        shared_expert_ffn_hidden_size=_shared_ffn(cfg) if experts else 0,
        name=name,
    )


QWEN3_5_MODEL_TYPES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}


def _is_qwen3_5(cfg: dict) -> bool:
    return str(cfg.get("model_type")) in QWEN3_5_MODEL_TYPES


def qwen3_5_text_config(cfg: dict) -> dict:
    """The text model's fields of a Qwen3.5 config.json: its `text_config` when nested (the
    ConditionalGeneration layout), else the config itself; a top-level tie_word_embeddings
    applies to the text model (the multimodal configs keep it there)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    merged = dict(text)
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def qwen3_5_layer_pattern(text: dict, num_layers: int, where: str) -> tuple[int, ...]:
    """1 (linear_attention) / 0 (full_attention) per layer, from `layer_types` or, as
    transformers derives it, from `full_attention_interval` (every n-th layer full)."""
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        return tuple(int(bool((i + 1) % interval)) for i in range(num_layers))
    known = {"linear_attention": 1, "full_attention": 0}
    unknown = sorted({str(t) for t in layer_types} - set(known))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(
            f"{where}: layer_types must hold {num_layers} entries of {sorted(known)}; got "
            f"{len(layer_types)} entries{f', unknown {unknown}' if unknown else ''}"
        )
    return tuple(known[t] for t in layer_types)


def _qwen3_5_fields(cfg: dict, name: str) -> dict[str, Any]:
    where = f"--model {name}"
    family = QWEN3_5_MODEL_TYPES[str(cfg["model_type"])]
    text = qwen3_5_text_config(cfg)
    need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim")
    missing = [k for k in need if k not in text]
    if missing:
        raise ValueError(f"{where}: the text config lacks {', '.join(missing)}")
    rope = text.get("rope_parameters") or {}
    layers = int(text["num_hidden_layers"])
    experts = int(text.get("num_experts") or 0) if family == "qwen3_5_moe" else 0
    moe_ffn = int(text.get("moe_intermediate_size") or 0) if experts else 0
    return dict(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_layers=layers,
        num_attention_heads=int(text["num_attention_heads"]),
        num_query_groups=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
        # the MoE text config has no dense MLP (every layer routes): its width is unused
        ffn_hidden_size=int(text.get("intermediate_size") or moe_ffn),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        rope_theta=float(rope.get("rope_theta") or text.get("rope_theta") or 1e7),
        norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(text.get("attention_bias", False)),
        family=family,
        qk_layernorm=True,
        kv_channels=int(text["head_dim"]),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        name=name,
        num_experts=experts,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_topk=int(text.get("num_experts_per_tok") or 0) if experts else 0,
        shared_expert_ffn_hidden_size=_shared_ffn(text) if experts else 0,
        moe_norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        # transformers' default when the config leaves it out (the published ones do)
        moe_aux_loss_coeff=float(text.get("router_aux_loss_coef", 0.001)) if experts else 0.0,
        linear_attention_pattern=qwen3_5_layer_pattern(text, layers, where),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        attention_output_gate=bool(text.get("attn_output_gate", True)),
        rotary_percent=float(
            rope.get("partial_rotary_factor") or text.get("partial_rotary_factor") or 0.25
        ),
        norm_zero_centered=True,
        mtp_num_layers=int(text.get("mtp_num_hidden_layers") or 0),
    )


def _rope_scaling_or_none(cfg: dict, name: str) -> RopeScaling | None:
    """The config's YaRN for the planner's context check; None for plain RoPE and for rope types
    the megatron model does not build (llama3, DeepSeek's YaRN with mscale, ...): their shape and
    memory are still estimated, without a context check (the model build refuses them by key)."""
    try:
        return rope_scaling_from_hf(cfg, f"--model {name}")
    except ValueError:
        return None


def _shared_ffn(cfg: dict) -> int:
    """The shared expert's width: Qwen2-MoE's shared_expert_intermediate_size, or DeepSeek's
    n_shared_experts x moe_intermediate_size."""
    if cfg.get("shared_expert_intermediate_size"):
        return int(cfg["shared_expert_intermediate_size"])
    return int(cfg.get("n_shared_experts") or 0) * int(cfg.get("moe_intermediate_size") or 0)


def _family(cfg: dict, qwen3: bool) -> str:
    if cfg.get("model_type") == "qwen3_moe":
        return "qwen3_moe"
    return "qwen3" if qwen3 else "qwen2"
