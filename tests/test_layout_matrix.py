"""The layout matrix: each TP/PP/CP/DP layout it lists gives the single-process gradients.

    python -m pytest tests/test_layout_matrix.py        # ~3-5 min on 2 cores

One launch computes the single-process reference (TP=PP=CP=DP=1, one micro-batch) for every rule
and scope used; then one launch per layout (2 or 4 gloo processes) runs all of that layout's cases:
rules token, sequence, balanced with 1 and 3 micro-batches each, plus per-layout extras
(balanced_mass, group_token_mean, batch scope, calculate_per_token_loss), and negative controls
that must fail the same comparison: the same loss normalised per micro-batch (NeMo-Aligner's
normalisation) and a loss scaled for megatron-core 0.12 (whose schedule multiplies by CP) on the
CP layouts. The per-micro-batch control must pass where its one micro-batch is the global batch
(one DP rank, M = 1: TP2, PP2, CP2), which shows it differs from the real loss in its
normalisation alone. TP2+SP runs sequence parallelism with the local spec (cpu_compat shim 6);
its control, the norms' gradients not summed over TP, must fail there and pass on TP2 without SP
(where no parameter is marked for that sum). TP4 puts tp above the model's 2 KV heads. Each
launch also
checks that the plan statistics were all-reduced exactly once per global batch on each rank that
computes the loss, our CP shards against megatron-core's get_batch_on_this_cp_rank, forward-only
log-probs and entropy, and one clipped AdamW step. Groups of 3 responses are split across the DP
ranks; response lengths are uneven and longer for wrong answers.
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

CORE = [Case(rule, m) for rule in ("token", "sequence", "balanced") for m in (1, 3)]
NEGATIVE_MB = Case("token", 3, normalization="per_microbatch")
NEGATIVE_SCALE = Case("balanced", 3, assume_megatron_version=(0, 12))
# The control where a micro-batch is the global batch (DP1 layouts): must pass.
WHOLE_BATCH_MB = Case("balanced", 1, normalization="per_microbatch")
# The norms' gradients not summed over TP: must fail under sequence parallelism, pass without.
SP_GRADS_UNREDUCED = Case("balanced", 3, sequence_parallel_grads_unreduced=True)

LAYOUTS: dict[str, tuple[ParallelLayout, list[Case]]] = {
    "DP2": (
        ParallelLayout(dp=2),
        [
            Case("balanced_mass", 3),
            Case("group_token_mean", 3, scope="batch"),  # per group though the scope is batch
            Case("balanced", 3, scope="batch"),
            Case("balanced", 3, per_token_loss=True),
            NEGATIVE_MB,
            Case("token", 1, normalization="per_microbatch"),
        ],
    ),
    "TP2": (
        ParallelLayout(tp=2),
        [Case("balanced", 3, per_token_loss=True), WHOLE_BATCH_MB, SP_GRADS_UNREDUCED],
    ),
    "TP2+SP": (ParallelLayout(tp=2, sequence_parallel=True), [SP_GRADS_UNREDUCED]),
    # tp above the debug model's 2 KV heads: megatron-core all-gathers the fused QKV and each
    # rank keeps its group's KV head (transformer/attention.py)
    "TP4": (ParallelLayout(tp=4), []),
    "PP2": (
        ParallelLayout(pp=2),
        [Case("token", 3, per_token_loss=True), NEGATIVE_MB, WHOLE_BATCH_MB],
    ),
    # uneven stages: the embedding's and the output layer's stages hold one layer each
    "PP3(1+2+1)": (
        ParallelLayout(pp=3, pp_first_stage_layers=1, pp_last_stage_layers=1),
        [NEGATIVE_MB, WHOLE_BATCH_MB],
    ),
    "CP2": (
        ParallelLayout(cp=2),
        [Case("sequence", 3, per_token_loss=True), NEGATIVE_MB, NEGATIVE_SCALE, WHOLE_BATCH_MB],
    ),
    "TP2xDP2": (ParallelLayout(tp=2, dp=2), [Case("balanced_mass", 1)]),
    "PP2xDP2": (ParallelLayout(pp=2, dp=2), [Case("balanced", 3, per_token_loss=True)]),
    "TP2xPP2": (ParallelLayout(tp=2, pp=2), [Case("balanced", 1, per_token_loss=True)]),
    "CP2xDP2": (
        ParallelLayout(cp=2, dp=2),
        [Case("balanced", 3, per_token_loss=True), NEGATIVE_MB, NEGATIVE_SCALE],
    ),
}


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _must_fail(case: Case, layout: ParallelLayout) -> bool:
    """A negative control whose difference from the real loss shows on this layout."""
    if case.assume_megatron_version is not None:
        return True
    if case.sequence_parallel_grads_unreduced:
        return layout.sequence_parallel
    # Per-micro-batch normalisation is the global one when a micro-batch is the whole batch.
    return case.normalization != "plan" and layout.dp * case.num_microbatches > 1


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> str:
    cases = CORE + [c for _, extra in LAYOUTS.values() for c in extra]
    path = str(tmp_path_factory.mktemp("layout") / "reference.pt")
    compute_reference(cases, seed=0, path=path)
    return path


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference):
    layout, extra = LAYOUTS[name]
    report = run_layout(layout, CORE + extra, seed=0, reference=reference)
    assert report.cp_layout_matches_megatron
    assert report.logprobs_err <= TOLERANCE and report.entropy_err <= TOLERANCE
    assert report.grad_norm_rel_err <= TOLERANCE
    assert report.update_rel_err <= 1e-3  # AdamW's g / (|g| + eps) amplifies rounding by ~lr/eps
    failures = []
    for r in report.cases:
        # The figures docs/parallelism.md quotes (seen with `pytest -s`).
        print(
            f"{layout} {r.case}: max_rel_grad_err={r.max_rel_grad_err:.3e} "
            f"loss_err={r.loss_err:.3e}"
        )
        assert r.reducer_calls == expected_reducer_calls(layout, r.case), (
            str(r.case),
            r.reducer_calls,
        )
        if _must_fail(r.case, layout):
            # The comparison must be able to fail: clearly, not by rounding.
            if r.max_rel_grad_err < 1e-2:
                failures.append(f"negative control passed: {r.case}: {r.max_rel_grad_err:.2e}")
        elif not r.ok:
            failures.append(
                f"{r.case}: max_rel_grad_err={r.max_rel_grad_err:.2e} loss_err={r.loss_err:.2e}"
            )
    assert not failures, f"{layout}: " + "; ".join(failures)
    assert len(report.cases) == len(CORE + extra)
