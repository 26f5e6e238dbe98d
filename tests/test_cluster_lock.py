"""tests/cluster_lock.py, which keeps the test command's side-by-side suites from sharing this
machine's Slurm and Ray at once: a second session waits while the first holds the lock and runs
as soon as it lets go; a process that holds it takes it again without waiting for itself; a
script run under the lock passes it to the tests it starts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import cluster_lock

TESTS = Path(__file__).resolve().parent
NESTED = """import cluster_lock
with cluster_lock.held("outer"):
    with cluster_lock.held("inner"):
        print("inside both")
"""


def _env(lock: Path) -> dict:
    return {"MBA_CLUSTER_LOCK": str(lock), "PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"}


def _session(lock: Path, *command: str) -> subprocess.Popen:
    """`python3 tests/cluster_lock.py COMMAND`: COMMAND run under the lock."""
    return subprocess.Popen([sys.executable, str(TESTS / "cluster_lock.py"), *command],
                            env=_env(lock), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def test_a_second_session_waits_for_the_first_and_then_runs(monkeypatch, tmp_path):
    lock = tmp_path / "cluster.lock"
    monkeypatch.setenv("MBA_CLUSTER_LOCK", str(lock))
    free = _session(lock, sys.executable, "-c", "print('ran')")
    assert free.communicate(timeout=60) == ("ran\n", "")  # the control: nobody holds it
    with cluster_lock.held("this test"):
        waiting = _session(lock, sys.executable, "-c", "print('ran')")
        time.sleep(2)
        assert waiting.poll() is None  # still waiting for this process
    out, err = waiting.communicate(timeout=60)
    assert out == "ran\n"
    assert "[cluster-lock] " in err and "waiting for another test session" in err


def test_a_holder_takes_it_again_and_its_script_passes_it_on(tmp_path):
    lock = tmp_path / "cluster.lock"
    nested = subprocess.run([sys.executable, "-c", NESTED], env=_env(lock), capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert (nested.stdout, nested.stderr) == ("inside both\n", "")
    show = "import os; print(os.environ['MBA_CLUSTER_LOCK_HELD'])"
    assert _session(lock, sys.executable, "-c", show).communicate(timeout=60) == ("1\n", "")
