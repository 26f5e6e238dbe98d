"""The verl 0.9.1 hooks: an advantage estimator that plans, and a policy loss that applies.

Planning (driver, whole batch). `balanced_advantages` computes GRPO advantages with the core
(`group_advantages`, sample std and eps 1e-6 as verl's `grpo` estimator; std normalisation follows
`algorithm.norm_adv_by_std_in_grpo`), group ids from the batch's `uid`, whole-response lengths from
`response_mask`, and the per-sequence weights w_i of the rule with the core (`sequence_weights`).
It returns w_i * A_i on every response token.

Folding is exact for the PPO term: with c >= 0,
    min(rho cA, clip(rho) cA) = c min(rho A, clip(rho) A),  max(phi, dual cA) = c max(phi, dual A),
and the clip branch taken depends on sign(A) only, which c > 0 keeps.
So sum_t phi(w_i A_i) = w_i sum_t phi(A_i): the objective sum_i w_i sum_t phi.

Applying (every micro-batch, every DP rank). `balanced_policy_loss` takes the per-sequence (folded)
advantage back out of the token tensor, evaluates the core's `grpo_loss` with unit weights (the plan
is already in the advantages), and multiplies by dp_size: verl's FSDP/Megatron engines average
gradients over the DP group, and the plan's shares must be summed (verl's own `agg_loss` applies the
same factor).

Rollout correction (algorithm.rollout_correction, decoupled mode). verl computes it on the driver
before the estimator (rollout_corr_helper.compute_rollout_correction_and_add_to_batch): rejection
sampling (rollout_rs) zeroes the rejected tokens of `response_mask`, so the estimator plans on the
kept tokens (a rejected token leaves T_i and every length sum; a wholly rejected response has
T_i = 0 and leaves its group's counts, while its reward still enters its group's mean and std, as
in verl's `grpo`); the IS weights (rollout_is) reach the policy loss as `rollout_is_weights`, the
core's per-token factor c_{i,t} on the clipped term. Both are verl's own numbers, used as given.

Settings verl's config has no key for are read from the environment of the process the
estimator runs in (verl's trainer, itself a Ray actor; the policy loss reads none of them):
MEGATRON_BA_SCOPE ("group" | "batch", default group), MEGATRON_BA_NEUTRAL_EPS (default 0) and
MEGATRON_BA_STEPS_PER_BATCH (default 1: the number of optimizer steps one rollout batch is split
into, train_batch_size / ppo_mini_batch_size times ppo_epochs; each step then carries a
full-scale objective, as each of verl's token-mean mini-batches does). main_ppo.py derives the
steps from verl's config and hands the variables set to verl's Ray processes; the steps are set
by hand only under verl's own entry point.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from megatron_ba._checks import check_choice
from megatron_ba.advantages import group_advantages
from megatron_ba.aggregation import sequence_weights
from megatron_ba.errors import SettingError
from megatron_ba.integrations._common import sequence_advantages, sequence_lengths

# The rules registered as estimator + policy loss pairs (the engines' table: loss.rule's verl cell)
from megatron_ba.integrations.engines.loss_rows import PLAN_RULES
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings

# AggregationSettings field -> the environment variable that sets it
ENV_KEYS = {"scope": "MEGATRON_BA_SCOPE", "neutral_eps": "MEGATRON_BA_NEUTRAL_EPS"}
STEPS_ENV = "MEGATRON_BA_STEPS_PER_BATCH"


def _settings(rule: str) -> tuple[AggregationSettings, float]:
    """The plan's settings of `rule` (scope and neutral_eps from the environment) and the
    optimizer steps per rollout batch."""
    scope = os.environ.get("MEGATRON_BA_SCOPE", "group")
    raw_eps = os.environ.get("MEGATRON_BA_NEUTRAL_EPS", "0")
    raw_steps = os.environ.get(STEPS_ENV, "1")
    try:
        eps, steps = float(raw_eps), float(raw_steps)
    except ValueError as err:
        raise ValueError(
            f"MEGATRON_BA_NEUTRAL_EPS / MEGATRON_BA_STEPS_PER_BATCH: must be numbers, got "
            f"{raw_eps!r} / {raw_steps!r}"
        ) from err
    if not (steps >= 1 and steps == int(steps)):
        raise ValueError(f"MEGATRON_BA_STEPS_PER_BATCH: must be an integer >= 1, got {raw_steps}")
    try:
        settings = AggregationSettings(rule=rule, scope=scope, neutral_eps=eps)
    except SettingError as e:
        raise ValueError(e.renamed(ENV_KEYS)) from None
    return settings, steps


def group_ids_from_uid(index) -> torch.Tensor:
    """Dense int64 group ids from verl's per-response `uid` array (one uid per prompt)."""
    if index is None:
        raise ValueError("index: the balanced estimator needs the batch's `uid` (prompt ids)")
    _, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def folded_advantages(
    rule: str, scores: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor, config=None
) -> torch.Tensor:
    """[N] float64 w_i * A_i (times MEGATRON_BA_STEPS_PER_BATCH) of N group members, from their
    outcome scores, loss-token counts and group ids; `config` is verl's algorithm config."""
    check_choice("rule", rule, PLAN_RULES)
    s, steps = _settings(rule)
    normalize = True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True))
    report = group_advantages(scores, group_ids, normalize_std=normalize, std="sample", eps=1e-6)
    w = sequence_weights(
        s.rule, lengths, report.advantages, group_ids, scope=s.scope, neutral_eps=s.neutral_eps
    )
    return w * report.advantages * steps


def balanced_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    *,
    rule: str = "balanced",
    **unused,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both w_i * A_i on response tokens: the plan folded into A."""
    group_ids = group_ids_from_uid(index)
    lengths = sequence_lengths(response_mask, name="response_mask")
    scores = token_level_rewards.to(torch.float64).sum(dim=-1)
    folded = folded_advantages(rule, scores, lengths, group_ids, config)
    folded = folded.to(token_level_rewards.dtype)
    out = folded[:, None] * response_mask.to(folded.dtype)
    return out, out


def balanced_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of -sum_i w_i sum_t phi, times dp_size (verl's DP-mean convention).

    `advantages` must come from one of the PLAN_RULES estimators (the plan is in them);
    `loss_agg_mode` is not used for the policy-gradient term (verl still applies it to its KL and
    entropy terms). `rollout_is_weights` (algorithm.rollout_correction.rollout_is, made by verl's
    rollout_corr_helper on the driver) is the core's per-token `is_weights`: -sum_i w_i sum_t
    c_{i,t} phi_{i,t}. Rejection sampling (rollout_rs) needs nothing here: verl has already taken
    the rejected tokens out of `response_mask`, before the estimator planned on it.
    """
    if config is None:
        raise ValueError("config: the actor config is required (clip ratios, global_batch_info)")
    if loss_agg_mode != "token-mean":
        # Seen on every micro-batch, also under the plain verl entry point (no check_config).
        warnings.warn(
            f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode} is ignored by the balanced "
            f"policy loss for its policy-gradient term (the plan weights responses and tokens); "
            f"verl still applies it to the KL and entropy terms",
            UserWarning,
            stacklevel=2,
        )
    clip = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    loss_config = GRPOLossConfig(
        clip_low=clip if low is None else low,
        clip_high=clip if high is None else high,
        dual_clip=config.get("clip_ratio_c", 3.0),
    )
    mask = response_mask.bool()
    folded = sequence_advantages(advantages, mask, name="advantages")
    ones = torch.ones_like(folded)
    plan = LossPlan(pg_weights=ones, reg_weights=ones, advantages=folded)
    # verl's rollout_is_weights (token or sequence level, truncated or IcePop-masked, detached)
    # multiply each token's clipped term, where verl's compute_policy_loss_vanilla puts them.
    loss, metrics = grpo_loss(
        log_prob, old_log_prob, mask, plan, loss_config, is_weights=rollout_is_weights
    )
    dp_size = (config.get("global_batch_info", None) or {}).get("dp_size", 1)
    # The core's definitions (fractions of this micro-batch's tokens), under their own names.
    pg_metrics = {
        "actor/ba_clip_low_frac": float(metrics["clip_low_frac"]),
        "actor/ba_clip_high_frac": float(metrics["clip_high_frac"]),
        "actor/ba_dual_clip_frac": float(metrics["dual_clip_frac"]),
        "actor/ba_weight_pos_share": float(metrics["weight_pos_share"]),
    }
    return loss * dp_size, pg_metrics


def register() -> None:
    """Put the estimators and policy losses in verl's registries (idempotent)."""
    from verl.trainer.ppo import core_algos

    for rule in PLAN_RULES:

        def estimator(*args, _rule=rule, **kwargs):
            return balanced_advantages(*args, rule=_rule, **kwargs)

        estimator.__name__ = f"{rule}_advantages"
        if core_algos.ADV_ESTIMATOR_REGISTRY.get(rule) is None:
            core_algos.register_adv_est(rule)(estimator)
        # One function for both names: the rule lives in the advantages the estimator folded.
        core_algos.register_policy_loss(rule)(balanced_policy_loss)
