"""verl's one-step-off-policy entry with the balanced hooks loaded and the config checked first.

    python -m megatron_ba.integrations.verl.one_step_off_policy \\
        [--config-name one_step_off_ppo_megatron_trainer] \\
        algorithm.adv_estimator=balanced \\
        actor_rollout_ref.actor.policy_loss.loss_mode=balanced \\
        algorithm.rollout_correction.bypass_mode=false ...

Composes the same config as `python -m verl.experimental.one_step_off_policy.main_ppo` (its
config folder, default `one_step_off_ppo_trainer`, the same Hydra overrides), then does what
main_ppo.py does (`run_checked`): check_config, the MEGATRON_BA_* settings handed to the Ray
processes, the preflight (exit 69, NEEDS_GPU, without a CUDA GPU), verl's own `main`.

What BA meets there (verl.experimental.one_step_off_policy.ray_trainer): each step trains on a
batch of data.train_batch_size prompts x rollout.n that the policy of the step before generated,
while the next batch is generated; the batch is the synchronous trainer's (one uid per prompt,
whole groups) and the same `compute_advantage` plans it, so the pair runs unchanged and the steps
per batch are the synchronous ones. The policy lag enters through old_log_prob, recomputed by the
actor in verl's decoupled mode, and `algorithm.rollout_correction.rollout_is`. verl's config sets
`algorithm.rollout_correction.bypass_mode: true`, which replaces the balanced loss: check_config
refuses it by name (set it to false).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from verl.experimental.one_step_off_policy import main_ppo as verl_entry

from megatron_ba.integrations.verl.main_ppo import run_checked

# verl's yaml files find ppo_trainer.yaml through `file://verl/trainer/config`, a path relative to
# the working directory (verl's source tree); the installed package is found from anywhere.
SEARCHPATH = "hydra.searchpath=[pkg://verl.trainer.config]"
CONFIG_DIR = str(Path(verl_entry.__file__).parent / "config")


def with_searchpath(argv: list[str]) -> list[str]:
    """argv with verl's trainer configs on Hydra's search path (unless the user set one); last,
    since Hydra's parser takes the overrides as one run of positional arguments."""
    if any(a.lstrip("+").startswith("hydra.searchpath=") for a in argv[1:]):
        return argv
    return [*argv, SEARCHPATH]


@hydra.main(config_path=CONFIG_DIR, config_name="one_step_off_ppo_trainer", version_base=None)
def _main(config) -> None:
    run_checked(config, verl_entry.main, trainer="one_step_off_policy trainer")


def main() -> None:
    """The checked entry: Hydra composes verl's one-step-off config, then run_checked."""
    sys.argv = with_searchpath(sys.argv)
    _main()


if __name__ == "__main__":
    main()
