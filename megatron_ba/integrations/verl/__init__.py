"""verl integration: `balanced` / `balanced_mass` / `group_token_mean` for verl 0.9.1 (via
VERL_USE_EXTERNAL_MODULES).

    VERL_USE_EXTERNAL_MODULES=megatron_ba.integrations.verl python -m verl.trainer.main_ppo \\
        algorithm.adv_estimator=balanced \\
        actor_rollout_ref.actor.policy_loss.loss_mode=balanced ...

Importing this module registers, in verl's own registries:
- advantage estimators `balanced`, `balanced_mass` and `group_token_mean`
  (ADV_ESTIMATOR_REGISTRY), and
- policy losses of the same names (POLICY_LOSS_REGISTRY).

Why two hooks. verl calls a policy loss with (old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) on one micro-batch: no `uid`, so no prompt group, and
no view of the other micro-batches. The only hook that sees the groups is the advantage estimator:
the trainer calls it on the driver, with the whole batch and `index=uid`. So the plan is built
there, with the core, and carried to the loss inside the advantages (see adapter.py for why
folding w_i into A_i is exact); the policy loss applies the core's PPO term to each micro-batch
and cancels verl's data-parallel gradient mean with `config.global_batch_info["dp_size"]`.

verl's v1 trainer hands every estimator but `grpo` the rows of multi-output agent sessions
without their session keys; sessions.py wraps that one step so that the balanced rules group a
session as `grpo` does (one member, one advantage for all its outputs).

The two hooks only work as a pair: `check_config` (checks.py) refuses a trainer config that sets
one without the other, and `python -m megatron_ba.integrations.verl.main_ppo` (main_ppo.py) calls
it before verl starts.
"""

from megatron_ba.integrations.verl.adapter import (
    balanced_advantages,
    balanced_policy_loss,
    register,
)
from megatron_ba.integrations.verl.checks import check_config
from megatron_ba.integrations.verl.sessions import install as install_sessions

register()
install_sessions()

__all__ = [
    "balanced_advantages",
    "balanced_policy_loss",
    "check_config",
    "install_sessions",
    "register",
]
