"""Half-configured verl runs are refused: `check_config` and `python -m ...verl.main_ppo`.

Runs inside .venv-verl (`bash scripts/run_verl_tests.sh`); in the main venv it skips. The configs
are verl 0.9.1's own, composed by Hydra from its config package (ppo_trainer.yaml and
ppo_megatron_trainer.yaml) with the overrides a user would type; each wrong pairing must raise a
ValueError naming the keys, a correct one must pass silently and reach verl's own `main`. The
entry point derives MEGATRON_BA_STEPS_PER_BATCH from the config and hands the settings to the Ray
processes (checked at verl's own ray.init); a value the user set against the config is refused.
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
from verl_test_env import BA_ENV, no_ba_environment  # noqa: F401 (autouse fixture)

from megatron_ba.integrations.verl import check_config
from megatron_ba.integrations.verl.adapter import _settings
from megatron_ba.integrations.verl.checks import steps_per_batch

CONFIGS = ["ppo_trainer", "ppo_megatron_trainer"]
GOOD = [
    "algorithm.adv_estimator=balanced",
    "actor_rollout_ref.actor.policy_loss.loss_mode=balanced",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
]


# 64 prompts / 16 per mini-batch x 2 epochs: 8 optimizer steps per rollout batch
EIGHT_STEPS = (
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_epochs=2",
)
MICRO = [  # what verl's own validate_config asks of any run
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
]


@pytest.fixture(autouse=True)
def no_preflight(monkeypatch):
    """These configs name no model folder or data file, and these tests are about what reaches
    verl's main: main_ppo's preflight (which reads them) is replaced by a pass here; its own tests
    are tests/test_verl_preflight.py."""
    from megatron_ba.integrations.verl import verl_preflight as preflight

    monkeypatch.setattr(preflight, "run", lambda config: "[megatron-ba] verl: preflight passed")


def _compose(config_name: str, overrides: list[str]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose(config_name, overrides=overrides)


def _with(*changes: str) -> list[str]:
    """GOOD with the keys of `changes` replaced (or added)."""
    keys = {c.split("=")[0].lstrip("+") for c in changes}
    return [o for o in GOOD if o.split("=")[0] not in keys] + list(changes)


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


# algorithm.rollout_correction in verl's decoupled mode: IS at both levels (TIS, IcePop, batch
# normalisation) and rejection sampling of each kind compose with the balanced pair.
ROLLOUT_CORRECTIONS = {
    "token_tis": ["rollout_is=token", "rollout_is_threshold=2.0"],
    "sequence_icepop": ["rollout_is=sequence", "rollout_is_threshold='0.5_2.0'"],
    "sequence_normalized": ["rollout_is=sequence", "rollout_is_batch_normalize=true"],
    "token_rs": ["rollout_rs=token_k1", "rollout_rs_threshold='0.6_1.6'"],
    "geometric_rs_token_tis": [
        "rollout_is=token", "rollout_rs=seq_mean_k1", "rollout_rs_threshold='0.9_1.1'"
    ],
    "seq_max_rs_sequence_tis": [
        "rollout_is=sequence", "rollout_rs=seq_max_k2", "rollout_rs_threshold=0.1"
    ],
}  # fmt: skip


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("case", sorted(ROLLOUT_CORRECTIONS))
def test_rollout_correction_passes_silently(config_name, case):
    """rollout_is / rollout_rs are no longer refused (the loss takes verl's weights, the estimator
    verl's rejection mask); control: the same settings with bypass_mode=true are refused."""
    changes = [f"algorithm.rollout_correction.{c}" for c in ROLLOUT_CORRECTIONS[case]]
    cfg = _compose(config_name, _with(*changes))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_config(cfg)
    bypass = _compose(config_name, _with(*changes, "algorithm.rollout_correction.bypass_mode=true"))
    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.bypass_mode: must be"):
        check_config(bypass)


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
        ["algorithm.rollout_correction.bypass_mode: must be false", "'bypass_mode' loss",
         "bypass_mode=false", "rollout_is and rollout_rs work"],
    ),
    "bypass_mode_with_rollout_is": (
        ["algorithm.rollout_correction.bypass_mode=true",
         "algorithm.rollout_correction.rollout_is=token"],
        ["algorithm.rollout_correction.bypass_mode: must be false"],
    ),
    "mini_batch_not_dividing_the_batch": (
        ["actor_rollout_ref.actor.ppo_mini_batch_size=48"],
        ["actor_rollout_ref.actor.ppo_mini_batch_size: is 48",
         "does not divide data.train_batch_size=64"],
    ),
    "steps_in_the_configs_ray_runtime_env": (
        ["+ray_kwargs.ray_init.runtime_env.env_vars.MEGATRON_BA_STEPS_PER_BATCH=1"],
        ["ray_kwargs.ray_init.runtime_env.env_vars.MEGATRON_BA_STEPS_PER_BATCH: set in the config",
         "environment of python -m megatron_ba.integrations.verl.main_ppo"],
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


# A MEGATRON_BA_STEPS_PER_BATCH the user set against the config: (its value, overrides, fragments)
CONTRADICTING = {
    "mini_batches": (
        "1", ["actor_rollout_ref.actor.ppo_mini_batch_size=16"],
        ["MEGATRON_BA_STEPS_PER_BATCH: is 1", "4 optimizer steps", "ppo_mini_batch_size=16",
         "MEGATRON_BA_STEPS_PER_BATCH=4"],
    ),
    "epochs": (
        "4", ["actor_rollout_ref.actor.ppo_epochs=2"],
        ["MEGATRON_BA_STEPS_PER_BATCH: is 4", "ppo_epochs", "MEGATRON_BA_STEPS_PER_BATCH=2"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("case", sorted(CONTRADICTING))
def test_a_steps_variable_against_the_config_is_refused_by_name(config_name, case, monkeypatch):
    value, changes, fragments = CONTRADICTING[case]
    monkeypatch.setenv("MEGATRON_BA_STEPS_PER_BATCH", value)
    with pytest.raises(ValueError) as err:
        check_config(_compose(config_name, _with(*changes)))
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize("config_name", CONFIGS)
def test_unset_steps_are_the_configs(config_name):
    """Unset, the variable is not refused: the steps come from the config (main_ppo exports them);
    8 = 64 prompts / 16 per mini-batch x 2 epochs."""
    cfg = _compose(config_name, _with(*EIGHT_STEPS))
    check_config(cfg)
    assert steps_per_batch(cfg) == 8
    assert steps_per_batch(_compose(config_name, GOOD)) == 1


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
    argv = ["main_ppo", *GOOD, *MICRO, f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", argv)
    main_ppo.main()
    assert len(seen) == 1
    assert seen[0].algorithm.adv_estimator == "balanced"
    assert seen[0].actor_rollout_ref.rollout.n == 4
    assert os.environ["VERL_USE_EXTERNAL_MODULES"] == "megatron_ba.integrations.verl"


class _RayInit(Exception):
    """Raised by the stand-in for ray.init: verl's run_ppo stops where Ray would start."""


def _run_entry_point_to_ray_init(monkeypatch, tmp_path, *changes: str) -> dict:
    """main_ppo.main() on GOOD with `changes`, through verl's own main and run_ppo up to ray.init;
    what ray.init was called with, and this process's environment at that moment."""
    import ray

    from megatron_ba.integrations.verl import main_ppo

    seen = {}

    def init(**kwargs):
        seen.update(kwargs=kwargs, environ=dict(os.environ))
        raise _RayInit

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of exiting with status 1
    hydra_dirs = [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", ["main_ppo", *_with(*changes), *MICRO, *hydra_dirs])
    try:
        main_ppo.main()
    except _RayInit:
        return seen
    raise AssertionError("verl's run_ppo returned without calling ray.init")


def test_entry_point_derives_the_steps_and_hands_them_to_the_ray_processes(monkeypatch, tmp_path):
    """No MEGATRON_BA_STEPS_PER_BATCH set: main_ppo derives 8 from the config (64 prompts / 16 per
    mini-batch x 2 epochs) and it reaches verl's ray.init, in the runtime env every Ray process of
    the run gets and in the environment a local cluster inherits, with the user's scope; a process
    with that runtime env (where the estimator runs) reads 8 steps and scope batch."""
    monkeypatch.setenv("MEGATRON_BA_SCOPE", "batch")
    seen = _run_entry_point_to_ray_init(monkeypatch, tmp_path, *EIGHT_STEPS)
    env_vars = seen["kwargs"]["runtime_env"]["env_vars"]
    assert env_vars["MEGATRON_BA_STEPS_PER_BATCH"] == "8"
    assert env_vars["MEGATRON_BA_SCOPE"] == "batch"
    assert "MEGATRON_BA_NEUTRAL_EPS" not in env_vars  # not set: the estimator's default
    assert seen["environ"]["MEGATRON_BA_STEPS_PER_BATCH"] == "8"
    assert "megatron_ba.integrations.verl" in seen["environ"]["VERL_USE_EXTERNAL_MODULES"]
    for name in BA_ENV:  # the estimator's process: only the runtime env's variables
        monkeypatch.delenv(name, raising=False)
        if name in env_vars:
            monkeypatch.setenv(name, env_vars[name])
    settings, steps = _settings("group_token_mean")
    assert (settings.scope, steps) == ("batch", 8)


def test_entry_point_refuses_a_steps_variable_against_the_config(monkeypatch, tmp_path):
    """The user's MEGATRON_BA_STEPS_PER_BATCH=4 where the config makes 8 steps: refused by name
    before verl starts (ray.init is never reached); 8 passes and is handed on unchanged."""
    monkeypatch.setenv("MEGATRON_BA_STEPS_PER_BATCH", "4")
    with pytest.raises(
        ValueError, match=r"^MEGATRON_BA_STEPS_PER_BATCH: is 4, .* into 8 optimizer"
    ):
        _run_entry_point_to_ray_init(monkeypatch, tmp_path, *EIGHT_STEPS)
    monkeypatch.setenv("MEGATRON_BA_STEPS_PER_BATCH", "8")
    seen = _run_entry_point_to_ray_init(monkeypatch, tmp_path, *EIGHT_STEPS)
    assert seen["kwargs"]["runtime_env"]["env_vars"]["MEGATRON_BA_STEPS_PER_BATCH"] == "8"


def test_entry_point_hands_rollout_correction_to_verls_main(monkeypatch, tmp_path):
    """Token IS with geometric rejection through main_ppo: check_config passes it, and verl's own
    main (its config validation included) hands run_ppo the config with the correction."""
    from verl.trainer import main_ppo as verl_main_ppo

    seen = []
    monkeypatch.setattr(
        verl_main_ppo, "run_ppo", lambda config, task_runner_class: seen.append(config)
    )
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    correction = [
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='0.9_1.1'",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]
    hydra_dirs = [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", ["main_ppo", *GOOD, *MICRO, *correction, *hydra_dirs])
    from megatron_ba.integrations.verl import main_ppo

    main_ppo.main()
    assert len(seen) == 1
    rc = seen[0].algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs, rc.rollout_rs_threshold) == (
        "token",
        "seq_mean_k1",
        "0.9_1.1",
    )
