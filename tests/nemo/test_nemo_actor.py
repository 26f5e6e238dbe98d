"""The GRPO actor inside NeMo-Aligner 0.7.0 (real classes, megatron-core 0.10 schedule) on CPU.

One TP=1 process and one TP=2 launch (two gloo processes) run tests/nemo/actor_worker.py; the
tests compare what they saved. The batch: 6 responses in 2 groups, unequal lengths, off-policy
old log-probs (clipping active), 3 micro-batches of 2 through `get_loss_and_metrics`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_nemo

pytestmark = [needs_nemo, pytest.mark.nemo, pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).resolve().parent / "actor_worker.py"


def _run(tp: int, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--tp", str(tp), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AssertionError(f"actor_worker --tp {tp} failed:\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("nemo_actor")
    _run(1, out)  # also writes the old log-probs the TP=2 run reuses
    _run(2, out)
    load = lambda name: torch.load(out / name, weights_only=False)  # noqa: E731
    return load("tp1.pt"), load("tp2.pt")


def max_rel(grads: dict, ref: dict) -> float:
    """max |g - ref| / max |ref| over all parameters (one scale for the whole model)."""
    assert grads.keys() == ref.keys()
    num = max(float((grads[k] - ref[k]).abs().max()) for k in ref)
    return num / max(float(ref[k].abs().max()) for k in ref)


def test_tp1_loss_and_gradients_equal_the_core(results):
    tp1, _ = results
    # The loss is a sum of O(1) terms of both signs: compare on their scale (fp32 model).
    assert tp1["loss"] == pytest.approx(tp1["ref_loss"], abs=1e-6)
    assert tp1["ref_loss"] != 0.0
    assert max_rel(tp1["grads"], tp1["ref_grads"]) < 1e-5
    assert tp1["reducer_calls"] == 1  # the plan statistics: one all-reduce per step


def test_tp2_loss_and_gradients_equal_the_core(results):
    tp1, tp2 = results
    assert tp2["loss"] == pytest.approx(tp1["ref_loss"], abs=1e-6)
    assert max_rel(tp2["grads"], tp1["ref_grads"]) < 1e-5
    assert tp2["reducer_calls"] == 1


def test_group_token_mean_equals_its_float64_definition(results):
    """model.grpo.rule: group_token_mean (scope batch) through NeMo-Aligner's loop, 3 micro-batches:
    the rule's definition on the whole batch (tests/rule_reference.py); the batch token mean, the
    same definition with one group, is the control and differs."""
    tp1, _ = results
    assert tp1["gtm_loss"] == pytest.approx(tp1["gtm_ref_loss"], abs=1e-6)
    assert max_rel(tp1["gtm_grads"], tp1["gtm_ref_grads"]) < 1e-5
    assert abs(tp1["gtm_pooled_loss"] - tp1["gtm_ref_loss"]) > 1e-3
    assert max_rel(tp1["gtm_pooled_grads"], tp1["gtm_ref_grads"]) > 1e-2


def test_comparison_fails_on_a_wrong_gradient(results):
    """The tolerance above is tight enough to see a 0.1% error in one parameter."""
    tp1, _ = results
    bad = dict(tp1["grads"])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    bad[name] = bad[name] + 1e-3 * tp1["ref_grads"][name].abs().max()
    assert max_rel(bad, tp1["ref_grads"]) > 1e-5


def test_nemo_aligner_per_microbatch_mean_differs(results):
    """Negative control: NeMo-Aligner's own REINFORCE actor vs ours (token-mean rule, on-policy).

    Equal with one micro-batch (the loss forms agree on-policy), different with three: the only
    difference is NeMo-Aligner's mean of per-micro-batch token means.
    """
    tp1, _ = results
    assert max_rel(tp1["control_ours_mbs6"], tp1["control_nemo_mbs6"]) < 1e-5
    assert max_rel(tp1["control_ours_mbs2"], tp1["control_nemo_mbs2"]) > 1e-2


def test_one_adamw_step(results):
    """NeMo's plain `adamw` (optim.name: adamw) applied the actor's gradients: Adam's first
    step is lr * g / (|g| + eps) with bias correction, weight decay 0."""
    tp1, _ = results
    assert tp1["opt_name"] == "AdamW"
    before, after, grads = tp1["opt_before"], tp1["opt_after"], tp1["opt_grads"]
    lr, eps = tp1["opt_lr"], tp1["opt_eps"]
    for k in before:
        expected = before[k] - lr * grads[k] / (grads[k].abs() + eps)
        assert float((after[k] - expected).abs().max()) < 1e-6, k
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0.5 * lr


def test_diagnostics_reach_the_metrics(results):
    tp1, _ = results
    m = tp1["metrics"]
    assert m["ba/num_sequences"] == 6.0 and m["ba/num_pos"] == 3.0
    assert m["ba/balanced/weight_pos_part"] == pytest.approx(0.5)
    assert m["num_tokens_sum"] == 63.0
