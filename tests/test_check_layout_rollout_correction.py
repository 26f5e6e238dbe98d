"""The layout check with the rollout correction on: loss and gradients of DP2 x 3 micro-batches
(truncating and rejecting modes) and of CP2 x 2 micro-batches (sequence_truncate, through the
command line) equal the single-process run, and the check fails when the rejected tokens are
wrongly kept in the plan's denominators.

    python -m pytest tests/test_check_layout_rollout_correction.py

Real gloo processes (the reference, then 2 ranks): ~1-2 min on 2 shared cores.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

FINAL = re.compile(r"^max_rel_grad_err=(\S+) loss_err=(\S+)$")


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


@pytest.mark.slow
@pytest.mark.distributed
def test_truncating_and_rejecting_modes_pass_and_the_denominator_control_fails():
    from megatron_ba.layout_equivalence.check import Case, run_layout
    from megatron_ba.parallel.parallel_layout import ParallelLayout

    cases = [
        Case("balanced", 3, rollout_correction="token_truncate"),
        Case("balanced", 3, rollout_correction="sequence_reject"),
        Case("balanced", 3, rollout_correction="token_reject"),
        Case("balanced", 3, rollout_correction="token_reject", rejected_kept_in_denominators=True),
    ]
    report = run_layout(ParallelLayout(dp=2), cases, seed=0)
    truncate, seq_reject, tok_reject, control = report.cases
    for r in (truncate, seq_reject, tok_reject):
        assert r.ok, r
        assert r.reducer_calls == [1, 1]
        assert 0.0 < r.fraction_corrected < 1.0, r  # the correction acted on some tokens
    # Control: the same rejection with the rejected tokens left in the denominators (weight 0)
    # is another loss: the check compares the correction, and fails on it.
    assert not control.ok
    assert control.loss_err > 1e-4


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_flag_runs_the_correction_through_the_check():
    # CP 2: the sequence ratio must come from whole sequences, before the CP cut
    args = ["--cp", "2", "--micro-batches", "2", "--rollout-correction", "sequence_truncate"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ba.cli", "check-layout", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "rollout-correction=sequence_truncate" in out
    m = re.search(r"rollout correction sequence_truncate: (\S+)% of the response tokens", out)
    assert m and float(m.group(1)) > 0, out
    grad_err, loss_err = map(float, FINAL.match(out.strip().splitlines()[-1]).groups())
    assert grad_err <= 1e-5 and loss_err <= 1e-5


def test_a_bad_mode_is_refused_by_name(capsys):
    from megatron_ba.cli import main

    with pytest.raises(SystemExit) as e:
        main(["check-layout", "--rollout-correction", "tis"])
    assert e.value.code == 2
    assert "--rollout-correction" in capsys.readouterr().err
