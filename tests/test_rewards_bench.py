"""`megatron-ba perf rewards` runs and its synthetic pairs are scored as labelled."""

import json
import subprocess
import sys

import data_helpers  # noqa: F401


def cli(*args, timeout=180):
    cmd = [sys.executable, "-m", "megatron_ba.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_bench_rewards_small_run(tmp_path):
    out = tmp_path / "figures.json"
    proc = cli("perf", "rewards", "--pairs", "60", "--workers", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["pairs"] == 60 and figures["workers"] == 2
    assert figures["label_agreement"] == 1.0  # every labelled pair scored as its label says
    assert figures["pairs_per_s"] > 0
    assert "pairs_per_s" in proc.stdout


def test_bench_lists_rewards_and_rejects_unknown_names():
    listed = cli("perf", "--help")
    assert listed.returncode == 0 and "rewards" in listed.stdout
    unknown = cli("perf", "nosuch")
    assert unknown.returncode == 2 and "invalid choice" in unknown.stderr
