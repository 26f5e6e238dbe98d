"""Expert parallelism in conversion: this rank's local expert numbers <-> global ones.

    read = global_reader(read, spec)        # loading: a local name reads its global expert
    stream = gather_experts(stream, spec)   # exporting: every EP rank's experts, global names

Under expert parallelism (EP) megatron-core gives EP rank r the experts r * E / ep ..
(r + 1) * E / ep - 1 of every MoE layer, numbered from 0 in its module tree
(`mlp.experts.local_experts.{j}`). megatron_ba.parallel.full_shape names parameters by their
module names, so an expert's full-shape name carries its local number; the conversion tables
want the global one. Loading renumbers the name before reading the Hugging Face tensors;
exporting gathers each expert tensor over the EP group (a collective: every EP rank walks the
same local names in the same order) and yields every rank's copy under its global name.
Expert tensor parallelism (TP > 1 together with EP > 1) is refused: full_shape gathers experts
over the TP group, which is then not the experts' tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from megatron_ba.conversion.family_table import EXPERT, canonical_name, expert_name
from megatron_ba.parallel import collectives
from megatron_ba.parallel.full_shape import megatron_layer_name, split_megatron_layer


def expert_layout(spec) -> tuple[int, int, Any]:
    """(EP rank, EP size, EP group) of this rank for `spec`; (0, 1, None) without EP."""
    if not getattr(spec, "num_experts", 0):
        return 0, 1, None
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return 0, 1, None
    if ps.get_tensor_model_parallel_world_size() > 1 or (
        ps.get_expert_tensor_parallel_world_size() > 1
    ):
        raise ValueError(
            f"expert_model_parallel_size: {ep} together with tensor parallelism is not "
            "converted (experts are gathered over the TP group, not their own); use TP=1 with EP"
        )
    # ep divides the experts: the model was built for its layout (ParallelLayout.check_model)
    return ps.get_expert_model_parallel_rank(), ep, ps.get_expert_model_parallel_group()


def global_name(name: str, spec, rank: int, ep: int) -> str | None:
    """The full-shape name of local expert parameter `name` on EP rank `rank`, in the local
    spelling with the global expert number; None when `name` is no expert's."""
    parts = split_megatron_layer(canonical_name(name))
    m = EXPERT.match(parts[1]) if parts is not None else None
    if m is None:
        return None
    j = rank * (spec.num_experts // ep) + int(m.group(1))
    return megatron_layer_name(parts[0], expert_name(j, m.group(2)))


def global_reader(read: Callable[[str], torch.Tensor], spec) -> Callable[[str], torch.Tensor]:
    """`read` (full name -> tensor) for this rank's local names: experts read their global one."""
    rank, ep, _ = expert_layout(spec)
    if ep == 1:
        return read
    return lambda name: read(global_name(name, spec, rank, ep) or name)


def gather_experts(
    stream: Iterable[tuple[str, torch.Tensor]], spec
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's full-shape tensors with every EP rank's experts, under global numbers.
    Collective over the EP group: every rank of it must exhaust the iterator."""
    rank, ep, group = expert_layout(spec)
    for name, t in stream:
        g = global_name(name, spec, rank, ep) if ep > 1 else None
        if g is None:
            yield name, t
            continue
        every = collectives.gather_pipeline_stages({g: t}, group=group)
        yield from ((k, every[k].cpu()) for k in sorted(every))
