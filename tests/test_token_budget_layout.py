"""Token-budget and non-dividing micro-batches keep the BA plan exact (gloo, CPU).

One single-process float64-checked reference of a 13-sequence synthetic batch (groups of 3, the
last of 1), then layouts whose DP ranks hold 7 and 6 sequences: micro-batch counts that divide
neither, token budgets (uneven micro-batches on DP shards balanced by tokens) and, at PP=2, every
micro-batch padded to one shape with masked rows. Each case's loss and full gradients must equal
the single-process ones; the per-micro-batch-normalised control, differing only in its
normalisation, must fail the same comparison under a token budget.

    python -m pytest tests/test_token_budget_layout.py     # ~1 min on 2 cores
"""

from __future__ import annotations

import pytest

from megatron_ba.layout_equivalence.check import (
    TOLERANCE,
    Case,
    compute_reference,
    expected_reducer_calls,
    run_layout,
)
from megatron_ba.parallel.parallel_layout import ParallelLayout

SEQUENCES = 13
REAL = [
    Case("balanced", 4),  # 7 and 6 rows in 4 micro-batches: sizes 2,2,2,1 and 2,2,1,1
    Case("token", 5, per_token_loss=True),
    Case("balanced", token_budget=40),
    Case("balanced_mass", token_budget=16),  # one-or-two rows per micro-batch
    Case("sequence", token_budget=60, per_token_loss=True),
]
CONTROL = Case("token", normalization="per_microbatch", token_budget=40)


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("budget") / "reference.pt")
    compute_reference([*REAL, CONTROL], seed=0, path=path, sequences=SEQUENCES)
    return path


def _check(layout: ParallelLayout, cases: list[Case], reference: str) -> None:
    report = run_layout(layout, cases, seed=0, reference=reference, sequences=SEQUENCES)
    assert report.logprobs_err <= TOLERANCE and report.entropy_err <= TOLERANCE
    for r in report.cases:
        print(f"{layout} {r.case}: max_rel_grad_err={r.max_rel_grad_err:.3e}")
        assert r.reducer_calls == expected_reducer_calls(layout, r.case)
        if r.case.normalization == "plan":
            assert r.ok, (str(r.case), r.max_rel_grad_err, r.loss_err)
        else:  # the control must fail clearly, not by rounding
            assert r.max_rel_grad_err > 1e-2, (str(r.case), r.max_rel_grad_err)


@pytest.mark.slow
@pytest.mark.distributed
def test_dp2_token_budgets_and_non_dividing_microbatches(reference):
    _check(ParallelLayout(dp=2), [*REAL, CONTROL], reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_dp2_token_budget_uniform_shapes(reference):
    _check(ParallelLayout(pp=2, dp=2), [REAL[2], REAL[4]], reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_dp2_sequence_parallel_token_budget_widths_padded_to_tp(reference):
    """Sequence parallelism scatters each micro-batch's positions over the TP ranks: token-budget
    micro-batches (cut to their longest row) are padded to a multiple of tp, masked."""
    _check(ParallelLayout(tp=2, dp=2, sequence_parallel=True), [REAL[2], REAL[3]], reference)
