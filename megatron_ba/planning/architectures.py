"""Which Hugging Face configs the planner's memory model describes, and a refusal that names what
it does not model, never a guess.

    check_modelled(cfg, "--model path/config.json")   # Unmodelled naming the architecture

The shape's formulas (megatron_ba/model_shape/shape.py) count decoders of grouped-query
attention with rotary embeddings, SwiGLU MLPs (dense, or routed experts with an optional shared
expert) and RMSNorm:
Qwen2 / Qwen2.5, Qwen2-MoE, Qwen3, Qwen3-MoE, Llama, Mistral; and Qwen3.5's hybrid decoder
(model types qwen3_5, qwen3_5_moe: Gated DeltaNet layers between gated full-attention layers,
read from the ConditionalGeneration config's `text_config` or a text-only config). Three things
change both the parameter count and the memory of a step and are refused by name wherever they
appear:
- multi-head latent attention (DeepSeek-V2 / V3, Kimi K2: `kv_lora_rank`): its low-rank KV
  projections and cache are sized by the rank, not by heads x head_dim (read as plain attention,
  transformers' DeepseekV3Config counts 706.7 B parameters for a 671 B model);
- linear-attention layers outside Qwen3.5 (Qwen3-Next, Kimi Linear, ...: `layer_types` or a
  `linear_*` head count): their projections, state and MoE layout are not Qwen3.5's;
- leading dense layers in a mixture of experts (DeepSeek's `first_k_dense_replace`).
Any other model_type is refused naming it. Another multimodal checkpoint's `text_config` is read
for the reason, and refused: only Qwen3.5's nesting is read. What a Gated DeltaNet asks of a
layout (tp x cp dividing its key and value heads: megatron-core 0.19.2's rule) is
ParallelLayout's rule
(parallel_layout.check_model), which every estimate applies.
"""

from __future__ import annotations

from megatron_ba.model_shape import QWEN3_5_MODEL_TYPES

MODELLED = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "qwen3_5",
            "qwen3_5_moe")  # fmt: skip


class Unmodelled(ValueError):
    """A config the planner gives no estimate for: `layout` refuses it (exit 2), the Slurm
    launcher's fit check skips its memory check saying why."""


def check_modelled(cfg: dict, where: str) -> None:
    """Unmodelled naming what in `cfg` (a config.json) the planner does not model."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    model_type = str(cfg.get("model_type") or (text or {}).get("model_type") or "")
    nested = " (its text model under text_config)" if text is not None else ""
    qwen3_5 = model_type in QWEN3_5_MODEL_TYPES
    for part in (cfg, text or {}):
        reason = _unmodelled_part(part, linear_attention=qwen3_5)
        if reason:
            raise Unmodelled(
                f"{where}: model_type {model_type!r}{nested} has {reason}, which the planner "
                "does not model: no estimate is given (docs/cluster-planning.md)"
            )
    if qwen3_5:
        return
    if text is not None:
        raise Unmodelled(
            f"{where}: model_type {model_type!r} nests its text model under text_config (a "
            "multimodal checkpoint), which the planner reads only for Qwen3.5 (qwen3_5, "
            "qwen3_5_moe): give the text model's config.json"
        )
    if model_type not in MODELLED:
        raise Unmodelled(
            f"{where}: model_type {model_type!r} is not one the planner models "
            f"({', '.join(MODELLED)}): no estimate is given (docs/cluster-planning.md)"
        )


def _unmodelled_part(cfg: dict, linear_attention: bool = False) -> str:
    """What in one config level the shape's formulas do not count ("" when nothing);
    `linear_attention`: Qwen3.5's Gated DeltaNet layers are modelled."""
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        return f"multi-head latent attention (kv_lora_rank {cfg.get('kv_lora_rank')})"
    layer_types = cfg.get("layer_types") or []
    linear = [t for t in layer_types if "linear" in str(t)]
    if linear and not linear_attention:
        return (
            f"linear-attention layers ({len(linear)} of its {len(layer_types)} layers are "
            f"{linear[0]!r}: a recurrent state, not a KV cache, modelled only for Qwen3.5)"
        )
    if not linear_attention and any(k.startswith("linear_num_") for k in cfg):
        return "linear-attention layers (its linear_* head counts; modelled only for Qwen3.5)"
    if cfg.get("first_k_dense_replace"):
        return f"{cfg['first_k_dense_replace']} dense layers before its expert layers"
    return ""
