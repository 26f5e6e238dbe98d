"""Half-configured verl runs are refused: `check_config` and `python -m ...verl.main_ppo`.

Runs inside .venv-verl (`bash scripts/run_verl_tests.sh`); in the main venv it skips. The configs
are verl 0.9.1's own, composed by Hydra from its config package (ppo_trainer.yaml and
ppo_megatron_trainer.yaml) with the overrides a user would type; each wrong pairing must raise a
ValueError naming the keys, a correct one must pass silently and reach verl's own `main`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip(
    "verl",
    reason="verl 0.9.1 lives in .venv-verl (bash scripts/run_verl_tests.sh), not in .venv",
)
from hydra import compose, initialize_config_module

from megatron_ba.integrations.verl import check_config

CONFIGS = ["ppo_trainer", "ppo_megatron_trainer"]
GOOD = [
    "algorithm.adv_estimator=balanced",
    "actor_rollout_ref.actor.policy_loss.loss_mode=balanced",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
]


def _compose(config_name: str, overrides: list[str]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(config_name, overrides=overrides)


def _with(*changes: str) -> list[str]:
    """GOOD with the keys of `changes` replaced (or added)."""
    keys = {c.split("=")[0].lstrip("+") for c in changes}
    return [o for o in GOOD if o.split("=")[0] not in keys] + list(changes)


@pytest.fixture(autouse=True)
def _no_ba_environment(monkeypatch):
    for name in ("MEGATRON_BA_SCOPE", "MEGATRON_BA_NEUTRAL_EPS", "MEGATRON_BA_STEPS_PER_BATCH"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("config_name", CONFIGS)
def test_correct_pairing_passes_silently(config_name):
    for rule in ("balanced", "balanced_mass", "group_token_mean"):
        cfg = _compose(
            config_name,
            _with(
                f"algorithm.adv_estimator={rule}",
                f"actor_rollout_ref.actor.policy_loss.loss_mode={rule}",
            ),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_config(cfg)
    check_config(_compose(config_name, []))  # verl's defaults (gae + vanilla): not ours to check


# (overrides, every fragment the error must contain)
WRONG = {
    "loss_without_estimator": (
        ["algorithm.adv_estimator=grpo"],
        ["actor_rollout_ref.actor.policy_loss.loss_mode=balanced", "algorithm.adv_estimator=grpo",
         "Set algorithm.adv_estimator=balanced"],
    ),
    "estimator_without_loss": (
        ["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"],
        ["algorithm.adv_estimator=balanced", "loss_mode=vanilla",
         "Set actor_rollout_ref.actor.policy_loss.loss_mode=balanced"],
    ),
    "mass_estimator_balanced_loss": (
        ["algorithm.adv_estimator=balanced_mass"],
        ["algorithm.adv_estimator=balanced_mass", "loss_mode=balanced", "same rule"],
    ),
    "group_token_mean_estimator_balanced_loss": (
        ["algorithm.adv_estimator=group_token_mean"],
        ["algorithm.adv_estimator=group_token_mean", "loss_mode=balanced", "same rule"],
    ),
    "group_token_mean_loss_without_estimator": (
        ["algorithm.adv_estimator=grpo",
         "actor_rollout_ref.actor.policy_loss.loss_mode=group_token_mean"],
        ["loss_mode=group_token_mean needs", "Set algorithm.adv_estimator=group_token_mean"],
    ),
    "single_response_groups": (
        ["actor_rollout_ref.rollout.n=1"],
        ["actor_rollout_ref.rollout.n", "advantage 0", "n=2"],
    ),
    "bypass_mode_replaces_loss": (
        ["algorithm.rollout_correction.bypass_mode=true"],
        ["algorithm.rollout_correction.bypass_mode", "bypass_mode=false"],
    ),
    "rollout_is_weights": (
        ["algorithm.rollout_correction.rollout_is=token"],
        ["algorithm.rollout_correction.rollout_is", "=null"],
    ),
    "mini_batches_without_steps": (
        ["actor_rollout_ref.actor.ppo_mini_batch_size=16"],
        ["MEGATRON_BA_STEPS_PER_BATCH", "4 optimizer steps", "ppo_mini_batch_size=16",
         "MEGATRON_BA_STEPS_PER_BATCH=4"],
    ),
    "epochs_without_steps": (
        ["actor_rollout_ref.actor.ppo_epochs=2"],
        ["MEGATRON_BA_STEPS_PER_BATCH", "ppo_epochs", "MEGATRON_BA_STEPS_PER_BATCH=2"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_pairing_is_refused(config_name, case):
    changes, fragments = WRONG[case]
    cfg = _compose(config_name, _with(*changes))
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_steps_variable_matching_verls_split_passes(monkeypatch):
    monkeypatch.setenv("MEGATRON_BA_STEPS_PER_BATCH", "8")
    check_config(
        _compose(
            "ppo_trainer",
            _with(
                "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                "actor_rollout_ref.actor.ppo_epochs=2",
            ),
        )
    )
    monkeypatch.setenv("MEGATRON_BA_SCOPE", "prompt")
    with pytest.raises(ValueError, match="MEGATRON_BA_SCOPE"):
        check_config(_compose("ppo_trainer", GOOD))


def test_ignored_loss_agg_mode_is_warned_about():
    cfg = _compose(
        "ppo_trainer", _with("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    )
    with pytest.warns(UserWarning, match=r"loss_agg_mode=seq-mean-token-mean is ignored .*KL"):
        check_config(cfg)


def _entry_point(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_ba.integrations.verl.main_ppo", *args]
    command += [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("config_name", CONFIGS)
def test_entry_point_refuses_before_anything_starts(config_name, tmp_path):
    done = _entry_point(
        f"--config-name={config_name}",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=balanced",
        "actor_rollout_ref.rollout.n=4",
        tmp_path=tmp_path,
    )
    assert done.returncode != 0
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=balanced needs" in done.stderr
    assert "ray init" not in done.stdout + done.stderr  # verl's run_ppo never began


def test_entry_point_hands_a_correct_config_to_verls_main(monkeypatch, tmp_path):
    from verl.trainer import main_ppo as verl_main_ppo

    from megatron_ba.integrations.verl import main_ppo

    seen = []
    # verl's main validates the config, then starts Ray in run_ppo: stop there.
    monkeypatch.setattr(
        verl_main_ppo, "run_ppo", lambda config, task_runner_class: seen.append(config)
    )
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    micro = [  # what verl's own validate_config asks of any run
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    ]
    argv = ["main_ppo", *GOOD, *micro, f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", argv)
    main_ppo.main()
    assert len(seen) == 1
    assert seen[0].algorithm.adv_estimator == "balanced"
    assert seen[0].actor_rollout_ref.rollout.n == 4
    assert os.environ["VERL_USE_EXTERNAL_MODULES"] == "megatron_ba.integrations.verl"
