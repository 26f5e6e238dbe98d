"""verl 0.9.1's asynchronous entries with the balanced pair: their configs, check_config and the
checked entries `python -m megatron_ba.integrations.verl.one_step_off_policy` and
`.fully_async_policy`.

The configs are verl's own (verl/experimental/{one_step_off_policy,fully_async_policy}/config,
built on ppo_trainer.yaml / ppo_megatron_trainer.yaml), composed by Hydra with the overrides a
user would type. check_config passes the pair, refuses by name the `bypass_mode: true` those
configs set (it replaces the balanced loss) and a MEGATRON_BA_STEPS_PER_BATCH against the fully
async trainer's split (async_training.require_batches x ppo_epochs), and warns about
async_training.partial_rollout=false. The entries hand the checked config and the settings to
verl's own main (up to ray.init here), and on the run files of tests/verl_run_files.py the
preflight ends with its NEEDS_GPU line naming the trainer. Runs in .venv-verl.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 lives in .venv-verl: bash scripts/run_verl_tests.sh")

from hydra import compose, initialize_config_dir
from verl_run_files import LINE, RECIPE, write_run_files
from verl_test_env import no_ba_environment  # noqa: F401 (autouse fixture)

from megatron_ba.integrations.engines.verl import recipe_to_verl_overrides
from megatron_ba.integrations.verl import check_config
from megatron_ba.integrations.verl import fully_async_policy as fully_async
from megatron_ba.integrations.verl import one_step_off_policy as one_step
from megatron_ba.integrations.verl.checks import steps_per_batch
from megatron_ba.integrations.verl.verl_preflight import NEEDS_GPU, PREFIX
from megatron_ba.recipe import load_recipe

ENTRIES = {"one_step_off_policy": one_step, "fully_async_policy": fully_async}
CONFIGS = {  # config name -> its entry
    "one_step_off_ppo_trainer": one_step,
    "one_step_off_ppo_megatron_trainer": one_step,
    "fully_async_ppo_trainer": fully_async,
    "fully_async_ppo_megatron_trainer": fully_async,
}
PAIR = [
    "algorithm.adv_estimator=balanced",
    "actor_rollout_ref.actor.policy_loss.loss_mode=balanced",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_epochs=2",
]
# one-step-off: 64 prompts / 16 x 2 epochs = 8 steps; fully async: 2 mini-batches x 2 epochs = 4
GOOD = {
    one_step: [*PAIR, "data.train_batch_size=64"],
    fully_async: [*PAIR, "data.train_batch_size=0", "async_training.require_batches=2",
                  "async_training.staleness_threshold=0.5"],
}  # fmt: skip
STEPS = {one_step: 8, fully_async: 4}
DECOUPLED = "algorithm.rollout_correction.bypass_mode=false"
MICRO = [  # what verl's validate_config asks of any run
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
]


def _compose(config_name: str, overrides: list[str]):
    """verl's config `config_name` as its entry composes it (verl's trainer configs on the
    search path: the yaml's own `file://verl/trainer/config` is relative to verl's source)."""
    with initialize_config_dir(CONFIG_DIRS[config_name], version_base=None):
        return compose(config_name, overrides=[one_step.SEARCHPATH, *overrides])


CONFIG_DIRS = {name: entry.CONFIG_DIR for name, entry in CONFIGS.items()}


def test_verls_one_step_yaml_finds_its_base_only_through_the_entrys_search_path():
    """verl's yaml names its base config by a path relative to verl's source tree: from here
    (no verl/trainer/config below the working directory) Hydra cannot load it without the
    entry's search path; the control is _compose (with it)."""
    from hydra.errors import MissingConfigException

    with initialize_config_dir(one_step.CONFIG_DIR, version_base=None):
        with pytest.raises(MissingConfigException, match="Could not load 'ppo_trainer'"):
            compose("one_step_off_ppo_trainer")
    assert _compose("one_step_off_ppo_trainer", []).algorithm.rollout_correction.bypass_mode


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_the_balanced_pair_passes_in_verls_async_configs(config_name):
    entry = CONFIGS[config_name]
    cfg = _compose(config_name, [*GOOD[entry], DECOUPLED])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_config(cfg)
    assert steps_per_batch(cfg) == STEPS[entry]
    if entry is fully_async:  # verl's async_training keys are there, with the overrides
        assert cfg.async_training.staleness_threshold == 0.5
        assert cfg.async_training.partial_rollout is True
        assert cfg.async_training.trigger_parameter_sync_step == 4
    check_config(_compose(config_name, [DECOUPLED]))  # verl's gae + vanilla: not ours to check


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_verls_async_default_bypass_mode_is_refused_by_name(config_name):
    cfg = _compose(config_name, GOOD[CONFIGS[config_name]])
    assert cfg.algorithm.rollout_correction.bypass_mode is True  # verl's async configs' default
    with pytest.raises(
        ValueError, match=r"^algorithm\.rollout_correction\.bypass_mode: must be"
    ) as e:
        check_config(cfg)
    assert "one_step_off_policy and fully_async_policy configs set it true" in str(e.value)


def test_a_steps_variable_against_the_async_split_is_refused(monkeypatch):
    cfg = _compose("fully_async_ppo_trainer", [*GOOD[fully_async], DECOUPLED])
    monkeypatch.setenv("MEGATRON_BA_STEPS_PER_BATCH", "8")  # the synchronous reading: wrong
    with pytest.raises(ValueError, match=r"^MEGATRON_BA_STEPS_PER_BATCH: is 8, .* into 4 ") as e:
        check_config(cfg)
    assert "async_training.require_batches=2 x actor_rollout_ref.actor.ppo_epochs" in str(e.value)
    monkeypatch.setenv("MEGATRON_BA_STEPS_PER_BATCH", "4")
    check_config(cfg)


def test_require_batches_below_one_is_refused():
    cfg = _compose(
        "fully_async_ppo_trainer", [*PAIR, DECOUPLED, "async_training.require_batches=0"]
    )
    with pytest.raises(ValueError, match=r"^async_training\.require_batches: is 0"):
        check_config(cfg)


def test_partial_rollout_off_is_warned_about():
    off = "async_training.partial_rollout=false"
    cfg = _compose("fully_async_ppo_trainer", [*GOOD[fully_async], DECOUPLED, off])
    with pytest.warns(UserWarning, match=r"async_training\.partial_rollout=false: verl keeps"):
        check_config(cfg)


class _RayInit(Exception):
    """Raised by the stand-in for ray.init: verl's run_ppo stops where Ray would start."""


def _to_ray_init(entry, monkeypatch, tmp_path, overrides: list[str]) -> dict:
    """entry.main() as `python -m` runs it (preflight replaced: no model or data named here),
    through verl's own main and run_ppo up to ray.init: what ray.init got, and the environment."""
    import ray

    from megatron_ba.integrations.verl import verl_preflight

    seen = {}

    def init(**kwargs):
        seen.update(kwargs=kwargs, environ=dict(os.environ))
        raise _RayInit

    monkeypatch.setattr(verl_preflight, "run", lambda config, **options: f"{PREFIX} passed")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of exiting with status 1
    hydra_dirs = [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", [entry.__name__, *overrides, *MICRO, *hydra_dirs])
    try:
        entry.main()
    except _RayInit:
        return seen
    raise AssertionError("verl's run_ppo returned without calling ray.init")


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_the_entry_hands_the_checked_config_and_steps_to_verls_main(name, monkeypatch, tmp_path):
    entry = ENTRIES[name]
    seen = _to_ray_init(entry, monkeypatch, tmp_path, [*GOOD[entry], DECOUPLED])
    env_vars = seen["kwargs"]["runtime_env"]["env_vars"]
    assert env_vars["MEGATRON_BA_STEPS_PER_BATCH"] == str(STEPS[entry])
    assert "megatron_ba.integrations.verl" in seen["environ"]["VERL_USE_EXTERNAL_MODULES"]
    # verl's default bypass_mode: refused before verl's main (ray.init never reached)
    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.bypass_mode"):
        _to_ray_init(entry, monkeypatch, tmp_path, GOOD[entry])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_run_files(tmp_path_factory.mktemp("verl-async-run"))


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_the_entry_preflight_stops_without_a_gpu(name, files, tmp_path, monkeypatch, capsys):
    """The recipe translated for verl (tests/verl_run_files.py: a tiny model, DAPO-Math rows)
    through the entry's megatron config: config, data, one step's batch and the reward through
    verl's code, then the NEEDS_GPU line naming verl's async trainer."""
    entry = ENTRIES[name]
    monkeypatch.setattr(os, "environ", os.environ)  # HF datasets rebinds it (test_verl_preflight)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    recipe = load_recipe(RECIPE, files.recipe_overrides())
    overrides = recipe_to_verl_overrides(recipe, nodes=1, gpus_per_node=1, run_dir=str(tmp_path))
    if entry is fully_async:  # its rollouter takes one prompt at a time: train_batch_size 0
        overrides = [o for o in overrides if not o.startswith("data.train_batch_size=")]
        overrides += ["data.train_batch_size=0", "async_training.require_batches=1"]
    argv = [f"--config-name={name.replace('_policy', '')}_ppo_megatron_trainer"]
    argv = [*argv, *overrides, DECOUPLED, f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", [entry.__name__, *argv])
    with pytest.raises(SystemExit) as stop:
        entry.main()
    out = capsys.readouterr()
    assert stop.value.code == NEEDS_GPU, out.err[-3000:]
    line = LINE.replace("verl's ppo_megatron_trainer", f"verl's {name} trainer")
    assert [x for x in out.out.splitlines() if x.startswith(PREFIX)] == [line]
