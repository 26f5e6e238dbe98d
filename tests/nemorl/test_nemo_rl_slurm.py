"""`sbatch slurm/grpo_balanced.sh RECIPE backend=nemo_rl` as a real job on one node of a real
Slurm, with the real entry (no RAY_ENTRY, the launcher's own `ray` and `nemo_rl` import check):
the job forms its Ray cluster, `megatron-ba train` execs run_grpo_balanced, whose preflight puts
the config, data and reward through NeMo-RL's own code and, without a GPU, ends with the
documented line and exit status NEEDS_GPU. `scancel --signal=USR1 --batch` while the entry runs
requeues the job; its second run forms Ray again and ends with the same line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

from preflight_inputs import (
    BENCH,
    PROMPTS_PER_STEP,
    QWEN,
    ROOT,
    TRAIN,
    expected_line,
    make_inputs,
    run_env,
)

sys.path.append(str(ROOT / "tests"))  # appended: `conftest` stays tests/nemorl's
import slurm_cluster

from megatron_ba.integrations.nemo_rl.nemo_rl_preflight import NEEDS_GPU

slurm = slurm_cluster.slurm  # the fixture: a running Slurm for this module's tests

pytestmark = pytest.mark.slow
BATCH = ROOT / "slurm/grpo_balanced.sh"


def _sbatch(conf: str, cwd: Path, args: list[str]) -> int:
    # run_env drops the caller's RAY_* (run_nemorl_tests.sh's own Ray head is RAY_ADDRESS there):
    # the entry must find the job's Ray, whose address the launcher exports.
    env = run_env(False, PYTHON=sys.executable, RUN_DIR=str(cwd / "run"))
    return slurm_cluster.submit(conf, BATCH, QWEN, *args, cwd=cwd, env=env, options=("--nodes=1",))


def test_sbatch_runs_the_preflight_on_the_jobs_ray_and_a_preempted_job_runs_it_again(
    slurm, tmp_path
):
    args = make_inputs(tmp_path)  # the job runs in tmp_path: the training release is found there
    job = _sbatch(slurm, tmp_path, args)
    logs = [tmp_path / "run" / "logs" / f"job-{job}-restart-{n}" for n in (0, 1)]
    entry = [d / "entry.log" for d in logs]
    # the entry has started (the launcher says so just before): it imports NeMo-RL for a while
    slurm_cluster.wait(
        lambda: (
            "launching on" in slurm_cluster.batch_output(tmp_path)
            or slurm_cluster.job_info(slurm, job).get("JobState") not in ("PENDING", "RUNNING")
        ),
        "the entry",
        timeout=900,
        every=0.5,
    )
    info = slurm_cluster.job_info(slurm, job)
    assert info.get("JobState") == "RUNNING", slurm_cluster.why(slurm, tmp_path, info, *entry)
    slurm_cluster.preempt(slurm, job)
    slurm_cluster.wait_requeued(slurm, job, timeout=300)
    info = slurm_cluster.wait_until_ended(slurm, job, cwd=tmp_path, more=tuple(entry))
    story = slurm_cluster.why(slurm, tmp_path, info, *entry)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", f"{NEEDS_GPU}:0"), story
    line = expected_line(len(TRAIN), sum(len(r) for r in BENCH.values()), PROMPTS_PER_STEP)
    first, second = (p.read_text() for p in entry)
    assert line not in first, story  # ended by the signal before the preflight's end
    assert second.strip().splitlines()[-1] == line, story
    assert "[megatron-ba] checked: BalancedPGLossFn" in second
    # each run's entry got the job's own Ray address (its port: 20000 + job id mod 20000), not
    # the caller's (run_env drops RAY_*)
    port = 20000 + job % 20000
    for d in logs:
        exported = [ln for ln in (d / "launch.sh").read_text().splitlines() if "RAY_ADDRESS=" in ln]
        assert len(exported) == 1 and exported[0].endswith(f":{port}"), exported
    out = slurm_cluster.batch_output(tmp_path)
    assert out.count("ray_cluster: 1 node(s) joined at ") == 2, out
    assert out.index("SIGUSR1: ending nemo_rl") < out.index("requeueing job"), out
    assert f"finished with exit status {NEEDS_GPU}" in out, out
    assert out.count("entry's preflight passed (config, data, reward)") == 1, out  # restart 1
