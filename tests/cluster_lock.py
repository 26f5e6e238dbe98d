"""One test session at a time uses this machine's Slurm and Ray.

The test command runs the main suite and the other environments' suites side by side
(scripts/run_tests.sh). Their Slurm jobs would compete for the two nodes of scripts/slurm_up.sh's
cluster, and Ray keeps machine-wide state: every `ray start` without its own --temp-dir points
/tmp/ray/ray_current_cluster at itself, and `ray stop --force` ends every Ray process of the user.
So the tests that submit Slurm jobs (tests/slurm_cluster.py's cluster()) or start Ray take an
exclusive lock on one file for as long as they use them, and the other side waits its turn.

    with held("Slurm jobs"): ...                       # in a test or fixture
    python3 tests/cluster_lock.py bash SCRIPT ARGS     # a whole script under the lock

The lock is flock(2) on MBA_CLUSTER_LOCK (default /tmp/megatron-ba-cluster.lock): released when
its holder ends, however it ends. A script run under it gets MBA_CLUSTER_LOCK_HELD=1, so the tests
it starts do not wait for their own parent. Standard library only: scripts run it with any Python.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time

HELD = "MBA_CLUSTER_LOCK_HELD"


def lock_path() -> str:
    return os.environ.get("MBA_CLUSTER_LOCK", "/tmp/megatron-ba-cluster.lock")


_depth = 0  # this process's holds: flock(2) would make a second one wait for the first


@contextlib.contextmanager
def held(what: str):
    """The machine's Slurm and Ray for this process until the block ends (waiting, and saying
    so on stderr, while another session holds them). Re-entrant within a process."""
    global _depth
    with contextlib.ExitStack() as stack:
        if not _depth and os.environ.get(HELD) != "1":  # not held here, nor by a parent's tree
            stack.enter_context(_flock(what))
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1


@contextlib.contextmanager
def _flock(what: str):
    with open(lock_path(), "a") as lock:  # not inherited by child processes (PEP 446)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            start = time.monotonic()
            _say(f"{what}: waiting for another test session to finish with this machine's "
                 f"Slurm and Ray ({lock_path()})")  # fmt: skip
            fcntl.flock(lock, fcntl.LOCK_EX)
            _say(f"{what}: waited {time.monotonic() - start:.0f} s")
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _say(line: str) -> None:
    print(f"[cluster-lock] {line}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python3 tests/cluster_lock.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with held(" ".join(argv[:2])):
        return subprocess.run(argv, env=dict(os.environ, **{HELD: "1"})).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
