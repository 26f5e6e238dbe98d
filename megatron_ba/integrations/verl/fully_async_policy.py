"""verl's fully asynchronous entry with the balanced hooks loaded and the config checked first.

    python -m megatron_ba.integrations.verl.fully_async_policy \\
        [--config-name fully_async_ppo_megatron_trainer] \\
        algorithm.adv_estimator=balanced \\
        actor_rollout_ref.actor.policy_loss.loss_mode=balanced \\
        algorithm.rollout_correction.bypass_mode=false \\
        async_training.staleness_threshold=0.5 async_training.require_batches=2 ...

Composes the same config as `python -m verl.experimental.fully_async_policy.fully_async_main`
(its config folder, default `fully_async_ppo_trainer`, the same Hydra overrides), then does what
main_ppo.py does (`run_checked`): check_config, the MEGATRON_BA_* settings handed to the Ray
processes (MEGATRON_BA_STEPS_PER_BATCH = async_training.require_batches x ppo_epochs), the
preflight and verl's own `main`. The preflight skips verl's validate_config (verl's fully async
entry does not call it: it would refuse the data.train_batch_size=0 that the rollouter requires)
and scores the prompts of one trainer step (ppo_mini_batch_size x require_batches).

What BA meets there (verl.experimental.fully_async_policy): the rollouter generates each prompt's
rollout.n responses as one queue sample with one uid (`uid_sample_...`); the trainer takes
ppo_mini_batch_size x require_batches samples from the message queue, assembles them
(detach_utils.assemble_batch_from_rollout_samples) and plans them with the same
`compute_advantage` as the synchronous trainer, so the estimator sees whole groups. A batch mixes
policy versions (up to async_training.staleness_threshold of a sync cycle's samples are older) and,
with partial rollouts, responses whose tokens two versions generated; neither enters the plan
(docs/math.md section 10: a step of whole groups is planned as today), they enter through
old_log_prob and rollout_is. The queue drops whole samples when full; nothing in verl 0.9.1's
asynchronous code splits a group across trainer steps. Within a step, balance_batch may spread a
group over the step's require_batches mini-batches, as in the synchronous trainer; the plan of
the whole step, scaled by the steps, is then split like section 10's Gamma_t.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from verl.experimental.fully_async_policy import fully_async_main as verl_entry

from megatron_ba.integrations.verl.checks import MINI_BATCH, REQUIRE_BATCHES, _get
from megatron_ba.integrations.verl.main_ppo import run_checked
from megatron_ba.integrations.verl.one_step_off_policy import with_searchpath

CONFIG_DIR = str(Path(verl_entry.__file__).parent / "config")


def step_prompts(config) -> tuple[int, str]:
    """(prompts of one trainer step, the keys that set them): what the trainer takes from its
    queue per step (FullyAsyncTrainer.required_samples)."""
    prompts = int(_get(config, MINI_BATCH, 1)) * int(_get(config, REQUIRE_BATCHES, 1))
    return prompts, f"{MINI_BATCH} x {REQUIRE_BATCHES}"


@hydra.main(config_path=CONFIG_DIR, config_name="fully_async_ppo_trainer", version_base=None)
def _main(config) -> None:
    run_checked(
        config,
        verl_entry.main,
        trainer="fully_async_policy trainer",
        validate=False,
        step=step_prompts(config),
    )


def main() -> None:
    """The checked entry: Hydra composes verl's fully async config, then run_checked."""
    sys.argv = with_searchpath(sys.argv)
    _main()


if __name__ == "__main__":
    main()
