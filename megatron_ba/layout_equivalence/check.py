"""Check that a TP x PP x CP x DP layout gives the single-process loss and gradients exactly.

    from megatron_ba.layout_equivalence.check import Case, run_layout
    results = run_layout(ParallelLayout(tp=2, dp=2), [Case("balanced", 3)], seed=0)
    results = run_layout(ParallelLayout(dp=2, ep=2), cases, seed=0, model="tiny-moe")

One launch of tp*pp*cp*dp gloo processes (torch.multiprocessing, spawn) runs every case of the
list; one single-process launch computes the reference (TP=PP=CP=DP=1, one micro-batch) first.
Each side starts from the same full weights (model.full_init_state_dict) and the same synthetic
GRPO batch (`synthetic_batch`): groups split across DP ranks, binary rewards, wrong answers longer
than right ones (uneven, sign-correlated lengths), one zero-variance group, old and reference
log-probs near the model's (so that clipping, dual clipping, KL and entropy all act).

Errors (float32 runs):
  max_rel_grad_err = max over parameters of max|g - g_ref| / max|g_ref| (each gathered to full
                     shape), loss_err = |L - L_ref| (absolute: a balanced loss is near 0);
  max_rel_decay_grad_err = the same over the Gated DeltaNet decay parameters (Qwen3.5's A_log,
                     dt_bias), which max_rel_grad_err leaves out: cases.DECAY_TOLERANCE.
CP runs at the loss level on CPU (grpo_step's cp_mode="loss"): the model sees whole sequences.
Each launch also checks, once per layout: our CP shards against megatron-core's
get_batch_on_this_cp_rank, forward-only log-probs/entropy, and one clipped AdamW step
(workers.py). The cases, the batch and the records of the results: cases.py.
"""

from __future__ import annotations

import json
import os
import tempfile

from megatron_ba.layout_equivalence import workers
from megatron_ba.layout_equivalence.cases import (  # re-exported: the check's public names
    SEQUENCES,
    TOLERANCE,
    Case,
    CaseResult,
    LayoutReport,
    check_layout_possible,
    describe,
    expected_reducer_calls,
    flag_layout,
)
from megatron_ba.parallel.parallel_layout import ParallelLayout
from megatron_ba.parallel.world import free_port, spawn

__all__ = [
    "TOLERANCE",
    "Case",
    "CaseResult",
    "LayoutReport",
    "check_layout_possible",
    "compute_reference",
    "describe",
    "expected_reducer_calls",
    "flag_layout",
    "run_layout",
]


def compute_reference(
    cases: list[Case], seed: int, path: str, sequences: int = SEQUENCES, model: str = "debug"
) -> None:
    """The single-process results of every (rule, scope, rollout correction) in `cases`, saved
    to `path` (`model`: the check's model, layout_equivalence.MODELS; one process holds every
    expert)."""
    keys = sorted({(c.rule, c.scope, c.rollout_correction) for c in cases})
    spawn(workers.reference_worker, 1, (free_port(), seed, keys, path, sequences, model))


def run_layout(
    layout: ParallelLayout,
    cases: list[Case],
    *,
    seed: int = 0,
    reference: str | None = None,
    sequences: int = SEQUENCES,
    model: str = "debug",
    attention: str = "unfused",
) -> LayoutReport:
    """Run every case on `layout` in one launch and compare with the single-process reference.

    `model`: the checked model (layout_equivalence.MODELS); `attention`: the local spec's core
    attention of the layout under test (the reference runs the unfused one). `reference`: a file
    written by `compute_reference` for (a superset of) these cases' rules, scopes and rollout
    corrections, this seed, model and number of sequences; computed here, in a temporary file,
    when None.
    """
    check_layout_possible(layout, cases, sequences=sequences, model=model, attention=attention)
    with tempfile.TemporaryDirectory() as tmp:
        if reference is None:
            reference = os.path.join(tmp, "reference.pt")
            compute_reference(cases, seed, reference, sequences, model)
        out = os.path.join(tmp, "report.json")
        args = (layout.world, free_port(), layout, model, attention, cases, reference, out)
        spawn(workers.layout_worker, layout.world, args)
        with open(out) as f:
            report = json.load(f)
    results = []
    for r in report.pop("cases"):
        case = r.pop("case")
        version = case.pop("assume_megatron_version")
        results.append(
            CaseResult(
                Case(**case, assume_megatron_version=tuple(version) if version else None), **r
            )
        )
    return LayoutReport(cases=results, **report)
