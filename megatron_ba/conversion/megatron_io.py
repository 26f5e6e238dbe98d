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

An export with a source folder writes the model as the source stores it: its layout's names
(Qwen3.5's `model.` or `model.language_model.`, from the source's config.json), fused experts
where the source fused them (conversion.hf_experts) and, when the files are written in the
source's dtype, each tensor in the dtype the source stores it in (published Qwen3.5 keeps
`linear_attn.A_log` and `linear_attn.norm.weight` in float32 in a bfloat16 checkpoint). Tensors
that are not the language model's (a table's `carried`: Qwen3.5's vision tower and MTP head) are
copied from the source unchanged, after the model's. A megatron-core distributed checkpoint keeps
what this needs in its `hf/` folder (`copy_carried`), so `megatron-ba convert --to hf` does the
same.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_ba.conversion import experts, family_table, hf_config, hf_experts, hf_folder
from megatron_ba.conversion.families import hf_config_from_spec, spec_from_hf_dir, table_for
from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import iter_full_tensors, load_full_tensors

# Export shards: the writer holds one shard, so this bounds what an export adds to the model.
DEFAULT_SHARD_BYTES = 512 * 1024**2


def check_checkpoint_names(ckpt: hf_folder.HFCheckpoint, spec) -> None:
    """ValueError naming tensors the family expects but the folder lacks, or the reverse (the
    tensors a family carries unchanged aside)."""
    table = table_for(spec, ckpt.config())
    expected = set(table.hf_names(spec))
    present = {k for k in ckpt.keys() if not family_table.is_skipped(k) and not table.is_carried(k)}
    extra = present - expected
    if spec.tie_word_embeddings and "lm_head.weight" in extra:
        # Some tied checkpoints store the head anyway: accepted only if it is the embedding.
        embedding = table.hf_name("model.embed_tokens.weight")
        if not torch.equal(ckpt.get("lm_head.weight"), ckpt.get(embedding)):
            raise ValueError(
                f"model_dir: tie_word_embeddings is true but lm_head.weight differs from "
                f"{embedding}"
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
    table = table_for(spec, ckpt.config())
    load_full_tensors(
        chunks,
        experts.global_reader(
            lambda name: family_table.megatron_tensor(table, spec, name, ckpt.get), spec
        ),
    )
    return spec


def megatron_state_dict_from_hf(
    hf: Mapping[str, torch.Tensor] | str | Path,
    spec,
    *,
    spelling: str = "local",
    hf_config: dict | None = None,
) -> dict[str, torch.Tensor]:
    """The full-shape megatron state dict of an HF state dict or folder, its names in the
    local spec's spelling or ("transformer_engine") the Transformer Engine spec's. hf_config: a
    state dict's config.json, for the layout of its names (a folder's own is read)."""
    if isinstance(hf, (str, Path)):
        ckpt = hf_folder.HFCheckpoint(hf)
        check_checkpoint_names(ckpt, spec)
        read, table = ckpt.get, table_for(spec, ckpt.config())
    else:
        read, table = _dict_reader(hf, spec), table_for(spec, hf_config)
    return {
        family_table.spelled(n, spelling): family_table.megatron_tensor(table, spec, n, read)
        for n in table.megatron_names(spec)
    }


def _dict_reader(hf: Mapping[str, torch.Tensor], spec):
    """`read(name)` of an HF state dict, fused experts seen per expert."""
    shapes = {k: tuple(v.shape) for k, v in hf.items() if hf_experts.FUSED.match(k)}
    views = hf_experts.expert_views(shapes)

    def read(name: str) -> torch.Tensor:
        if name in views:
            return hf_experts.read_view(views[name], lambda n, e: hf[n][e])
        if name not in hf:
            raise ValueError(f"hf: missing Hugging Face tensor {name!r} ({spec.family})")
        return hf[name]

    return read


def hf_named_tensors(
    full: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    spec,
    hf_config: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of full-shape megatron tensors: the vLLM weight sync and exports.
    hf_config: the config.json of the checkpoint they go to, for its layout's names (Qwen3.5's
    ConditionalGeneration layout); default the text layout."""
    return family_table.iter_hf_tensors(table_for(spec, hf_config), spec, full)


def _stored_as_source(
    stream: Iterable[tuple[str, torch.Tensor]],
    table: family_table.FamilyTable,
    source_dir: Path,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's HF tensors as the source stores them (fused experts, per-tensor dtypes when
    `dtype` is the source's), then the source's carried tensors unchanged."""
    layout = hf_folder.source_layout(source_dir)
    fused = {k: n for k, n in layout["fused_experts"].items() if not table.is_carried(k)}
    if fused:
        stream = hf_experts.fuse_experts(stream, fused)
    kept: dict[str, torch.dtype] = {}
    if dtype == hf_config.dtype(json.loads((source_dir / "config.json").read_text())):
        kept = {k: hf_folder.SAFETENSORS_DTYPES[v] for k, v in layout["dtypes"].items()}
    stream = ((n, t.to(kept.get(n, dtype))) for n, t in stream)
    return itertools.chain(stream, carried_tensors(source_dir, table))


def carried_tensors(
    source_dir: str | Path, table: family_table.FamilyTable
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `source_dir` that are not the language model's, as stored."""
    if table.carried is None or not hf_folder.has_weights(source_dir):
        return
    ckpt = hf_folder.HFCheckpoint(source_dir)
    for name in ckpt.stored_keys():
        if table.is_carried(name):
            yield name, ckpt.get(name)


def copy_carried(source_dir: str | Path, out_dir: str | Path, spec) -> None:
    """Keep in `out_dir` (a distributed checkpoint's hf/ folder, beside the source's config.json)
    what an export needs of the source's tensors: the carried ones (model.safetensors) and how
    the source stores the model's (hf_folder.LAYOUT_FILE), when there is any."""
    src, out = Path(source_dir), Path(out_dir)
    layout = hf_folder.source_layout(src)
    if layout["dtypes"] or layout["fused_experts"]:
        hf_folder.write_json(out / hf_folder.LAYOUT_FILE, layout)
    table = table_for(spec, json.loads((src / "config.json").read_text()))
    carried = carried_tensors(src, table)
    first = next(carried, None)
    if first is not None:
        hf_folder.write_safetensors(
            out, itertools.chain([first], carried), max_shard_bytes=DEFAULT_SHARD_BYTES
        )


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
    (token ids, transformers_version and other fields a spec does not hold), its tokenizer
    files and generation_config.json are copied, and the tensors are written as it stores them
    (see the module docstring; `hf_tensors` named in its layout). tokenizer: an object with
    `save_pretrained` (used when there is no source folder, e.g. a model trained from scratch).
    dtype: the tensors' dtype in the files (default the spec's params_dtype). config_fields: set
    last in config.json (e.g. token ids). generation_config: written when the source has none
    (default: the config's token ids).
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or spec.params_dtype
    base = None
    if source_dir is not None:
        base = json.loads((Path(source_dir) / "config.json").read_text())
        stream = _stored_as_source(hf_tensors, table_for(spec, base), Path(source_dir), dtype)
    else:
        stream = ((n, t.to(dtype)) for n, t in hf_tensors)
    hf_folder.write_safetensors(out, stream, max_shard_bytes=max_shard_bytes)
    fields = dict(config_fields or {})
    cfg = hf_config_from_spec(spec, base=base, **fields)
    hf_config.set_dtype(cfg, dtype)  # the files' dtype, which may differ from the training one
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
    base = None
    if kwargs.get("source_dir") is not None:
        base = json.loads((Path(kwargs["source_dir"]) / "config.json").read_text())
    return write_hf_folder(out_dir, hf_named_tensors(stream, spec, base), spec, **kwargs)
