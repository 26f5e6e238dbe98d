"""megatron-core distributed checkpoints of a model (layout-independent), with its spec.

    save_dist_checkpoint(chunks, spec, CKPT, source_dir=HF_DIR)   # collective
    spec = read_spec(CKPT)
    chunks = build_model_chunks(spec)                              # any TP / PP
    load_dist_checkpoint(chunks, CKPT)                             # collective

The tensors go through `megatron.core.dist_checkpointing.save/load` of the model's
`sharded_state_dict()` (the `torch_dist` format: every shard is stored with its global offsets,
so a checkpoint written at one TP x PP layout loads at another). Beside them the folder holds
`megatron_ba_spec.json` (the ModelSpec) and `hf/` (the source's config.json, tokenizer files and
generation_config.json; a Qwen3.5 source's vision tower and MTP tensors, megatron_io.copy_carried)
so `megatron-ba convert --to hf` can rebuild the model and its folder.

CPU: megatron-core 0.16.1's torch_dist save path calls `torch.cuda.synchronize()` after copying
tensors to the host (`FileSystemWriterAsync.preload_tensors`, non_blocking=True is hard-coded in
`get_save_function_and_args`), which raises on a CPU-only torch. On CPU that call is made a no-op
for the duration of the save (it waits for device copies, of which a CPU run has none). The save
also starts a `multiprocessing` manager with the spawn method, which re-imports `__main__`: a
script that saves must guard its entry point (`if __name__ == "__main__":`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from megatron_ba.conversion import hf_folder
from megatron_ba.conversion.hf_config import DTYPE_NAMES, DTYPES
from megatron_ba.conversion.megatron_io import copy_carried
from megatron_ba.megatron.mcore_compat import check_checkpoint_readable
from megatron_ba.megatron.model import ModelSpec
from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import unwrap

SPEC_FILE = "megatron_ba_spec.json"
HF_META = "hf"
FORMAT_VERSION = 1


def spec_to_json(spec) -> dict:
    from dataclasses import fields

    # config_overrides are a build's, not the checkpoint's; name is a label
    skip = ("config_overrides", "name")
    out = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in skip}
    out["params_dtype"] = DTYPE_NAMES[spec.params_dtype]
    if spec.rope_scaling is not None:  # read back as a dict (ModelShape coerces it)
        out["rope_scaling"] = dataclasses.asdict(spec.rope_scaling)
    return {"format_version": FORMAT_VERSION, "spec": out}


def spec_from_json(obj: dict):
    if obj.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{SPEC_FILE}: format_version {obj.get('format_version')!r} != 1")
    fields = dict(obj["spec"])
    fields["params_dtype"] = DTYPES[fields["params_dtype"]]
    return ModelSpec(**fields)


def read_spec(ckpt_dir: str | Path):
    path = Path(ckpt_dir) / SPEC_FILE
    if not path.is_file():
        raise ValueError(
            f"checkpoint: {str(ckpt_dir)!r} has no {SPEC_FILE} (not written by megatron-ba convert)"
        )
    return spec_from_json(json.loads(path.read_text()))


@contextlib.contextmanager
def _cpu_synchronize():
    """torch.cuda.synchronize as a no-op while a CPU-only process saves (see the docstring)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


def _single_model(chunks: list[torch.nn.Module]) -> torch.nn.Module:
    if len(chunks) != 1:
        raise ValueError(f"chunks: one model chunk expected (no virtual pipeline): {len(chunks)}")
    return unwrap(chunks[0])


def save_sharded(sharded_sd: dict, ckpt_dir: str | Path) -> Path:
    """`dist_checkpointing.save` of a sharded state dict into the new or empty `ckpt_dir`
    (collective: every rank calls it). Training checkpoints save model + optimiser this way."""
    from megatron.core import dist_checkpointing

    out = Path(ckpt_dir)
    if collectives.world_rank_and_size()[0] == 0:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"out: {str(out)!r} is not empty")
        out.mkdir(parents=True, exist_ok=True)
    if collectives.is_initialized():
        collectives.barrier()
    with _cpu_synchronize():
        dist_checkpointing.save(sharded_sd, str(out))
    return out


def load_sharded(sharded_sd: dict, ckpt_dir: str | Path) -> dict:
    """`dist_checkpointing.load`: the tensors of `sharded_sd`'s keys, resharded to this layout."""
    from megatron.core import dist_checkpointing

    check_checkpoint_readable(ckpt_dir)
    return dist_checkpointing.load(sharded_sd, str(ckpt_dir))


def write_model_meta(out: str | Path, spec, source_dir=None) -> None:
    """The spec and the source's config / tokenizer files beside the tensors (the writer rank),
    what `megatron-ba convert --to hf` rebuilds the model and its folder from; with them the
    source's tensors that are not the model's (Qwen3.5's vision tower and MTP head) and how it
    stores the model's (megatron_io.copy_carried), for the export to write them back."""
    out = Path(out)
    hf_folder.write_json(out / SPEC_FILE, spec_to_json(spec))
    if source_dir is not None:
        (out / HF_META).mkdir(exist_ok=True)
        src = Path(source_dir)
        (out / HF_META / "config.json").write_text((src / "config.json").read_text())
        hf_folder.copy_side_files(src, out / HF_META)
        copy_carried(src, out / HF_META, spec)


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """The model's megatron-core sharded state dict (one chunk: no virtual pipeline)."""
    return _single_model(chunks).sharded_state_dict()


def load_model_state(chunks: list[torch.nn.Module], state: dict) -> None:
    """Copy a loaded model state (from `load_sharded`) into the chunks' parameters."""
    _single_model(chunks).load_state_dict(state)


def save_dist_checkpoint(
    chunks: list[torch.nn.Module], spec, ckpt_dir: str | Path, *, source_dir=None
) -> Path:
    """Save the model as a distributed checkpoint in the empty (or new) folder `ckpt_dir`."""

    out = save_sharded(model_sharded_state_dict(chunks), ckpt_dir)
    if collectives.world_rank_and_size()[0] == 0:
        write_model_meta(out, spec, source_dir)
    return out


def load_dist_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Load a distributed checkpoint into this rank's chunks (any TP / PP layout). A training
    checkpoint's `dist/` folder loads too (its optimiser tensors are not read)."""
    model = _single_model(chunks)
    wanted = model.sharded_state_dict()
    state = load_sharded(wanted, ckpt_dir)
    # dist_checkpointing merges the checkpoint's whole common (non-tensor) state into the
    # result: a training checkpoint's optimiser step count and hyper-parameters among it.
    model.load_state_dict({k: v for k, v in state.items() if k in wanted})
