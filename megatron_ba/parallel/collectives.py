"""Every collective megatron-ba issues, in one place.

- `StatisticsReducer`: the SUM all-reduce of the per-group plan statistics over the data-parallel
  group, once per global batch (it counts its calls and the bytes it moves, so tests and benchmarks
  can check "one collective of O(groups) numbers per step").
- `gather_tensor_parallel` / `gather_pipeline_stages`: full-shape parameters and gradients from
  TP shards and PP stages (checks, weight sync to an inference engine).
- `broadcast_from_last_stage`, `gather_context_parallel`: results of the last pipeline stage
  (log-probs) to every stage, and whole sequences from context-parallel shards.
- `singleton_group`: a process group of this rank alone (a model that must not see CP).

Process groups are arguments (no parallel_state lookups here), so the module is torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ba.parallel.layout import cp_unshard, tp_unshard


@dataclass
class StatisticsReducer:
    """Sums a plan-statistics table over `group` (the data-parallel group, without CP).

    Pass an instance as `reduce=` to `LossPlan.build` / `plan_statistics`. Context-parallel peers
    hold shards of the *same* sequences, so they must not be in the group (their statistics
    would be counted cp times); tensor-parallel and pipeline peers likewise hold the same batch.
    With `group=None` (or a group of one) the table is returned unchanged, still counted.
    """

    group: object | None = None
    calls: int = 0
    bytes_reduced: int = 0
    last_payload_bytes: int = 0
    history: list[int] = field(default_factory=list)

    def __call__(self, table: torch.Tensor) -> torch.Tensor:
        if table.dtype != torch.float64:
            raise ValueError(f"table: the statistics table must be float64, got {table.dtype}")
        self.calls += 1
        payload = table.numel() * table.element_size()
        self.last_payload_bytes = payload
        self.bytes_reduced += payload
        self.history.append(payload)
        if self.group is None or dist.get_world_size(self.group) == 1:
            return table
        out = table.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def reset(self) -> None:
        self.calls = 0
        self.bytes_reduced = 0
        self.last_payload_bytes = 0
        self.history.clear()


def statistics_payload_bytes(num_groups: int, num_columns: int | None = None) -> int:
    """Bytes one statistics all-reduce moves per rank: num_groups x columns float64 numbers."""
    if num_columns is None:
        from megatron_ba.aggregation import NUM_COLUMNS

        num_columns = NUM_COLUMNS
    return int(num_groups) * int(num_columns) * 8


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def gather_tensor_parallel(shard: torch.Tensor, *, dim: int, stride: int, group) -> torch.Tensor:
    """The full tensor from the TP shards of every rank of `group` (megatron-core layout)."""
    size = _world(group)
    if size == 1:
        return shard.clone()
    shard = shard.contiguous()
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard, group=group)
    return tp_unshard(parts, dim=dim, stride=stride)


def gather_pipeline_stages(local: dict[str, torch.Tensor], *, group) -> dict[str, torch.Tensor]:
    """The union of every pipeline stage's {name: tensor}, on every rank of `group`.

    Names, shapes and dtypes travel as objects; the tensors by broadcast from their owner stage
    (so this works on NCCL with device tensors as on gloo).
    """
    size = _world(group)
    if size == 1:
        return dict(local)
    meta_local = [(k, tuple(v.shape), v.dtype) for k, v in local.items()]
    metas: list = [None] * size
    dist.all_gather_object(metas, meta_local, group=group)
    me = dist.get_rank(group)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    for stage, meta in enumerate(metas):
        src = dist.get_global_rank(group, stage)
        for name, shape, dtype in meta:
            if name in out:
                raise ValueError(f"gather_pipeline_stages: {name!r} is held by two stages")
            t = (
                local[name].contiguous()
                if stage == me
                else torch.empty(shape, dtype=dtype, device=device)
            )
            dist.broadcast(t, src=src, group=group)
            out[name] = t
    return out


def broadcast_from_last_stage(tensor: torch.Tensor | None, *, shape, dtype, group) -> torch.Tensor:
    """`tensor` from the last rank of the pipeline `group` on every rank of it."""
    size = _world(group)
    if size == 1:
        return tensor
    last = dist.get_global_rank(group, size - 1)
    if dist.get_rank(group) == size - 1:
        buf = tensor.contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype)
    dist.broadcast(buf, src=last, group=group)
    return buf


def gather_context_parallel(part: torch.Tensor, *, dim: int, group) -> torch.Tensor:
    """The whole sequence from this CP rank's load-balanced part and its peers' (every rank)."""
    size = _world(group)
    if size == 1:
        return part
    part = part.contiguous()
    parts = [torch.empty_like(part) for _ in range(size)]
    dist.all_gather(parts, part, group=group)
    return cp_unshard(parts, dim=dim)


def singleton_group():
    """A process group holding this rank alone (collective: every rank of the world calls it)."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


def all_reduce_sum(t: torch.Tensor, *, group) -> torch.Tensor:
    """A SUM over `group` of a copy of `t` (metrics of a step)."""
    out = t.clone()
    if _world(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def broadcast_object_from_last_stage(obj, *, group):
    """A picklable object (e.g. metric names) from the last rank of `group` on every rank."""
    size = _world(group)
    if size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, size - 1), group=group)
    return box[0]
