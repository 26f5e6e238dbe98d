"""Sequence parallelism in a training run: `parallel.sequence_parallel=true` at TP 2 trains as TP 2
without it.

    python -m pytest tests/test_train_sequence_parallel.py      # ~2 min on 2 cores

`check-layout --sequence-parallel` proves one step exact against one process; this runs the whole
loop (vLLM rollouts, the old log-probs, the update, the refit, evaluation) twice, three steps
each, two gloo processes, with the keys of tests/fixtures/tiny-train.yaml: once with sequence
parallelism, once without, everything else equal. The runs must log the layouts they built
(`[layout] TP2+SP...` and `[layout] TP2x...`), agree on every metric of every step (floats within
1e-9 relative: SP only reorders the sums, as the reduce-scatter replaces the all-reduce) and end
with the same weights. The metric comparison is checked to flag a 1e-6 change, and the weights
to have moved from the warm start by far more than the tolerance their comparison allows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_metrics import trajectory, trajectory_mismatches

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests/fixtures/tiny-train.yaml"
KEYS = ("grpo.steps=3", "warmstart.steps=150", "logging.plots=false", "parallel.tp=2")
REL = 1e-9  # metrics: SP reorders float sums, nothing else
WEIGHTS_ATOL = 1e-6  # the final weights, fp32
pytestmark = pytest.mark.slow


def _train(run_dir: Path, cache: Path, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "train", "--nproc-per-node", "2", str(RECIPE),
         *KEYS, *extra, "--run-dir", str(run_dir), "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(run folder, console) with sequence parallelism, the same without, and the cache."""
    root = tmp_path_factory.mktemp("sp")
    cache = root / "cache"
    with_sp = root / "sp", _train(root / "sp", cache, "parallel.sequence_parallel=true")
    without = root / "plain", _train(root / "plain", cache)
    return with_sp, without, cache


def test_each_run_built_its_layout(runs):
    (_, sp_console), (_, plain_console), _ = runs
    assert "[layout] TP2+SPxPP1xCP1xDP1" in sp_console
    assert "[layout] TP2xPP1xCP1xDP1" in plain_console


def test_sequence_parallel_trains_as_tensor_parallel_alone(runs):
    (sp_dir, _), (plain_dir, _), _ = runs
    a, b = trajectory(sp_dir), trajectory(plain_dir)
    assert [r["step"] for r in a] == [0, 1, 2, 3]
    assert any(r.get("grad_norm", 0) > 0 for r in a)  # an update with a gradient is compared
    assert trajectory_mismatches(a, b, rel=REL) == []


def test_the_metric_comparison_flags_a_small_change(runs):
    """The control of the comparison: one metric moved by 1e-6 of itself is a mismatch."""
    (sp_dir, _), _, _ = runs
    a = trajectory(sp_dir)
    moved = [dict(r) for r in a]
    step = next(r for r in moved if r.get("grad_norm", 0) > 0)
    step["grad_norm"] *= 1 + 1e-6
    assert trajectory_mismatches(a, moved, rel=REL) == [
        f"step {step['step']} grad_norm: {dict(a[step['step']])['grad_norm']} != "
        f"{step['grad_norm']}"
    ]


def test_the_runs_end_with_the_same_weights(runs):
    """Equal within WEIGHTS_ATOL, and each tensor moved from the warm start by more than 10x it
    (so equality is not the warm start's, unchanged)."""
    (sp_dir, _), (plain_dir, _), cache = runs
    sp = load_file(sp_dir / "hf" / "model.safetensors")
    plain = load_file(plain_dir / "hf" / "model.safetensors")
    (warm_dir,) = cache.glob("warmstart-*")
    warm = load_file(warm_dir / "model.safetensors")
    assert sp.keys() == plain.keys() == warm.keys()
    for name in sp:
        assert (sp[name] - plain[name]).abs().max().item() <= WEIGHTS_ATOL, name
        assert (sp[name] - warm[name]).abs().max().item() > 10 * WEIGHTS_ATOL, name
