"""The preflight of run_grpo_balanced (megatron_ba/integrations/nemo_rl/nemo_rl_preflight.py)
through the real entry, as `megatron-ba train RECIPE backend=nemo_rl` execs it, on CPU: the
tokenizer of a tiny local model, DAPO-Math-17k rows and benchmark files through NeMo-RL's data
processors, the math environment's dapo_math_verify on the first batch, then the documented line and
exit status NEEDS_GPU. Negative controls: a benchmark file with no rows, and a training row whose
ground truth the verifier cannot match, each fail naming the cause and never reach the line.
"""

from __future__ import annotations

import subprocess
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
    TRAIN,
    expected_line,
    make_inputs,
    run_env,
    write_bench,
    write_train,
)

from megatron_ba.integrations.nemo_rl.nemo_rl_preflight import NEEDS_GPU

pytestmark = pytest.mark.slow


def _train(where: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`megatron-ba train QWEN ARGS` started in `where` (it execs run_grpo_balanced)."""
    cmd = [sys.executable, "-m", "megatron_ba.cli", "train", str(QWEN), *args,
           "--run-dir", str(where / "run")]  # fmt: skip
    return subprocess.run(cmd, cwd=where, env=run_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    where = tmp_path_factory.mktemp("preflight")
    return where, make_inputs(where)


def test_the_entry_checks_config_data_and_reward_then_names_the_gpu_it_needs(inputs):
    where, args = inputs
    p = _train(where, args)
    out = p.stdout.strip().splitlines()
    assert p.returncode == NEEDS_GPU == 69, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[megatron-ba] checked: BalancedPGLossFn rule=balanced" in p.stdout
    val = sum(len(rows) for rows in BENCH.values())
    assert out[-1] == expected_line(len(TRAIN), val, PROMPTS_PER_STEP), out[-1]
    assert "Traceback" not in p.stderr


def test_a_benchmark_file_without_rows_is_named(inputs, tmp_path):
    """Negative control: aime25.jsonl empty; the run stops at it, not at the GPU line."""
    _, args = inputs
    bench = write_bench(tmp_path, {**BENCH, "aime25": []})
    write_train(tmp_path)
    args = [a if not a.startswith("eval.data_dir=") else f"eval.data_dir={bench}" for a in args]
    p = _train(tmp_path, args)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last == f"ValueError: {bench}/aime25.jsonl: no rows (the file is empty)", last
    assert "needs CUDA GPUs" not in p.stdout


def test_a_ground_truth_the_math_verifier_cannot_match_is_named(inputs, tmp_path):
    """Negative control: a two-line ground truth in the scored batch (row 1); dapo_math_verify
    reads one line after `Answer:`, so the right response scores 0 and the run stops naming the
    row, not at the GPU line."""
    _, args = inputs
    rows = [TRAIN[0], ("What are 3 and 4?", "3\n4"), *TRAIN[2:]]
    write_train(tmp_path, rows)
    p = _train(tmp_path, args)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: data.train row 1: ground truth '3\\n4': "), last
    assert "dapo_math_verify scored the response 'Answer: 3\\n4' 0.0, expected 1.0" in last, last
    assert "needs CUDA GPUs" not in p.stdout
