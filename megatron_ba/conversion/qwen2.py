"""Qwen2 / Qwen2.5 (HF `Qwen2ForCausalLM`) <-> megatron-core: the name table and config fields.

Qwen2 has a bias on q/k/v (none on o_proj or the MLP), no q/k norms, SwiGLU, RMSNorm, RoPE, and
tied (0.5B, 1.5B, 3B) or untied (7B and up) embeddings.
"""

from __future__ import annotations

from megatron_ba.conversion import hf_config
from megatron_ba.conversion.family_table import Copy, FamilyTable, FusedQKV, GatedFC1
from megatron_ba.megatron.model import ModelSpec

ATTENTION_AND_MLP = {
    "input_layernorm.weight": Copy("input_layernorm.weight"),
    "self_attention.linear_qkv.weight": FusedQKV(
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"
    ),
    "self_attention.linear_qkv.bias": FusedQKV(
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"
    ),
    "self_attention.linear_proj.weight": Copy("self_attn.o_proj.weight"),
    "pre_mlp_layernorm.weight": Copy("post_attention_layernorm.weight"),
    "mlp.linear_fc1.weight": GatedFC1("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": Copy("mlp.down_proj.weight"),
}

TOP = {
    "embedding.word_embeddings.weight": Copy("model.embed_tokens.weight"),
    "decoder.final_layernorm.weight": Copy("model.norm.weight"),
    "output_layer.weight": Copy("lm_head.weight"),
}

TABLE = FamilyTable(
    family="qwen2",
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    top=TOP,
    layer=ATTENTION_AND_MLP,
    optional={"self_attention.linear_qkv.bias": "qkv_bias"},
)


def spec_from_config(cfg: dict, **changes):
    fields = hf_config.common_spec_fields(cfg, "qwen2")
    fields.update(qkv_bias=True, qk_layernorm=False)  # Qwen2 always has the q/k/v bias
    fields.update(changes)
    return ModelSpec(**fields)


def config_from_spec(spec, base: dict | None = None) -> dict:
    if spec.qk_layernorm or not spec.qkv_bias:
        raise ValueError(
            "spec: a Qwen2 model has a QKV bias and no q/k layernorm "
            f"(got qkv_bias={spec.qkv_bias}, qk_layernorm={spec.qk_layernorm})"
        )
    fields = hf_config.common_config_fields(spec, TABLE)
    return hf_config.merged_config(fields, float(spec.rope_theta), base, spec.rope_scaling)
