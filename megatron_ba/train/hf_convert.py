"""The driver's names for HF <-> megatron-core conversion, kept as thin adapters over
megatron_ba.conversion (the table-driven converter, one module per family; docs/checkpoints.md).

New code should call megatron_ba.conversion with a ModelSpec: `hf_named_tensors(full, spec)`,
`megatron_state_dict_from_hf(hf, spec)`, `write_hf_folder(...)`, `hf_config_from_spec(spec)`.
These keep the warm-start driver's call sites (Qwen2, untied, QKV bias) working unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_ba.conversion import (
    hf_config_from_spec,
    hf_named_tensors,
    megatron_state_dict_from_hf,
    write_hf_folder,
)


def _qwen2_spec(heads: int, groups: int, head_dim: int, hidden: int, tied: bool, layers: int = 1):
    """The fields of a Qwen2 spec that the name tables read (the shapes come with the tensors)."""
    from megatron_ba.megatron.model import ModelSpec

    return ModelSpec(
        vocab_size=1,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=1,
        kv_channels=head_dim,
        tie_word_embeddings=tied,
    )


def megatron_to_hf(
    full: dict[str, torch.Tensor], *, num_attention_heads: int, num_query_groups: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF Qwen2 name, tensor) for a full-shape megatron Qwen2 state dict."""
    proj = full["decoder.layers.0.self_attention.linear_proj.weight"]
    spec = _qwen2_spec(
        num_attention_heads,
        num_query_groups,
        proj.shape[1] // num_attention_heads,
        proj.shape[0],
        "output_layer.weight" not in full,
    )
    return hf_named_tensors(full, spec)


def hf_to_megatron(
    hf: dict[str, torch.Tensor], *, num_attention_heads: int, num_query_groups: int
) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf` (local-spec names)."""
    from megatron_ba.conversion.names import split_hf_layer

    q = hf["model.layers.0.self_attn.q_proj.weight"]
    layers = {p[0] for p in map(split_hf_layer, hf) if p is not None}
    spec = _qwen2_spec(
        num_attention_heads,
        num_query_groups,
        q.shape[0] // num_attention_heads,
        q.shape[1],
        "lm_head.weight" not in hf,
        len(layers),
    )
    return megatron_state_dict_from_hf(hf, spec)


def qwen2_config(spec, *, eos_token_id: int, bos_token_id: int | None = None) -> dict:
    """config.json of the HF model with `spec`'s shape (a megatron_ba ModelSpec)."""
    bos = eos_token_id if bos_token_id is None else bos_token_id
    return hf_config_from_spec(spec, eos_token_id=eos_token_id, bos_token_id=bos)


def save_hf_model(out_dir: str | Path, full: dict[str, torch.Tensor], spec, tokenizer) -> Path:
    """Write config.json, model.safetensors (float32), generation_config.json and the tokenizer."""
    eos = tokenizer.eos_token_id
    return write_hf_folder(
        out_dir,
        hf_named_tensors(full, spec),
        spec,
        tokenizer=tokenizer,
        dtype=torch.float32,
        config_fields={"eos_token_id": eos, "bos_token_id": eos},
        generation_config={"eos_token_id": eos, "do_sample": True, "temperature": 1.0},
    )
