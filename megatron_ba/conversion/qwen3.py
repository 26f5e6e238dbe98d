"""Qwen3 (HF `Qwen3ForCausalLM`, dense) <-> megatron-core: the name table and config fields.

Against Qwen2: no q/k/v bias (`attention_bias: false`), an RMSNorm over each head of q and k
(HF `self_attn.q_norm` / `k_norm`, weight [head_dim]; megatron-core `qk_layernorm=True`:
`self_attention.q_layernorm` / `k_layernorm`, the same spelling under the local and the Transformer
Engine spec), and an explicit `head_dim` that may differ from hidden / heads (Qwen3-0.6B: hidden
1024, 16 heads, head_dim 128), which is megatron-core's `kv_channels`.
"""

from __future__ import annotations

from megatron_ba.conversion import hf_config
from megatron_ba.conversion.family_table import Copy, FamilyTable
from megatron_ba.conversion.qwen2 import ATTENTION_AND_MLP, TOP
from megatron_ba.megatron.model import ModelSpec

LAYER = {k: v for k, v in ATTENTION_AND_MLP.items() if k != "self_attention.linear_qkv.bias"}
LAYER["self_attention.q_layernorm.weight"] = Copy("self_attn.q_norm.weight")
LAYER["self_attention.k_layernorm.weight"] = Copy("self_attn.k_norm.weight")

TABLE = FamilyTable(
    family="qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    top=TOP,
    layer=LAYER,
    optional={},
)


def spec_from_config(cfg: dict, **changes):
    if cfg.get("attention_bias"):
        raise ValueError(
            "config.json (qwen3): attention_bias=true (a bias on q/k/v and o_proj) is not "
            "supported: the megatron model here has no o_proj bias"
        )
    fields = hf_config.common_spec_fields(cfg, "qwen3")
    if fields["kv_channels"] is None:  # Qwen3Config's default head_dim
        fields["kv_channels"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(qkv_bias=False, qk_layernorm=True)
    fields.update(changes)
    return ModelSpec(**fields)


def config_from_spec(spec, base: dict | None = None) -> dict:
    if not spec.qk_layernorm or spec.qkv_bias:
        raise ValueError(
            "spec: a Qwen3 model has q/k layernorms and no QKV bias "
            f"(got qkv_bias={spec.qkv_bias}, qk_layernorm={spec.qk_layernorm})"
        )
    fields = hf_config.common_config_fields(spec, TABLE)
    fields["head_dim"] = spec.head_dim
    fields["attention_bias"] = False
    return hf_config.merged_config(fields, float(spec.rope_theta), base, spec.rope_scaling)
