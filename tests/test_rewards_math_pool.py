"""The math reward's machinery: it starts from any caller and its failures raise, never score 0.

Before the pool ran its own server, an unguarded script or `python -` made the workers re-import
`__main__`, die at start-up, and every answer score 0.0.
"""

import os
import signal
import subprocess
import sys
import time

import data_helpers  # noqa: F401  (offline settings)
import pytest

from megatron_ba.rewards import MathRewardError, MathRewardPool

# No `if __name__ == "__main__":` guard, on purpose: a right and a wrong answer.
UNGUARDED = (
    "from megatron_ba.rewards import math_score\n"
    'print(math_score("Answer: 34", "34"), math_score("Answer: 35", "34"))\n'
)


def _python(args, **kw):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=240, **kw
    )


def test_an_unguarded_script_scores(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(UNGUARDED)
    proc = _python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1.0", "0.0"]
    assert "bootstrapping" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_script_read_from_stdin_scores(tmp_path):
    proc = _python(["-"], input=UNGUARDED, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1.0", "0.0"]


def _broken_math_verify(tmp_path):
    fake = tmp_path / "fake_site"
    fake.mkdir()
    (fake / "math_verify.py").write_text('raise ImportError("simulated: math-verify is broken")\n')
    return fake


def test_a_server_that_cannot_start_raises_naming_the_cause(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_broken_math_verify(tmp_path)))
    with MathRewardPool(workers=1, timeout_s=5.0) as pool:
        with pytest.raises(MathRewardError, match=r"failed to start(.|\n)*simulated: math-verify"):
            pool.score(["Answer: 34"], ["34"])
    monkeypatch.undo()
    with MathRewardPool(workers=1, timeout_s=5.0) as pool:  # the control: a working sys.path
        assert pool.score(["Answer: 34"], ["34"]).scores == [1.0]


def test_start_failure_from_a_script_is_an_error_not_a_zero(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(UNGUARDED)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_broken_math_verify(tmp_path)), *sys.path])
    proc = _python([str(script)], cwd=tmp_path, env=env)
    assert proc.returncode != 0 and proc.stdout.strip() == ""
    assert "MathRewardError: math reward server failed to start" in proc.stderr
    assert "simulated: math-verify is broken" in proc.stderr


def test_a_worker_killed_from_outside_raises_then_the_pool_recovers():
    with MathRewardPool(workers=2, timeout_s=5.0) as pool:
        assert pool.score(["Answer: 1", "Answer: 2"], ["1", "3"]).scores == [1.0, 0.0]
        for w in pool._workers:  # e.g. the OOM killer
            os.kill(w.pid, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(MathRewardError, match=r"worker \(pid \d+\) died .*killed by SIGKILL"):
            pool.score(["Answer: 1", "Answer: 2"], ["1", "3"])
        # the pool starts afresh on the next call
        assert pool.score(["Answer: 1", "Answer: 2"], ["1", "3"]).scores == [1.0, 0.0]


def test_a_dead_server_raises_naming_it():
    with MathRewardPool(workers=1, timeout_s=5.0) as pool:
        assert pool.score(["Answer: 1"], ["1"]).scores == [1.0]
        server_pid = pool._server.proc.pid
        os.kill(server_pid, signal.SIGKILL)
        time.sleep(0.2)  # its worker follows it (PR_SET_PDEATHSIG)
        with pytest.raises(MathRewardError, match=rf"server \(pid {server_pid}\) died"):
            pool.score(["Answer: 1"], ["1"])
        assert pool.score(["Answer: 1"], ["1"]).scores == [1.0]


def test_no_process_outlives_close():
    pool = MathRewardPool(workers=2, timeout_s=5.0)
    pool.score(["Answer: 1"], ["1"])
    pids = [w.pid for w in pool._workers] + [pool._server.proc.pid]
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
