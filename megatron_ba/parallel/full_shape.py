"""Full-shape (TP=1 / PP=1) tensors in and out of this rank's tensor- and pipeline-parallel shards.

    full = gather_full_state_dict(chunks)            # {full name: full tensor}, on every rank
    grads = gather_full_state_dict(chunks, grads=True)
    load_full_state_dict(chunks, full)               # the same weights, any TP / PP layout
    for name, tensor in iter_full_tensors(chunks):   # streaming: one full tensor alive at a time

A full name is megatron-core's parameter name at TP=1 / PP=1: transformer layers are
`decoder.layers.{i}.{rest}` with i the global layer number, where a pipeline stage's chunk numbers
its own layers from 0 (`local_to_full_names` renumbers them). Which rows or columns of a full
tensor a rank holds is the parameter's own TP sharding (megatron-core's `tensor_model_parallel`,
`partition_dim`, `partition_stride` attributes; parallel.sharding.tp_shard cuts it). Nothing
here knows the model's architecture: any megatron-core module tree with `decoder.layers` works.
The process groups come from megatron-core's parallel_state (imported lazily: callers of the pure
helpers need no megatron-core). The Hugging Face names of these tensors are
megatron_ba.conversion's business; it names layers with the helpers below, so that the model's
renumbering and the conversion tables cannot disagree on what a layer name is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from megatron_ba.parallel import collectives
from megatron_ba.parallel.sharding import tp_shard

MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"


def split_megatron_layer(name: str) -> tuple[int, str] | None:
    """`decoder.layers.3.mlp.linear_fc2.weight` -> (3, "mlp.linear_fc2.weight"); else None."""
    m = MEGATRON_LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def megatron_layer_name(index: int, rest: str) -> str:
    return f"decoder.layers.{index}.{rest}"


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside its wrappers (DDP, Float16Module)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_to_full_names(chunks: list[torch.nn.Module]) -> dict[str, tuple[torch.nn.Parameter, str]]:
    """Full (global) name -> (local parameter, local name) for this rank's chunks."""
    out: dict[str, tuple[torch.nn.Parameter, str]] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        layers = model.decoder.layers if hasattr(model, "decoder") else []
        for local_name, param in model.named_parameters():
            name = local_name
            parts = split_megatron_layer(local_name)
            if parts:  # local index -> global layer number (1-based in megatron-core)
                name = megatron_layer_name(layers[parts[0]].layer_number - 1, parts[1])
            out[name] = (param, local_name)
    return out


def tp_sharding(param: torch.nn.Parameter) -> tuple[bool, int, int]:
    """(sharded over TP, partition dim, partition stride) of a megatron-core parameter."""
    sharded = bool(getattr(param, "tensor_model_parallel", False))
    return (
        sharded,
        int(getattr(param, "partition_dim", 0)),
        int(getattr(param, "partition_stride", 1)),
    )


@torch.no_grad()
def load_full_tensors(
    chunks: list[torch.nn.Module], read: Callable[[str], torch.Tensor]
) -> list[str]:
    """Copy full-shape tensors, fetched one at a time by `read(full_name)`, into this rank's
    shards; return the names loaded. Streaming: only one full tensor is alive at a time.

    A tied model's last stage at PP > 1 holds a copy of the embedding (`output_layer.weight`,
    marked `shared_embedding` by megatron-core): it is read as the embedding.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    loaded = []
    for name, (param, _) in local_to_full_names(chunks).items():
        source = EMBEDDING if getattr(param, "shared_embedding", False) else name
        src = read(source)
        sharded, dim, stride = tp_sharding(param)
        piece = tp_shard(src, dim=dim, stride=stride, rank=rank, size=tp) if sharded else src
        if piece.shape != param.shape:
            raise ValueError(
                f"full: {name!r} has shape {tuple(src.shape)}, which does not shard to this "
                f"rank's {tuple(param.shape)} (tp={tp}, dim={dim}, stride={stride})"
            )
        param.copy_(piece.to(param.dtype))
        loaded.append(name)
    return loaded


def load_full_state_dict(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy a full-shape (TP=1, PP=1 names) state dict into this rank's shards.

    Every parameter this rank holds must be in `full` with the full shape (ValueError
    otherwise); entries for other pipeline stages are ignored.
    """

    def read(name: str) -> torch.Tensor:
        if name not in full:
            raise ValueError(f"full: missing parameter {name!r}")
        return full[name]

    load_full_tensors(chunks, read)


def _local_tensor(param: torch.nn.Parameter, grads: bool) -> torch.Tensor:
    if not grads:
        return param.detach()
    t = getattr(param, "main_grad", None)
    if t is None:
        t = param.grad
    return (torch.zeros_like(param) if t is None else t).detach()


def gather_full_state_dict(
    chunks: list[torch.nn.Module], *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """The full-shape (TP=1, PP=1 names) parameters, or their gradients, on every rank.

    A collective over the tensor- and pipeline-parallel groups: every rank of them must call it.
    Gradients are read from `main_grad` (megatron-core DDP) or `.grad`; call it after the
    schedule's `finalize_model_grads` to see the data-parallel-reduced gradient. Tensors come
    back as CPU copies in the parameters' dtype. Holds the whole model once more; to stream
    (an export), use `iter_full_tensors`.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    local: dict[str, torch.Tensor] = {}
    for name, (param, _) in local_to_full_names(chunks).items():
        t = _local_tensor(param, grads)
        sharded, dim, stride = tp_sharding(param)
        if sharded:
            t = collectives.gather_tensor_parallel(t, dim=dim, stride=stride, group=tp_group)
        local[name] = t.to(param.dtype).clone()  # a copy: buffers change at the next step
    merged = collectives.gather_pipeline_stages(local, group=pp_group)
    return {k: v.cpu() for k, v in sorted(merged.items(), key=lambda kv: _order(kv[0]))}


def iter_full_tensors(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(full name, full-shape CPU tensor) of every parameter, one at a time, on every rank.

    The streaming form of `gather_full_state_dict` (a collective over the TP and PP groups:
    every rank must exhaust the iterator): one full tensor is alive at a time, so an export
    needs the model's shards plus its largest tensor, not a second copy of the model.
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    held = local_to_full_names(chunks)
    # The names of every stage (empty placeholders travel, not the tensors).
    names = collectives.gather_pipeline_stages({k: torch.empty(0) for k in held}, group=pp_group)
    for name in sorted(names, key=_order):
        one: dict[str, torch.Tensor] = {}
        if name in held:
            param = held[name][0]
            t = param.detach()
            sharded, dim, stride = tp_sharding(param)
            if sharded:
                t = collectives.gather_tensor_parallel(t, dim=dim, stride=stride, group=tp_group)
            one[name] = t.clone()
        yield name, collectives.gather_pipeline_stages(one, group=pp_group)[name].cpu()


def _order(name: str) -> tuple[int, int, str]:
    parts = split_megatron_layer(name)
    if name.startswith("embedding."):
        return (0, 0, name)
    if parts:
        return (1, parts[0], name)
    return (2, 0, name)
