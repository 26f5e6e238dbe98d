"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`) <-> megatron-core: the name table and config fields.

Attention and norms are Qwen3's (qwen3.py). A sparse layer's MLP is a router (HF `mlp.gate`,
megatron-core `mlp.router.weight`, [experts, hidden]) and `num_experts` SwiGLU experts (HF
`mlp.experts.{e}.gate_proj / up_proj / down_proj`; megatron-core SequentialMLP
`mlp.experts.local_experts.{e}.linear_fc1` = [gate; up] as the dense MLP, `linear_fc2` = down).
Which layers are sparse: HF's rule, layer i unless `i in mlp_only_layers` or
`(i + 1) % decoder_sparse_step`; the others keep a dense MLP of `intermediate_size`, which is
megatron-core's `moe_layer_freq` pattern (ModelShape.moe_layer_pattern). Routing: softmax, top
`num_experts_per_tok`, `norm_topk_prob` (megatron_ba.megatron.model.moe_config_fields).
`router_aux_loss_coef` becomes megatron-core's `moe_aux_loss_coeff` (a training setting; HF adds
its own load-balancing loss only with output_router_logits). Shared experts (Qwen2-MoE's
`shared_expert_intermediate_size`) do not exist in Qwen3-MoE and are refused by name.
"""

from __future__ import annotations

from megatron_ba.conversion import hf_config
from megatron_ba.conversion.family_table import Copy, FamilyTable, GatedFC1
from megatron_ba.conversion.qwen3 import LAYER, TOP
from megatron_ba.conversion.qwen3 import spec_from_config as qwen3_spec_from_config
from megatron_ba.megatron.model import ModelSpec

MOE_LAYER = {"mlp.router.weight": Copy("mlp.gate.weight")}
EXPERT = {
    "linear_fc1.weight": GatedFC1(
        "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"
    ),
    "linear_fc2.weight": Copy("mlp.experts.{e}.down_proj.weight"),
}

TABLE = FamilyTable(
    family="qwen3_moe",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    top=TOP,
    layer=LAYER,
    optional={},
    moe_layer=MOE_LAYER,
    expert=EXPERT,
)
WHERE = "config.json (qwen3_moe)"
# transformers 5 writes the expert count as num_local_experts, 4.x as num_experts.
EXPERT_KEYS = ("num_experts", "num_local_experts")


def _pattern(cfg: dict, num_layers: int) -> tuple[int, ...] | None:
    """HF's sparse-layer rule as megatron-core's pattern (None: every layer sparse)."""
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"{WHERE}: decoder_sparse_step must be >= 1, got {step}")
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    pattern = tuple(0 if (i in dense or (i + 1) % step) else 1 for i in range(num_layers))
    if 1 not in pattern:
        raise ValueError(
            f"{WHERE}: mlp_only_layers / decoder_sparse_step leave no sparse layer "
            "(a dense model is model_type qwen3)"
        )
    return None if all(pattern) else pattern


def _num_experts(cfg: dict) -> int:
    values = {k: cfg[k] for k in EXPERT_KEYS if cfg.get(k) is not None}
    if not values:
        raise ValueError(f"{WHERE}: has neither num_experts nor num_local_experts")
    if len(set(values.values())) > 1:
        raise ValueError(f"{WHERE}: num_experts and num_local_experts disagree: {values}")
    return int(next(iter(values.values())))


def spec_from_config(cfg: dict, **changes):
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(
            f"{WHERE}: shared_expert_intermediate_size={cfg['shared_expert_intermediate_size']}: "
            "shared experts are not supported (Qwen3-MoE has none)"
        )
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in cfg:
            raise ValueError(f"{WHERE}: has no {key!r}")
    dense = qwen3_spec_from_config({**cfg, "model_type": "qwen3"})
    fields = {f: getattr(dense, f) for f in dense.__dataclass_fields__}
    fields.update(
        family="qwen3_moe",
        num_experts=_num_experts(cfg),
        moe_router_topk=int(cfg["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        # transformers' Qwen3MoeConfig default is False (the released models set true)
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layer_pattern=_pattern(cfg, dense.num_layers),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001)),
    )
    fields.update(changes)
    return ModelSpec(**fields)


def _sparse_fields(spec, base: dict | None) -> dict:
    """decoder_sparse_step / mlp_only_layers for the spec's pattern: the base's own fields when
    they give the same pattern, else step 1 with the dense layers listed."""
    want = spec.moe_layer_pattern
    if base is not None and _pattern(base, spec.num_layers) == want:
        return {k: base[k] for k in ("decoder_sparse_step", "mlp_only_layers") if k in base}
    dense = [] if want is None else [i for i, m in enumerate(want) if not m]
    return {"decoder_sparse_step": 1, "mlp_only_layers": dense}


def config_from_spec(spec, base: dict | None = None) -> dict:
    if not spec.num_experts or not spec.qk_layernorm or spec.qkv_bias:
        raise ValueError(
            "spec: a Qwen3-MoE model has experts, q/k layernorms and no QKV bias (got "
            f"num_experts={spec.num_experts}, qkv_bias={spec.qkv_bias}, "
            f"qk_layernorm={spec.qk_layernorm})"
        )
    fields = hf_config.common_config_fields(spec, TABLE)
    key = "num_local_experts" if base and "num_local_experts" in base else "num_experts"
    fields.update(
        head_dim=spec.head_dim,
        attention_bias=False,
        num_experts_per_tok=spec.moe_router_topk,
        moe_intermediate_size=spec.moe_ffn_hidden_size,
        norm_topk_prob=spec.moe_norm_topk_prob,
        router_aux_loss_coef=spec.moe_aux_loss_coeff,
        **{key: spec.num_experts},
        **_sparse_fields(spec, base),
    )
    return hf_config.merged_config(fields, float(spec.rope_theta), base, spec.rope_scaling)
