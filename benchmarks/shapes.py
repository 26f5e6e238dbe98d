"""Qwen2-family shapes of the benchmarks, and a megatron-core ModelSpec as the planner's shape.

    spec = model_spec("qwen2.5-1.5b", seq_len=16384, dtype=torch.bfloat16, layers=2)
    shape = planner_shape(spec)      # planning.memory.ModelShape: estimates, model FLOPs

The presets' values are those of each model's public config.json (Qwen2.5-0.5B and -1.5B tie the
output layer to the embedding); "tiny" and "small" are CPU-sized shapes of the same family.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ba.megatron.model import ModelSpec
from megatron_ba.planning.memory import ModelShape

# field -> value (ModelSpec names)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=384,
    ),
    "small": dict(
        vocab_size=32768,
        hidden_size=512,
        num_layers=8,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=1408,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_attention_heads=14,
        num_query_groups=2,
        ffn_hidden_size=4864,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        num_layers=28,
        num_attention_heads=12,
        num_query_groups=2,
        ffn_hidden_size=8960,
        tie_word_embeddings=True,
    ),
}
# Command-line overrides of a preset: option name -> ModelSpec field.
OVERRIDES = dict(
    hidden="hidden_size",
    layers="num_layers",
    heads="num_attention_heads",
    query_groups="num_query_groups",
    ffn="ffn_hidden_size",
    vocab="vocab_size",
)


def add_shape_arguments(p) -> None:
    """--shape and the per-field overrides (--hidden, --layers, ...) of an argparse parser."""
    p.add_argument("--shape", choices=SHAPES, default="tiny", help="Qwen2 shape preset")
    for name in OVERRIDES:
        option = name.replace("_", "-")
        p.add_argument(f"--{option}", type=int, default=None, help=f"override the preset's {name}")


def model_spec(args, *, seq_len: int, dtype: torch.dtype) -> ModelSpec:
    """The ModelSpec of `args.shape` with the overrides `args` sets (argparse names)."""
    shape = dict(SHAPES[args.shape])
    for arg, field in OVERRIDES.items():
        if getattr(args, arg) is not None:
            shape[field] = getattr(args, arg)
    return ModelSpec(
        **shape, max_position_embeddings=seq_len, rope_theta=10_000.0, params_dtype=dtype
    )


def planner_shape(spec: ModelSpec, name: str = "model") -> ModelShape:
    """planning.memory's ModelShape of the same decoder (its memory and FLOPs arithmetic)."""
    return ModelShape(
        name=name,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.head_dim,
        intermediate_size=spec.ffn_hidden_size,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_layernorm,
    )
