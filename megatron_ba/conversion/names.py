"""Parameter-name patterns shared by megatron_ba.megatron.model and the conversion tables.

megatron-core names transformer layers `decoder.layers.{i}.{rest}` (i local to a pipeline stage
inside a model chunk, global in megatron_ba's full-shape state dicts); Hugging Face Qwen models
name them `model.layers.{i}.{rest}`. One regex of each, so that the model's local -> global
renumbering and the conversion tables cannot disagree on what a layer name is.
"""

from __future__ import annotations

import re

MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def split_megatron_layer(name: str) -> tuple[int, str] | None:
    """`decoder.layers.3.mlp.linear_fc2.weight` -> (3, "mlp.linear_fc2.weight"); else None."""
    m = MEGATRON_LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def split_hf_layer(name: str) -> tuple[int, str] | None:
    """`model.layers.3.mlp.down_proj.weight` -> (3, "mlp.down_proj.weight"); else None."""
    m = HF_LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def megatron_layer_name(index: int, rest: str) -> str:
    return f"decoder.layers.{index}.{rest}"


def hf_layer_name(index: int, rest: str) -> str:
    return f"model.layers.{index}.{rest}"
