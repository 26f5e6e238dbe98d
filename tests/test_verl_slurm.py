"""backend=verl as a real Slurm job, with the real entry: `sbatch slurm/grpo_balanced.sh RECIPE
backend=verl` on the Slurm that tests/slurm_cluster.py starts or finds (scripts/slurm_up.sh), with
.venv-verl's Python and Ray, the launcher's own import check of verl, and the translated entry
(`megatron-ba train` exec'ing `python -m megatron_ba.integrations.verl.main_ppo`): no stand-in.

One job: Ray forms; the entry's preflight starts (its log appears) and is preempted (`scancel
--signal=USR1 --batch`: the launcher ends the entry, stops Ray and requeues the job); the second run
(restart 1) forms Ray again and its entry reads the config, the data and the reward through verl's
own code and stops with the documented line (verl_preflight.py) and exit status NEEDS_GPU, which is
the job's exit code. The tiny model and data files: tests/verl_run_files.py.

Runs in .venv-verl (bash scripts/run_verl_tests.sh); skips where no Slurm can be started.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 lives in .venv-verl: bash scripts/run_verl_tests.sh")

import slurm_cluster
from verl_run_files import LINE, RECIPE, write_run_files

from megatron_ba.integrations.verl.verl_preflight import NEEDS_GPU

ROOT = Path(__file__).resolve().parents[1]
BATCH_SCRIPT = ROOT / "slurm/grpo_balanced.sh"
VERL_PYTHON = ROOT / ".venv-verl/bin/python"


def _env(run_dir: Path) -> dict:
    """The submitting shell: no Slurm job or Ray settings of its own (the launcher picks the
    job's Ray port), .venv-verl's Python."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_JOB", "RAY_"))}  # fmt: skip
    env.update(PYTHON=str(VERL_PYTHON), RUN_DIR=str(run_dir), PYTHONPATH=str(ROOT))
    return env


def _log(run_dir: Path, job: int, restart: int) -> Path:
    return run_dir / "logs" / f"job-{job}-restart-{restart}" / "entry.log"


@pytest.mark.slow
def test_a_verl_job_runs_the_preflight_and_a_preempted_one_runs_it_again(tmp_path):
    if not VERL_PYTHON.exists():
        pytest.skip("no .venv-verl (bash scripts/setup_verl_env.sh)")
    if torch.cuda.is_available():  # hiding it (CUDA_VISIBLE_DEVICES=) fails Ray's --num-gpus
        pytest.skip("a CUDA GPU is visible: the job would train; this is the CPU ending")
    start = time.time()
    files = write_run_files(tmp_path / "files")
    run = tmp_path / "run"
    with slurm_cluster.cluster() as conf:
        env = _env(run)
        job = slurm_cluster.submit(conf, BATCH_SCRIPT, RECIPE, *files.recipe_overrides(),
                                   cwd=tmp_path, env=env, options=("--nodes=1",))  # fmt: skip
        first = _log(run, job, 0)
        info = lambda: slurm_cluster.job_info(conf, job)  # noqa: E731
        alive = ("PENDING", "RUNNING")
        slurm_cluster.wait(lambda: first.exists() or info().get("JobState") not in alive,
                           "the entry's log", timeout=600, every=0.5)  # fmt: skip
        assert first.exists(), slurm_cluster.why(conf, tmp_path, dict(info(), JobId=str(job)))
        # while the entry imports verl (half a minute here): Slurm's warning of the end
        slurm_cluster.preempt(conf, job)
        slurm_cluster.wait_requeued(conf, job, timeout=120)
        second = _log(run, job, 1)
        ended = slurm_cluster.wait_until_ended(conf, job, timeout=600, cwd=tmp_path,
                                               more=(first, second))  # fmt: skip
        story = slurm_cluster.why(conf, tmp_path, ended, first, second)
    assert ended["ExitCode"] == f"{NEEDS_GPU}:0" and ended["Restarts"] == "1", story
    assert LINE not in first.read_text(), story  # the first run was ended before its end
    assert second.read_text().count(LINE) == 1, story
    out = slurm_cluster.batch_output(tmp_path)
    assert out.count("Ray cluster formed: 1 node(s)") == 2, story
    assert (
        out.index("SIGUSR1: ending verl")
        < out.index("requeueing job")
        < out.rindex("Ray cluster formed")
    )
    assert f"finished with exit status {NEEDS_GPU}" in out, story
    assert out.count("entry's preflight passed (config, data, reward)") == 1, story  # restart 1
    print(f"the job's test: {time.time() - start:.0f} s")
