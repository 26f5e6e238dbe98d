"""Every collective megatron-ba issues, in one place.

- `StatisticsReducer`: the SUM all-reduce of the per-group plan statistics over the data-parallel
  group, once per global batch (it counts its calls and the bytes it moves, so tests and benchmarks
  can check "one collective of O(groups) numbers per step").
- `gather_tensor_parallel` / `gather_pipeline_stages`: full-shape parameters and gradients from
  TP shards and PP stages (checks, weight sync to an inference engine).
- `gather_tensor_parallel_to`, `send_within_group`, `gather_object_to`: the rollout engines'
  share of the work (weight refit within a model-parallel group to its engine rank; samples of
  every engine to the scoring rank).
- `broadcast_from_last_stage`, `gather_context_parallel`: results of the last pipeline stage
  (log-probs) to every stage, and whole sequences from context-parallel shards.
- `singleton_group`: a process group of this rank alone (a model that must not see CP).
- `all_reduce_max_`, `sum_over_tensor_parallel`, `all_gather_stacked`: the vocab-parallel
  log-softmax's three collectives over the TP group (megatron_ba.megatron.vocab_parallel).
- `init_process_group` / `destroy_process_group`, `world_rank_and_size`, `world_group`,
  `barrier`, `broadcast_object`, `all_gather_object`: the world's lifecycle and the small
  picklable exchanges of the trainer (parallel/world.py), the layout check's workers and the
  benchmarks. Nothing outside this module calls torch.distributed (tests/test_code_structure.py).

Process groups are arguments (no parallel_state lookups here), so the module is torch alone.
Buffers live where the group's backend needs them (`comm_device`: the current CUDA device for
NCCL, the CPU for gloo); results come back on the caller's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_ba.aggregation import NUM_COLUMNS
from megatron_ba.parallel.sharding import Stride, cp_unshard, tp_unshard


def comm_device(group) -> torch.device:
    """Where tensors must be for collectives over `group`: CUDA for NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        out = table.to(comm_device(self.group), copy=True).contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(table.device)

    def reset(self) -> None:
        self.calls = 0
        self.bytes_reduced = 0
        self.last_payload_bytes = 0
        self.history.clear()


def statistics_payload_bytes(num_groups: int, num_columns: int | None = None) -> int:
    """Bytes one statistics all-reduce moves per rank: num_groups x columns float64 numbers."""
    if num_columns is None:
        num_columns = NUM_COLUMNS
    return int(num_groups) * int(num_columns) * 8


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def gather_tensor_parallel(shard: torch.Tensor, *, dim: int, stride: Stride, group) -> torch.Tensor:
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
    device = comm_device(group)
    out: dict[str, torch.Tensor] = {}
    for stage, meta in enumerate(metas):
        src = dist.get_global_rank(group, stage)
        for name, shape, dtype in meta:
            if name in out:
                raise ValueError(f"gather_pipeline_stages: {name!r} is held by two stages")
            t = (
                local[name].to(device).contiguous()
                if stage == me
                else torch.empty(shape, dtype=dtype, device=device)
            )
            dist.broadcast(t, src=src, group=group)
            out[name] = t
    return out


def gather_tensor_parallel_to(
    shard: torch.Tensor, *, dim: int, stride: Stride, group, dst: int = 0
) -> torch.Tensor | None:
    """The full tensor from the TP shards of `group` on its rank `dst` only (None elsewhere):
    the weight refit needs it on the engine's rank alone, not on every rank."""
    size = _world(group)
    if size == 1:
        return shard.clone()
    device = comm_device(group)
    buf = shard.to(device).contiguous()
    me = dist.get_rank(group)
    parts = [torch.empty_like(buf) for _ in range(size)] if me == dst else None
    dist.gather(buf, gather_list=parts, dst=dist.get_global_rank(group, dst), group=group)
    if me != dst:
        return None
    return tp_unshard(parts, dim=dim, stride=stride).to(shard.device)


def send_within_group(
    tensor: torch.Tensor | None, *, src: int, dst: int, shape, dtype, device, group
) -> torch.Tensor | None:
    """`tensor` of group rank `src` on group rank `dst` (point to point; only those two ranks
    call; None on the sender). `device`: where the receiver wants it."""
    me = dist.get_rank(group)
    comm = comm_device(group)
    if me == src:
        dist.send(tensor.to(comm).contiguous(), dst=dist.get_global_rank(group, dst), group=group)
        return None
    if me != dst:
        raise ValueError(f"send_within_group: group rank {me} is neither src {src} nor dst {dst}")
    buf = torch.empty(shape, dtype=dtype, device=comm)
    dist.recv(buf, src=dist.get_global_rank(group, src), group=group)
    return buf.to(device)


def gather_object_to(obj, *, group, dst: int = 0) -> list | None:
    """Every rank's picklable `obj` on group rank `dst`, in group rank order (None elsewhere):
    each rollout engine's samples to the scoring rank."""
    if group is None or _world(group) == 1:
        return [obj]
    me = dist.get_rank(group)
    out: list | None = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, dst), group=group)
    return out


def broadcast_from_last_stage(tensor: torch.Tensor | None, *, shape, dtype, group) -> torch.Tensor:
    """`tensor` from the last rank of the pipeline `group` on every rank of it."""
    size = _world(group)
    if size == 1:
        return tensor
    last = dist.get_global_rank(group, size - 1)
    device = comm_device(group)
    if dist.get_rank(group) == size - 1:
        buf = tensor.to(device).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=device)
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
    if _world(group) == 1:
        return t.clone()
    out = t.to(comm_device(group), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.to(t.device)


def broadcast_object_from_last_stage(obj, *, group):
    """A picklable object (e.g. metric names) from the last rank of `group` on every rank."""
    size = _world(group)
    if size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, size - 1), group=group)
    return box[0]


# --- the vocab-parallel log-softmax's collectives (megatron_ba.megatron.vocab_parallel) ---------


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, size) in `group`; (0, 1) for None (the tensor is not sharded)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def all_reduce_max_(t: torch.Tensor, group) -> torch.Tensor:
    """In-place MAX over `group` (None: unchanged). No gradient: used for a softmax's shift."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class _SumOverTensorParallel(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: the loss downstream is replicated over the TP
    ranks, so d loss / d (this rank's summand) = d loss / d (the sum), which each rank has."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_tensor_parallel(t: torch.Tensor, group) -> torch.Tensor:
    """Differentiable SUM over the TP `group` (see _SumOverTensorParallel for the backward)."""
    return _SumOverTensorParallel.apply(t, group)


def all_gather_stacked(t: torch.Tensor, group) -> torch.Tensor:
    """[...] per rank -> [size, ...], rank r's tensor in row r (None: a stack of one)."""
    if group is None:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


# --- the world: process-group lifecycle and picklable objects -------------------------------


def default_backend() -> str:
    """NCCL where CUDA is available, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
) -> None:
    """Join the world. With `port`: `world_size` processes on this host meet at 127.0.0.1:port
    (spawned workers); without: torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE)."""
    if (rank is None) != (world_size is None):
        raise ValueError("init_process_group: give rank and world_size together, or neither")
    kwargs = {}
    if port is not None:
        if rank is None:
            raise ValueError("init_process_group: a port needs rank and world_size")
        kwargs["init_method"] = f"tcp://127.0.0.1:{int(port)}"
    if rank is not None:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend=backend or default_backend(), **kwargs)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy_process_group() -> None:
    """Leave the world (nothing to do when it is not initialised: an in-process vLLM engine may
    have destroyed it already)."""
    if is_initialized():
        dist.destroy_process_group()


def world_rank_and_size() -> tuple[int, int]:
    """(rank, size) in the world; (0, 1) before init_process_group."""
    if not is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def world_group():
    """The group of every rank (to pass where a group argument is wanted)."""
    return dist.group.WORLD


def barrier(group=None) -> None:
    """Wait for every rank of `group` (the world by default); nothing to wait for alone."""
    if is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj, *, src: int = 0, group=None):
    """A picklable object from global rank `src` on every rank of `group` (the world by
    default); the other ranks' `obj` is ignored."""
    if not is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj, *, group=None) -> list:
    """Every rank's picklable `obj`, in rank order of `group` (the world by default)."""
    if not is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def sum_microbatch_metrics(store: list[dict], *, last: bool, dp_group, pp_group) -> dict:
    """Per-micro-batch scalar metrics (name -> 0-d tensor) summed over micro-batches on the last
    pipeline stage, over `dp_group` there, and sent to every stage: name -> float everywhere.

    The names travel from the last stage (other stages have no loss, so no metrics of their own).
    """
    keys = broadcast_object_from_last_stage(
        sorted(store[0]) if last and store else [], group=pp_group
    )
    local = torch.zeros(len(keys), dtype=torch.float64)
    if last:
        for d in store:
            local += torch.stack([d[k].detach().double().reshape(()).cpu() for k in keys])
        local = all_reduce_sum(local, group=dp_group)
    total = broadcast_from_last_stage(local, shape=local.shape, dtype=local.dtype, group=pp_group)
    return {k: float(v) for k, v in zip(keys, total.tolist(), strict=True)}
