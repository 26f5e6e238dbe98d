"""`megatron-ba eval` end to end: a tiny random Qwen2 built here, real vLLM (CPU), fixture
benchmarks in the real schemas. The random model scores ~0; what is checked is that every stage
runs and the outputs have the promised shape and content, and that vLLM's own lines go to the
log file beside the output (on the terminal with --verbose)."""

import json
import os
import re
import subprocess
import sys

import data_helpers  # noqa: F401
import pytest
from data_helpers import BENCH

from megatron_ba.testing.tiny_hf import build_tiny_qwen2

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# vLLM's logger: "INFO 12-01 20:01:02 [file.py:12] ..." (the engine process prefixes its name)
VLLM_LINE = re.compile(r"\b(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_eval_command_end_to_end(tmp_path):
    pytest.importorskip("vllm")
    model = build_tiny_qwen2(tmp_path / "tiny")
    out_json, out_md = tmp_path / "eval.json", tmp_path / "eval.md"
    cmd = [
        sys.executable, "-m", "megatron_ba.cli", "eval", str(model),
        "--benchmarks", "math500,aime24,aime25,olympiad,minerva,livecodebench",
        "--samples", "2", "--max-tokens", "12", "--max-model-len", "1024",
        "--data-dir", str(BENCH), "--label", "tiny", "--code-timeout", "2",
        "--out-json", str(out_json), "--out-md", str(out_md),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = tmp_path / "eval.log"  # beside --out-json
    assert VLLM_LINE.search(log.read_text())
    assert not VLLM_LINE.search(proc.stdout + proc.stderr), proc.stderr[-3000:]
    assert f"third-party output: {log}" in proc.stderr
    report = json.loads(out_json.read_text())
    sizes = {"math500": 3, "aime24": 2, "aime25": 2, "olympiad": 2, "minerva": 2}
    sizes["livecodebench"] = 3
    assert list(report["benchmarks"]) == list(sizes)
    assert report["samples"] == 2 and report["label"] == "tiny"
    assert report["settings"]["chat_template"] is True
    assert report["settings"]["max_tokens"] == 12
    for name, size in sizes.items():
        b = report["benchmarks"][name]
        assert b["problems"] == size and len(b["correct_counts"]) == size
        assert 0.0 <= b["acc"] <= b["best"] <= 1.0
        assert all(0 <= c <= 2 for c in b["correct_counts"])
    table = out_md.read_text()
    assert table.splitlines()[0] == (
        "| Run | Metric | MATH-500 | AIME24 | AIME25 | OlympiadBench | Minerva | LiveCodeBench "
        "| Avg. |"
    )
    assert "| tiny | Acc@2 |" in table and "| tiny | Best@2 |" in table
    assert table in proc.stdout  # the table is printed too


def test_eval_command_rejects_unknown_benchmarks(tmp_path):
    cmd = [sys.executable, "-m", "megatron_ba.cli", "eval", str(tmp_path), "--benchmarks", "gsm8k"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown benchmark" in proc.stderr


def test_eval_verbose_keeps_vllm_lines_on_the_terminal(tmp_path):
    pytest.importorskip("vllm")
    model = build_tiny_qwen2(tmp_path / "tiny")
    out_json = tmp_path / "eval.json"
    cmd = [
        sys.executable, "-m", "megatron_ba.cli", "eval", str(model), "--benchmarks", "math500",
        "--limit", "1", "--samples", "1", "--max-tokens", "4", "--max-model-len", "1024",
        "--data-dir", str(BENCH), "--out-json", str(out_json), "--verbose",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert VLLM_LINE.search(proc.stdout + proc.stderr)
    assert not (tmp_path / "eval.log").exists() and out_json.is_file()
