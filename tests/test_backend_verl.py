"""`megatron-ba train RECIPE backend=verl`: a recipe as verl 0.9.1's ppo_megatron_trainer overrides.

Runs inside .venv-verl (`bash scripts/run_verl_tests.sh`); in the main venv it skips. Each paper
recipe's overrides are composed by Hydra into verl's REAL config (its config package, as
`python -m megatron_ba.integrations.verl.main_ppo --config-name ppo_megatron_trainer` composes
it); the composed values must be the recipe's and the integration's `check_config` must accept
them. A key verl cannot honour is refused by name; a misspelled override path is refused by
verl's Hydra (the composition check can fail).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "verl",
    reason="verl 0.9.1 lives in .venv-verl (bash scripts/run_verl_tests.sh), not in .venv",
)
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from verl_test_env import no_ba_environment  # noqa: F401 (autouse fixture)

from megatron_ba.integrations.engines.verl import (
    DISPLAY_ONLY,
    ENTRY,
    LOCAL_ONLY,
    NO_DUAL_CLIP,
    TRANSLATED,
    markdown_table,
    recipe_to_verl_overrides,
    refuse_unsupported,
    schema_keys,
    verl_environment,
)
from megatron_ba.integrations.verl import check_config
from megatron_ba.integrations.verl.checks import steps_per_batch
from megatron_ba.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
# the paper recipes verl takes, and the nodes of 8 GPUs each is meant for (its header)
NODES = {
    "qwen2.5-math-7b-dapo17k": 1,
    "qwen3-1.7b-dapo17k": 1,
    "qwen2.5-32b-dapo17k-16k": 4,
    "qwen2.5-32b-dapo17k-32k": 8,
    "qwen3-30b-a3b-dapo17k-16k": 4,  # mixture of experts at EP 8
}
PAPER = sorted(NODES)
POLARIS = ["qwen2.5-math-7b-polaris", "qwen3-1.7b-polaris"]
# What a cluster user adds: verl reads local parquet files in its layout
FILES = ["backend=verl", "data.path=/data/dapo-math-17k.parquet", "eval.data_dir=/data/bench"]


def _compose(overrides: list[str]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_megatron_trainer", overrides=overrides)


def _recipe(name: str, *extra: str):
    return load_recipe(ROOT / f"recipes/{name}.yaml", [*FILES, *extra])


@pytest.mark.parametrize("name", PAPER)
def test_paper_recipe_composes_into_verls_config(name):
    recipe = _recipe(name)
    cfg = _compose(recipe_to_verl_overrides(recipe, nodes=2, gpus_per_node=8, run_dir="runs/x"))
    actor, rollout, g = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, recipe.grpo
    assert cfg.actor_rollout_ref.model.path == recipe.model.pretrained
    assert actor.megatron.tensor_model_parallel_size == recipe.parallel.tp
    assert actor.megatron.pipeline_model_parallel_size == recipe.parallel.pp
    assert actor.megatron.context_parallel_size == recipe.parallel.cp
    assert actor.megatron.sequence_parallel == recipe.parallel.sequence_parallel
    assert actor.megatron.expert_model_parallel_size == recipe.parallel.ep
    assert actor.megatron.expert_tensor_parallel_size == recipe.parallel.etp
    ref = cfg.actor_rollout_ref.ref.megatron  # verl's reference model follows the actor's EP
    assert (ref.expert_model_parallel_size, ref.expert_tensor_parallel_size) == (
        recipe.parallel.ep,
        recipe.parallel.etp,
    )
    assert actor.megatron.override_transformer_config.recompute_granularity == "full"
    assert (rollout.name, rollout.n, rollout.temperature) == ("vllm", g.group_size, g.temperature)
    assert rollout.tensor_model_parallel_size == recipe.rollout.engine_tp
    assert rollout.gpu_memory_utilization == recipe.rollout.gpu_memory_utilization
    assert cfg.data.train_batch_size == g.prompts_per_step == 128
    assert actor.ppo_mini_batch_size == g.prompts_per_step // g.mini_batches == 32
    assert steps_per_batch(cfg) == g.mini_batches  # what main_ppo exports to the estimator
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (1024, g.max_new_tokens)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert actor.clip_ratio_c == NO_DUAL_CLIP
    assert (actor.use_kl_loss, actor.entropy_coeff) == (False, 0.0)
    assert cfg.algorithm.adv_estimator == actor.policy_loss.loss_mode == "balanced"
    assert cfg.algorithm.norm_adv_by_std_in_grpo is True
    assert (actor.optim.lr, actor.optim.lr_warmup_steps, actor.optim.weight_decay) == (
        1e-6,
        10,
        0.1,
    )
    assert list(actor.optim.betas) == [0.9, 0.99]
    t = cfg.trainer
    assert (t.total_training_steps, t.save_freq, t.test_freq, t.resume_mode) == (
        500,
        25,
        25,
        "auto",
    )
    assert (t.nnodes, t.n_gpus_per_node, t.default_local_dir) == (2, 8, "runs/x/checkpoints")
    assert cfg.data.val_files[0] == "/data/bench/math500.parquet"
    assert rollout.val_kwargs.n == recipe.eval.samples
    check_config(cfg)
    assert verl_environment(recipe) == {}  # scope group, neutral_eps 0: the estimator's defaults


@pytest.mark.parametrize(
    ("rule", "estimator", "loss_mode", "agg"),
    [
        ("balanced_mass", "balanced_mass", "balanced_mass", "token-mean"),
        ("group_token_mean", "group_token_mean", "group_token_mean", "token-mean"),
        ("token", "grpo", "vanilla", "token-mean"),
        ("sequence", "grpo", "vanilla", "seq-mean-token-mean"),
    ],
)
def test_each_rule_composes_to_its_verl_pair(rule, estimator, loss_mode, agg):
    scope = [] if rule in ("balanced_mass", "group_token_mean") else ["loss.scope=batch"]
    extra = [f"loss.rule={rule}", *scope, "loss.kl_coef=0.01", "loss.dual_clip=3.0"]
    cfg = _compose(recipe_to_verl_overrides(_recipe("qwen3-1.7b-dapo17k", *extra)))
    actor = cfg.actor_rollout_ref.actor
    assert (cfg.algorithm.adv_estimator, actor.policy_loss.loss_mode) == (estimator, loss_mode)
    assert actor.loss_agg_mode == agg
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (True, 0.01, "k3")
    assert actor.clip_ratio_c == 3.0
    check_config(cfg)


def test_balanced_scope_and_neutral_eps_go_to_the_estimators_environment():
    recipe = _recipe("qwen3-1.7b-dapo17k", "loss.scope=batch", "loss.neutral_eps=0.01")
    assert verl_environment(recipe) == {
        "MEGATRON_BA_SCOPE": "batch",
        "MEGATRON_BA_NEUTRAL_EPS": "0.01",
    }


def test_token_budget_micro_batches_become_dynamic_batch_sizes():
    recipe = _recipe("qwen3-1.7b-dapo17k", "parallel.max_tokens_per_microbatch=20000")
    actor = _compose(recipe_to_verl_overrides(recipe)).actor_rollout_ref.actor
    assert (actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu) == (True, 20000)


def test_uneven_pipeline_stages_reach_verls_transformer_config():
    uneven = [
        "parallel.pp=3",
        "parallel.pp_first_stage_layers=8",
        "parallel.pp_last_stage_layers=10",
    ]
    megatron = _compose(recipe_to_verl_overrides(_recipe("qwen3-1.7b-dapo17k", *uneven)))
    megatron = megatron.actor_rollout_ref.actor.megatron
    assert megatron.pipeline_model_parallel_size == 3
    over = megatron.override_transformer_config
    assert (over.num_layers_in_first_pipeline_stage, over.num_layers_in_last_pipeline_stage) == (
        8,
        10,
    )
    even = _compose(recipe_to_verl_overrides(_recipe("qwen3-1.7b-dapo17k")))
    assert "num_layers_in_first_pipeline_stage" not in (
        even.actor_rollout_ref.actor.megatron.override_transformer_config
    )


def _release_config(folder: Path, config) -> str:
    """A checkpoint folder holding only the release's config.json (transformers' own defaults
    for the model type, as its to_json_string writes them)."""
    folder.mkdir()
    (folder / "config.json").write_text(config.to_json_string())
    return str(folder)


def test_a_gated_deltanet_checkpoint_trains_on_padded_micro_batches(tmp_path):
    """Qwen3.5 (its config.json) turns verl's packed micro-batches off; a Qwen3 checkpoint, and
    a folder whose config.json is not here, keep verl's default (packed)."""
    import transformers

    folders = {
        "qwen3.5": _release_config(tmp_path / "q35", transformers.Qwen3_5MoeConfig()),
        "qwen3": _release_config(tmp_path / "q3", transformers.Qwen3Config()),
        "absent": str(tmp_path / "not-here"),
    }
    padding = {}
    for name, folder in folders.items():
        recipe = _recipe("qwen3-1.7b-dapo17k", f"model.pretrained={folder}")
        megatron = _compose(recipe_to_verl_overrides(recipe)).actor_rollout_ref.actor.megatron
        padding[name] = megatron.use_remove_padding
    assert padding == {"qwen3.5": False, "qwen3": True, "absent": True}


# (overrides, the recipe key the error must start with)
REFUSED = {
    "arithmetic_task": (["data.task=arithmetic"], "data.task"),
    "warm_start_steps": (["warmstart.steps=10"], "warmstart.steps"),
    "builtin_engine": (["rollout.engine=builtin"], "rollout.engine"),
    "hub_id_data": (["data.path=BytedTsinghua-SIA/DAPO-Math-17k"], "data.path"),
    "dr_grpo": (["loss.rule=dr_grpo"], "loss.rule"),
    "token_per_group": (["loss.rule=token"], "loss.scope"),
    "dynamic_sampling": (["grpo.dynamic_sampling=true"], "grpo.dynamic_sampling"),
    "drop_zero_variance": (["grpo.drop_zero_variance=true"], "grpo.drop_zero_variance"),
    "logprob_chunk": (["parallel.logprob_chunk_size=512"], "parallel.logprob_chunk_size"),
    "no_benchmark_files": (["eval.data_dir=null"], "eval.data_dir"),
    "eval_budget": (["eval.max_new_tokens=1024"], "eval.max_new_tokens"),
    "fp32": (["model.precision=fp32"], "model.precision"),
    "shape_key": (["model.hidden_size=2048"], "model.hidden_size"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_key_verl_cannot_honour_is_refused_by_name(case):
    extra, key = REFUSED[case]
    with pytest.raises(ValueError) as err:
        refuse_unsupported(_recipe("qwen3-1.7b-dapo17k", *extra))
    assert str(err.value).startswith(f"{key}: "), str(err.value)


@pytest.mark.parametrize("name", POLARIS)
def test_polaris_recipes_are_refused_naming_the_data_set(name):
    with pytest.raises(ValueError, match=r"^data\.dataset: .*'polaris'"):
        refuse_unsupported(load_recipe(ROOT / f"recipes/{name}.yaml", FILES))


def test_every_recipe_key_is_translated_or_refused():
    """No key is dropped: each leaf of the schema is translated, refused away from its default
    (LOCAL_ONLY) or display-only, exactly once; and every verl path the table names exists in
    verl's composed config (the docs' table is these dicts)."""
    keys = schema_keys()
    groups = [set(TRANSLATED), set(LOCAL_ONLY), set(DISPLAY_ONLY)]
    assert sum(len(g) for g in groups) == len(keys) and set().union(*groups) == set(keys)
    cfg = _compose(["actor_rollout_ref.rollout.name=vllm"])  # verl's default is ??? (missing)
    paths = set()
    for where in TRANSLATED.values():
        paths |= set(
            re.findall(
                r"(?<![+\w])(?:actor_rollout_ref|data|trainer|algorithm|reward)\.[\w.]*\w", where
            )
        )
        # a key hydra adds (`+key`): its parent must exist
        paths |= {
            p.rpartition(".")[0] for p in re.findall(r"\+((?:actor_rollout_ref)\.[\w.]*\w)", where)
        }
    assert len(paths) > 40
    missing = [p for p in sorted(paths) if OmegaConf.select(cfg, p, default=KeyError) is KeyError]
    assert not missing, missing


def test_docs_table_names_every_key():
    text = (ROOT / "docs/integrations.md").read_text()
    section = text[text.index("### From a recipe") :]
    for key in schema_keys():
        assert f"| `{key}` |" in section, key
    assert markdown_table() in section  # the table is the dicts, as they are


def test_a_misspelled_override_path_is_refused_by_verls_hydra():
    """Negative control: the composition above can fail."""
    good = recipe_to_verl_overrides(_recipe("qwen3-1.7b-dapo17k"))
    _compose(good)
    bad = [o.replace("clip_ratio_high", "clip_ratio_hihg") for o in good]
    with pytest.raises(ConfigCompositionException, match="clip_ratio_hihg"):
        _compose(bad)


@pytest.mark.parametrize("name", PAPER)
def test_verls_own_main_validates_the_translation(name, monkeypatch, tmp_path):
    """The printed command's entry point (main_ppo: check_config, then verl's own main with its
    validate_config) on the translation, stopped where verl would start Ray (run_ppo)."""
    from verl.trainer import main_ppo as verl_main_ppo

    from megatron_ba.integrations.verl import main_ppo

    seen = []
    monkeypatch.setattr(
        verl_main_ppo, "run_ppo", lambda config, task_runner_class: seen.append(config)
    )
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    # the recipes' model folders and data files are not here: the preflight that reads them is
    # tests/test_verl_preflight.py's
    monkeypatch.setattr(main_ppo.preflight, "run", lambda config: "preflight passed")
    overrides = recipe_to_verl_overrides(_recipe(name), nodes=NODES[name], run_dir=str(tmp_path))
    hydra_dirs = [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", ["main_ppo", *ENTRY[2:], *overrides, *hydra_dirs])
    main_ppo.main()
    assert len(seen) == 1 and seen[0].trainer.nnodes == NODES[name]
    assert os.environ["MEGATRON_BA_STEPS_PER_BATCH"] == "4"  # grpo.mini_batches


def test_without_print_overrides_the_command_is_printed_and_execd(monkeypatch, capsys):
    """`megatron-ba train RECIPE backend=verl` (verl imports here): the command on stdout, then
    exec of it with the estimator's settings in its environment."""
    from megatron_ba.commands import train

    calls = []
    monkeypatch.setattr(train.os, "execve", lambda *a: calls.append(a))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    extra = ["loss.scope=batch", "--run-dir", "runs/v"]
    args = parser.parse_args(["recipes/qwen3-1.7b-dapo17k.yaml", *FILES, *extra])
    monkeypatch.chdir(ROOT)
    train.run(args)
    printed = capsys.readouterr().out.strip()
    (path, argv, env) = calls[0]
    assert path == sys.executable and argv[1:5] == ENTRY
    assert f"trainer.default_local_dir={ROOT}/runs/v/checkpoints" in argv
    assert env["MEGATRON_BA_SCOPE"] == "batch"
    assert printed.startswith("MEGATRON_BA_SCOPE=batch python " + " ".join(ENTRY))
    assert printed.endswith(argv[-1])


def test_without_verl_the_command_is_printed_and_the_run_refused(monkeypatch, capsys):
    import importlib.util

    from megatron_ba.commands import train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verl" else real(name, *a)
    )
    monkeypatch.setattr(train.os, "execve", lambda *a: pytest.fail("exec'd without verl"))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    monkeypatch.chdir(ROOT)
    assert train.run(parser.parse_args(["recipes/qwen3-1.7b-dapo17k.yaml", *FILES])) == 2
    out = capsys.readouterr()
    assert out.out.startswith("python -m megatron_ba.integrations.verl.main_ppo")
    assert "backend verl needs verl 0.9.1" in out.err


def test_the_command_prints_the_overrides_and_refuses_by_name():
    cmd = [sys.executable, "-m", "megatron_ba.cli", "train", "recipes/qwen3-1.7b-dapo17k.yaml"]
    out = subprocess.run(
        [*cmd, *FILES, "--print-overrides", "--nodes", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "algorithm.adv_estimator=balanced" in lines and "trainer.nnodes=2" in lines
    command = "python -m megatron_ba.integrations.verl.main_ppo --config-name ppo_megatron_trainer"
    assert command in out.stderr
    assert "note: grpo.std: population; " in out.stderr and "1.0328 times" in out.stderr
    refused = subprocess.run(
        [*cmd, *FILES, "rollout.engine=builtin", "--print-overrides"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "train: rollout.engine: " in refused.stderr
