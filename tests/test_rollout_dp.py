"""DP=2 under torchrun, each rank with its own vLLM engine: prompts split, weights refit in memory.

One torchrun launch (tests/rollout_checks.py) of the tiny training recipe on two data-parallel
ranks; ~2.5 min on 2 shared cores (two vLLM engine processes start), hence slow.
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
RECIPE = ROOT / "tests/fixtures/tiny-train.yaml"
CHECKS = ROOT / "tests/rollout_checks.py"
pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    cache = tmp_path_factory.mktemp("warmstart-cache")
    run_dir = tmp_path_factory.mktemp("dp2") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(CHECKS)]
    proc = subprocess.run(
        [*cmd, str(RECIPE), str(cache), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_every_replica_has_its_own_engine(ranks):
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["dp"] == 2 and r["has_engine"] for r in ranks)


def test_each_engine_generates_its_share_and_rank_0_gets_them_in_order(ranks):
    main, other = ranks
    # A round of 5 prompts: 3 on rank 0, 2 on rank 1; then rank 0's engine alone on all 5
    # (evaluation's path) samples the same tokens: per-prompt seeds follow the prompt's index.
    assert main["prompts_generated_round"] == [3, 5]
    assert other["prompts_generated_round"] == [2]
    assert main["split_groups"] == 5 and main["split_equals_single_engine"]
    # A GRPO step of grpo.prompts_per_step = 4: two prompts per engine.
    assert main["prompts_generated_step"] == [2] and other["prompts_generated_step"] == [2]


def test_refit_in_memory_brings_every_engine_level_with_its_trainer(ranks):
    for r in ranks:
        assert r["stale_max_abs"] > 1e-2  # negative control: the policy moved, no refit yet
        assert r["synced_max_abs"] < 1e-4  # after the in-memory refit
        assert r["step_moved_policy_max_abs"] > 1e-6  # the step's update changed the policy ...
        assert r["after_step_max_abs"] < 1e-4  # ... and the step's refit followed it
        assert r["refits"] == 2


def test_no_weights_file_and_the_shared_segment_is_removed(ranks):
    for r in ranks:
        assert not r["weights_dir_exists"]
        assert r["shm_segment_existed"] and r["shm_segment_removed"]


def test_async_steps_overlap_both_engines_and_refit_them(ranks):
    main, other = ranks
    # Step 2's batch generated now (2 prompts per engine), step 3's during step 2's update (one
    # step old when step 3 trains it), step 4's during step 3's update.
    assert main["prompts_generated_async"] == [2, 2, 2] == other["prompts_generated_async"]
    assert main["async_staleness"] == [0, 1]
    for r in ranks:
        assert r["engine_version"] == 3 and r["after_async_max_abs"] < 1e-4
        assert r["refits_after_async"] == 4
