"""The CPU-sized debug shapes the tests, the CPU recipes and the benchmarks build (tiny models of
each family the project trains), part of model_shape.PRESETS beside the released models."""

from __future__ import annotations

from megatron_ba.model_shape.shape import ModelShape


def qwen3(name: str, **fields) -> ModelShape:
    """A Qwen3 shape: q/k RMSNorms, no QKV bias."""
    defaults = {"family": "qwen3", "qkv_bias": False, "qk_layernorm": True}
    return ModelShape(name=name, **{**defaults, **fields})


# The tiny Qwen3.5 presets' shared fields (see "tiny-qwen3.5" below).
_TINY_QWEN3_5 = dict(
    vocab_size=512,
    hidden_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=256,
    max_position_embeddings=1024,
    rope_theta=10_000_000.0,
    qkv_bias=False,
    qk_layernorm=True,
    kv_channels=32,
    linear_attention_pattern=(1, 1, 1, 0),
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    attention_output_gate=True,
    rotary_percent=0.25,
    norm_zero_centered=True,
)


TINY_PRESETS: dict[str, ModelShape] = {
    # CPU-sized shapes of the same family. tiny: the CPU recipes' policy (recipe.TINY_SHAPE;
    # the recipe's vocabulary is its tokenizer's) and the benchmarks' default.
    "tiny": ModelShape(
        1024, 128, 2, 4, 2, 384, max_position_embeddings=256, rope_theta=10_000.0, name="tiny"
    ),
    "small": ModelShape(32768, 512, 8, 8, 2, 1408, name="small"),
    # The model of the multi-process CPU tests and the layout check (~60k parameters): head_dim
    # 16, 4 query heads in 2 groups (TP=2 splits both), 4 layers (PP=2 or 4 splits them).
    "debug": ModelShape(
        128, 64, 4, 4, 2, 96, max_position_embeddings=256, rope_theta=10_000.0, name="debug"
    ),
    # Hugging Face tiny models (megatron_ba.testing.tiny_hf; `megatron-ba tiny-model`): tied,
    # head_dim 32 (the smallest vLLM's CPU attention takes); the vocabulary is the tokenizer's.
    "tiny-qwen2": ModelShape(512, 128, 2, 4, 2, 256, tie_word_embeddings=True, name="tiny-qwen2"),
    "tiny-qwen3": qwen3(
        "tiny-qwen3",
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        max_position_embeddings=1024,
        kv_channels=32,
        tie_word_embeddings=True,
    ),
    # A CPU Qwen3-MoE (megatron_ba.testing.tiny_hf.build_tiny_qwen3_moe; `megatron-ba tiny-model
    # --family qwen3_moe`): 8 experts, top-2, head_dim 32 for vLLM's CPU attention.
    "tiny-moe": qwen3(
        "tiny-moe",
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=256,
        max_position_embeddings=1024,
        kv_channels=32,
        tie_word_embeddings=True,
        family="qwen3_moe",
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_aux_loss_coeff=0.001,
    ),
    # CPU-sized Qwen3.5 (megatron_ba.testing.tiny_hf; `megatron-ba tiny-model --family qwen3_5`,
    # `--family qwen3_5_moe`): 4 layers, 3 Gated DeltaNet then 1 full attention (Qwen3.5's
    # every-4th pattern; PP2 splits it 2 + 2), head_dim 32 for vLLM's CPU attention with a
    # quarter of it rotated, 2 key and 4 value heads of 64 channels in the DeltaNet (TP2 splits
    # both; vLLM's CPU delta-rule kernel takes head dims 64 and 128 only), untied (a tied model
    # cannot run PP > 1 on CPU: megatron_ba.megatron.model.build_gpt_model).
    "tiny-qwen3.5": ModelShape(
        name="tiny-qwen3.5",
        family="qwen3_5",
        **_TINY_QWEN3_5,
    ),
    # Its mixture of experts: 8 routed experts, top-2, and a gated shared expert in every layer.
    "tiny-qwen3.5-moe": ModelShape(
        name="tiny-qwen3.5-moe",
        family="qwen3_5_moe",
        **{**_TINY_QWEN3_5, "ffn_hidden_size": 64},
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        shared_expert_ffn_hidden_size=64,
        moe_aux_loss_coeff=0.001,
    ),
}
