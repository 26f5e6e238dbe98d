"""The local backend end to end: HF <-> megatron <-> vLLM weights, and a killed run that resumes.

Each check runs in its own process (tests/train_checks.py): megatron-core's parallel state is
global to a process, and vLLM starts an engine process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_metrics import kill_after_checkpoint, trajectory, trajectory_mismatches

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "tests/fixtures/tiny-train.yaml"
CHECKS = ROOT / "tests/train_checks.py"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("warmstart-cache")


def _run_check(*args: str, timeout: float = 600) -> dict:
    proc = subprocess.run(
        [sys.executable, str(CHECKS), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_weights_agree_across_hf_megatron_and_vllm(cache_dir):
    r = _run_check("sync", str(RECIPE), str(cache_dir))
    assert r["roundtrip_same_keys"] and r["roundtrip_max_abs"] == 0.0
    assert r["megatron_vs_hf_max_abs"] < 1e-4  # float32 forward of two implementations
    # After a deterministic perturbation the stale engine disagrees (negative control) ...
    assert r["stale_vllm_vs_megatron_max_abs"] > 1e-2
    # ... and after the sync vLLM's log-probs of the same tokens match the policy's.
    assert r["synced_vllm_vs_megatron_max_abs"] < 1e-4
    assert r["builtin_padding_max_abs"] < 1e-4
    assert r["builtin_unmasked_padding_max_abs"] > 1e-3  # padding would leak without the mask
    assert r["builtin_shapes"] == [2, 2] and 1 <= r["builtin_max_len"] <= 6


def _train_cmd(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_ba.cli",
        "train",
        str(RECIPE),
        "grpo.steps=6",
        *extra,
        "--run-dir",
        str(run_dir),
        "--cache-dir",
        str(cache_dir),
    ]


# TensorBoard and W&B (offline) on the killed-and-resumed run (the resume reads them from its
# recipe.yaml): test_trackers_hold_what_metrics_jsonl_holds.
TRACKING = ("logging.tensorboard=true", "logging.wandb.mode=offline",
            "logging.wandb.project=megatron-ba-tests")  # fmt: skip


@pytest.fixture(scope="module")
def resumed_run(cache_dir, tmp_path_factory):
    """A 6-step run SIGKILLed after its checkpoint of step >= 2, then resumed to the end."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    step = kill_after_checkpoint(_train_cmd(run_dir, cache_dir, *TRACKING), run_dir, 2, cwd=ROOT)
    assert 2 <= step < 6
    return run_dir, step, _run_check("resume", str(RECIPE), str(run_dir), str(cache_dir))


def test_killed_run_resumes_with_the_saved_state(resumed_run):
    _, step, r = resumed_run
    assert r["start_step"] == r["checkpoint_step"] == step
    assert r["weights_equal"] and r["optimizer_equal"] and r["torch_rng_equal"]
    assert r["num_weight_shards"] > 5  # the comparison saw the model's tensors
    assert r["optimizer_steps"] == [2 * step]  # AdamW's count: grpo.mini_batches = 2 per step
    assert r["saved_optimizer_step"] == 2 * step
    assert max(r["steps_logged_before"]) == step  # metrics cut back to the checkpoint
    after = r["steps_logged_after"]
    train_steps = [s for s in after if s > 0]
    assert train_steps == list(range(1, 7))  # every step exactly once, none lost or repeated
    assert r["summary"] and "eval_accuracy.png" in r["plots"]
    # Hugging Face weights only at the end of the run (RUN_DIR/hf), none per checkpoint.
    assert r["run_hf"] and not r["checkpoint_hf"]


def test_trackers_hold_what_metrics_jsonl_holds(resumed_run):
    """Every number of metrics.jsonl is in TensorBoard once, at its step (the steps the killed
    run logged after its checkpoint were purged when the resume redid them), and in the W&B
    history: the resumed run's file holds the steps after the checkpoint, the killed run's file
    agrees with metrics.jsonl on whatever it had written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_log import history

    from megatron_ba.train.tracking import numbers

    run_dir, step, _ = resumed_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tb = EventAccumulator(str(run_dir / "tb"))
    tb.Reload()
    for key in ("reward_mean", "pg_loss", "grad_norm", "eval_accuracy"):
        want = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        got = [(e.step, e.value) for e in tb.Scalars(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=1e-7)
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(numbers(r))
    killed, resumed = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    after = {row["_step"]: row for row in history(resumed)}
    assert sorted(after) == [s for s in sorted(by_step) if s > step]
    for s, row in [
        *after.items(),
        *((r["_step"], r) for r in history(killed) if r["_step"] <= step),
    ]:
        assert {k: row[k] for k in by_step[s]} == by_step[s], s


def test_resumed_run_follows_the_uninterrupted_trajectory(resumed_run, cache_dir, tmp_path):
    killed_dir, step, _ = resumed_run
    straight = tmp_path / "straight"
    proc = subprocess.run(
        _train_cmd(straight, cache_dir), cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # The terminal holds our lines only; vLLM's and the other libraries' go to logs/.
    terminal = (proc.stdout + proc.stderr).splitlines()
    assert not [x for x in terminal if "INFO" in x or "WARNING" in x or "warn" in x.lower()]
    log = (straight / "logs" / "rank-0.log").read_text()
    assert "Loading safetensors checkpoint shards" in log  # vLLM's weight loader, not ours
    a, b = trajectory(straight), trajectory(killed_dir)
    assert trajectory_mismatches(a, b) == [], f"resumed from step {step}"
    samples = [json.loads(x)["step"] for x in (killed_dir / "samples.jsonl").open()]
    assert samples == sorted(samples) and len(samples) == len(set(samples)) * 4  # none twice
    # The comparison is bit for bit: one changed digit of one metric is caught.
    b[-1] = {**b[-1], "pg_loss": b[-1]["pg_loss"] + 1e-12}
    assert trajectory_mismatches(a, b) == [
        f"step 6 pg_loss: {a[-1]['pg_loss']} != {b[-1]['pg_loss']}"
    ]


def test_compare_writes_the_report(cache_dir, tmp_path):
    out = tmp_path / "compare"
    cmd = [
        sys.executable,
        "-m",
        "megatron_ba.cli",
        "compare",
        str(RECIPE),
        "grpo.steps=2",
        "grpo.mini_batches=1",
        "eval.every=0",
        "--rules",
        "token,balanced",
        "--out",
        str(out),
    ]
    out.mkdir()
    os.symlink(cache_dir, out / ".cache")  # compare's warm-start cache: the module's
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = (out / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| average | ")]
    labels = [r.split(" | ")[1] for r in rows]
    assert labels == ["token (per-group mean)", "balanced (per-group mean)"]  # the recipe's scope
    for name in ("pg_loss.png", "eval_accuracy.png", "length_var.png", "length_gap.png"):
        assert (out / "figures" / name).stat().st_size > 1000
    cells = json.loads((out / "report.json").read_text())["cells"]
    assert [c["runs"] for c in cells] == [["token-seed0"], ["balanced-seed0"]]
    # a second call keeps the finished runs instead of training again
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "2/2 elements finished earlier; 0 to run" in again.stdout
