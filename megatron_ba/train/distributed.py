"""Process-group setup for the local backend: one process, or `torchrun` ranks (NCCL on GPUs,
gloo on CPU).

    ctx = setup(tp=1, pp=1, cp=1, seed=0)   # reads torchrun's RANK/WORLD_SIZE when present
    ctx.is_main, ctx.dp, ctx.dp_rank, ctx.device, ctx.broadcast(obj), ctx.barrier()
    teardown()

`ctx.device` is this rank's device: cuda:LOCAL_RANK (made the current CUDA device, so that
megatron-core's `torch.cuda.current_device()` buffers land there too) when CUDA is available,
else the CPU. It is the one place a device is chosen; everything else takes it from `ctx.device`
or from its input tensors.

The world is tp x pp x cp x dp ranks; dp is what is left of the world size. Rank 0 (the main rank)
owns the rollout engine, the reward workers and the run folder; every rank trains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_ba.parallel import collectives
from megatron_ba.parallel.launch import free_port


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    dp_rank: int
    device: torch.device  # this rank's: cuda:LOCAL_RANK with CUDA, else cpu

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        """`obj` from rank 0 to every rank (pickled; small objects and tensors)."""
        return obj if self.world == 1 else collectives.broadcast_object(obj, src=0)

    def barrier(self) -> None:
        if self.world > 1:
            collectives.barrier()


def rank_device(local_rank: int | None = None) -> torch.device:
    """This process's device: cuda:LOCAL_RANK with CUDA (one GPU per rank), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(
            f"LOCAL_RANK: {local_rank} has no GPU on this node ({count} visible); launch at "
            f"most {count} processes per node"
        )
    return torch.device("cuda", local_rank)


_ENV_SET: dict[str, str] = {}  # the variables setup() wrote for a world of one


def setup(*, tp: int, pp: int, cp: int, seed: int) -> DistContext:
    """Initialise torch.distributed (NCCL with CUDA, gloo on CPU) and megatron-core's parallel
    state; with CUDA, bind this process to its GPU (cuda:LOCAL_RANK) first, as NCCL needs."""
    from megatron.core import parallel_state

    if not collectives.is_initialized():
        if "RANK" not in os.environ:  # a plain `python` launch: a world of one
            world_of_one = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
            }
            # Undone by teardown: a process that sets up in-process (a test, a benchmark) and
            # later launches children must not hand them this rendezvous (its store's port is
            # still held here: EADDRINUSE), nor make them believe they are torchrun ranks.
            _ENV_SET.update(world_of_one)
            os.environ.update(world_of_one)
    device = rank_device()
    if device.type == "cuda":
        # Before the process group: NCCL's communicators and every `torch.cuda.current_device()`
        # buffer of megatron-core belong to this rank's GPU, not all to cuda:0.
        torch.cuda.set_device(device)
    if not collectives.is_initialized():
        collectives.init_process_group()  # NCCL with CUDA, else gloo; torchrun's environment
    rank, world = collectives.world_rank_and_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"parallel: the world size {world} is not a multiple of tp*pp*cp = {tp * pp * cp} "
            f"(launch with torchrun --nproc-per-node {tp * pp * cp} or a multiple of it)"
        )
    if not torch.cuda.is_available():
        from megatron_ba.megatron import cpu_compat

        cpu_compat.install()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
        )
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from megatron_ba.megatron.cpu_compat import seed_model_parallel_rng

        seed_model_parallel_rng(seed)
    return DistContext(
        rank=rank,
        world=world,
        tp=tp,
        pp=pp,
        cp=cp,
        dp=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
    )


def teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    collectives.destroy_process_group()  # a no-op if an in-process vLLM engine did it already
    for key, value in list(_ENV_SET.items()):
        if os.environ.get(key) == value:  # unless something else replaced it since
            del os.environ[key]
        del _ENV_SET[key]
