"""verl's PPO entry point with the balanced hooks loaded and the config checked first.

    python -m megatron_ba.integrations.verl.main_ppo [--config-name ppo_megatron_trainer] \\
        algorithm.adv_estimator=balanced \\
        actor_rollout_ref.actor.policy_loss.loss_mode=balanced ...

Composes the same config as `python -m verl.trainer.main_ppo` (verl's own config package and
default `ppo_trainer`, the same Hydra overrides), calls `check_config` on it, runs the preflight
(verl_preflight.py: verl's validate_config, the model folder, the data files and one batch through
verl's RLHFDataset and collate_fn, the reward on that batch through verl's reward manager), then
hands it to verl's own `main` (its `hydra.main` wrapper is skipped: the config is already
composed).

Exit status: 0 when verl's trainer finishes; 1 when a check fails (the preflight's message on
stderr names the config key or file); 69 (NEEDS_GPU, sysexits' EX_UNAVAILABLE) when every check
passed and torch sees no CUDA GPU: verl's ppo_megatron_trainer (megatron-core actor, vLLM
rollout) cannot run on CPU, so the entry stops before training after one line on stdout,
`[megatron-ba] verl: checked config, N training / M validation prompts through verl's
RLHFDataset, reward on a batch of B (B right, B wrong); verl's ppo_megatron_trainer needs CUDA
GPUs (megatron-core actor, vLLM rollout) and none is visible: stopping before training`.

The settings reach the processes that read them before verl starts any. The estimator runs in
verl's trainer, a Ray actor (TaskRunner) started from this process, and reads the MEGATRON_BA_*
variables there (adapter.py); the Ray workers that run the policy loss import the hooks. So:
- MEGATRON_BA_STEPS_PER_BATCH is derived from the config (`steps_per_batch`: train_batch_size /
  ppo_mini_batch_size x ppo_epochs) and exported, unless the user set it (check_config has then
  refused any other value);
- the MEGATRON_BA_* variables set here go into the config's Ray runtime env
  (ray_kwargs.ray_init.runtime_env.env_vars), which verl passes to ray.init for every process of
  the run: a local Ray cluster would inherit this process's environment anyway, a cluster started
  elsewhere (`ray start`) would not;
- VERL_USE_EXTERNAL_MODULES is extended with this package: each Ray process registers the hooks
  when it imports verl (verl/__init__.py reads that variable).
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import OmegaConf
from verl.trainer import main_ppo as verl_main_ppo

from megatron_ba.integrations.verl import verl_preflight as preflight
from megatron_ba.integrations.verl.checks import (
    RUNTIME_ENV_VARS,
    SETTINGS_ENV,
    STEPS_ENV,
    check_config,
    steps_per_batch,
    uses_plan,
)

MODULE = "megatron_ba.integrations.verl"


def _export_hooks() -> None:
    """Add this package to VERL_USE_EXTERNAL_MODULES (kept: any modules already listed)."""
    listed = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if MODULE not in listed:
        os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join([*listed, MODULE])


def _export_settings(config) -> None:
    """MEGATRON_BA_STEPS_PER_BATCH from the config (if unset), then every MEGATRON_BA_* setting of
    this process into the config's Ray runtime env. Run after check_config."""
    steps = steps_per_batch(config)
    if steps is not None and STEPS_ENV not in os.environ:
        os.environ[STEPS_ENV] = str(steps)
    for name in SETTINGS_ENV:
        if name in os.environ:
            # force_add: verl's runtime_env node is a struct with no env_vars key
            OmegaConf.update(config, f"{RUNTIME_ENV_VARS}.{name}", os.environ[name], force_add=True)


def run_checked(config, verl_main, **preflight_options) -> None:
    """check_config(config), the settings handed on, the preflight (which stops here without a
    CUDA GPU; `preflight_options` go to verl_preflight.run), then `verl_main` (a verl entry's
    hydra.main function) on the same config. The asynchronous entries call it too."""
    check_config(config)
    if uses_plan(config):
        _export_settings(config)
    _export_hooks()
    try:
        line = preflight.run(config, **preflight_options)
    except preflight.PreflightError as err:  # one line naming the key, not Hydra's dump
        message = " ".join(str(err).split())  # verl's and HF's own messages span lines
        print(f"{preflight.PREFIX} preflight failed: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    print(f"{line}; starting verl's trainer", file=sys.stderr, flush=True)
    verl_main.__wrapped__(config)  # its hydra.main wrapper skipped: the config is composed


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    """run_checked on verl's main_ppo."""
    run_checked(config, verl_main_ppo.main)


if __name__ == "__main__":
    main()
