"""`check_config`: refuse a verl trainer config that would train on a silently different loss.

The balanced integration is two hooks that only work as a pair (adapter.py): the estimator folds
the plan into the advantages, the policy loss sums the folded advantages without normalising them.
Each half runs on its own without complaint, on another objective:
- policy loss `balanced` with estimator `grpo`: -sum_i T_i A_i, a token sum of unweighted
  advantages that over-weights long responses (and is not 0 on an all-neutral batch);
- estimator `balanced` with verl's `vanilla` loss: the plan divided again by the mini-batch's token
  count (a learning rate rescaled by the batch's length);
- `algorithm.rollout_correction.bypass_mode`: verl replaces `policy_loss.loss_mode` with its own
  `bypass_mode` loss at the first step (rollout_corr_helper.apply_bypass_mode), dropping
  `balanced` silently: the folded advantages would then be aggregated by verl's `loss_agg_mode`
  (the plan divided once more). The rest of rollout correction composes (decoupled mode):
  `rollout_is` weights reach the balanced loss as the core's per-token `is_weights`, and
  `rollout_rs` rejects tokens by taking them out of `response_mask` before the estimator plans.
The same holds for settings verl has no key for (MEGATRON_BA_* variables, adapter.py): the number
of optimizer steps a rollout batch is split into must match verl's batch sizes. `steps_per_batch`
reads it from the config (main_ppo.py exports it); a MEGATRON_BA_STEPS_PER_BATCH the user set must
agree with it.

verl's asynchronous trainers (one_step_off_policy.py, fully_async_policy.py) train on whole
groups too, so the pair runs there unchanged: one-step-off generates each batch of
data.train_batch_size prompts x n with the policy one step behind, and the fully asynchronous
trainer takes ppo_mini_batch_size x async_training.require_batches prompts from its message queue,
each queue sample one prompt's n responses (its rollouter sets one uid per sample), and plans them
together. Two things differ. Their configs set `bypass_mode: true`, refused here as above (decoupled
mode recomputes old_log_prob; `rollout_is` corrects for the older policies). And in the fully
asynchronous config (the one with an `async_training` node) data.train_batch_size is 0: the steps
per planned batch are require_batches x ppo_epochs. `async_training.partial_rollout=false` is warned
about: verl then keeps a response cut by a weight sync as it is.

`check_config(cfg)` reads verl's composed trainer config (ppo_trainer.yaml,
ppo_megatron_trainer.yaml and the asynchronous trainers' configs built on them) and raises a
ValueError naming the keys and the fix. The entries (`python -m megatron_ba.integrations.verl.
main_ppo`, `.one_step_off_policy`, `.fully_async_policy`) call it before verl starts anything.
"""

from __future__ import annotations

import os
import warnings

from megatron_ba.integrations.verl.adapter import ENV_KEYS, PLAN_RULES, STEPS_ENV, _settings

ESTIMATOR = "algorithm.adv_estimator"
LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"
AGG_MODE = "actor_rollout_ref.actor.loss_agg_mode"
ROLLOUT_N = "actor_rollout_ref.rollout.n"
BYPASS = "algorithm.rollout_correction.bypass_mode"
TRAIN_BATCH = "data.train_batch_size"
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
EPOCHS = "actor_rollout_ref.actor.ppo_epochs"
# verl's fully asynchronous trainer (verl.experimental.fully_async_policy): its config alone has
# this node; each trainer step plans ppo_mini_batch_size x require_batches prompts from its queue.
ASYNC = "async_training"
REQUIRE_BATCHES = "async_training.require_batches"
PARTIAL = "async_training.partial_rollout"
# Ray's runtime env for every process of the run (verl merges it into ray.init's); main_ppo.py
# puts the MEGATRON_BA_* settings there.
RUNTIME_ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"
SETTINGS_ENV = (*ENV_KEYS.values(), STEPS_ENV)
# The checked entries (python -m ...): verl's synchronous, one-step-off and fully async trainers.
ENTRIES = (
    "megatron_ba.integrations.verl.main_ppo",
    "megatron_ba.integrations.verl.one_step_off_policy",
    "megatron_ba.integrations.verl.fully_async_policy",
)

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
    rollout correction `bypass_mode` (it replaces the policy loss; `rollout_is` and `rollout_rs`
    pass: they compose); MEGATRON_BA_SCOPE / _NEUTRAL_EPS valid; `ppo_mini_batch_size` dividing
    `data.train_batch_size`, and MEGATRON_BA_STEPS_PER_BATCH, where set, equal to
    `steps_per_batch(cfg)`; no MEGATRON_BA_* variable in the config's Ray runtime env (main_ppo.py
    puts the checked ones there); the fully asynchronous config's `async_training.require_batches`
    >= 1 (its steps, see steps_per_batch). A `loss_agg_mode` other than token-mean is warned about
    (the balanced loss ignores it for its policy-gradient term), and so is
    `async_training.partial_rollout=false`. Any other config passes untouched.
    """
    if not uses_plan(cfg):
        return
    estimator = str(_get(cfg, ESTIMATOR, "gae"))
    loss_mode = str(_get(cfg, LOSS_MODE, "vanilla"))
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
    _check_runtime_env(cfg)
    _warn_partial_rollout(cfg)
    mode = str(_get(cfg, AGG_MODE, "token-mean"))
    if mode != "token-mean":
        warnings.warn(
            f"{AGG_MODE}={mode} is ignored by the {loss_mode} loss for its policy-gradient term "
            f"(the plan decides how responses and tokens are weighted); verl still applies it to "
            f"the KL and entropy terms",
            UserWarning,
            stacklevel=2,
        )


def uses_plan(cfg) -> bool:
    """Whether the estimator or the policy loss of `cfg` is one of the integration's."""
    estimator = str(_get(cfg, ESTIMATOR, "gae"))
    return estimator in PLAN_RULES or str(_get(cfg, LOSS_MODE, "vanilla")) in PLAN_RULES


def steps_per_batch(cfg) -> int | None:
    """The optimizer steps verl makes per rollout batch: `data.train_batch_size /
    ppo_mini_batch_size x ppo_epochs` (verl splits the batch into mini-batches of that size, one
    step each, every epoch), `async_training.require_batches x ppo_epochs` for the fully
    asynchronous trainer (its batch is that many mini-batches); None where the config lacks the
    batch sizes (verl checks those)."""
    if _get(cfg, ASYNC, None) is not None:
        return _async_steps(cfg)
    train, mini = _get(cfg, TRAIN_BATCH, None), _get(cfg, MINI_BATCH, None)
    if train is None or mini is None:
        return None
    train, mini = int(train), int(mini)
    if mini < 1 or train % mini:
        # verl's last mini-batch would be smaller: no step count gives each step a full share.
        raise ValueError(
            f"{MINI_BATCH}: is {mini}, which does not divide {TRAIN_BATCH}={train}; verl's last "
            f"mini-batch would be smaller than the others, and the plan gives every optimizer "
            f"step a full-scale objective. Choose a {MINI_BATCH} that divides {TRAIN_BATCH}"
        )
    return train // mini * int(_get(cfg, EPOCHS, 1))


def _async_steps(cfg) -> int:
    """require_batches x ppo_epochs: the fully asynchronous trainer plans (and steps on) exactly
    require_batches mini-batches of prompts at a time, whatever data.train_batch_size says (0)."""
    batches = int(_get(cfg, REQUIRE_BATCHES, 1))
    if batches < 1:
        raise ValueError(
            f"{REQUIRE_BATCHES}: is {batches}; each trainer step takes {MINI_BATCH} x "
            f"require_batches prompts from the queue and plans them. Set it to 1 or more"
        )
    return batches * int(_get(cfg, EPOCHS, 1))


def _warn_partial_rollout(cfg) -> None:
    """Without partial rollouts verl's fully asynchronous rollouter keeps a response that a weight
    sync aborted, cut where the sync came: its length (and reward) then depend on the sync's
    timing, which the plan weighs like any other length."""
    if _get(cfg, ASYNC, None) is not None and not bool(_get(cfg, PARTIAL, True)):
        warnings.warn(
            f"{PARTIAL}=false: verl keeps the responses a weight sync aborts, cut at the sync, and "
            f"the plan weighs them by that cut length; set {PARTIAL}=true to have them resumed",
            UserWarning,
            stacklevel=3,
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
    """Bypass mode only: verl's decoupled rollout correction (rollout_is, rollout_rs) composes."""
    if bool(_get(cfg, BYPASS, False)):
        raise ValueError(
            f"{BYPASS}: must be false with the balanced loss; verl's bypass mode replaces "
            f"{LOSS_MODE} with its own 'bypass_mode' loss, which would train on the folded "
            f"advantages aggregated by {AGG_MODE} (the plan divided once more). Set "
            f"{BYPASS}=false (verl's one_step_off_policy and fully_async_policy configs set it "
            f"true): algorithm.rollout_correction.rollout_is and rollout_rs work with the "
            f"balanced loss in verl's decoupled mode"
        )


def _check_steps(cfg) -> None:
    """A MEGATRON_BA_STEPS_PER_BATCH set by the user must be the optimizer steps verl makes per
    rollout batch; unset, main_ppo.py sets it from the config."""
    expected = steps_per_batch(cfg)
    if expected is None or os.environ.get(STEPS_ENV) is None:
        return
    _, steps = _settings("balanced")
    if steps != expected:
        if _get(cfg, ASYNC, None) is not None:
            split = f"{REQUIRE_BATCHES}={_get(cfg, REQUIRE_BATCHES)} x {EPOCHS}"
        else:
            split = f"{TRAIN_BATCH}={_get(cfg, TRAIN_BATCH)} / {MINI_BATCH}={_get(cfg, MINI_BATCH)}"
            split += f" x {EPOCHS}"
        raise ValueError(
            f"{STEPS_ENV}: is {steps:g}, but verl splits each rollout batch into {expected} "
            f"optimizer steps ({split}); each step would carry {steps / expected:g} of the "
            f"objective. Set {STEPS_ENV}={expected}, or unset it: the entries (python -m "
            f"{' / '.join(ENTRIES)}) set it from the config"
        )


def _check_runtime_env(cfg) -> None:
    """main_ppo.py hands the checked MEGATRON_BA_* settings to Ray's processes through the runtime
    env: one that the config already sets there would be replaced, or read unchecked."""
    given = _get(cfg, RUNTIME_ENV_VARS, None) or {}
    named = [name for name in SETTINGS_ENV if name in given]
    if named:
        raise ValueError(
            f"{RUNTIME_ENV_VARS}.{named[0]}: set in the config; set {', '.join(named)} in the "
            f"environment of python -m megatron_ba.integrations.verl.main_ppo instead, which "
            f"checks them and hands them to verl's Ray processes through this runtime env"
        )
