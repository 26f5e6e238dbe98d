"""Stopping NeMo-Aligner's loop at a step boundary when the cluster asks, so that a requeued job
continues from a checkpoint with no step lost: the NeMo backend's side of the launcher's protocol
(slurm/lib.sh; the local backend's side is megatron_ba/train/preemption.py).

NeMo-Aligner's `fit` asks its run timer (exp_manager.max_time_per_run) after every step whether
time is up; when it is, the loop validates, saves a checkpoint and returns. `RunTimerWithRequests`
also says yes once RUN_DIR/PREEMPT exists (slurm/lib.sh writes it when Slurm signals the batch
shell before the time limit, `--signal=B:USR1@300`). The answer is summed over all ranks, one
all-reduce per step, so that every rank stops after the same step. train_grpo then writes
RUN_DIR/preempted.json ({"step": N}) and exits with PREEMPTED_EXIT_CODE: the launcher requeues
the job, and NeMo's resume_if_exists continues from that checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_ba.parallel import collectives

# The launcher's protocol, as megatron_ba/train/preemption.py has it (a test checks they agree).
REQUEST_FILE = "PREEMPT"
MARKER_FILE = "preempted.json"
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which a requeue does


class RunTimerWithRequests:
    """NeMo-Aligner's run timer (its utils.distributed.Timer) that also finishes on request.

    NeMo's own `is_finished` broadcasts rank 0's clock; here rank 0's clock and every rank's
    look at the request file go in one sum over the world. `requested` says which it was.
    """

    def __init__(self, timer, run_dir: str | Path) -> None:
        self.timer = timer
        self.request = Path(run_dir) / REQUEST_FILE
        self.requested = False

    def start_time(self) -> None:
        self.timer.start_time()

    def get_time_remaining(self) -> float:
        return self.timer.get_time_remaining()

    def is_finished(self) -> bool:
        rank, _ = collectives.world_rank_and_size()
        timed_out = rank == 0 and self.timer.get_time_remaining() <= 0
        votes = torch.tensor([float(timed_out), float(self.request.exists())], dtype=torch.float64)
        world = collectives.world_group() if collectives.is_initialized() else None
        timed_out, asked = collectives.all_reduce_sum(votes, group=world)
        self.requested = bool(asked > 0)
        return bool(timed_out > 0) or self.requested

    def __repr__(self) -> str:
        return f"RunTimerWithRequests({self.timer!r}, request={str(self.request)!r})"


def mark_preempted(run_dir: str | Path, step: int) -> None:
    """RUN_DIR/preempted.json: the launcher's sure sign (rank 0, after the checkpoint)."""
    (Path(run_dir) / MARKER_FILE).write_text(json.dumps({"step": step}) + "\n")
