"""scripts/gpu_check.sh and its driver: shellcheck, the failure reasons, the no-GPU path, and (slow)
the CPU dry run's JSON figures. The GPU figures themselves come from a GPU machine, never a test."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_driver(tmp_path, *args, allow_cpu: bool):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GPU_CHECK_ALLOW_CPU", None)
    if allow_cpu:
        env["GPU_CHECK_ALLOW_CPU"] = "1"
    out = tmp_path / "out" / "gpu_check.json"
    cmd = [sys.executable, "scripts/gpu_check.py", "--out", str(out), "--work", str(tmp_path)]
    p = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    return p, json.loads(out.read_text())


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = [ROOT / "scripts/gpu_check.sh", ROOT / "scripts/fetch_gpu_wheels.sh"]
    p = subprocess.run(["shellcheck", "-x", *map(str, scripts)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_budgets_fit_eight_minutes():
    gc = _driver()
    sh = (ROOT / "scripts/gpu_check.sh").read_text()
    # the shell's venv (20 s), install (30 s) and the driver's cap (415 s + 10 s kill grace)
    for piece in ("timeout 20 ", "timeout 30 ", 'timeout --kill-after=10 "$cap"', "cap=415\n"):
        assert piece in sh, piece
    assert gc.STAGE_BUDGET_S <= 415 - 5  # the driver writes its file after the stages
    assert 20 + 30 + 415 + 10 <= 8 * 60


def test_failure_reasons():
    gc = _driver()
    text = "train: model.precision: unknown key; known keys: pretrained, hidden_size"
    assert gc._why(text, 2).startswith("recipe key model.precision is not known")
    assert gc._why("torch.OutOfMemoryError: CUDA out of memory.", 1).startswith("CUDA out of")
    assert gc._why("x\n[timed out after 5 s]", 124) == "timed out"
    assert gc._why("a\nValueError: --tokens bad\n", 1) == "exit 1: ValueError: --tokens bad"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_cuda_only_env_runs(tmp_path):
    p, d = _run_driver(tmp_path, allow_cpu=False)
    assert p.returncode == 1, p.stdout + p.stderr
    assert d["stages"]["env"]["status"] == "pass"
    env = d["stages"]["env"]["figures"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] is False
    assert {"megatron_core", "transformer_engine", "vllm", "gpu_name", "pip_check"} <= set(env)
    others = {k: v["status"] for k, v in d["stages"].items() if k != "env"}
    assert set(others) == {"train", "check_layout", "vocab_parallel", "step", "memory_7b"}
    assert set(others.values()) == {"skipped"}
    assert d["figures"]["stages_failed"] == []


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
def test_cpu_dry_run_figures(tmp_path):
    # train is left out: its keys (model.precision, ...) are the devices work's; the training
    # path on CPU is tests/test_train_integration.py's.
    stages = "check_layout,vocab_parallel,step,memory_7b"
    p, d = _run_driver(tmp_path, "--stages", stages, allow_cpu=True)
    assert d["mode"] == "cpu-dry-run"
    status = {k: v["status"] for k, v in d["stages"].items()}
    assert status == {
        "env": "pass",
        "train": "skipped",
        "check_layout": "pass",
        "vocab_parallel": "pass",
        "step": "pass",
        "memory_7b": "pass",
    }, {k: v.get("error") for k, v in d["stages"].items()}
    assert p.returncode == 0
    f = d["figures"]
    assert f["check_layout_max_rel_grad_err"] <= 1e-5
    assert f["step_ratio_ba_over_token_mean"] > 0
    assert f["step_ba_peak_mib"] > 0 and f["step_token_mean_peak_mib"] > 0
    assert f["vocab_parallel_naive_peak_extra_mib"] >= 0
    assert "vocab_parallel_chunked:64_median_s" in f
    assert f["memory_7b_slice_measured_peak_gib"] > 0
    assert f["memory_7b_slice_estimated_peak_gib"] > 0
    # the whole 7B step at 16K in the recipes' layout: the planner's figure (docs/performance.md)
    assert f["memory_7b_16k_chosen_layout_estimate_gib"] == pytest.approx(70.04)
    step = d["stages"]["step"]["figures"]
    assert step["device"] == "cpu" and step["memory_kind"].startswith("VmHWM")
    assert len(step["ba_times_s"]) == len(step["token_mean_times_s"]) == 2
