"""The shape of a Qwen-family decoder, its parameter and activation counts, and the named shapes
every part of the project uses: ModelShape (shape.py), read from a config.json (config_json.py),
the named shapes (presets.py).

    shape = PRESETS["Qwen2.5-Math-7B"]          # or preset("qwen2.5-math-7b"), case-insensitive
    shape.total_params(), shape.head_dim       # a layout against it: parallel_layout
    spec = ModelSpec.of(PRESETS["debug"])       # megatron_ba.megatron.model: + build options

Pure Python (no torch), so the recipe, the planner, the benchmarks' argument parsers and
scripts/gpu_check.py read it without importing torch. The model builder
(megatron_ba.megatron.model.ModelSpec) extends it with what only a build needs (parameter dtype,
initialisation, megatron-core config overrides); the planner (megatron_ba.planning) computes
memory and FLOPs from it.

The architecture is Qwen2's or Qwen3's: RMSNorm, SwiGLU MLP without biases, RoPE (plain or
scaled by YaRN: `rope_scaling`), grouped-query
attention with a bias on the fused QKV projection (Qwen2) or RMSNorms on each q and k head (Qwen3,
`qk_layernorm`), an explicit head dimension (`kv_channels`), tied or untied output layer. Field
names follow megatron-core where they overlap (Hugging Face's num_key_value_heads is
num_query_groups, intermediate_size is ffn_hidden_size, head_dim is kv_channels). Qwen3.5's
hybrid decoder (Gated DeltaNet layers between gated full-attention layers) is described by
ModelShape's fields; the counts take each layer by its type (`total_params` equals transformers'
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM parameter count: tests/test_planner_qwen3_5.py).
"""

from megatron_ba.model_shape.config_json import (
    QWEN3_5_MODEL_TYPES,
    qwen3_5_layer_pattern,
    qwen3_5_text_config,
    shape_fields,
)
from megatron_ba.model_shape.presets import PRESETS, preset
from megatron_ba.model_shape.shape import FAMILIES, GDN_CHUNK, ModelShape

__all__ = [
    "FAMILIES",
    "GDN_CHUNK",
    "PRESETS",
    "QWEN3_5_MODEL_TYPES",
    "ModelShape",
    "preset",
    "qwen3_5_layer_pattern",
    "qwen3_5_text_config",
    "shape_fields",
]
