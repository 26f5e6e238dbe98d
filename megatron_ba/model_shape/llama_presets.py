"""The Llama 3 shapes among the presets (presets.py merges them into PRESETS).

    PRESETS["Llama-3.1-8B"]; preset("meta-llama/llama-3.2-3b-instruct")   # case-insensitive

Each from its release's config.json (sources beside it). Llama is read as from_hf_config reads a
`llama` config: grouped-query attention without biases, family "qwen2" (the conversion table's
name only). Its "llama3" RoPE scaling changes no memory term and is not kept (no context check).
The -Instruct checkpoints have their base model's shapes.
"""

from __future__ import annotations

from megatron_ba.model_shape.shape import ModelShape


def _llama3(name: str, hidden: int, layers: int, heads: int, ffn: int, **fields) -> ModelShape:
    """What every Llama 3 release's config.json shares: vocabulary 128256, 8 KV heads,
    rope_theta 500000, rms_norm_eps 1e-05, no attention biases."""
    shared = dict(rope_theta=500_000.0, norm_eps=1e-5, qkv_bias=False, name=name)
    return ModelShape(128256, hidden, layers, heads, 8, ffn, **{**shared, **fields})


LLAMA_PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-3.1-8B-Instruct (_name_or_path of e.g. huggingface.co/NaniDAO/
    # Meta-Llama-3.1-8B-Instruct-ablated config.json): hidden 4096, 32 layers, 32 heads,
    # intermediate 14336, untied.
    "Llama-3.1-8B": _llama3("Llama-3.1-8B", 4096, 32, 32, 14336),
    # meta-llama/Llama-3.1-405B: hidden 16384, 126 layers, 128 heads, intermediate 53248,
    # max_position_embeddings 131072, untied (NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/
    # models/llama/llama_provider.py @2afd2d3 Llama31ModelProvider405B; Lightning-AI/litgpt
    # litgpt/config.py @2685705, which links the release's config.json; it once had 16 KV heads,
    # corrected after a report that the config says 8).
    "Llama-3.1-405B": _llama3(
        "Llama-3.1-405B", 16384, 126, 128, 53248, max_position_embeddings=131072
    ),
    # meta-llama/Llama-3.1-70B(-Instruct): hidden 8192, 80 layers, 64 heads, intermediate 28672,
    # max_position_embeddings 131072, untied (Megatron-Bridge llama_provider.py @217de1a2e^
    # Llama31ModelProvider70B; make_vocab_size_divisible_by 128 keeps 128256): Llama-3.3-70B's
    # shape.
    "Llama-3.1-70B": _llama3("Llama-3.1-70B", 8192, 80, 64, 28672, max_position_embeddings=131072),
    # meta-llama/Llama-3.2-1B(-Instruct): hidden 2048, 16 layers, 32 heads of 64, intermediate
    # 8192, tied, max_position_embeddings 131072 (kevinstephano/thunder_model_blocks
    # thunder_model_blocks/hf_llama/llama_config.py @867e9db, the Instruct config.json at the
    # hub's 4e20de3; Megatron-Bridge's Llama32ModelProvider1B @2afd2d3 agrees).
    "Llama-3.2-1B": _llama3(
        "Llama-3.2-1B",
        2048,
        16,
        32,
        8192,
        max_position_embeddings=131072,
        kv_channels=64,
        tie_word_embeddings=True,
    ),
    # meta-llama/Llama-3.2-3B(-Instruct): hidden 3072, 28 layers, 24 heads of 128, intermediate
    # 8192, tied, max_position_embeddings 131072 (Megatron-Bridge llama_provider.py @217de1a2e^
    # Llama32ModelProvider3B; its card's 3.21B parameters: tests/test_layout_planner.py).
    "Llama-3.2-3B": _llama3(
        "Llama-3.2-3B",
        3072,
        28,
        24,
        8192,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    # meta-llama/Llama-3.3-70B-Instruct (_name_or_path of huggingface.co/relaxml/
    # Llama-3.3-70B-Instruct-QTIP-3Bit config.json): hidden 8192, 80 layers, 64 heads,
    # intermediate 28672, untied.
    "Llama-3.3-70B": _llama3("Llama-3.3-70B", 8192, 80, 64, 28672),
    # meta-llama/Meta-Llama-3-70B: hidden 8192, 80 layers, 64 heads, intermediate 28672,
    # max_position_embeddings 8192, untied (Megatron-Bridge src/megatron/bridge/models/llama/
    # llama_provider.py @4db3ed97, Llama3ModelProvider70B and Llama3ModelProvider; its
    # vocabulary in scripts/performance/configs/llama3/llama3_llm_pretrain.py): Llama-3.3-70B's
    # shape with Llama 3's 8K context.
    "Meta-Llama-3-70B": _llama3(
        "Meta-Llama-3-70B", 8192, 80, 64, 28672, max_position_embeddings=8192
    ),
}
