"""The process-group lifecycle: start a world, join it, split it into megatron-core's model-parallel
groups, and leave it. One process, `torchrun` ranks (NCCL on GPUs, gloo on CPU), or workers
spawned on this host.

    port = free_port()
    spawn(worker, nprocs=4, args=(port, ...))     # worker(rank, port, ...) in 4 new processes
    device = join_world()                         # torchrun's RANK/WORLD_SIZE, else a world of one
    device = join_world("gloo", rank=r, world_size=4, port=port)   # in a spawned worker
    layout = joined_layout(ParallelLayout(tp=2))  # dp from the joined world
    init_model_parallel(layout)                   # megatron-core's parallel_state
    ctx = world_context(layout, device)           # ctx.is_main, ctx.dp, ctx.broadcast(obj), ...
    leave_world()

megatron_ba.megatron.startup.setup composes these with megatron-core's CPU shims and RNG seeding
(what this layer must not know): every caller that trains, converts or benchmarks starts there.

`ctx.device` is this rank's device: cuda:LOCAL_RANK (made the current CUDA device, so that
megatron-core's `torch.cuda.current_device()` buffers land there too) when CUDA is available,
else the CPU. It is the one place a device is chosen; everything else takes it from `ctx.device`
or from its input tensors.

The world is tp x pp x cp x dp ranks (parallel_layout.ParallelLayout, which holds every rule of
the split); dp is what is left of the world size. Rank 0 (the main rank)
owns the rollout engine, the reward workers and the run folder; every rank trains. No
torch.distributed here: joining the world is collectives.init_process_group. megatron-core is
imported inside the functions that need its parallel_state.
"""

from __future__ import annotations

import faulthandler
import os
import socket
from dataclasses import dataclass

import torch

from megatron_ba.parallel import collectives
from megatron_ba.parallel.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the world: its rank, its data-parallel rank, its device, and the
    world's layout (its sizes: ctx.tp, ctx.dp, ... read the layout's)."""

    rank: int
    layout: ParallelLayout  # dp known: the joined world's
    dp_rank: int
    device: torch.device  # this rank's: cuda:LOCAL_RANK with CUDA, else cpu

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def etp(self) -> int | None:
        return self.layout.etp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        """`obj` from rank 0 to every rank (pickled; small objects and tensors)."""
        return obj if self.world == 1 else collectives.broadcast_object(obj, src=0)

    def barrier(self) -> None:
        if self.world > 1:
            collectives.barrier()


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every worker `spawn` starts imports first: loaded once into the fork server, so that a
# worker forks with it imported (megatron-core's import costs ~6 s of CPU per process; a layout
# check starts up to 8 workers, and the tests start hundreds). A name that does not import is
# skipped by the server (a light install without megatron-core).
SPAWN_PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
)


def spawn(fn, nprocs: int, args: tuple) -> None:
    """Run fn(rank, *args) in `nprocs` new worker processes on this host and wait for all; a
    worker's exception is raised here.

    The workers fork from multiprocessing's fork server, which imported SPAWN_PRELOAD once and
    holds no other state of this process: no process group, no model, no thread pool. Each
    worker gets what a fresh interpreter started now would: this process's sys.path and working
    directory (multiprocessing's preparation data), and its environment and stdout/stderr as of
    this call (the server's own are from when it started: under pytest, another test's capture)."""
    import multiprocessing

    import torch.multiprocessing as mp

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(SPAWN_PRELOAD))  # read when the server first starts
    inherited = (dict(os.environ), _ParentFd(1), _ParentFd(2))
    mp.start_processes(
        _as_if_started_now,
        args=(fn, inherited, args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


class _ParentFd:
    """A file descriptor of the spawning process, duplicated into the worker when multiprocessing
    pickles the worker's arguments (its fd-passing DupFd); it arrives as the worker's fd number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def _as_if_started_now(rank: int, fn, inherited: tuple, args: tuple) -> None:
    environment, stdout_fd, stderr_fd = inherited
    os.environ.clear()
    os.environ.update(environment)
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    # A worker killed by a signal (an abort inside gloo, a segfault) leaves no Python exception
    # for the parent to raise: its threads' Python stacks on stderr say where it was.
    faulthandler.enable()
    fn(rank, *args)


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


_ENV_SET: dict[str, str] = {}  # the variables join_world() wrote for a world of one


def join_world(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
) -> torch.device:
    """Initialise torch.distributed (NCCL with CUDA, gloo on CPU, unless `backend` says) and
    return this rank's device; with CUDA, bind this process to it (cuda:LOCAL_RANK) first, as
    NCCL needs. Without `rank`: torchrun's environment, or a world of one for a plain `python`
    launch. With rank, world_size and port: a worker spawned on this host. A no-op but for the
    device when the world is already initialised."""
    if not collectives.is_initialized() and rank is None and "RANK" not in os.environ:
        world_of_one = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
        }
        # Undone by leave_world: a process that sets up in-process (a test, a benchmark) and
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
        collectives.init_process_group(backend, rank=rank, world_size=world_size, port=port)
    return device


def joined_layout(layout: ParallelLayout) -> ParallelLayout:
    """`layout` on the joined world: dp is what its size leaves (LayoutError, key "world",
    when tp x pp x cp does not divide it; key "dp" when a given dp disagrees)."""
    return layout.for_world(collectives.world_rank_and_size()[1])


def init_model_parallel(layout: ParallelLayout) -> None:
    """megatron-core's model-parallel groups of the joined world for `layout` (once per
    process; the experts' groups only when the layout splits experts)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        experts = {}
        if layout.has_experts:
            experts = dict(
                expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp
            )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            **experts,
        )


def world_context(layout: ParallelLayout, device: torch.device) -> DistContext:
    """This rank's place in the initialised world and model-parallel groups (`layout` with dp
    known: joined_layout's)."""
    from megatron.core import parallel_state

    rank, world = collectives.world_rank_and_size()
    if layout.world != world or layout.dp != parallel_state.get_data_parallel_world_size():
        raise RuntimeError(
            f"world_context: layout {layout} is not the initialised world's ({world} ranks, "
            f"DP {parallel_state.get_data_parallel_world_size()})"
        )
    return DistContext(
        rank=rank,
        layout=layout,
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=device,
    )


def leave_world() -> None:
    """Destroy the model-parallel groups and the process group; undo a world of one's
    rendezvous variables."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    collectives.destroy_process_group()  # a no-op if an in-process vLLM engine did it already
    for key, value in list(_ENV_SET.items()):
        if os.environ.get(key) == value:  # unless something else replaced it since
            del os.environ[key]
        del _ENV_SET[key]
