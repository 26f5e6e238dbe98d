"""Hugging Face Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Qwen3.5 (dense, MoE) checkpoints <->
megatron-core, per family.

    from megatron_ba.conversion import spec_from_hf_dir, load_hf_into_chunks, export_chunks_to_hf
    spec = spec_from_hf_dir(DIR)                     # ModelSpec from config.json
    chunks = build_model_chunks(spec)                # megatron_ba.megatron.model, any TP / PP
    load_hf_into_chunks(chunks, DIR, spec)           # streaming, this rank's shards
    export_chunks_to_hf(chunks, spec, OUT, source_dir=DIR)

Modules: `family_table` (the name-rule machinery, TE spellings), `fused_layouts` (fused QKV,
gated QKV, Gated DeltaNet in_proj and gated-MLP row layouts), `qwen2` / `qwen3` / `qwen3_moe` /
`qwen3_5` / `qwen3_5_moe` (one name table and config mapping per family), `families` (dispatch
on model_type), `experts` (local <-> global expert numbers under expert parallelism),
`hf_experts` (per-expert and fused expert tensors), `hf_folder` (safetensors reading one tensor
at a time, the one safetensors writer), `megatron_io` (chunks in and out; an export writes the
source's layout and carries its other tensors, Qwen3.5's vision tower and MTP head),
`dist_checkpoint` (megatron-core distributed checkpoints). The HF / megatron-core / vLLM log-prob
check is tests/conversion_agreement.py; docs/checkpoints.md has the tables.
"""

from megatron_ba.conversion.families import (
    hf_config_from_spec,
    spec_from_hf_config,
    spec_from_hf_dir,
    table_for,
)
from megatron_ba.conversion.hf_folder import HFCheckpoint, write_safetensors
from megatron_ba.conversion.megatron_io import (
    export_chunks_to_hf,
    hf_named_tensors,
    load_hf_into_chunks,
    megatron_state_dict_from_hf,
    write_hf_folder,
)

__all__ = [
    "HFCheckpoint",
    "export_chunks_to_hf",
    "hf_config_from_spec",
    "hf_named_tensors",
    "load_hf_into_chunks",
    "megatron_state_dict_from_hf",
    "spec_from_hf_config",
    "spec_from_hf_dir",
    "table_for",
    "write_hf_folder",
    "write_safetensors",
]
