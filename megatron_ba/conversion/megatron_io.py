"""Hugging Face folders into and out of megatron-core model chunks, under any TP / PP layout.

    spec = spec_from_hf_dir(DIR)                       # family, shape, dtype from config.json
    chunks = build_model_chunks(spec)                  # after parallel_state is initialised
    load_hf_into_chunks(chunks, DIR, spec)             # streaming, this rank's shards only
    export_chunks_to_hf(chunks, spec, OUT, source_dir=DIR)   # collective; global rank 0 writes
    engine.load_weights(hf_named_tensors(gather_full_state_dict(chunks), spec))  # vLLM sync

Loading walks this rank's parameters: each full-shape megatron tensor is built from the HF tensors
it is made of (read one file access at a time), sharded for this rank and copied in, then freed;
the checkpoint is never materialised as a state dict (peak: the model plus its largest fused
tensor). Exporting walks every parameter once (`iter_full_tensors`: TP all-gather, then the owning
pipeline stage's broadcast) and the writer streams it into safetensors shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_ba.conversion import experts, family_table, hf_folder
from megatron_ba.conversion.families import hf_config_from_spec, spec_from_hf_dir, table_for
from megatron_ba.conversion.hf_config import DTYPE_NAMES
from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import iter_full_tensors, load_full_tensors

# Export shards: the writer holds one shard, so this bounds what an export adds to the model.
DEFAULT_SHARD_BYTES = 512 * 1024**2


def check_checkpoint_names(ckpt: hf_folder.HFCheckpoint, spec) -> None:
    """ValueError naming tensors the family expects but the folder lacks, or the reverse."""
    expected = set(table_for(spec).hf_names(spec))
    present = {k for k in ckpt.keys() if not family_table.is_skipped(k)}
    extra = present - expected
    if spec.tie_word_embeddings and "lm_head.weight" in extra:
        # Some tied checkpoints store the head anyway: accepted only if it is the embedding.
        if not torch.equal(ckpt.get("lm_head.weight"), ckpt.get("model.embed_tokens.weight")):
            raise ValueError(
                "model_dir: tie_word_embeddings is true but lm_head.weight differs from "
                "model.embed_tokens.weight"
            )
        extra.discard("lm_head.weight")
    missing = expected - present
    if missing or extra:
        raise ValueError(
            f"model_dir: {str(ckpt.dir)!r} does not match its {spec.family} config: "
            f"missing {sorted(missing)[:4]} ({len(missing)}), "
            f"unexpected {sorted(extra)[:4]} ({len(extra)})"
        )


def load_hf_into_chunks(chunks: list[torch.nn.Module], model_dir: str | Path, spec=None):
    """Load a Hugging Face folder into this rank's model chunks (streaming); return the spec.

    spec: the model's ModelSpec (default: from the folder's config.json). Every rank calls it
    with its own chunks; no collectives.
    """

    spec = spec if spec is not None else spec_from_hf_dir(model_dir)
    ckpt = hf_folder.HFCheckpoint(model_dir)
    check_checkpoint_names(ckpt, spec)
    table = table_for(spec)
    load_full_tensors(
        chunks,
        experts.global_reader(
            lambda name: family_table.megatron_tensor(table, spec, name, ckpt.get), spec
        ),
    )
    return spec


def megatron_state_dict_from_hf(
    hf: Mapping[str, torch.Tensor] | str | Path, spec, *, spelling: str = "local"
) -> dict[str, torch.Tensor]:
    """The full-shape megatron state dict of an HF state dict or folder, its names in the
    local spec's spelling or ("transformer_engine") the Transformer Engine spec's."""
    if isinstance(hf, (str, Path)):
        ckpt = hf_folder.HFCheckpoint(hf)
        check_checkpoint_names(ckpt, spec)
        read = ckpt.get
    else:

        def read(name: str) -> torch.Tensor:
            if name not in hf:
                raise ValueError(f"hf: missing Hugging Face tensor {name!r} ({spec.family})")
            return hf[name]

    table = table_for(spec)
    return {
        family_table.spelled(n, spelling): family_table.megatron_tensor(table, spec, n, read)
        for n in table.megatron_names(spec)
    }


def hf_named_tensors(
    full: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], spec
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of full-shape megatron tensors: the vLLM weight sync and exports."""
    return family_table.iter_hf_tensors(table_for(spec), spec, full)


def _is_writer() -> bool:
    return collectives.world_rank_and_size()[0] == 0


def write_hf_folder(
    out_dir: str | Path,
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    spec,
    *,
    source_dir: str | Path | None = None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = DEFAULT_SHARD_BYTES,
    config_fields: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    """A Hugging Face folder: safetensors, config.json, generation_config.json, tokenizer.

    source_dir: the folder the model came from; its config.json is the base of the new one
    (token ids, transformers_version and other fields a spec does not hold) and its tokenizer
    files and generation_config.json are copied. tokenizer: an object with `save_pretrained`
    (used when there is no source folder, e.g. a model trained from scratch). dtype: the
    tensors' dtype in the files (default the spec's params_dtype). config_fields: set last in
    config.json (e.g. token ids). generation_config: written when the source has none (default:
    the config's token ids).
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or spec.params_dtype
    hf_folder.write_safetensors(out, hf_tensors, dtype=dtype, max_shard_bytes=max_shard_bytes)
    base = None
    if source_dir is not None:
        base = json.loads((Path(source_dir) / "config.json").read_text())
    fields = dict(config_fields or {})
    cfg = hf_config_from_spec(spec, base=base, **fields)
    key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
    cfg[key] = DTYPE_NAMES[dtype]  # the files' dtype, which may differ from the training one
    hf_folder.write_json(out / "config.json", cfg)
    copied = hf_folder.copy_side_files(source_dir, out) if source_dir is not None else []
    if tokenizer is not None and not any(n.startswith("tokenizer") for n in copied):
        tokenizer.save_pretrained(out)
    if "generation_config.json" not in copied:
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        gen = generation_config or {k: cfg[k] for k in ids if cfg.get(k) is not None}
        hf_folder.write_json(out / "generation_config.json", gen)
    return out


def export_chunks_to_hf(
    chunks: list[torch.nn.Module], spec, out_dir: str | Path, **kwargs
) -> Path | None:
    """Write this model (every rank's chunks) as a Hugging Face folder; see `write_hf_folder`
    for the options. A collective over the TP, PP (and, for experts, EP) groups; global rank 0
    writes (other data-parallel replicas take part in their own groups and write nothing)."""

    # under expert parallelism every EP rank takes part in each expert's gather
    stream = experts.gather_experts(iter_full_tensors(chunks), spec)
    if not _is_writer():
        for _ in stream:  # take part in every gather, keep nothing
            pass
        return None
    return write_hf_folder(out_dir, hf_named_tensors(stream, spec), spec, **kwargs)
