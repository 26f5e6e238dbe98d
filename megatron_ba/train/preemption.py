"""Stopping a run at a step boundary when the cluster asks, so that a requeued job resumes with
no step lost or repeated.

    install()                              # megatron-ba train: SIGUSR1 sets this process's flag
    if should_stop(ctx, run_dir): ...      # every rank, after each step: the ranks' agreed answer
    stop(trainer, step)                    # checkpoint at `step` unless just saved; raise Preempted

Two ways to ask: SIGUSR1 to a training process (`kill -USR1 PID`, `srun --signal`), or the file
RUN_DIR/PREEMPT (slurm/lib.sh writes it when its batch shell receives `--signal=B:USR1@s`).
The file is how the Slurm launcher forwards the signal: the training processes sit under torchrun,
whose agent is killed by SIGUSR1 (it handles TERM/INT/HUP/QUIT only), and signalling the whole
step would also reach the vLLM engine and reward worker processes, which die on it. The run
folder is on the file system every node shares anyway (checkpoints are written there).

Ranks must stop at the same step: a rank that stopped alone would leave the others blocked in the
next step's collectives. So each rank's local answer (flag or file) is summed over the world once
per step, one integer (megatron_ba.parallel.collectives.all_reduce_sum), and all stop if any asked.

After the checkpoint rank 0 writes RUN_DIR/preempted.json ({"step": N}) and `megatron-ba train`
exits with PREEMPTED_EXIT_CODE. torchrun turns any worker's failure into exit status 1, so the
launcher looks for preempted.json, not only for the code, before it requeues the job.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which a requeue does
REQUEST_FILE = "PREEMPT"
MARKER_FILE = "preempted.json"

_requested = False


class Preempted(Exception):
    """Raised out of Trainer.run() once the checkpoint of `step` is on disk."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted: checkpoint of step {step} saved, stopping")
        self.step = step


def _on_signal(signum, frame) -> None:  # the signal module's signature
    global _requested
    _requested = True  # only a flag: the step in flight finishes, the check below acts on it


def install(signals=(signal.SIGUSR1,)) -> None:
    """Route `signals` to this process's flag (call once per process, before training)."""
    global _requested
    _requested = False
    for s in signals:
        signal.signal(s, _on_signal)


def requested_here(run_dir: Path) -> bool:
    """This rank's own answer: its flag, or the request file in the run folder."""
    return _requested or (Path(run_dir) / REQUEST_FILE).exists()


def should_stop(ctx, run_dir: Path) -> bool:
    """True on every rank when any rank was asked to stop (a collective: every rank calls it)."""
    mine = requested_here(run_dir)
    if ctx.world == 1:
        return mine
    import torch
    import torch.distributed as dist

    from megatron_ba.parallel.collectives import all_reduce_sum

    votes = all_reduce_sum(torch.tensor([int(mine)], dtype=torch.int64), group=dist.group.WORLD)
    return int(votes.item()) > 0


def clear(run_dir: Path) -> None:
    """Forget an earlier request and marker (the launcher's, before it starts or resumes)."""
    for name in (REQUEST_FILE, MARKER_FILE):
        (Path(run_dir) / name).unlink(missing_ok=True)


def stop(trainer, step: int) -> None:
    """Checkpoint `step` (collective) unless the last checkpoint is that step; mark and raise."""
    from megatron_ba.train import checkpoint

    latest = checkpoint.latest_dir(trainer.run_dir)
    if latest is None or latest.name != checkpoint.step_dir_name(step):
        trainer._checkpoint(step)
    if trainer.ctx.is_main:
        (Path(trainer.run_dir) / REQUEST_FILE).unlink(missing_ok=True)  # the request is served
        marker = Path(trainer.run_dir) / MARKER_FILE
        marker.write_text(json.dumps({"step": step}) + "\n")
        trainer.log(f"[preempt] checkpoint of step {step} saved; stopping for a requeue")
    raise Preempted(step)
