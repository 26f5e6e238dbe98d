"""`megatron-ba train RECIPE backend=nemo_rl`: the pure translation, without NeMo-RL.

The overrides' values, the refusals by name, the keys table (every recipe key once, the docs'
table these dicts), `--print-overrides`, and the one-line refusal where NeMo-RL does not import.
That NeMo-RL's own config path accepts the overrides is tests/nemorl/test_nemo_rl_recipe.py's
(in .venv-nemorl).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from megatron_ba.integrations.engines.nemo_rl import (
    DISPLAY_ONLY,
    LOCAL_ONLY,
    TRANSLATED,
    markdown_table,
    recipe_to_nemo_rl_overrides,
    refuse_unsupported,
    translation_notes,
)
from megatron_ba.integrations.engines.table import schema_keys
from megatron_ba.integrations.hydra_values import hydra_value
from megatron_ba.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
# What a cluster user adds for NeMo-RL (docs/integrations.md)
USER = [
    "backend=nemo_rl",
    "eval.samples=1",
    "eval.benchmarks=math500,aime24,aime25,olympiad,minerva",
    "eval.data_dir=/data/bench",
]


def _recipe(*extra: str, name: str = "qwen3-1.7b-dapo17k"):
    return load_recipe(ROOT / f"recipes/{name}.yaml", [*USER, *extra])


def _as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_uneven_pipeline_stages_reach_nemo_rls_megatron_config():
    uneven = [
        "parallel.pp=3",
        "parallel.pp_first_stage_layers=8",
        "parallel.pp_last_stage_layers=10",
    ]
    o = _as_dict(recipe_to_nemo_rl_overrides(_recipe(*uneven), nodes=2, run_dir="/r"))
    mc = "policy.megatron_cfg"
    assert o[f"{mc}.pipeline_model_parallel_size"] == "3"
    assert o[f"{mc}.num_layers_in_first_pipeline_stage"] == "8"
    assert o[f"{mc}.num_layers_in_last_pipeline_stage"] == "10"
    even = _as_dict(recipe_to_nemo_rl_overrides(_recipe(), nodes=2, run_dir="/r"))
    assert even[f"{mc}.num_layers_in_first_pipeline_stage"] == "null"


def test_the_paper_recipe_translates_key_by_key():
    o = _as_dict(recipe_to_nemo_rl_overrides(_recipe(), nodes=2, run_dir="/r"))
    assert o["policy.model_name"] == "/models/Qwen3-1.7B"
    assert o["grpo.num_prompts_per_step"] == "128" and o["grpo.num_generations_per_prompt"] == "16"
    assert o["policy.train_global_batch_size"] == str(32 * 16)  # 4 optimizer steps per batch
    assert o["policy.train_micro_batch_size"] == "2"
    assert o["policy.max_total_sequence_length"] == str(1024 + 8192)
    assert o["policy.megatron_cfg.activation_checkpointing"] == "true"
    assert (o["loss_fn.ratio_clip_min"], o["loss_fn.ratio_clip_max"]) == ("0.2", "0.28")
    assert o["loss_fn.ratio_clip_c"] == "null" and o["loss_fn.reference_policy_kl_penalty"] == "0.0"
    assert (o["++loss_fn.ba_rule"], o["++loss_fn.ba_scope"]) == ("balanced", "group")
    assert "++loss_fn.ba_max_length" not in o  # dr_grpo's only
    assert o["policy.megatron_cfg.optimizer.lr"] == "1e-06"
    assert o["policy.megatron_cfg.scheduler.lr_warmup_iters"] == "10"
    assert (o["cluster.num_nodes"], o["cluster.gpus_per_node"]) == ("2", "8")
    assert o["checkpointing.checkpoint_dir"] == "/r/checkpoints"
    assert o["checkpointing.save_period"] == "25" and o["grpo.val_period"] == "25"
    assert o["data.train.dataset_name"] == "DAPOMath17K"
    assert o["data.validation"].startswith(
        "[{dataset_name:ResponseDataset,data_path:/data/bench/math500.jsonl,input_key:problem,"
        "output_key:answer,prompt_file:/r/data/nemo_rl_eval_prompt.txt},"
    )
    # only BalancedPGLossFn's keys are new to the stock config (`++`)
    assert [k for k in o if k.startswith("++")] == [
        "++loss_fn.ba_rule",
        "++loss_fn.ba_scope",
        "++loss_fn.ba_neutral_eps",
    ]


def test_dr_grpo_gets_its_length_and_the_std_note_its_factor():
    o = _as_dict(recipe_to_nemo_rl_overrides(_recipe("loss.rule=dr_grpo", "loss.scope=batch")))
    assert o["++loss_fn.ba_max_length"] == "8192"
    (note,) = translation_notes(_recipe())
    assert note.startswith("grpo.std: population") and "1.0328 times" in note
    assert translation_notes(_recipe("grpo.std=sample")) == []


# (overrides, the recipe key the error must start with)
REFUSED = {
    "polaris": (["data.dataset=polaris", "data.template=polaris"], "data.dataset"),
    "local_file": (["data.path=/data/dapo.parquet"], "data.path"),
    "arithmetic_task": (["data.task=arithmetic"], "data.task"),
    "builtin_engine": (["rollout.engine=builtin"], "rollout.engine"),
    "fp32": (["model.precision=fp32"], "model.precision"),
    "eval_samples": (["eval.samples=8"], "eval.samples"),
    "livecodebench": (["eval.benchmarks=aime24,livecodebench"], "eval.benchmarks"),
    "no_benchmark_files": (["eval.data_dir=null"], "eval.data_dir"),
    "entropy": (["loss.entropy_coef=0.01"], "loss.entropy_coef"),
    "dynamic_sampling": (["grpo.dynamic_sampling=true"], "grpo.dynamic_sampling"),
    "shape_key": (["model.hidden_size=2048"], "model.hidden_size"),
    "wandb_offline": (["logging.wandb.mode=offline", "logging.wandb.project=p"],
                      "logging.wandb.mode"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_key_nemo_rl_cannot_honour_is_refused_by_name(case):
    extra, key = REFUSED[case]
    with pytest.raises(ValueError) as err:
        refuse_unsupported(_recipe(*extra))
    assert str(err.value).startswith(f"{key}: "), str(err.value)


def test_the_paper_recipes_mini_batches_become_nemo_rls_optimizer_steps():
    """The paper's 4 optimizer steps per rollout batch of 128 prompts x 16: steps of 32 prompts
    (BalancedPGLossFn plans each, tests/nemorl/test_nemo_rl_train_loop.py)."""
    recipe = load_recipe(ROOT / "recipes/qwen3-1.7b-dapo17k.yaml", USER)
    assert recipe.grpo.mini_batches == 4
    o = _as_dict(recipe_to_nemo_rl_overrides(recipe, nodes=2, run_dir="/r"))
    assert o["policy.train_global_batch_size"] == str(32 * 16)
    assert o["grpo.num_prompts_per_step"] == "128"


def test_every_recipe_key_is_translated_or_refused_and_the_docs_table_is_the_dicts():
    keys = schema_keys()
    groups = [set(TRANSLATED), set(LOCAL_ONLY), set(DISPLAY_ONLY)]
    assert sum(len(g) for g in groups) == len(keys) and set().union(*groups) == set(keys)
    text = (ROOT / "docs/integrations.md").read_text()
    section = text[text.index("### From a recipe: `megatron-ba train RECIPE backend=nemo_rl`") :]
    assert markdown_table() in section


def test_hydra_value_formats_a_list_of_dicts():
    assert hydra_value([{"a": 1, "b": None}, {"c": True}]) == "[{a:1,b:null},{c:true}]"


def _run(argv: list[str]) -> int:
    from megatron_ba.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return train.run(parser.parse_args(argv))


def test_print_overrides_prints_them_and_the_command(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert _run(["recipes/qwen3-1.7b-dapo17k.yaml", *USER, "--print-overrides"]) == 0
    out = capsys.readouterr()
    assert "++loss_fn.ba_rule=balanced" in out.out.splitlines()
    assert "python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced --config " in out.err


def test_a_refused_key_stops_the_command_with_its_name(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = ["recipes/qwen3-1.7b-dapo17k.yaml", *USER, "eval.samples=8", "--print-overrides"]
    assert _run(argv) == 2
    assert capsys.readouterr().err.startswith("train: eval.samples: ")


def test_without_nemo_rl_the_command_is_printed_and_the_run_refused(monkeypatch, capsys, tmp_path):
    from megatron_ba.commands import train

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "nemo_rl" else real(name, *a)
    )
    monkeypatch.setattr(train.os, "execv", lambda *a: pytest.fail("exec'd without NeMo-RL"))
    monkeypatch.chdir(ROOT)
    assert _run(["recipes/qwen3-1.7b-dapo17k.yaml", *USER, "--run-dir", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out.startswith("python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced")
    (line,) = [x for x in out.err.splitlines() if "needs NeMo-RL" in x]
    assert line.startswith("train: backend nemo_rl needs NeMo-RL v0.7.0") and ".venv-nemorl" in line
