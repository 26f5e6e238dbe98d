"""`sbatch slurm/grpo_balanced.sh RECIPE backend=nemo_aligner` on one node of a real Slurm, in
.venv-nemo: the launcher translates the recipe (CPU: two gloo processes for TP=2, fp32, torch's
AdamW), each task writes the recipe's prompts and becomes NeMo-Aligner's train_grpo, and the run
trains, validates and checkpoints in RUN_DIR. Slurm's warning before the time limit stops it after
a step with a checkpoint; the job requeues itself and continues from there (NeMo's
resume_if_exists), every step once."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_nemo, nemo_env

sys.path.append(str(REPO / "tests"))  # appended: `conftest` stays tests/nemo's
import slurm_cluster

slurm = slurm_cluster.slurm  # the fixture: a running Slurm for this module's tests

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow]

BATCH = REPO / "slurm/grpo_balanced.sh"
TP2 = REPO / "recipes/tiny-cpu-tp2.yaml"
# recipes/tiny-cpu-tp2.yaml on the tiny .nemo, cut to seconds per step
SMALL = [
    "backend=nemo_aligner", "warmstart.enabled=false", "tokenizer.kind=hf",
    "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.max_new_tokens=24",
    "parallel.micro_batch_size=8", "data.eval_prompts=8", "eval.every=2", "checkpoint.every=2",
]  # fmt: skip


def _sbatch(conf: str, cwd: Path, run_dir: Path, *overrides: str) -> int:
    env = dict(nemo_env(), RUN_DIR=str(run_dir), PYTHON=sys.executable)
    options = ("--ntasks-per-node=2",)  # one task per process (TP=2)
    return slurm_cluster.submit(conf, BATCH, TP2, *SMALL, *overrides, cwd=cwd, env=env,
                                options=options)  # fmt: skip


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _rows(run_dir) if "reward_mean" in r]


def test_sbatch_trains_on_nemo_aligner_and_a_preempted_job_resumes(slurm, tiny, tmp_path):
    run = tmp_path / "run"
    job = _sbatch(slurm, tmp_path, run, f"model.pretrained={tiny / 'model.nemo'}", "grpo.steps=8")
    slurm_cluster.wait(lambda: _train_steps(run), "the first step", every=0.2)
    logs = run / "logs" / f"job-{job}-restart-0"
    launch = (logs / "launch.sh").read_text()
    assert "--ntasks-per-node=2 " in launch and "--accelerator cpu" in launch  # TP=2 on CPU
    assert "#   ++model.tensor_model_parallel_size=2" in launch
    assert len((run / "data" / "train.jsonl").read_text().splitlines()) == 8 * 4

    # Slurm's warning before the time limit (--signal=B:USR1 reaches the batch shell alone)
    slurm_cluster.preempt(slurm, job)
    held = slurm_cluster.wait_requeued(slurm, job)
    ranks = [logs / "rank-0.log", logs / "rank-1.log"]
    assert (run / "preempted.json").is_file(), slurm_cluster.why(slurm, tmp_path, held, *ranks)
    stopped = json.loads((run / "preempted.json").read_text())["step"]
    assert 1 <= stopped < 8
    assert list((run / "checkpoints").glob(f"megatron_gpt-step={stopped}-*"))
    assert _train_steps(run) == list(range(1, stopped + 1))
    assert "requeueing job" in slurm_cluster.batch_output(tmp_path)
    # on whichever node of the cluster had room (scripts/slurm_up.sh starts two)
    assert re.search(
        rf"job {job} \(restart 0\) on \S+; resume=0", slurm_cluster.batch_output(tmp_path)
    )

    again = run / "logs" / f"job-{job}-restart-1"
    info = slurm_cluster.wait_until_ended(  # Slurm starts the requeued job itself
        slurm, job, cwd=tmp_path, more=(again / "rank-0.log", again / "rank-1.log")
    )
    assert info["JobState"] == "COMPLETED", slurm_cluster.why(
        slurm, tmp_path, info, again / "rank-0.log", again / "rank-1.log"
    )
    assert re.search(
        rf"job {job} \(restart 1\) on \S+; resume=1", slurm_cluster.batch_output(tmp_path)
    )
    assert _train_steps(run) == list(range(1, 9))  # every step once: none lost, none redone
    rows = _rows(run)
    assert {2, 4, 6, 8} <= {r["step"] for r in rows if "eval_accuracy" in r}
    assert all(r["updates_applied"] == 1 for r in rows if "reward_mean" in r)
    assert list((run / "checkpoints").glob("megatron_gpt-step=8-*-last"))
    assert not (run / "preempted.json").exists()  # cleared on relaunch; the finished run adds none
