"""scripts/gpu_check.sh and its driver: shellcheck, the budgets, the failure reasons, the no-GPU
path, the planner comparison's arithmetic by hand, and (slow) the CPU dry run's JSON figures.
The GPU figures themselves come from a GPU machine, never a test."""

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


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


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


def test_budgets_fit_ten_minutes():
    gc = _driver()
    sh = (ROOT / "scripts/gpu_check.sh").read_text()
    # the shell's venv (20 s), install (30 s) and the driver's cap (495 s + 10 s kill grace)
    for piece in ("timeout 20 ", "timeout 30 ", 'timeout --kill-after=10 "$cap"', "cap=495\n"):
        assert piece in sh, piece
    assert gc.STAGE_BUDGET_S <= 495 - 5  # the driver writes its file after the stages
    assert 20 + 30 + 495 + 10 <= 10 * 60
    assert list(gc.BUDGET) == [
        "env",
        "attention",
        "train_0p5b",
        "memory_1p5b",
        "step",
        "aggregation",
        "train",
        "vocab_parallel",
    ]


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
    assert env["sdpa_attention_import_error"] is None
    others = {k: v["status"] for k, v in d["stages"].items() if k != "env"}
    assert set(others) == {
        "attention",
        "train_0p5b",
        "memory_1p5b",
        "step",
        "aggregation",
        "train",
        "vocab_parallel",
    }
    assert set(others.values()) == {"skipped"}
    assert d["figures"]["stages_failed"] == []


def test_planner_estimate_of_the_1p5b_step_by_hand():
    """Qwen2.5-1.5B (tied), one 16,384-token sequence per micro-batch, TP = PP = CP = DP = 1, full
    recomputation, chunked log-probs (1,024): planning.memory's terms, computed by hand."""
    stages = _driver().stages
    from megatron_ba.model_shape import PRESETS

    est = stages.planner_estimate(PRESETS["qwen2.5-1.5b"], 16384, True, 1024)
    # per layer: q 1536^2 + k, v 2 x 1536 x 256 + o 1536^2 + biases 2048 + MLP 3 x 1536 x 8960
    # + 2 norms 3072 = 46,797,824; x 28 + embedding 151,936 x 1536 + final norm 1536
    p = 28 * 46_797_824 + 151_936 * 1536 + 1536
    assert est["parameters"] == p == 1_543_714_304
    weights, grads, optimizer = 2 * p, 4 * p, 12 * p  # bf16, fp32 grads, fp32 main + Adam m, v
    # full recompute: each layer's input (h x 2 bytes x T) + one layer's saved activations,
    # 4h + (q + 2 kv) + q + 3 ffn = 36,608 elements x 2 bytes per token
    activations = 28 * 1536 * 2 * 16384 + 36_608 * 2 * 16384
    # chunked log-probs: bf16 logits and their gradient + two fp32 chunk buffers of 1,024 x V
    logits = 16384 * 151_936 * 2 * 2 + 2 * 1024 * 151_936 * 4
    assert est["estimate_bytes"] == weights + grads + optimizer + activations + logits
    assert est["estimate_bytes"] == 41_597_651_968  # 38.74 GiB
    # Control: without recomputation the estimate is another figure.
    assert stages.planner_estimate(PRESETS["qwen2.5-1.5b"], 16384, False, 1024)["estimate_gib"] > 60


def test_measured_over_estimate_by_hand():
    stages = _driver().stages
    step = {
        "ba_peak_mib": 40 * 1024,
        "token_mean_peak_mib": 39 * 1024,
        "ba_peak_reserved_mib": 43 * 1024,
        "token_mean_peak_reserved_mib": 44 * 1024,
    }
    got = stages.memory_comparison(step, {"estimate_gib": 32.0})
    assert got == {
        "measured_peak_gib": 40.0,  # the larger of the two steps
        "measured_peak_reserved_gib": 44.0,
        "estimate_gib": 32.0,
        "measured_over_estimate": 1.25,
        "reserved_over_estimate": 1.375,
    }


def _gpu_stack_installed() -> bool:
    """Whether this environment's megatron-core is the one requirements/gpu.txt pins (the
    current-stack suite's): the dry run rehearses the GPU environment, so it runs there only."""
    from importlib.metadata import PackageNotFoundError, version

    pins = (ROOT / "requirements/gpu.txt").read_text().splitlines()
    (pin,) = [line.split("==")[1].split()[0] for line in pins if line.startswith("megatron-core==")]
    try:
        return version("megatron-core") == pin
    except PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
def test_cpu_dry_run_figures(tmp_path):
    if not _gpu_stack_installed():
        pytest.skip("runs on the GPU stack's megatron-core: bash scripts/run_current_tests.sh")
    # train (the CLI) is left out: a minute or more on 2 CPU cores; the training path on CPU is
    # tests/test_train_integration.py's.
    stages = "attention,train_0p5b,memory_1p5b,step,aggregation,vocab_parallel"
    p, d = _run_driver(tmp_path, "--stages", stages, allow_cpu=True)
    assert d["mode"] == "cpu-dry-run"
    status = {k: v["status"] for k, v in d["stages"].items()}
    assert status == {
        "env": "pass",
        "attention": "pass",
        "train_0p5b": "pass",
        "memory_1p5b": "pass",
        "step": "pass",
        "aggregation": "pass",
        "train": "skipped",
        "vocab_parallel": "pass",
    }, {k: v.get("error") for k, v in d["stages"].items()}
    assert p.returncode == 0
    f = d["figures"]
    assert f["attention_fp32_sdpa_rel_err"] <= 1e-5 and f["attention_fp32_unfused_rel_err"] <= 1e-5
    assert f["attention_sdpa_peak_extra_mib"] is None  # memory is measured on CUDA only
    assert f["train_0p5b_loss_fell"] and f["train_0p5b_loss_last"] < f["train_0p5b_loss_first"]
    assert f["train_0p5b_precision_max_rel_diff"] == 0.0  # fp32 twice on the CPU
    assert f["train_0p5b_tokens_per_s"] > 0 and f["train_0p5b_mfu"] is None  # no GPU peak
    lm = d["stages"]["train_0p5b"]["figures"]
    assert lm["attention"] == "sdpa" and lm["optimizer"] == "ShardedAdamW"
    assert lm["throughput"]["formula"].startswith("per sequence of S tokens: 6 N S")
    assert f["memory_1p5b_measured_peak_gib"] > 0 and f["memory_1p5b_estimate_gib"] > 0
    mem = d["stages"]["memory_1p5b"]["figures"]
    assert mem["attention"] == "sdpa" and mem["memory_kind"].startswith("VmHWM")
    assert mem["measured_over_estimate"] == pytest.approx(
        mem["measured_peak_gib"] / mem["estimate_gib"]
    )
    assert f["step_ratio_ba_over_token_mean"] > 0 and f["step_attention"] == "unfused"
    assert f["step_ba_peak_mib"] > 0 and f["step_token_mean_peak_mib"] > 0
    assert f["vocab_parallel_naive_peak_extra_mib"] >= 0
    assert "vocab_parallel_chunked:64_median_s" in f
    step = d["stages"]["step"]["figures"]
    assert step["device"] == "cpu" and step["memory_kind"].startswith("VmHWM")
    assert len(step["ba_times_s"]) == len(step["token_mean_times_s"]) == 2
    agg = d["stages"]["aggregation"]["figures"]
    assert agg["device"] == "cpu" and agg["sequences"] == 64
    assert f["aggregation_grpo_loss_ratio"] == agg["ratio_grpo_loss"] > 0
    assert (
        f["aggregation_grpo_loss_balanced_ms"] > 0 and f["aggregation_grpo_loss_token_mean_ms"] > 0
    )
