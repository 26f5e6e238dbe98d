"""Stopping a run at a step boundary when the cluster asks, so that a requeued job resumes with
no step lost or repeated.

    install()                              # megatron-ba train: SIGUSR1 sets this process's flag
    if should_stop(ctx, run_dir): ...      # every rank, after each step: the ranks' agreed answer
    stop(trainer, step)                    # checkpoint at `step` unless just saved; raise Preempted

Two ways to ask: SIGUSR1 to the training processes (`kill -USR1 PID`, or `scancel
--signal=USR1` on the job, which srun forwards to every process of the step), or the file
RUN_DIR/PREEMPT, which slurm/lib.sh writes when its batch shell receives `--signal=B:USR1@s`
(Slurm then signals that shell alone). The file is how the launcher forwards the signal to
every node: the run folder is on the file system all nodes share (checkpoints go there). The
launcher starts torchrun with SIGUSR1 ignored (its agent would die of it) and install() keeps the
signal from killing the vLLM engine and reward worker processes (see there).

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
import threading
from pathlib import Path

from megatron_ba.parallel.collectives import all_reduce_sum, world_group
from megatron_ba.train import checkpoint

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


def _wait_for(signals) -> None:
    global _requested
    while True:
        signal.sigwait(signals)
        _requested = True


def install(signals=(signal.SIGUSR1,)) -> None:
    """Route `signals` to this process's flag, and keep them from killing its children.

    Call once per process, before the rollout engine and reward workers start. The signals are
    blocked in the calling (main) thread, so every process started from it inherits them
    blocked: a signal sent to the whole Slurm step (`scancel --signal=USR1`, which srun forwards
    to every process of the step) then cannot kill the vLLM engine or a reward worker, whose
    default action for SIGUSR1 is to terminate. Here a thread waits for them (sigwait) and a
    handler catches them in any thread started before; both only set the flag.
    """
    global _requested
    _requested = False
    for s in signals:
        signal.signal(s, _on_signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    threading.Thread(
        target=_wait_for, args=(set(signals),), name="preemption-signals", daemon=True
    ).start()


def requested_here(run_dir: Path) -> bool:
    """This rank's own answer: its flag, or the request file in the run folder."""
    return _requested or (Path(run_dir) / REQUEST_FILE).exists()


def should_stop(ctx, run_dir: Path) -> bool:
    """True on every rank when any rank was asked to stop (a collective: every rank calls it)."""
    mine = requested_here(run_dir)
    if ctx.world == 1:
        return mine
    import torch

    votes = all_reduce_sum(torch.tensor([int(mine)], dtype=torch.int64), group=world_group())
    return int(votes.item()) > 0


def clear(run_dir: Path) -> None:
    """Forget an earlier request and marker (the launcher's, before it starts or resumes)."""
    for name in (REQUEST_FILE, MARKER_FILE):
        (Path(run_dir) / name).unlink(missing_ok=True)


def stop(trainer, step: int) -> None:
    """Checkpoint `step` (collective) unless the last checkpoint is that step; mark and raise."""

    latest = checkpoint.latest_dir(trainer.run_dir)
    if latest is None or latest.name != checkpoint.step_dir_name(step):
        trainer._checkpoint(step)
    if trainer.ctx.is_main:
        (Path(trainer.run_dir) / REQUEST_FILE).unlink(missing_ok=True)  # the request is served
        marker = Path(trainer.run_dir) / MARKER_FILE
        marker.write_text(json.dumps({"step": step}) + "\n")
        trainer.log(f"[preempt] checkpoint of step {step} saved; stopping for a requeue")
    raise Preempted(step)
