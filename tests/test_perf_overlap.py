"""`megatron-ba perf overlap`'s comparison: hand-computed on two tiny runs, and the published
measurement (docs/runs/async-cpu) recomputed from the metrics it ships."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from megatron_ba.commands.perf_overlap import compare, summarize

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "docs/runs/async-cpu"


def _run(k: int, steps: list[float], acc: list[float]) -> dict:
    return {
        "staleness": k,
        "seed": 0,
        "step_seconds": steps,
        "trainer_wait_seconds": [s / 2 for s in steps],
        "engine_idle_seconds": [s / 4 for s in steps],
        "eval_steps": [0, 2, 4],
        "eval_accuracy": acc,
    }


def test_the_comparison_by_hand():
    runs = {
        "k0-seed0": _run(0, [3.0, 2.0, 2.0, 2.0], [0.3, 0.5, 0.6]),
        "k1-seed0": _run(1, [3.0, 1.0, 1.0, 1.0], [0.3, 0.6, 0.55]),
    }
    c = compare(runs)
    assert c["target_accuracy"] == 0.6  # K = 0's final accuracy
    assert c["k0"]["mean_step_seconds"] == 2.0  # steps 2-4: step 1 overlaps nothing
    assert c["k1"]["step_time_ratio"] == 0.5
    # K = 0 reaches 0.6 at its step-4 evaluation (9 s); K = 1 at step 2 (4 s)
    assert c["k0"]["seconds_to_target"] == 9.0 and c["k1"]["seconds_to_target"] == 4.0
    assert c["k1"]["time_to_target_ratio"] == pytest.approx(4 / 9)
    never = copy.deepcopy(runs)
    never["k1-seed0"]["eval_accuracy"] = [0.3, 0.5, 0.59]
    assert compare(never)["k1"]["seconds_to_target"] is None


def test_the_published_measurement_recomputes_from_its_metrics():
    shipped = json.loads((PUBLISHED / "summary.json").read_text())
    assert summarize(PUBLISHED)["comparison"] == shipped["comparison"]
    assert sorted(shipped["runs"]) == [f"k{k}-seed{s}" for k in (0, 1, 2) for s in (0, 1, 2)]
    # control: one evaluation changed in the data changes the comparison
    runs = copy.deepcopy(shipped["runs"])
    runs["k1-seed0"]["eval_accuracy"][-1] += 0.25
    assert compare(runs) != shipped["comparison"]
