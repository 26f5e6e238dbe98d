"""A short `megatron-ba train` with the built-in sampler (`rollout.engine=builtin`, no vLLM).

    python -m pytest tests/test_train_builtin.py        # ~2 min on 2 cores

It runs in every environment, the current stack's (.venv-current: Python 3.12, megatron-core 0.19,
no vLLM) among them: a 4-step GRPO run with a checkpoint after every step trains (finite losses,
the plan's statistics, evaluation rows), and a copy of it cut back to its step-2 checkpoint and
resumed with `--resume` ends with the same metrics as the run it was cut from, bit for bit.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_metrics import trajectory, trajectory_mismatches

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests/fixtures/tiny-train.yaml"
STEPS = 4
# 150 warm-start steps (cached per test session) give the policy non-zero rewards, so that every
# GRPO step has non-zero advantages and gradients and the resume comparison compares something.
KEYS = (
    "rollout.engine=builtin",
    f"grpo.steps={STEPS}",
    "warmstart.steps=150",
    "logging.plots=false",
)
pytestmark = [pytest.mark.slow, pytest.mark.stack]


def _train(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the straight run, the copy cut back to step 2 and resumed)."""
    root = tmp_path_factory.mktemp("builtin")
    straight, cache = root / "straight", root / "cache"
    _train(str(RECIPE), *KEYS, "--run-dir", str(straight), "--cache-dir", str(cache))
    resumed = root / "resumed"
    shutil.copytree(straight, resumed)
    ckpts = resumed / "checkpoints"
    for later in ckpts.glob("step-*"):
        if int(later.name.split("-")[1]) > 2:
            shutil.rmtree(later)
    (ckpts / "latest").write_text("step-000002\n")
    _train(str(RECIPE), *KEYS, "--resume", str(resumed), "--cache-dir", str(cache))
    return straight, resumed


def test_builtin_run_trains_and_checkpoints(runs):
    straight, _ = runs
    rows = [r for r in trajectory(straight) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert math.isfinite(r["pg_loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert any(0 < r["reward_mean"] < 1 for r in rows)
    assert (straight / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:06d}"
    assert (straight / "hf" / "config.json").is_file()


def test_resumed_builtin_run_matches_the_straight_run(runs):
    straight, resumed = runs
    a, b = trajectory(straight), trajectory(resumed)
    assert trajectory_mismatches(a, b) == []
    # The comparison is bit for bit: one changed digit of one metric is caught.
    b[-1] = {**b[-1], "pg_loss": b[-1]["pg_loss"] + 1e-12}
    assert trajectory_mismatches(a, b) == [
        f"step {STEPS} pg_loss: {a[-1]['pg_loss']} != {b[-1]['pg_loss']}"
    ]
