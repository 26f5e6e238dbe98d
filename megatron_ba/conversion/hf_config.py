"""Reading and writing the fields of a Hugging Face Qwen `config.json` that every family shares.

transformers 5 keeps RoPE settings in `rope_parameters` ({"rope_type", "rope_theta"}); 4.x and
most hub configs have a top-level `rope_theta`. Both are read (they must agree when both exist);
a config written from scratch gets both, so that either transformers generation reads the same
theta (5.x prefers `rope_parameters`, 4.x ignores it and would otherwise fall back to 10000).
RoPE scaling (YaRN) is read by megatron_ba.rope_scaling from either `rope_parameters` or 4.x's
`rope_scaling` and written back in the form the source used (a source whose settings the spec
keeps is left as it was, so HF -> megatron -> HF gives its config.json back unchanged). Features the
megatron model here does not build (other rope types, sliding windows, activations other than
SiLU) are refused with the field named, never silently dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ba.rope_scaling import RopeScaling, rope_scaling_from_hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _field(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return cfg[key]


def rope_theta(cfg: dict, where: str = "config.json") -> float:
    """RoPE's base: rope_parameters.rope_theta or the top-level rope_theta (they must agree)."""
    params = cfg.get("rope_parameters") or {}
    nested, top = params.get("rope_theta"), cfg.get("rope_theta")
    if nested is not None and top is not None and float(nested) != float(top):
        raise ValueError(
            f"{where}: rope_theta {top} disagrees with rope_parameters.rope_theta {nested}"
        )
    theta = nested if nested is not None else top
    if theta is None:
        raise ValueError(f"{where}: neither rope_parameters.rope_theta nor rope_theta is set")
    return float(theta)


def set_rope(cfg: dict, theta: float, scaling: RopeScaling | None = None) -> None:
    """Write theta and the scaling where `cfg` keeps them (both forms for a config written from
    scratch); a config that already says exactly this is left as it is."""
    try:
        if rope_theta(cfg) == theta and rope_scaling_from_hf(cfg) == scaling:
            return
    except ValueError:
        pass  # settings the spec replaces
    has_nested, has_top = "rope_parameters" in cfg, "rope_theta" in cfg
    fields = scaling.hf_fields() if scaling is not None else {"rope_type": "default"}
    if has_nested or not has_top:
        cfg["rope_parameters"] = {"rope_theta": theta, **fields}
    if has_top or not has_nested:
        cfg["rope_theta"] = theta
    if scaling is not None and (has_top or not has_nested or "rope_scaling" in cfg):
        cfg["rope_scaling"] = scaling.hf_fields()
    elif cfg.get("rope_scaling"):
        cfg["rope_scaling"] = None


def _dtype_key(cfg: dict) -> str:
    return "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"


def dtype(cfg: dict) -> torch.dtype:
    """The checkpoint's dtype: `dtype` (transformers 5) or `torch_dtype` (4.x), else a nested
    `text_config`'s (Qwen3.5's multimodal layout may keep it there only), else float32."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    name = cfg.get(_dtype_key(cfg)) or text.get(_dtype_key(text)) or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json: dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def set_dtype(cfg: dict, value: torch.dtype) -> None:
    """Say `value` in `cfg` (its spelling, dtype or torch_dtype) and in a nested text_config that
    names a dtype of its own (only there when the top level names none)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    nested = "dtype" in text or "torch_dtype" in text
    if nested:
        text[_dtype_key(text)] = DTYPE_NAMES[value]
    if not nested or "dtype" in cfg or "torch_dtype" in cfg:
        cfg[_dtype_key(cfg)] = DTYPE_NAMES[value]


def common_spec_fields(cfg: dict, family: str) -> dict[str, Any]:
    """ModelSpec keyword arguments every Qwen family reads the same way."""
    where = f"config.json ({family})"
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported (full attention only)")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{where}: layer_types {sorted(set(layer_types))} (full_attention only)")
    heads = int(_field(cfg, "num_attention_heads", where))
    head_dim = cfg.get("head_dim")
    return dict(
        family=family,
        vocab_size=int(_field(cfg, "vocab_size", where)),
        hidden_size=int(_field(cfg, "hidden_size", where)),
        num_layers=int(_field(cfg, "num_hidden_layers", where)),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(_field(cfg, "intermediate_size", where)),
        kv_channels=None if head_dim is None else int(head_dim),
        max_position_embeddings=int(_field(cfg, "max_position_embeddings", where)),
        rope_theta=rope_theta(cfg, where),
        rope_scaling=rope_scaling_from_hf(cfg, where),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        init_std=float(cfg.get("initializer_range", 0.02)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        params_dtype=dtype(cfg),
    )


def common_config_fields(spec, table) -> dict[str, Any]:
    """The config.json fields a ModelSpec determines (family-specific ones are added after)."""
    cfg: dict[str, Any] = {
        "architectures": [table.architecture],
        "model_type": table.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": spec.init_std,
        "dtype": DTYPE_NAMES[spec.params_dtype],
    }
    if spec.kv_channels is not None:
        cfg["head_dim"] = spec.kv_channels
    return cfg


def merged_config(
    spec_fields: dict, theta: float, base: dict | None, scaling: RopeScaling | None = None
) -> dict:
    """`base` (the source checkpoint's config.json, kept for the fields a spec does not hold:
    token ids, transformers_version, ...) updated with the spec's fields; from scratch without."""
    cfg = dict(base or {"attention_dropout": 0.0, "use_sliding_window": False})
    if base is not None:
        if "torch_dtype" in base and "dtype" not in base:  # transformers 4.x spelling
            spec_fields = dict(spec_fields)
            spec_fields["torch_dtype"] = spec_fields.pop("dtype")
        if "head_dim" not in base and spec_fields.get("head_dim") is not None:
            hidden, heads = spec_fields["hidden_size"], spec_fields["num_attention_heads"]
            if spec_fields["head_dim"] == hidden // heads:  # implied: keep the source's form
                spec_fields = {k: v for k, v in spec_fields.items() if k != "head_dim"}
    cfg.update(spec_fields)
    set_rope(cfg, theta, scaling)
    return cfg
