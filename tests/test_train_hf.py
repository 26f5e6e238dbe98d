"""The real pipeline at test size: GRPO from a Hugging Face Qwen3 checkpoint (built by
`megatron-ba tiny-model`, saved by transformers) on a DAPO-Math-17k file, evaluated on benchmark
files during training, exported to RUN_DIR/hf. With learning rate 0 the export is the input,
bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-run")
    model = root / "tiny-qwen3"
    _cli("tiny-model", str(model))
    run_dir = root / "run"
    _cli(
        "train",
        "recipes/tiny-hf-cpu.yaml",
        f"model.pretrained={model}",
        "optimizer.lr=0",
        "--run-dir",
        str(run_dir),
    )
    return model, run_dir


def test_metrics_carry_each_benchmark_at_every_evaluation(run):
    _, run_dir = run
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]  # step 0 and eval.every = grpo.steps = 2
    for r in evals:
        for name in ("math500", "aime24"):
            assert 0.0 <= r[f"eval/{name}/acc"] <= r[f"eval/{name}/best"] <= 1.0
            assert r[f"eval/{name}/skipped_too_long"] == 0
        mean = (r["eval/math500/acc"] + r["eval/aime24/acc"]) / 2
        assert r["eval_accuracy"] == pytest.approx(mean, abs=1e-12)
    train = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2] and all("pg_loss" in r for r in train)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["eval_table"]["benchmarks"]) == {"math500", "aime24"}
    for name in ("benchmarks_acc.png", "benchmarks_best.png"):
        assert (run_dir / "plots" / name).stat().st_size > 1000


def test_export_with_lr_zero_is_the_input_bit_for_bit(run, tmp_path):
    from megatron_ba.conversion.hf_folder import HFCheckpoint, write_safetensors
    from tests.conversion_agreement import compare_folders

    model, run_dir = run
    same = compare_folders(model, run_dir / "hf")
    assert same["same_keys"] and same["num_tensors"] > 0
    assert same["unequal_tensors"] == [] and same["config_diff"] == []
    assert same["side_files_equal"]
    # Negative control: the same folder with one tensor changed by one ulp is caught.
    changed = tmp_path / "changed"
    shutil.copytree(run_dir / "hf", changed)
    ckpt = HFCheckpoint(changed)
    tensors = {k: ckpt.get(k).clone() for k in ckpt.keys()}
    name = sorted(tensors)[0]
    t = tensors[name].view(-1)
    t[0] = t[0].nextafter(t[0] + 1)
    (changed / "model.safetensors").unlink()
    write_safetensors(changed, tensors.items())
    assert compare_folders(model, changed)["unequal_tensors"] == [name]


def test_moe_checkpoint_under_expert_parallelism(tmp_path):
    """A tiny Qwen3-MoE saved by transformers, trained on 2 processes at parallel.ep=2 (each holds
    half of every layer's experts; each rank's vLLM engine gets them all at each refit): the
    engines' log-probs follow the trainer's, and with learning rate 0 the exported folder, every
    expert gathered back, is the input bit for bit."""
    from tests.conversion_agreement import compare_folders

    model, run_dir = tmp_path / "tiny-qwen3-moe", tmp_path / "run"
    _cli("tiny-model", str(model), "--family", "qwen3_moe")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "megatron_ba.cli", "train", "recipes/tiny-hf-cpu.yaml",
         f"model.pretrained={model}", "parallel.ep=2", "optimizer.lr=0", "eval.every=0",
         "logging.plots=false", "--run-dir", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["rollout_correction/logprob_gap"] for r in records if r["step"] > 0]
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps  # a missing expert moves it to ~1
    same = compare_folders(model, run_dir / "hf")
    assert same["same_keys"] and same["unequal_tensors"] == [] and same["config_diff"] == []
