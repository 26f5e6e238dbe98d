"""Which Hugging Face configs the planner's memory model describes, and a refusal that names what
it does not model, never a guess.

    check_modelled(cfg, "--model path/config.json")   # Unmodelled naming the architecture

The shape's formulas (model_shape.py) count decoders of grouped-query attention with rotary
embeddings, SwiGLU MLPs (dense, or routed experts with an optional shared expert) and RMSNorm:
Qwen2 / Qwen2.5, Qwen2-MoE, Qwen3, Qwen3-MoE, Llama, Mistral. Three things change both the
parameter count and the memory of a step and are refused by name wherever they appear:
- multi-head latent attention (DeepSeek-V2 / V3, Kimi K2: `kv_lora_rank`): its low-rank KV
  projections and cache are sized by the rank, not by heads x head_dim (read as plain attention,
  transformers' DeepseekV3Config counts 706.7 B parameters for a 671 B model);
- linear-attention layers (Qwen3.5, Qwen3-Next: Gated DeltaNet, `layer_types` or a
  `linear_*` head count): a recurrent state in place of a KV cache, other projections;
- leading dense layers in a mixture of experts (DeepSeek's `first_k_dense_replace`).
Any other model_type is refused naming it. A multimodal checkpoint's `text_config` (Qwen3.5's
ConditionalGeneration layout) is read for the reason, since its top level holds no layers.
"""

from __future__ import annotations

MODELLED = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral")


class Unmodelled(ValueError):
    """A config the planner gives no estimate for: `layout` refuses it (exit 2), the Slurm
    launcher's fit check skips its memory check saying why."""


def check_modelled(cfg: dict, where: str) -> None:
    """Unmodelled naming what in `cfg` (a config.json) the planner does not model."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    model_type = str(cfg.get("model_type") or (text or {}).get("model_type") or "")
    nested = " (its text model under text_config)" if text is not None else ""
    for part in (cfg, text or {}):
        reason = _unmodelled_part(part)
        if reason:
            raise Unmodelled(
                f"{where}: model_type {model_type!r}{nested} has {reason}, which the planner "
                "does not model: no estimate is given (docs/cluster-planning.md)"
            )
    if text is not None:
        raise Unmodelled(
            f"{where}: model_type {model_type!r} nests its text model under text_config (a "
            "multimodal checkpoint), which the planner does not read: give the text model's "
            "config.json"
        )
    if model_type not in MODELLED:
        raise Unmodelled(
            f"{where}: model_type {model_type!r} is not one the planner models "
            f"({', '.join(MODELLED)}): no estimate is given (docs/cluster-planning.md)"
        )


def _unmodelled_part(cfg: dict) -> str:
    """What in one config level the shape's formulas do not count ("" when nothing)."""
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        return f"multi-head latent attention (kv_lora_rank {cfg.get('kv_lora_rank')})"
    layer_types = cfg.get("layer_types") or []
    linear = [t for t in layer_types if "linear" in str(t)]
    if linear:
        return (
            f"linear-attention layers ({len(linear)} of its {len(layer_types)} layers are "
            f"{linear[0]!r}: Gated DeltaNet's recurrent state, not a KV cache)"
        )
    if any(k.startswith("linear_num_") for k in cfg):
        return "linear-attention layers (its linear_* head counts: Gated DeltaNet)"
    if cfg.get("first_k_dense_replace"):
        return f"{cfg['first_k_dense_replace']} dense layers before its expert layers"
    return ""
