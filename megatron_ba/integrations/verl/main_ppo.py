"""verl's PPO entry point with the balanced hooks loaded and the config checked first.

    python -m megatron_ba.integrations.verl.main_ppo [--config-name ppo_megatron_trainer] \\
        algorithm.adv_estimator=balanced \\
        actor_rollout_ref.actor.policy_loss.loss_mode=balanced ...

Composes the same config as `python -m verl.trainer.main_ppo` (verl's own config package and
default `ppo_trainer`, the same Hydra overrides), calls `check_config` on it, then hands it to
verl's own `main` (its `hydra.main` wrapper is skipped: the config is already composed).

VERL_USE_EXTERNAL_MODULES is extended with this package before verl runs: the trainer and its
workers are Ray processes started from this one, and each registers the hooks when it imports
verl (verl/__init__.py reads that variable).
"""

from __future__ import annotations

import os

import hydra
from verl.trainer import main_ppo as verl_main_ppo

from megatron_ba.integrations.verl.checks import check_config

MODULE = "megatron_ba.integrations.verl"


def _export_hooks() -> None:
    """Add this package to VERL_USE_EXTERNAL_MODULES (kept: any modules already listed)."""
    listed = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if MODULE not in listed:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([*listed, MODULE])


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    """check_config(config), then verl's main_ppo on the same config."""
    check_config(config)
    _export_hooks()
    verl_main_ppo.main.__wrapped__(config)


if __name__ == "__main__":
    main()
