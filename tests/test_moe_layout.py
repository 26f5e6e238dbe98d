"""The layout check on a mixture-of-experts model: expert parallelism gives the single-process
loss and gradients.

    python -m pytest tests/test_moe_layout.py        # ~105 s on 2 shared cores (SP layouts: 17 s)

The model is the tiny-moe preset (8 experts, top-2, SequentialMLP experts, the allgather
dispatcher; untied embeddings, the router's auxiliary loss off: layout_equivalence.cases.tiny_spec).
One launch computes the single-process reference, which holds every expert; then one launch per
layout runs the rules token, sequence and balanced (3 micro-batches each) and compares the loss
and every parameter's gradient (experts gathered over their tensor- and expert-parallel groups
under global expert numbers, the router included), the forward-only log-probs and one clipped
AdamW step (its gradient norm sums the experts over the expert-parallel ranks).

Layouts: EP2 (DP2, expert-DP 1), DP4 x EP2 (expert-DP 2: the expert-data-parallel group differs
from the data-parallel group), DP4 x EP2 x ETP2 (experts tensor-parallel over 2 ranks, expert-DP
1), PP2 (one MoE layer per stage), and TP2 with sequence parallelism (the local spec's norms run
it on CPU through cpu_compat shim 6): EP2 x TP2 (ETP 1, 2 processes) and DP2 x EP2 x TP2 (ETP 2,
4 processes). TP > 1 without sequence parallelism is refused for MoE (every TP rank would route
the same tokens); the refusal is tested here without a launch.
The negative controls: each rank's expert gradients unreduced over the expert-data-parallel
group must fail on DP4 x EP2 and pass where expert-DP is 1 (EP2); the gradients sequence
parallelism marks (norms, router) not summed over TP must fail on EP2 x TP2 + SP and pass on EP2
(nothing marked). Each differs from the real step in that reduction alone.
"""

from __future__ import annotations

import pytest

from megatron_ba.layout_equivalence.check import (
    TOLERANCE,
    Case,
    check_layout_possible,
    compute_reference,
    expected_reducer_calls,
    flag_layout,
    run_layout,
)
from megatron_ba.parallel.parallel_layout import ParallelLayout

MODEL = "tiny-moe"
CORE = [Case(rule, 3) for rule in ("token", "sequence", "balanced")]
EXPERTS_UNREDUCED = Case("balanced", 3, expert_grads_unreduced=True)
SP_GRADS_UNREDUCED = Case("balanced", 3, sequence_parallel_grads_unreduced=True)

LAYOUTS: dict[str, tuple[ParallelLayout, list[Case]]] = {
    "EP2": (ParallelLayout(dp=2, ep=2), [*CORE, EXPERTS_UNREDUCED, SP_GRADS_UNREDUCED]),
    "DP4xEP2": (ParallelLayout(dp=4, ep=2), [*CORE, EXPERTS_UNREDUCED]),
    "DP4xEP2xETP2": (ParallelLayout(dp=4, ep=2, etp=2), CORE),
    "PP2": (ParallelLayout(pp=2), CORE),
    # TP2 with sequence parallelism (the local spec's norms: cpu_compat shim 6); the experts
    # split over the two TP ranks (ETP 1), then DP2 x TP2 with EP2 over DP (ETP 2, expert-DP 1).
    "EP2xTP2+SP": (
        ParallelLayout(tp=2, ep=2, etp=1, sequence_parallel=True),
        [*CORE, SP_GRADS_UNREDUCED],
    ),
    "DP2xEP2xTP2+SP": (ParallelLayout(tp=2, dp=2, ep=2, sequence_parallel=True), CORE),
}


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("moe-layout") / "reference.pt")
    compute_reference(CORE, seed=0, path=path, model=MODEL)
    return path


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, moe_reference):
    layout, cases = LAYOUTS[name]
    report = run_layout(layout, cases, seed=0, reference=moe_reference, model=MODEL)
    assert report.logprobs_err <= TOLERANCE and report.entropy_err <= TOLERANCE
    assert report.grad_norm_rel_err <= TOLERANCE
    assert report.update_rel_err <= 1e-3  # AdamW's g / (|g| + eps) amplifies rounding by ~lr/eps
    failures = []
    for r in report.cases:
        # The figures docs/parallelism.md quotes (seen with `pytest -s`).
        err = f"max_rel_grad_err={r.max_rel_grad_err:.3e} loss_err={r.loss_err:.3e}"
        print(f"{layout} {r.case}: {err}")
        assert r.reducer_calls == expected_reducer_calls(layout, r.case), str(r.case)
        if (r.case.expert_grads_unreduced and layout.expert_dp > 1) or (
            r.case.sequence_parallel_grads_unreduced and layout.sequence_parallel
        ):
            if r.max_rel_grad_err < 1e-2:  # must fail clearly, not by rounding
                failures.append(f"negative control passed: {r.case}: {r.max_rel_grad_err:.2e}")
        elif not r.ok:
            failures.append(
                f"{r.case}: max_rel_grad_err={r.max_rel_grad_err:.2e} loss_err={r.loss_err:.2e}"
            )
    print(
        f"{layout}: grad-norm rel err {report.grad_norm_rel_err:.2e}, "
        f"update rel err {report.update_rel_err:.2e}"
    )
    assert not failures, f"{layout}: " + "; ".join(failures)
    assert len(report.cases) == len(cases)


@pytest.mark.parametrize(
    "fields, model, flag",
    [
        (dict(tp=2, dp=2, ep=2), MODEL, "--tp"),  # TP > 1 without SP
        (dict(dp=2, ep=2, sequence_parallel=True), MODEL, "--sequence-parallel"),
        (dict(dp=2, ep=3), MODEL, "--ep"),  # 3 does not divide 8 experts
        (dict(dp=2, ep=4), MODEL, "--ep"),  # 4 > the 2 ranks of the stage
        (dict(dp=2, ep=2), "debug", "--ep"),  # the dense model has no experts
        (dict(dp=4, ep=2, etp=3), MODEL, "--etp"),
    ],
)
def test_impossible_expert_layouts_are_refused_naming_the_flag(fields, model, flag):
    check_layout_possible(flag_layout(dp=2, ep=2), CORE, model=MODEL)  # the control: possible
    with pytest.raises(ValueError, match=f"^{flag}"):
        check_layout_possible(flag_layout(**fields), CORE, model=model)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--model", "tiny-moe", "--tp", "2", "--dp", "2", "--ep", "2"], "--tp"),
        (["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--sequence-parallel"], "--sequence"),
        (["--dp", "2", "--ep", "2"], "--ep"),
        (["--dp", "2", "--negative-control-experts"], "--negative-control-experts"),
        (["--model", "tiny-moe", "--dp", "2", "--ep", "0"], "--ep"),
    ],
)
def test_check_layout_command_refuses_impossible_expert_layouts(args, flag, capsys):
    from megatron_ba.cli import main

    assert main(["check-layout", *args]) == 2  # refused before any launch
    assert flag in capsys.readouterr().err
