"""The benchmarks' model: a named shape (megatron_ba.model_shape.PRESETS) with per-field overrides.

    add_shape_arguments(parser)      # --shape tiny|small|qwen2.5-0.5b|qwen2.5-1.5b, --hidden, ...
    spec = model_spec(args, seq_len=16384, dtype=torch.bfloat16)   # a megatron ModelSpec

The spec is also the planner's shape (a ModelSpec is a ModelShape): estimates and model FLOPs
take it as it is.
"""

from __future__ import annotations

import torch

from megatron_ba.megatron.model import ModelSpec
from megatron_ba.model_shape import PRESETS

# The presets `--shape` offers.
SHAPES = ("tiny", "small", "qwen2.5-0.5b", "qwen2.5-1.5b")
# Command-line overrides of a preset: option name -> ModelShape field.
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
    """The ModelSpec of `args.shape` with the overrides `args` sets (argparse names); every
    benchmark model has RoPE theta 10,000 and room for `seq_len` positions."""
    changes = {
        f: getattr(args, arg) for arg, f in OVERRIDES.items() if getattr(args, arg) is not None
    }
    return ModelSpec.of(
        PRESETS[args.shape],
        **changes,
        max_position_embeddings=seq_len,
        rope_theta=10_000.0,
        params_dtype=dtype,
    )
