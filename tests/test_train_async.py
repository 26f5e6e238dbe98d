"""Asynchronous GRPO in the local trainer (rollout.max_staleness): the next step's rollouts are
generated while the update runs, on weights at most K steps old.

Four-step runs of tests/fixtures/tiny-train.yaml: synchronous (K = 0), one step off-policy
(K = 1), K = 2 with a refit every 2 steps, and a K = 1 run killed after a checkpoint and resumed.
What they show: the overlapped machinery leaves a step's update untouched (step 1, whose batch
both schedules generate fresh, is equal bit for bit; from step 2 on the stale engine's batches
differ: the control); the staleness each step reports is the schedule's; a killed asynchronous
run resumed repeats the uninterrupted one bit for bit (the batch in flight is in the
checkpoint); resumed with a smaller K, the batch too old for it is dropped by name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_metrics import kill_after_checkpoint, trajectory, trajectory_mismatches

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests/fixtures/tiny-train.yaml"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ASYNC1 = ("rollout.max_staleness=1",)
# K = 2, a refit every 2 steps; no evaluation or checkpoint before the end (each refits).
ASYNC2 = ("rollout.max_staleness=2", "rollout.sync_every=2", "eval.every=0", "checkpoint.every=0")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart-cache")


# The same threads in every run, so that runs compare schedules: one trainer thread (an
# asynchronous run's default on 2 cores: train/engine_setup.py cpu_split) and the engine unbound
# (the variable a user exports wins over the split's binding).
THREADS = ("rollout.threads=1",)
ENV = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _cmd(run_dir: Path, cache_dir: Path, *extra: str, resume: bool = False) -> list[str]:
    where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    return [
        sys.executable, "-m", "megatron_ba.cli", "train", str(RECIPE), "grpo.steps=4", *THREADS,
        *extra, *where, "--cache-dir", str(cache_dir),
    ]  # fmt: skip


def _train(run_dir: Path, cache_dir: Path, *extra: str, resume: bool = False) -> Path:
    _terminal(run_dir, cache_dir, *extra, resume=resume)
    return run_dir


def _terminal(run_dir: Path, cache_dir: Path, *extra: str, resume: bool = False) -> str:
    """What `megatron-ba train` printed on the terminal (our lines: the rest goes to logs/)."""
    proc = subprocess.run(
        _cmd(run_dir, cache_dir, *extra, resume=resume),
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return {
        "sync": _train(root / "sync", cache_dir),
        "async1": _train(root / "async1", cache_dir, *ASYNC1),
        "async2": _train(root / "async2", cache_dir, *ASYNC2),
    }


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def _without_async(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("async/")} for r in rows]


def test_staleness_zero_is_the_synchronous_loop(runs):
    sync = _rows(runs["sync"])
    assert not [k for r in sync for k in r if k.startswith("async/")]  # nothing async logged
    a, b = trajectory(runs["sync"]), trajectory(runs["async1"])
    # Step 1 trains a fresh batch in both (the overlap starts during it): equal bit for bit.
    first_a = [r for r in a if r["step"] == 1]
    first_b = _without_async([r for r in b if r["step"] == 1])
    assert trajectory_mismatches(first_a, first_b) == []
    # Later steps: the asynchronous run trains the stale engine's batches (the control): they
    # differ once the policy has moved (a step of zero rewards moves nothing), and the engine's
    # log-probs lag the trainer's by the step's age while the synchronous run's agree.
    later = trajectory_mismatches(a, _without_async(b))
    assert later and all(not m.startswith("step 1 ") for m in later)
    gap = "rollout_correction/logprob_gap"
    assert max(r[gap] for r in _rows(runs["sync"])) < 1e-5
    assert max(r[gap] for r in _rows(runs["async1"])) > 1e-3


def test_each_step_reports_the_schedules_staleness(runs):
    one = _rows(runs["async1"])
    assert [r["async/staleness_max"] for r in one] == [0, 1, 1, 1]
    assert [r["async/staleness_mean"] for r in one] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/dropped_samples"] for r in one] == [0, 0, 0, 0]
    assert all(r["time/engine_busy"] > 0 for r in one[:-1])  # the last step prefetches nothing
    # K = 2, refit after step 2 and at the end: batches of versions 0, 0, 0, 2.
    assert [r["async/staleness_max"] for r in _rows(runs["async2"])] == [0, 1, 2, 1]
    synced = ["time/sync" in r for r in _rows(runs["async2"])]
    assert synced == [False, True, False, True]


def test_a_killed_async_run_resumes_bit_for_bit(runs, cache_dir, tmp_path):
    run_dir = tmp_path / "killed"
    step = kill_after_checkpoint(_cmd(run_dir, cache_dir, *ASYNC1), run_dir, 2, cwd=ROOT, env=ENV)
    assert 2 <= step < 4
    assert (run_dir / "checkpoints" / f"step-{step:06d}" / "pending_rollouts.pt").is_file()
    _train(run_dir, cache_dir, resume=True)
    a, b = trajectory(runs["async1"]), trajectory(run_dir)
    assert trajectory_mismatches(a, b) == [], f"resumed from step {step}"
    samples = [json.loads(x)["step"] for x in (run_dir / "samples.jsonl").open()]
    assert sorted(set(samples)) == [1, 2, 3, 4] and samples == sorted(samples)  # none twice


def test_resumed_with_a_smaller_staleness_the_old_batch_is_dropped(runs, cache_dir, tmp_path):
    run_dir = tmp_path / "async1"
    shutil.copytree(runs["async1"], run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step-000003\n")  # its pending batch: v2
    said = _terminal(run_dir, cache_dir, "rollout.max_staleness=0", resume=True)
    last = _rows(run_dir)[-1]
    assert last["step"] == 4 and last["async/dropped_samples"] == 16  # 4 prompts x 4
    assert last["async/staleness_max"] == 0  # generated again by the resumed weights
    assert "dropped 16 samples drawn for step 4, 1 steps old: rollout.max_staleness is 0" in said


def test_an_async_cpu_run_gives_the_engine_and_the_trainer_their_own_cores():
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train.engine_setup import cpu_split

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to split")
    one = load_recipe(RECIPE, ["rollout.max_staleness=1"])
    engine, trainer = cpu_split(one, world=1)
    assert engine == cores[-max(1, len(cores) // 2) :] and trainer + engine == cores
    assert not set(engine) & set(trainer)
    assert cpu_split(load_recipe(RECIPE, []), world=1) is None  # synchronous: every core each
    assert cpu_split(one, world=2) is None  # several processes: the launcher's placement
    every = load_recipe(RECIPE, ["rollout.max_staleness=1", f"rollout.engine_cores={len(cores)}"])
    with pytest.raises(ValueError, match=r"rollout\.engine_cores: \d+ leaves none"):
        cpu_split(every, world=1)
