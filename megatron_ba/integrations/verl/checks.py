"""`check_config`: refuse a verl trainer config that would train on a silently different loss.

The balanced integration is two hooks that only work as a pair (adapter.py): the estimator folds
the plan into the advantages, the policy loss sums the folded advantages without normalising them.
Each half runs on its own without complaint, on another objective:
- policy loss `balanced` with estimator `grpo`: -sum_i T_i A_i, a token sum of unweighted
  advantages that over-weights long responses (and is not 0 on an all-neutral batch);
- estimator `balanced` with verl's `vanilla` loss: the plan divided again by the mini-batch's token
  count (a learning rate rescaled by the batch's length);
- `algorithm.rollout_correction.bypass_mode`: verl replaces `policy_loss.loss_mode` with its own
  `bypass_mode` loss at the first step (rollout_corr_helper), dropping `balanced` silently.
The same holds for settings verl has no key for (MEGATRON_BA_* variables, adapter.py): the number
of optimizer steps a rollout batch is split into must match verl's batch sizes.

`check_config(cfg)` reads verl's composed trainer config (ppo_trainer.yaml,
ppo_megatron_trainer.yaml) and raises a ValueError naming the keys and the fix.
`python -m megatron_ba.integrations.verl.main_ppo` calls it before verl starts anything
(main_ppo.py).
"""

from __future__ import annotations

import warnings

from megatron_ba.integrations.verl.adapter import PLAN_RULES, _settings

ESTIMATOR = "algorithm.adv_estimator"
LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"
AGG_MODE = "actor_rollout_ref.actor.loss_agg_mode"
ROLLOUT_N = "actor_rollout_ref.rollout.n"
BYPASS = "algorithm.rollout_correction.bypass_mode"
ROLLOUT_IS = "algorithm.rollout_correction.rollout_is"
TRAIN_BATCH = "data.train_batch_size"
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
EPOCHS = "actor_rollout_ref.actor.ppo_epochs"
STEPS_ENV = "MEGATRON_BA_STEPS_PER_BATCH"

# What each half does without its partner (the error says it, so the user sees why it matters).
_ALONE = {
    LOSS_MODE: "the balanced loss sums the advantages over tokens unnormalised, so with other "
    "advantages it trains on -sum_i T_i A_i (long responses over-weighted), not on the plan",
    ESTIMATOR: "the estimator folds the plan's weights into the advantages, so another policy "
    "loss normalises them a second time (a silently rescaled objective)",
}


def _get(cfg, key: str, default=None):
    """cfg[a][b]... for a dotted key of a DictConfig or nested dicts; `default` when absent."""
    node = cfg
    for part in key.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(part, None)
    return default if node is None else node


def check_config(cfg) -> None:
    """Raise ValueError if `cfg` (verl's composed trainer config) half-configures BA.

    Checked when either `algorithm.adv_estimator` or `actor_rollout_ref.actor.policy_loss.loss_mode`
    names a rule of PLAN_RULES: both name the same rule; `actor_rollout_ref.rollout.n` >= 2; no
    rollout correction (`bypass_mode` replaces the policy loss, `rollout_is` weights are not
    modelled); MEGATRON_BA_SCOPE / _NEUTRAL_EPS valid and MEGATRON_BA_STEPS_PER_BATCH equal to
    `data.train_batch_size / ppo_mini_batch_size * ppo_epochs`. A `loss_agg_mode` other than
    token-mean is warned about (the balanced loss ignores it for its policy-gradient term).
    Any other config passes untouched.
    """
    estimator = str(_get(cfg, ESTIMATOR, "gae"))
    loss_mode = str(_get(cfg, LOSS_MODE, "vanilla"))
    if estimator not in PLAN_RULES and loss_mode not in PLAN_RULES:
        return
    _check_pair(estimator, loss_mode)
    n = int(_get(cfg, ROLLOUT_N, 1))
    if n < 2:
        raise ValueError(
            f"{ROLLOUT_N}: is {n}; the {estimator} estimator plans over groups of responses to one "
            f"prompt and a group of one has advantage 0 (nothing is learnt). Set {ROLLOUT_N}=2 or "
            f"more"
        )
    _check_rollout_correction(cfg)
    _settings(estimator)  # MEGATRON_BA_SCOPE / _NEUTRAL_EPS / _STEPS_PER_BATCH parse, or raise
    _check_steps(cfg)
    mode = str(_get(cfg, AGG_MODE, "token-mean"))
    if mode != "token-mean":
        warnings.warn(
            f"{AGG_MODE}={mode} is ignored by the {loss_mode} loss for its policy-gradient term "
            f"(the plan decides how responses and tokens are weighted); verl still applies it to "
            f"the KL and entropy terms",
            UserWarning,
            stacklevel=2,
        )


def _check_pair(estimator: str, loss_mode: str) -> None:
    if estimator == loss_mode:
        return
    if estimator in PLAN_RULES and loss_mode in PLAN_RULES:
        raise ValueError(
            f"{ESTIMATOR}={estimator} and {LOSS_MODE}={loss_mode}: both must name the same rule "
            f"(the estimator decides the plan); set both to {estimator} or both to {loss_mode}"
        )
    rule, alone, other_key, other = (
        (loss_mode, LOSS_MODE, ESTIMATOR, estimator)
        if loss_mode in PLAN_RULES
        else (estimator, ESTIMATOR, LOSS_MODE, loss_mode)
    )
    raise ValueError(
        f"{alone}={rule} needs {other_key}={rule}, got {other_key}={other}: {_ALONE[alone]}. "
        f"Set {other_key}={rule} (or neither to {rule})"
    )


def _check_rollout_correction(cfg) -> None:
    if bool(_get(cfg, BYPASS, False)):
        raise ValueError(
            f"{BYPASS}: must be false with the balanced loss; verl's bypass mode replaces "
            f"{LOSS_MODE} with its own 'bypass_mode' loss, which would train on the folded "
            f"advantages without the plan. Set {BYPASS}=false"
        )
    if _get(cfg, ROLLOUT_IS, None) is not None:
        raise ValueError(
            f"{ROLLOUT_IS}: must be null with the balanced loss (the core's PPO term has no "
            f"per-token importance-sampling factor); set {ROLLOUT_IS}=null"
        )


def _check_steps(cfg) -> None:
    """MEGATRON_BA_STEPS_PER_BATCH must be the optimizer steps verl makes per rollout batch."""
    _, steps = _settings("balanced")
    train, mini = _get(cfg, TRAIN_BATCH, None), _get(cfg, MINI_BATCH, None)
    if train is None or mini is None:
        return  # nothing to compare with (a partial config): the batch sizes are verl's to check
    expected = int(train) / int(mini) * int(_get(cfg, EPOCHS, 1))
    if steps != expected:
        raise ValueError(
            f"{STEPS_ENV}: is {steps:g}, but verl splits each rollout batch into {expected:g} "
            f"optimizer steps ({TRAIN_BATCH}={train} / {MINI_BATCH}={mini} x {EPOCHS}); each step "
            f"would carry {steps / expected:g} of the objective. Set {STEPS_ENV}={expected:g} in "
            f"the trainer's environment (or make {MINI_BATCH} equal {TRAIN_BATCH})"
        )
