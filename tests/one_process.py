"""A measurement in one spawned megatron process (a world of one), its JSON result returned.

    result = measure_in_one_process(compute, arg, ..., out=tmp_path / "result.json")

`compute(*args) -> dict` (a module-level function, so that the worker can import it) runs in a
process of its own with megatron-core's parallel state started as the trainer starts it
(startup.setup: TP = PP = DP = 1, gloo), one thread, and the warnings of absent GPU kernels
silenced; the parent pytest process keeps none of megatron's global state. The result is printed
to stderr (`pytest -s` shows the measured figures) and returned.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path


def _worker(rank: int, port: int, compute, args: tuple, out: str) -> None:
    import torch

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    setup(ParallelLayout(dp=None), seed=0, rank=rank, world_size=1, port=port)
    result = compute(*args)
    teardown()
    Path(out).write_text(json.dumps(result, indent=1))


def measure_in_one_process(compute, *args, out: Path) -> dict:
    """compute(*args) in one spawned megatron process; its result, read back from `out`."""
    from megatron_ba.parallel.world import free_port, spawn

    spawn(_worker, 1, (free_port(), compute, args, str(out)))
    result = json.loads(Path(out).read_text())
    print(json.dumps(result, indent=1), file=sys.stderr)
    return result
