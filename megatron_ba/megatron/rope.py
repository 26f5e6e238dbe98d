"""The position embedding of the megatron model: plain RoPE, or YaRN through megatron-core's own
`YarnRotaryEmbedding` (megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py).

    config = TransformerConfig(**kwargs, **config_defaults(spec))  # model.transformer_config
    set_yarn_fields(config, spec)                # before GPTModel: attention reads them at build
    check_cp(spec, pg_collection)                # YaRN slices by parallel_state's CP group
    GPTModel(..., **gpt_model_kwargs(spec))      # position_embedding_type "rope" or "yarn"

How megatron-core's YaRN is driven (0.16.1 and 0.19.2 read the same names): GPTModel's
`position_embedding_type="yarn"` builds YarnRotaryEmbedding from `config.yarn_*` attributes, which
the plain TransformerConfig does not declare (MLATransformerConfig does): they are set on the
config object after it is built. Attention multiplies cos and sin by the concentration factor
`_yarn_get_concentration_factor_from_config(config)`; 0.19.2 computes it once when each attention
module is built, so the fields must be set before GPTModel.

Against transformers' `_compute_yarn_parameters` (transformers 5.19) the arithmetic is the same
step for step: inverse frequencies 1/theta^(2i/d) and 1/(factor theta^(2i/d)) in float32, the
correction range from beta_fast / beta_slow over original_max_position_embeddings, floored /
ceiled when rounding (transformers' `truncate`, megatron-core's
`yarn_correction_range_round_to_int`), clamped to [0, d - 1], the same linear ramp (+0.001 when the
bounds meet), and the attention factor 0.1 ln(factor) + 1 on both q's and k's cos and sin. The one
knob that differs is the attention factor's form: transformers uses get_mscale(factor) unless both
`mscale` and `mscale_all_dim` are set; megatron-core uses get_mscale(factor, yarn_mscale) /
get_mscale(factor, yarn_mscale_all_dim) unless either is None. yarn_mscale=1, yarn_mscale_all_dim=0
gives (0.1 ln f + 1) / 1, transformers' default; configs that set mscale, mscale_all_dim or
attention_factor are refused when read (megatron_ba.rope_scaling). Rounding of the rotary angles:
both take cos / sin of position x inverse frequency in float32; tests/test_rope_yarn.py compares
the logits. Transformer Engine's fused RoPE cannot apply an attention factor other than 1:
rope_utils.apply_rotary_pos_emb (0.16.1, 0.19.2) falls back to the unfused path with a warning
for [s, b, h, d] tensors but calls the fused kernel without it for packed (thd) sequences, so a
YaRN model is built with apply_rope_fusion=False (set explicitly to true, it is refused).
"""

from __future__ import annotations

from typing import Any


def yarn_fields(spec) -> dict[str, Any]:
    """The `yarn_*` attributes megatron-core's GPTModel and attention read, for a YaRN spec."""
    s = spec.rope_scaling
    return dict(
        yarn_rotary_scaling_factor=float(s.factor),
        yarn_original_max_position_embeddings=int(s.original_max_position_embeddings),
        yarn_beta_fast=float(s.beta_fast),
        yarn_beta_slow=float(s.beta_slow),
        yarn_mscale=1.0,  # with mscale_all_dim 0: attention factor 0.1 ln(factor) + 1
        yarn_mscale_all_dim=0.0,
        yarn_correction_range_round_to_int=bool(s.truncate),
    )


def config_defaults(spec) -> dict[str, Any]:
    """TransformerConfig fields a YaRN spec needs (none for plain RoPE)."""
    return {"apply_rope_fusion": False} if spec.rope_scaling is not None else {}


def set_yarn_fields(config, spec) -> None:
    """Set the yarn_* attributes on `config` (a YaRN spec; nothing for plain RoPE), refusing a
    config whose fused RoPE cannot apply YaRN's attention factor."""
    if spec.rope_scaling is None:
        return
    if getattr(config, "apply_rope_fusion", False):
        raise ValueError(
            "apply_rope_fusion: must be false for a YaRN model (Transformer Engine's fused RoPE "
            "does not apply YaRN's attention factor)"
        )
    for key, value in yarn_fields(spec).items():
        setattr(config, key, value)


def gpt_model_kwargs(spec) -> dict[str, Any]:
    """GPTModel's position embedding arguments."""
    kind = "rope" if spec.rope_scaling is None else "yarn"
    kwargs = {"position_embedding_type": kind, "rotary_base": int(spec.rope_theta)}
    if spec.rotary_percent != 1.0:  # Qwen3.5: RoPE on the first quarter of each head
        kwargs["rotary_percent"] = spec.rotary_percent
    return kwargs


def check_cp(spec, pg_collection) -> None:
    """ValueError for a YaRN model at context parallelism megatron-core cannot give it.

    GPTModel (0.16.1 and 0.19.2) builds YarnRotaryEmbedding without its own CP group: the
    embedding slices its angles by parallel_state's CP group, already when it builds its cos/sin
    cache, with a CUDA call (rope_utils.get_pos_emb_on_this_cp_rank). So at CP > 1 a YaRN model
    must run the CP attention itself (Transformer Engine, cp_mode "model") on CUDA; whole
    sequences per rank (model_pg_collection_without_cp, the CPU's cp_mode "loss") would get
    sliced angles."""
    if spec.rope_scaling is None:
        return
    import torch
    from megatron.core import parallel_state

    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is not None and group.size() != cp:
        raise ValueError(
            f"parallel.cp: a YaRN model at cp={cp} runs its context parallelism itself "
            "(megatron-core's YaRN embedding slices by the global CP group); it cannot see whole "
            "sequences per rank (cp_mode 'loss'); use a Transformer Engine build or cp=1"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"parallel.cp: a YaRN model at cp={cp} needs CUDA (megatron-core slices its rotary "
            "cache with a CUDA call); on CPU run it at cp=1"
        )
