"""`megatron-ba check-layout`: trust a TP x PP x CP x DP layout before training on it.

    megatron-ba check-layout --tp 2 --pp 1 --cp 1 --dp 2 --micro-batches 3 --rule balanced
    megatron-ba check-layout --tp 1 --pp 2 --cp 1 --dp 2 --micro-batches 1 --rule token --seed 3
    megatron-ba check-layout --cp 2 --dp 2 --micro-batches 3 --rule sequence --scope batch
    megatron-ba check-layout --dp 2 --micro-batches 3 --rule token --per-token-loss
    megatron-ba check-layout --dp 2 --sequences 13 --micro-batches 4 --rule balanced
    megatron-ba check-layout --pp 2 --dp 2 --sequences 14 --token-budget 40 --rule balanced
    megatron-ba check-layout --tp 2 --micro-batches 2 --attention sdpa
    megatron-ba check-layout --pp 2 --pp-first-stage-layers 1 --dp 2 --micro-batches 3
    megatron-ba check-layout --pp 3 --pp-first-stage-layers 1 --pp-last-stage-layers 1 \
        --micro-batches 3 --rule balanced
    megatron-ba check-layout --dp 2 --micro-batches 3 --rollout-correction sequence_reject
    megatron-ba check-layout --model tiny-moe --dp 4 --ep 2 --micro-batches 3 --rule balanced
    megatron-ba check-layout --tp 2 --sequence-parallel --micro-batches 3 --rule token
    megatron-ba check-layout --model tiny-moe --tp 2 --ep 2 --etp 1 --sequence-parallel \
        --micro-batches 3 --rule balanced
    megatron-ba check-layout --model tiny-qwen3.5 --tp 2 --micro-batches 2 --rule balanced

Launches tp*pp*cp*dp gloo processes on CPU with a tiny Qwen2-shaped megatron-core GPTModel
(RMSNorm, SwiGLU, RoPE, GQA), runs one GRPO forward/backward on a fixed synthetic batch
(`--sequences`, default 12: groups of 3 responses split across the DP ranks, wrong answers longer
than right ones, one zero-variance group in every 4; `--micro-batches` need not divide a rank's
sequences; `--token-budget T` packs each rank's sequences into micro-batches of at most T tokens,
rows x longest, on DP shards balanced by tokens) and compares the loss and every parameter's
gradient, gathered to full shape, with a
single-process TP=PP=CP=DP=1 run of the same model and batch (megatron-core's unfused attention;
`--attention sdpa` runs the layout under test with megatron_ba's SDPA core). CP is checked at the
loss level (megatron-core's CP attention needs Transformer Engine). Prints one final line

    max_rel_grad_err=<x> loss_err=<y>

and exits 0 iff both are <= 1e-5 (for Qwen3.5's models the Gated DeltaNet's decay parameters,
whose float32 rounding is larger, are left out of it and printed the line before as
max_rel_decay_grad_err, held to layout_equivalence.cases.DECAY_TOLERANCE) and the plan statistics
were all-reduced exactly once per rank that computes the loss; 1 otherwise; 2 if the layout
cannot be built. The comparison is shown to fail by `--negative-control`: the same loss (clip,
dual clip, KL, entropy) normalised per micro-batch, as NeMo-Aligner does (each micro-batch's plan
from its own statistics, no all-reduce), which must pass where a micro-batch is the whole batch
and fail elsewhere:

    megatron-ba check-layout --dp 1 --micro-batches 1 --rule token --scope batch --negative-control
    megatron-ba check-layout --dp 2 --micro-batches 3 --rule token --scope batch --negative-control

(exit 0, max_rel_grad_err=0.000e+00; exit 1, max_rel_grad_err=2.583e-01, measured).

`--rollout-correction MODE` adds synthetic rollout log-probs (the old ones plus noise) and
`loss.rollout_correction`'s weights and rejection, each DP rank correcting its own whole
sequences before the plan, as training does (megatron_ba.rollout_correction).
"""

from __future__ import annotations

import argparse
import sys

from megatron_ba.layout_equivalence import MODELS
from megatron_ba.loss_settings import ROLLOUT_CORRECTION_MODES, RULES, SCOPES
from megatron_ba.megatron.mcore_compat import has_pg_collection


def add_arguments(p: argparse.ArgumentParser) -> None:
    _layout_arguments(p)
    _case_arguments(p)
    _control_arguments(p)


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    """The layout and the checked model."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    for end in ("first", "last"):
        p.add_argument(
            f"--pp-{end}-stage-layers",
            type=int,
            metavar="N",
            help=f"uneven stages: the {end} pipeline stage's layers (the stages between share the "
            "rest evenly; default: every stage num_layers / pp)",
        )
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (loss level on CPU)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument(
        "--model",
        choices=MODELS,
        default="debug",
        help="the checked model: the dense debug preset, the tiny-moe preset (8 experts, "
        "top-2, untied embeddings, router aux loss off), or Qwen3.5's hybrid tiny-qwen3.5 / "
        "tiny-qwen3.5-moe (Gated DeltaNet and gated attention; tp x cp divides the DeltaNet's "
        "heads)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (tiny-moe), carved out of DP x CP as megatron-core does",
    )
    p.add_argument(
        "--etp",
        type=int,
        default=None,
        help="expert-tensor-parallel size (tiny-moe; default: megatron-core's, the TP size)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="parallel.sequence_parallel: the sequence split over the TP ranks outside the "
        "attention and MLP (needs --tp > 1; required for tiny-moe at --tp > 1)",
    )


def _case_arguments(p: argparse.ArgumentParser) -> None:
    """The checked step: its micro-batches, batch, rule, attention, rollout correction."""
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per DP rank (need not divide its sequences: sizes differ by one)",
    )
    p.add_argument(
        "--sequences",
        type=int,
        default=12,
        help="sequences in the synthetic batch (groups of 3, the last smaller if 3 does not "
        "divide it)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="tokens per micro-batch (parallel.max_tokens_per_microbatch: uneven micro-batches, "
        "DP shards balanced by tokens); replaces --micro-batches",
    )
    p.add_argument("--rule", choices=RULES, default="balanced", help="aggregation rule")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    p.add_argument(
        "--attention",
        choices=("unfused", "sdpa"),
        default="unfused",
        help="core attention of the layout under test (model.attention); the single-process "
        "reference runs megatron-core's unfused core",
    )
    p.add_argument("--scope", choices=SCOPES, default="group")
    p.add_argument(
        "--rollout-correction",
        choices=ROLLOUT_CORRECTION_MODES,
        default="none",
        help="loss.rollout_correction's mode: synthetic rollout log-probs (the old ones plus "
        "noise) and the correction (cap 1.5, accepted ratios [0.6, 1.6]) in the checked step",
    )
    p.add_argument(
        "--per-token-loss",
        action="store_true",
        help="build the model with megatron-core's calculate_per_token_loss=True",
    )


def _control_arguments(p: argparse.ArgumentParser) -> None:
    """The negative controls: the same check of a step broken on purpose."""
    # Listed in --help: the docs tell users to run it to see the check fail on a wrong loss.
    p.add_argument(
        "--negative-control",
        action="store_true",
        help="check a deliberately wrong loss (normalised per micro-batch, as NeMo-Aligner "
        "does): passes with one micro-batch for the whole batch, fails otherwise",
    )
    p.add_argument(
        "--negative-control-experts",
        action="store_true",
        help="check a deliberately wrong expert-gradient reduction (each rank keeps its own "
        "experts' gradients, not summed over the expert-data-parallel group): passes where "
        "expert-DP is 1, fails otherwise",
    )
    p.add_argument(
        "--negative-control-sequence-parallel",
        action="store_true",
        help="check a deliberately wrong sequence-parallel reduction (the norms' and router's "
        "gradients not summed over TP): passes without --sequence-parallel, fails with it",
    )
    p.add_argument(
        "--negative-control-deltanet-norm",
        action="store_true",
        help="(Qwen3.5 models) check a deliberately wrong Gated DeltaNet output-norm gradient "
        "(each TP rank keeps its heads' share, as megatron-core's own norm there does): passes "
        "at --tp 1, fails at --tp 2",
    )


def unsupported_megatron_core() -> str | None:
    """Why the installed megatron-core cannot run the layout check, or None.

    The check builds its model with megatron-core's process-group collections
    (`megatron.core.process_groups_config`, absent in 0.10) and is tested with 0.16.1 and 0.19.
    """
    from megatron.core import package_info

    if not has_pg_collection():
        return (
            f"megatron-core {package_info.__version__} is not supported: the layout check needs "
            "megatron.core.process_groups_config (megatron-core 0.16.1 through 0.19 are tested; "
            "0.10, NeMo-Aligner 0.7.0's, lacks it). Under megatron-core 0.10 the GRPO loss is "
            "checked inside NeMo-Aligner by tests/nemo/ (bash scripts/run_nemo_tests.sh)"
        )
    return None


def run(args: argparse.Namespace) -> int:
    # torch: imported on use, so that --help imports none
    from megatron_ba.layout_equivalence.check import describe, run_layout

    unsupported = unsupported_megatron_core()
    if unsupported:
        print(f"check-layout: {unsupported}", file=sys.stderr)
        return 2
    build = dict(model=args.model, attention=args.attention)
    try:
        layout, case = _layout_and_case(args, build)
    except ValueError as e:
        print(f"check-layout: cannot build layout: {e}", file=sys.stderr)
        return 2
    print(
        f"check-layout: {describe(layout, **build)} ({layout.world} gloo processes), {case}, "
        f"seed {args.seed}, {args.sequences} sequences"
    )
    report = run_layout(layout, [case], seed=args.seed, sequences=args.sequences, **build)
    return _verdict(layout, case, report)


def _layout_and_case(args: argparse.Namespace, build: dict):
    """(the ParallelLayout, the Case) of the flags; ValueError naming the flag at fault."""
    from megatron_ba.layout_equivalence.check import Case, check_layout_possible, flag_layout

    case = Case(
        rule=args.rule,
        num_microbatches=args.micro_batches,
        scope=args.scope,
        per_token_loss=args.per_token_loss,
        normalization="per_microbatch" if args.negative_control else "plan",
        token_budget=args.token_budget,
        rollout_correction=args.rollout_correction,
        expert_grads_unreduced=args.negative_control_experts,
        sequence_parallel_grads_unreduced=args.negative_control_sequence_parallel,
        deltanet_norm_grads_unreduced=args.negative_control_deltanet_norm,
    )
    layout = flag_layout(
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        dp=args.dp,
        ep=args.ep,
        etp=args.etp,
        sequence_parallel=args.sequence_parallel,
        pp_first_stage_layers=args.pp_first_stage_layers,
        pp_last_stage_layers=args.pp_last_stage_layers,
    )
    if args.negative_control_experts and args.model == "debug":
        raise ValueError("--negative-control-experts: needs --model tiny-moe")
    if args.negative_control_deltanet_norm and "qwen3.5" not in args.model:
        raise ValueError("--negative-control-deltanet-norm: needs --model tiny-qwen3.5[-moe]")
    if not (isinstance(args.micro_batches, int) and args.micro_batches >= 1):
        raise ValueError(f"--micro-batches: must be >= 1, got {args.micro_batches}")
    if args.token_budget is not None and args.micro_batches != 1:
        raise ValueError(
            "--micro-batches: the token budget decides the micro-batches; give one of "
            "--micro-batches and --token-budget"
        )
    check_layout_possible(layout, [case], sequences=args.sequences, **build)
    return layout, case


def _verdict(layout, case, report) -> int:
    """Print what the launch found and its verdict; 0 when it passed, 1 when it did not."""
    from megatron_ba.layout_equivalence.cases import DECAY_TOLERANCE
    from megatron_ba.layout_equivalence.check import TOLERANCE, expected_reducer_calls

    (result,) = report.cases
    print(f"loss {result.loss:.9g} (single process {result.loss_ref:.9g})")
    print(f"statistics all-reduces per rank: {result.reducer_calls}")
    if case.rollout_correction != "none":
        print(
            f"rollout correction {case.rollout_correction}: {result.fraction_corrected:.1%} of "
            "the response tokens truncated, masked or rejected"
        )
    print(
        f"forward-only log-probs: max abs err {report.logprobs_err:.2e} (entropy "
        f"{report.entropy_err:.2e}); CP shards as megatron-core's: "
        f"{report.cp_layout_matches_megatron}; AdamW step: grad-norm rel err "
        f"{report.grad_norm_rel_err:.2e}, update rel err {report.update_rel_err:.2e}"
    )
    expected = expected_reducer_calls(layout, case)
    calls_ok = result.reducer_calls == expected
    ok = result.ok and calls_ok and report.cp_layout_matches_megatron
    if not calls_ok:
        print(
            f"FAIL: statistics all-reduces per rank {result.reducer_calls}, expected "
            f"{expected} (once on each rank computing the loss; none for the per-micro-batch "
            "control)"
        )
    if not report.cp_layout_matches_megatron:
        print("FAIL: our CP shards differ from megatron-core's get_batch_on_this_cp_rank")
    if result.max_rel_decay_grad_err:
        print(
            f"max_rel_decay_grad_err={result.max_rel_decay_grad_err:.3e} "
            f"(tolerance {DECAY_TOLERANCE:g})"
        )
    print("PASS" if ok else f"FAIL (tolerance {TOLERANCE:g})")
    print(f"max_rel_grad_err={result.max_rel_grad_err:.3e} loss_err={result.loss_err:.3e}")
    return 0 if ok else 1
