"""Starting local worlds: a free port to meet at, and worker processes spawned to join it.

    port = free_port()
    spawn(worker, nprocs=4, args=(port, ...))     # worker(rank, port, ...) in 4 fresh processes
    # in the worker: collectives.init_process_group("gloo", rank=rank, world_size=4, port=port)

Used by the layout check, the benchmarks and a plain `python` training launch (a world of one).
No torch.distributed here: joining the world is collectives.init_process_group.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, args: tuple) -> None:
    """Run fn(rank, *args) in `nprocs` fresh interpreters ("spawn": no state of this process is
    inherited) and wait for all; a worker's exception is raised here."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
