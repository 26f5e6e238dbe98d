"""A command in N local processes: `megatron-ba train --nproc-per-node 2 RECIPE`.

    megatron-ba train --nproc-per-node 2 recipes/tiny-cpu-tp2.yaml
    # = torchrun --nproc-per-node 2 -m megatron_ba.cli train recipes/tiny-cpu-tp2.yaml, except that
    #   a user error ends as one line and exit status 2

The processes are torchrun's, started by torchrun's own launcher (torch.distributed.run) with the
same arguments, so they see the same world (RANK, WORLD_SIZE, MASTER_ADDR, OMP_NUM_THREADS=1).
What differs is the ending. torchrun turns any failed worker into its ChildFailedError report (a
traceback and a table, ~40 lines) and exit status 1, whatever the worker said. Here a worker that
met bad input (errors.UserError, exit status 2: megatron_ba/cli.py) has written its message to
torchrun's per-worker error file and printed nothing. When the first failure was such a worker,
the launch ends with status 2, printing each different message once (all ranks usually say the
same; a rank's own problem, e.g. a shard of its own, is named with its rank). Any other failure
keeps torchrun's report and status 1. A preempted run (every worker saved its checkpoint and
ended with 75) ends with 75. To preempt one, touch RUN_DIR/PREEMPT: SIGUSR1 would end the
launcher itself, which is torchrun's agent, not a worker.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

USER_ERROR_EXIT = 2  # megatron-ba's status for bad input (argparse's too)
# train/preemption.py's PREEMPTED_EXIT_CODE (checkpoint saved, run again with --resume): a launch
# whose every worker stopped so ends with it too (parallel/ sits below train/; a test holds the two
# equal).
PREEMPTED_EXIT = 75
_LAUNCHER_ENV = "MEGATRON_BA_LOCAL_LAUNCH"  # set for the workers run_local starts


def add_nproc_argument(parser) -> None:
    """The `--nproc-per-node N` option of a command that runs in N processes (cli.py acts on it)."""
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="run in N local processes (torchrun's launcher; bad input: one line, exit 2)",
    )


def in_launched_worker() -> bool:
    """True inside a process that torchrun (or this module) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def report_user_error(message: str) -> None:
    """Say a user error once. Into torchrun's error file of this worker, where torchrun's report
    or this module's launcher reads it; on stderr outside a launch, and from rank 0 under torchrun
    itself (this module's launcher prints it: which ranks' failures it sees depends on timing)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's format: ProcessFailure reads "message" and "timestamp"
        with open(error_file, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    under_launcher = error_file and os.environ.get(_LAUNCHER_ENV) == "1"
    if os.environ.get("RANK", "0") == "0" and not under_launcher:
        print(message, file=sys.stderr)


def user_error_status(failures: dict) -> tuple[int, list[str]] | None:
    """(exit status, lines to print) when the failed workers (rank -> torch's ProcessFailure:
    exitcode, message, timestamp) ended for bad input; None for any other failure.

    Bad input ended the run when the first failure (torchrun's root cause: the earliest timestamp)
    exited with 2. The others are its consequences: stopped by the launcher, or broken off in a
    collective whose peer had left (exit 1). A worker's own timestamp is its error file's, in whole
    seconds, so it is never later than the launcher's observation of another's exit. The lines:
    each different message once, the lowest rank's as it is, another rank's named."""
    user = {r: f for r, f in failures.items() if f.exitcode == USER_ERROR_EXIT}
    if not user or min(f.timestamp for f in user.values()) > min(
        f.timestamp for f in failures.values()
    ):
        return None
    lines, said = [], set()
    for rank in sorted(user):
        message = user[rank].message
        if message and message not in said:
            lines.append(message if not lines else f"rank {rank}: {message}")
            said.add(message)
    return USER_ERROR_EXIT, lines


def run_local(nproc: int, argv: list[str]) -> int:
    """`torchrun --nproc-per-node NPROC -m megatron_ba.cli ARGV`, ended as the module says."""
    # torch: imported on use, so that --help imports none
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--nproc-per-node", str(nproc), "-m", "megatron_ba.cli", *argv]
    )
    # The launcher's own log lines (OMP_NUM_THREADS, each failed worker's exit) would repeat what
    # the report below or the workers say; the workers' output is their own and is untouched.
    logging.disable(logging.ERROR)
    os.environ[_LAUNCHER_ENV] = "1"
    try:
        run(args)
    except ChildFailedError as e:
        if {f.exitcode for f in e.failures.values()} == {PREEMPTED_EXIT}:
            return PREEMPTED_EXIT  # rank 0 said where the checkpoint is and how to go on
        ended = user_error_status(e.failures)
        if ended is None:
            print(e.format_msg(), file=sys.stderr)
            return 1
        status, lines = ended
        for line in lines:
            print(line, file=sys.stderr)
        return status
    finally:
        logging.disable(logging.NOTSET)
    return 0
