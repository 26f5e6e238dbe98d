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

Mixture-of-experts: an expert's parameter (`...mlp.experts.local_experts.{j}...`) is sharded
over the expert-tensor-parallel group (megatron-core's `expert_tensor_parallel_size`, by default
the TP group) and, under expert parallelism (EP), EP rank r holds experts r*n .. r*n + n - 1 of
each layer as local 0 .. n-1. `gather_full_state_dict` and `load_full_state_dict` name experts by
their global number (gathered over the EP group); `local_to_full_names`, `load_full_tensors` and
`iter_full_tensors` keep the local number (megatron_ba.conversion.experts renumbers those).
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
LOCAL_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..+)$")


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


def tp_sharding(param: torch.nn.Parameter) -> tuple[bool, int, int | tuple[int, ...]]:
    """(sharded over TP, partition dim, partition stride) of a megatron-core parameter. The
    stride is the tuple `partition_sections` (full sizes of unequal fused parts; set by the
    model builder where megatron-core's layout needs it: sharding.tp_shard) when present."""
    sharded = bool(getattr(param, "tensor_model_parallel", False))
    sections = getattr(param, "partition_sections", None)
    return (
        sharded,
        int(getattr(param, "partition_dim", 0)),
        tuple(sections) if sections is not None else int(getattr(param, "partition_stride", 1)),
    )


def is_expert_name(name: str) -> bool:
    """An expert's parameter (routed experts; not the router, not shared experts)."""
    return ".experts." in name and ".shared_experts." not in name


def _tp_of(name: str) -> tuple[int, int, object]:
    """(rank, size, group) of the tensor-parallel group that shards parameter `name`: the
    expert-tensor-parallel one for experts."""
    from megatron.core import parallel_state as ps

    if is_expert_name(name):
        return (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def global_expert_names(names) -> dict[str, str]:
    """Local full name -> the name with the global expert number, for this rank's experts
    (EP rank r of size n per layer: local j is r*n + j); other names map to themselves."""
    if not any(LOCAL_EXPERT.match(name) for name in names):
        return {name: name for name in names}
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    per_layer: dict[str, int] = {}
    for name in names:
        m = LOCAL_EXPERT.match(name)
        if m:
            per_layer[m.group(1)] = max(per_layer.get(m.group(1), 0), int(m.group(2)) + 1)
    out = {}
    for name in names:
        m = LOCAL_EXPERT.match(name)
        if m is None:
            out[name] = name
        else:
            j = ep_rank * per_layer[m.group(1)] + int(m.group(2))
            out[name] = f"{m.group(1)}{j}{m.group(3)}"
    return out


@torch.no_grad()
def load_full_tensors(
    chunks: list[torch.nn.Module], read: Callable[[str], torch.Tensor]
) -> list[str]:
    """Copy full-shape tensors, fetched one at a time by `read(full_name)`, into this rank's
    shards; return the names loaded. Streaming: only one full tensor is alive at a time.

    A tied model's last stage at PP > 1 holds a copy of the embedding (`output_layer.weight`,
    marked `shared_embedding` by megatron-core): it is read as the embedding.
    """
    loaded = []
    for name, (param, _) in local_to_full_names(chunks).items():
        source = EMBEDDING if getattr(param, "shared_embedding", False) else name
        src = read(source)
        rank, tp, _ = _tp_of(name)
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

    names = global_expert_names(list(local_to_full_names(chunks)))
    load_full_tensors(chunks, lambda name: read(names.get(name, name)))


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
    back as CPU copies in the parameters' dtype. Experts: gathered over their own tensor-parallel
    group, then over the expert-parallel group, under global expert numbers. Holds the whole
    model once more; to stream (an export), use `iter_full_tensors`.
    """
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    held = local_to_full_names(chunks)
    names = global_expert_names(list(held))
    local: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    for name, (param, _) in held.items():
        t = _local_tensor(param, grads)
        sharded, dim, stride = tp_sharding(param)
        if sharded:
            group = _tp_of(name)[2]
            t = collectives.gather_tensor_parallel(t, dim=dim, stride=stride, group=group)
        # a copy: buffers change at the next step
        (experts if is_expert_name(name) else local)[names[name]] = t.to(param.dtype).clone()
    if experts:  # every rank of an EP group holds experts (the same layers)
        ep_group = parallel_state.get_expert_model_parallel_group()
        local.update(collectives.gather_pipeline_stages(experts, group=ep_group))
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
