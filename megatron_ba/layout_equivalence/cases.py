"""What the layout check checks: cases and their negative controls on a ParallelLayout (with the
checked model and core attention), the synthetic batch, the results' records.

Shared by the launcher (check.py, the parent process) and the process bodies
(workers.py, the spawned ranks); importing neither, so that they import it and not each
other. The check itself and its error measures: megatron_ba.layout_equivalence.check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ba.advantages import group_advantages
from megatron_ba.layout_equivalence import MODELS, controls
from megatron_ba.loss import GRPOLossConfig
from megatron_ba.loss_settings import (
    ROLLOUT_CORRECTION_MODES,
    AggregationSettings,
    RolloutCorrectionSettings,
)
from megatron_ba.megatron import grpo_step
from megatron_ba.megatron.batching import response_end
from megatron_ba.megatron.model import ModelSpec, tiny_qwen2_spec
from megatron_ba.megatron.packing import balanced_dp_shards
from megatron_ba.model_shape import PRESETS
from megatron_ba.parallel.parallel_layout import FLAGS, LayoutError, ParallelLayout
from megatron_ba.step_settings import StepSettings

TOLERANCE = 1e-5
# Qwen3.5's Gated DeltaNet runs its delta rule in float32 (megatron-core's and transformers'
# torch kernels cast to it), and the gradients of its decay parameters (A_log, dt_bias: sums over
# every token of cumulative decays) carry that rounding: one float32 process of tiny-qwen3.5 is
# 8.2e-5 (megatron-core 0.16.1) and 1.3e-4 (0.19.2) from float64 on them, every other parameter
# within 1.6e-6 (tests/test_qwen3_5_layout.py measures both). They are held to DECAY_TOLERANCE,
# that rounding rounded up; every other parameter to TOLERANCE. Layouts differ from one process
# there by at most 2.0e-5 (0.16.1) and 7.5e-5 (0.19.2; 2026-12-07, TP2 with SP and EP2 on
# tiny-qwen3.5-moe).
DECAY_PARAMETERS = (".A_log", ".dt_bias")
DECAY_TOLERANCE = 2e-4
LOSS_CONFIG = GRPOLossConfig(
    clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01
)

# The rollout correction's bounds in the check: tight enough that the synthetic rollout log-probs
# (the old ones plus noise, workers.reference_worker) truncate, mask or reject some tokens.
CORRECTION_BOUNDS = dict(cap=1.5, low=0.6, high=1.6)


def correction_settings(mode: str) -> RolloutCorrectionSettings:
    """The check's `--rollout-correction MODE` settings (ValueError naming the mode)."""
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(
            f"--rollout-correction: must be one of {', '.join(ROLLOUT_CORRECTION_MODES)}, "
            f"got {mode!r}"
        )
    return RolloutCorrectionSettings(mode, **CORRECTION_BOUNDS)


# The local spec's core attentions the layout under test may run (model.attention); the
# single-process reference always runs megatron-core's unfused core.
ATTENTIONS = ("unfused", "sdpa")


def describe(layout: ParallelLayout, model: str = "debug", attention: str = "unfused") -> str:
    """How the check names what it runs: the layout, a non-default model and attention."""
    extra = f" {model}" if model != "debug" else ""
    core = f" ({attention} attention)" if attention != "unfused" else ""
    return f"{layout}{extra}{core}"


def flag_layout(**fields) -> ParallelLayout:
    """The ParallelLayout of check-layout's flags; ValueError naming the flag it breaks."""
    try:
        return ParallelLayout(**fields)
    except LayoutError as e:
        raise ValueError(e.renamed(FLAGS)) from None


NORMALIZATIONS = ("plan", "per_microbatch")


@dataclass(frozen=True)
class Case:
    rule: str
    num_microbatches: int = 1
    scope: str = "group"
    per_token_loss: bool = False
    # "per_microbatch": the negative control. The same loss (clip, dual clip, KL, entropy), its
    # plan built from each micro-batch's own statistics instead of the global batch's, the mean
    # over micro-batches and DP ranks (NeMo-Aligner's normalisation). Equal to the reference
    # where a micro-batch is the global batch (DP1 x 1 micro-batch); must fail elsewhere.
    normalization: str = "plan"
    # Negative control of the scaling: cancel another megatron-core version's factors.
    assume_megatron_version: tuple[int, int] | None = None
    # parallel.max_tokens_per_microbatch: token-budget micro-batches (num_microbatches is then
    # ignored) on DP shards balanced by tokens (packing.balanced_dp_shards).
    token_budget: int | None = None
    # loss.rollout_correction's mode: each DP rank corrects its own rows (whole sequences) from
    # the synthetic rollout log-probs before the step, as train/update.py does.
    rollout_correction: str = "none"
    # Negative control of the rejection: the rejected tokens keep their place in the mask (weight
    # 0), so they stay in the plan's denominators; must fail for a rejecting mode.
    rejected_kept_in_denominators: bool = False
    # Negative control of expert parallelism: each rank keeps its own experts' gradients, scaled
    # by DDP but not summed over the expert-data-parallel group; must fail where expert-DP > 1.
    expert_grads_unreduced: bool = False
    # Negative control of sequence parallelism: the parameters SP marks (norms, router) keep each
    # TP rank's share of their gradient, not summed over TP; must fail under SP, pass without.
    sequence_parallel_grads_unreduced: bool = False
    # Negative control of the Gated DeltaNet's output norm (Qwen3.5 models): its weight keeps
    # each TP rank's heads' share of the gradient, as megatron-core's own norm there does; must
    # fail at tp > 1, pass at tp = 1.
    deltanet_norm_grads_unreduced: bool = False

    def step_settings(self) -> StepSettings:
        """The step's settings of this case: its rule and scope (dr_grpo's budget: SEQ_LEN),
        the check's loss coefficients (LOSS_CONFIG), its rollout correction."""
        return StepSettings(
            aggregation=AggregationSettings(rule=self.rule, scope=self.scope, max_length=SEQ_LEN),
            loss=LOSS_CONFIG,
            rollout_correction=correction_settings(self.rollout_correction),
        )

    def step_function(self):
        """The step this case runs: grpo_step.forward_backward, or one of the controls."""
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization: unknown value {self.normalization!r}")
        if self.normalization == "per_microbatch":
            return controls.per_microbatch_plan(self.assume_megatron_version)
        if self.assume_megatron_version is not None:
            return controls.scaled_as(self.assume_megatron_version)
        if self.expert_grads_unreduced:
            return controls.expert_grads_unreduced
        if self.sequence_parallel_grads_unreduced:
            return controls.sequence_parallel_grads_unreduced
        if self.deltanet_norm_grads_unreduced:
            return controls.deltanet_norm_grads_unreduced
        return grpo_step.forward_backward

    def __str__(self) -> str:
        extra = " per-token" if self.per_token_loss else ""
        extra += " PER-MICROBATCH-NORMALISED" if self.normalization != "plan" else ""
        if self.assume_megatron_version is not None:
            major, minor = self.assume_megatron_version
            extra += f" SCALED-AS-{major}.{minor}"
        if self.rollout_correction != "none":
            extra += f" rollout-correction={self.rollout_correction}"
        if self.rejected_kept_in_denominators:
            extra += " REJECTED-KEPT-IN-DENOMINATORS"
        if self.expert_grads_unreduced:
            extra += " EXPERT-GRADS-UNREDUCED"
        if self.sequence_parallel_grads_unreduced:
            extra += " SP-GRADS-UNREDUCED"
        if self.deltanet_norm_grads_unreduced:
            extra += " DELTANET-NORM-GRADS-UNREDUCED"
        split = (
            f"M={self.num_microbatches}"
            if self.token_budget is None
            else f"token-budget={self.token_budget}"
        )
        return f"{self.rule}/{self.scope} {split}{extra}"


@dataclass
class CaseResult:
    case: Case
    max_rel_grad_err: float
    loss_err: float
    loss: float
    loss_ref: float
    reducer_calls: list[int]  # per rank, in global rank order
    # The share of the batch's response tokens the rollout correction truncated, masked or
    # rejected (0 without one): the check exercised it only if > 0.
    fraction_corrected: float = 0.0
    # The Gated DeltaNet decay parameters' gradients (DECAY_PARAMETERS; 0 for other models),
    # which max_rel_grad_err leaves out: held to DECAY_TOLERANCE
    max_rel_decay_grad_err: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.max_rel_grad_err <= TOLERANCE
            and self.max_rel_decay_grad_err <= DECAY_TOLERANCE
            and self.loss_err <= TOLERANCE
        )


@dataclass
class LayoutReport:
    """Everything one launch of a layout checked, besides the cases."""

    cases: list[CaseResult]
    cp_layout_matches_megatron: bool  # our CP shards == get_batch_on_this_cp_rank's, every rank
    logprobs_err: float  # compute_logprobs on the layout vs single process, max abs
    entropy_err: float
    grad_norm_rel_err: float  # ShardedAdamW's global gradient norm vs single process
    update_rel_err: float  # one clipped AdamW step's parameter change vs single process


NUM_GROUPS, GROUP_SIZE = 4, 3  # the default batch: 12 sequences
SEQUENCES = NUM_GROUPS * GROUP_SIZE
REWARDS = [[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0]]  # group 3: zero variance
SEQ_LEN = 16  # >= max prompt + response (4 + 10), a multiple of 2 x CP for CP in {1, 2, 4}


def num_groups(sequences: int) -> int:
    """Groups of GROUP_SIZE consecutive rows; the last one smaller if GROUP_SIZE does not
    divide `sequences`."""
    return -(-sequences // GROUP_SIZE)


def tiny_spec(model: str = "debug"):
    """The model of the check: "debug", megatron_ba.megatron.model.tiny_qwen2_spec(); "tiny-moe",
    the tiny-moe preset (8 experts, top-2) with untied embeddings (a tied model cannot run PP > 1
    on CPU) and the router's auxiliary loss off (not layout-invariant: docs/parallelism.md);
    "tiny-qwen3.5" / "tiny-qwen3.5-moe": Qwen3.5's hybrid (3 Gated DeltaNet layers, then gated
    full attention; the MoE with a gated shared expert), the same way."""
    if model not in MODELS:
        raise ValueError(f"--model: must be one of {', '.join(MODELS)}, got {model!r}")
    if model == "debug":
        return tiny_qwen2_spec()
    return ModelSpec.of(PRESETS[model], tie_word_embeddings=False, moe_aux_loss_coeff=0.0)


def check_layout_possible(
    layout: ParallelLayout,
    cases: list[Case],
    world_size: int | None = None,
    *,
    sequences: int = SEQUENCES,
    model: str = "debug",
    attention: str = "unfused",
) -> None:
    """ValueError saying why a layout (or a case on it) cannot be built, naming the flag."""
    if world_size is not None and world_size != layout.world:
        raise ValueError(f"world size {world_size} != tp*pp*cp*dp = {layout.world}")
    if attention not in ATTENTIONS:
        raise ValueError(f"--attention: must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    try:
        layout.check_training(tiny_spec(model))
        layout.check_micro_batching(token_budget=any(c.token_budget is not None for c in cases))
    except LayoutError as e:
        raise ValueError(e.renamed(FLAGS)) from None
    if not (isinstance(sequences, int) and sequences >= 1):
        raise ValueError(f"--sequences: must be an integer >= 1, got {sequences!r}")
    if layout.ep > 1 and sequences % layout.dp:
        # the experts' token exchange: one collective per micro-batch over EP ranks
        raise ValueError(
            f"--sequences: {sequences} do not divide over the {layout.dp} DP ranks; with "
            "--ep every rank's micro-batches must hold the same tokens (the experts' "
            "dispatcher exchanges them across DP ranks)"
        )
    if sequences < layout.dp:
        raise ValueError(f"--sequences: {sequences} is fewer than the {layout.dp} DP ranks")
    fewest = sequences // layout.dp  # dp_rows: the smallest rank's share
    for case in cases:
        correction_settings(case.rollout_correction)
        if case.token_budget is not None:
            b = case.token_budget
            if isinstance(b, bool) or not isinstance(b, int) or b < SEQ_LEN:
                raise ValueError(
                    f"--token-budget: must be an integer >= {SEQ_LEN} (the synthetic batch's "
                    f"longest sequence may take {SEQ_LEN} tokens), got {b!r}"
                )
        elif case.num_microbatches > fewest:
            raise ValueError(
                f"--micro-batches: {case.num_microbatches} is more than the {fewest} sequences "
                f"the smallest of the {layout.dp} DP ranks holds"
            )


def synthetic_batch(
    seed: int, sequences: int = SEQUENCES, model: str = "debug"
) -> dict[str, torch.Tensor]:
    """The global batch (without log-probs): rows grouped by prompt, groups of 3 (rewards
    cycling through REWARDS; the last group smaller when 3 does not divide `sequences`)."""
    g = torch.Generator().manual_seed(seed)
    spec = tiny_spec(model)
    n = sequences
    per_group = torch.tensor(REWARDS, dtype=torch.float64)
    rewards = per_group[torch.arange(num_groups(n)) % len(REWARDS)].reshape(-1)[:n]
    group_ids = torch.arange(num_groups(n)).repeat_interleave(GROUP_SIZE)[:n]
    right = torch.randint(2, 6, (n,), generator=g)
    wrong = torch.randint(6, 11, (n,), generator=g)
    resp = torch.where(rewards > 0, right, wrong)  # wrong answers longer: sign-correlated
    prompt = torch.randint(2, 5, (n,), generator=g)
    s = SEQ_LEN
    tokens = torch.randint(1, spec.vocab_size, (n, s), generator=g)
    pos = torch.arange(s)[None]
    mask = (pos >= prompt[:, None]) & (pos < (prompt + resp)[:, None])
    tokens = torch.where(pos < (prompt + resp)[:, None], tokens, torch.zeros_like(tokens))

    adv = group_advantages(rewards, group_ids).advantages.float()
    return {"tokens": tokens, "response_mask": mask, "advantages": adv, "group_ids": group_ids}


def dp_rows(n: int, dp: int, rank: int) -> torch.Tensor:
    """Rows of DP rank `rank`: every dp-th row, so that each group of 3 spans the DP ranks."""
    return torch.arange(rank, n, dp)


def case_rows(batch: dict, layout: ParallelLayout, case: Case, rank: int) -> torch.Tensor:
    """This DP rank's rows for `case`: dp_rows, or under a token budget the shards balanced by
    tokens (packing.balanced_dp_shards over prompt + response lengths)."""
    n = batch["tokens"].shape[0]
    if case.token_budget is None:
        return dp_rows(n, layout.dp, rank)

    shards = balanced_dp_shards(response_end(batch["response_mask"]), layout.dp)
    return torch.tensor(shards[rank], dtype=torch.long)


def expected_reducer_calls(layout: ParallelLayout, case: Case | None = None) -> list[int]:
    """1 on the ranks of the last pipeline stage (they compute the loss), 0 elsewhere; 0 on
    every rank for the per-micro-batch control (its statistics are its micro-batch's own).

    megatron-core's default rank order is tp-cp-ep-dp-pp: the pipeline stage is the slowest
    varying index, so the last stage holds the last tp*cp*dp global ranks.
    """
    if case is not None and case.normalization == "per_microbatch":
        return [0] * layout.world
    per_stage = layout.stage_ranks
    return [1 if r // per_stage == layout.pp - 1 else 0 for r in range(layout.world)]
