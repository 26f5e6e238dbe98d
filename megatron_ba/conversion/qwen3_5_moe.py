"""Qwen3.5-MoE (HF `qwen3_5_moe`) <-> megatron-core: the name table and config fields.

Token mixers, norms and both layouts are Qwen3.5's (qwen3_5.py). Every layer's MLP is sparse
(transformers' Qwen3_5MoeDecoderLayer; its text config has no mlp_only_layers or
decoder_sparse_step): a router (HF `mlp.gate`, megatron-core `mlp.router.weight`), `num_experts`
SwiGLU experts (HF per expert `mlp.experts.{e}.gate_proj / up_proj / down_proj`, or fused
`mlp.experts.gate_up_proj` / `down_proj` as the published checkpoints ship them: both are read,
and an export writes the source's form, conversion.hf_experts; megatron-core SequentialMLP
`mlp.experts.local_experts.{e}.linear_fc1` = [gate; up], `linear_fc2` = down), and one shared
expert of `shared_expert_intermediate_size` scaled by sigmoid of its own gate (HF
`mlp.shared_expert.*` and `mlp.shared_expert_gate.weight` [1, hidden]; megatron-core
`mlp.shared_experts.linear_fc1` = [gate; up], `linear_fc2`, `gate_weight`). Routing: softmax,
top `num_experts_per_tok`, the top-k weights always renormalised (transformers'
Qwen3_5MoeTopKRouter; the config has no norm_topk_prob).
"""

from __future__ import annotations

from megatron_ba.conversion import qwen3_5
from megatron_ba.conversion.family_table import Copy, FamilyTable, GatedFC1
from megatron_ba.conversion.qwen2 import TOP
from megatron_ba.conversion.qwen3_5 import CARRIED, LAYER, LINEAR_LAYER, REFUSED
from megatron_ba.conversion.qwen3_moe import EXPERT

MOE_LAYER = {
    "mlp.router.weight": Copy("mlp.gate.weight"),
    "mlp.shared_experts.linear_fc1.weight": GatedFC1(
        "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"
    ),
    "mlp.shared_experts.linear_fc2.weight": Copy("mlp.shared_expert.down_proj.weight"),
    "mlp.shared_experts.gate_weight": Copy("mlp.shared_expert_gate.weight"),
}

TABLE = FamilyTable(
    family="qwen3_5_moe",
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    top=TOP,
    layer=LAYER,
    optional={},
    moe_layer=MOE_LAYER,
    expert=EXPERT,
    linear_layer=LINEAR_LAYER,
    carried=CARRIED,
    refused=REFUSED,
)
WHERE = "config.json (qwen3_5_moe)"
hf_prefix = qwen3_5.hf_prefix  # the same two layouts


def spec_from_config(cfg: dict, **changes):
    text = qwen3_5.check_config(cfg)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not text.get(key):
            raise ValueError(f"{WHERE}: the text config has no {key!r}")
    if not text.get("shared_expert_intermediate_size"):
        raise ValueError(
            f"{WHERE}: the text config has no shared_expert_intermediate_size (every "
            "Qwen3.5-MoE layer has a shared expert)"
        )
    # the router renormalises its top-k weights whatever the config says
    return qwen3_5.spec_from_config(cfg, **{"moe_norm_topk_prob": True, **changes})


def config_from_spec(spec, base: dict | None = None) -> dict:
    qwen3_5.check_spec(spec, "qwen3_5_moe")
    if (
        not spec.num_experts
        or spec.moe_layer_pattern is not None
        or not spec.shared_expert_ffn_hidden_size
        or not spec.moe_norm_topk_prob
    ):
        raise ValueError(
            "spec: a Qwen3.5-MoE model has experts in every layer, a shared expert and "
            f"renormalised top-k weights (got num_experts={spec.num_experts}, "
            f"moe_layer_pattern={spec.moe_layer_pattern}, "
            f"shared_expert_ffn_hidden_size={spec.shared_expert_ffn_hidden_size}, "
            f"moe_norm_topk_prob={spec.moe_norm_topk_prob})"
        )
    return qwen3_5.merged_config(spec, base, TABLE, moe_fields, spec_from_config)


def moe_fields(spec) -> dict:
    return {
        **qwen3_5.text_fields(spec),
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "shared_expert_intermediate_size": spec.shared_expert_ffn_hidden_size,
        "router_aux_loss_coef": spec.moe_aux_loss_coeff,
    }
