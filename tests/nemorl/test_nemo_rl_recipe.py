"""`megatron-ba train RECIPE backend=nemo_rl`: the paper recipes as NeMo-RL v0.7.0 GRPO overrides,
checked by NeMo-RL's own config path.

Each translated recipe's overrides go onto NeMo-RL's stock
examples/configs/grpo_math_1B_megatron.yaml through `run_grpo_balanced.load_master_config`
(NeMo-RL's load_config, parse_hydra_overrides in struct mode, its resolvers, then its pydantic
`MasterConfig`: what examples/run_grpo.py builds); the validated values must be the recipe's, and
run_grpo_balanced's own checks (check_master_config, BalancedPGLossFn from
`master_config.loss_fn`) must accept them. Controls: a misspelt key is rejected by NeMo-RL's
Hydra, a wrong type by its MasterConfig.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

from conftest import nemo_rl_root
from nemo_rl.utils.config import OverridesError, load_config, register_omegaconf_resolvers
from omegaconf import OmegaConf
from pydantic import ValidationError

from megatron_ba.data.templates import render_prompt
from megatron_ba.integrations.engines.nemo_rl import (
    ENTRY,
    STOCK_CONFIG,
    TRANSLATED,
    recipe_to_nemo_rl_overrides,
    stock_config_path,
)
from megatron_ba.integrations.engines.table import schema_keys
from megatron_ba.integrations.nemo_rl import BalancedPGLossFn, run_grpo_balanced
from megatron_ba.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
# the paper's DAPO-Math-17k recipes and the nodes of 8 GPUs each is meant for (its header)
NODES = {
    "qwen2.5-math-7b-dapo17k": 1,
    "qwen3-1.7b-dapo17k": 1,
    "qwen2.5-32b-dapo17k-16k": 4,
    "qwen2.5-32b-dapo17k-32k": 8,
    "qwen3-30b-a3b-dapo17k-16k": 4,  # mixture of experts at EP 8
}
POLARIS = ["qwen2.5-math-7b-polaris", "qwen3-1.7b-polaris"]
# What a cluster user adds for NeMo-RL (docs/integrations.md): one validation sample per prompt,
# local benchmark files without livecodebench
USER = [
    "backend=nemo_rl",
    "eval.samples=1",
    "eval.benchmarks=math500,aime24,aime25,olympiad,minerva",
    "eval.data_dir=/data/bench",
]


def _master(overrides: list[str]):
    """NeMo-RL's MasterConfig from the stock megatron yaml and `overrides`, built as
    run_grpo.py builds it (run_grpo_balanced.load_master_config)."""
    run_grpo = str(Path(nemo_rl_root()) / "examples" / "run_grpo.py")
    return run_grpo_balanced.load_master_config(
        ["--config", stock_config_path(), *overrides], run_grpo
    )


def _recipe(name: str, *extra: str):
    return load_recipe(ROOT / f"recipes/{name}.yaml", [*USER, *extra])


def test_the_stock_config_is_nemo_rls_megatron_one():
    path = Path(stock_config_path())
    assert path == Path(nemo_rl_root()) / STOCK_CONFIG and path.is_file()
    assert load_config(path).policy.megatron_cfg.enabled is True


@pytest.mark.parametrize("name", sorted(NODES))
def test_paper_recipe_validates_into_nemo_rls_master_config(name, tmp_path):
    recipe = _recipe(name)
    overrides = recipe_to_nemo_rl_overrides(recipe, nodes=NODES[name], run_dir=str(tmp_path))
    master = _master(overrides)
    assert type(master).__name__ == "MasterConfig"
    p, g, mc = recipe.parallel, recipe.grpo, master.policy["megatron_cfg"]
    assert master.policy["model_name"] == recipe.model.pretrained
    assert (mc["enabled"], master.policy["dtensor_cfg"]["enabled"]) == (True, False)
    assert (mc["tensor_model_parallel_size"], mc["pipeline_model_parallel_size"]) == (p.tp, p.pp)
    assert (mc["context_parallel_size"], mc["sequence_parallel"]) == (p.cp, p.sequence_parallel)
    etp = p.tp if p.etp is None else p.etp  # megatron-core's default, not NeMo-RL's yaml's 1
    assert (mc["expert_model_parallel_size"], mc["expert_tensor_parallel_size"]) == (p.ep, etp)
    assert (mc["activation_checkpointing"], mc["recompute_granularity"]) == (True, "full")
    assert master.grpo["num_prompts_per_step"] == g.prompts_per_step == 128
    assert master.grpo["num_generations_per_prompt"] == g.group_size == 16
    assert g.mini_batches == 4  # the paper's 4 optimizer steps of 32 prompts per batch
    assert master.policy["train_global_batch_size"] == 32 * 16
    assert master.policy["train_micro_batch_size"] == p.micro_batch_size
    assert master.policy["logprob_batch_size"] == p.micro_batch_size  # the stock interpolation
    total = recipe.data.max_prompt_tokens + g.max_new_tokens
    assert master.policy["max_total_sequence_length"] == total
    gen = master.policy["generation"]
    assert (gen["backend"], gen["max_new_tokens"], gen["temperature"]) == (
        "vllm",
        g.max_new_tokens,
        1.0,
    )
    assert gen["vllm_cfg"]["max_model_len"] == total
    assert gen["vllm_cfg"]["gpu_memory_utilization"] == recipe.rollout.gpu_memory_utilization
    loss = master.loss_fn
    assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.ratio_clip_c) == (0.2, 0.28, None)
    assert loss.reference_policy_kl_penalty == 0.0
    assert loss.model_extra["ba_rule"] == "balanced" and loss.model_extra["ba_scope"] == "group"
    opt, sched = mc["optimizer"], mc["scheduler"]
    assert (opt["lr"], opt["min_lr"], opt["weight_decay"]) == (1e-6, 1e-6, 0.1)
    assert (opt["adam_beta1"], opt["adam_beta2"]) == (0.9, 0.99)
    assert (sched["lr_warmup_iters"], sched["lr_decay_style"]) == (10, "constant")
    assert master.grpo["max_num_steps"] == 500 and master.grpo["val_period"] == 25
    ck = master.checkpointing
    assert (ck["enabled"], ck["save_period"], ck["keep_top_k"]) == (True, 25, 2)
    assert ck["checkpoint_dir"] == f"{tmp_path}/checkpoints"
    assert master.logger["log_dir"] == f"{tmp_path}/logs"
    assert (master.cluster["num_nodes"], master.cluster["gpus_per_node"]) == (NODES[name], 8)
    assert master.data["train"]["dataset_name"] == "DAPOMath17K"
    validation = master.data["validation"]
    assert validation[0]["data_path"] == "/data/bench/math500.jsonl"
    assert len(validation) == 5 and master.env["math"]["math_verify_impl"] == "dapo_math_verify"
    # run_grpo_balanced's own checks, as its entry point runs them before NeMo-RL starts
    sizes = run_grpo_balanced.check_master_config(master)
    assert sizes == {"group_size": 16, "step_size": master.policy["train_global_batch_size"]}
    fn = BalancedPGLossFn(master.loss_fn, **sizes)
    assert (fn.aggregation.rule, fn.aggregation.scope) == ("balanced", "group")


@pytest.mark.parametrize("rule", ["token", "sequence", "group_token_mean", "dr_grpo"])
def test_each_rule_reaches_balanced_pg_loss_fn(rule):
    extra = [f"loss.rule={rule}", "loss.kl_coef=0.01", "loss.dual_clip=3.0", "loss.scope=batch"]
    master = _master(recipe_to_nemo_rl_overrides(_recipe("qwen3-1.7b-dapo17k", *extra)))
    fn = BalancedPGLossFn(master.loss_fn, **run_grpo_balanced.check_master_config(master))
    assert (fn.aggregation.rule, fn.aggregation.scope) == (rule, "batch")
    assert fn.reference_policy_kl_penalty == 0.01 and master.loss_fn.ratio_clip_c == 3.0
    if rule == "dr_grpo":
        assert fn.aggregation.max_length == 8192  # grpo.max_new_tokens


def test_rollout_max_staleness_becomes_nemo_rls_async_grpo():
    """rollout.max_staleness K > 0 composes through NeMo-RL's Hydra and MasterConfig into
    async_grpo_train's settings, which the entry's checks accept; 0 leaves grpo_train."""
    master = _master(
        recipe_to_nemo_rl_overrides(_recipe("qwen3-1.7b-dapo17k", "rollout.max_staleness=2"))
    )
    assert master.grpo["async_grpo"]["enabled"] is True
    assert master.grpo["async_grpo"]["max_trajectory_age_steps"] == 2
    assert master.policy["generation"]["vllm_cfg"]["async_engine"] is True
    assert master.loss_fn.use_importance_sampling_correction is True  # async_grpo_train's assert
    sizes = run_grpo_balanced.check_master_config(master)
    assert sizes["group_size"] == 16
    sync = _master(recipe_to_nemo_rl_overrides(_recipe("qwen3-1.7b-dapo17k")))
    assert sync.grpo["async_grpo"]["enabled"] is False  # the stock config's, untouched
    with pytest.raises(ValueError, match=r"^rollout\.sync_every: not available on the nemo_rl"):
        recipe_to_nemo_rl_overrides(
            _recipe("qwen3-1.7b-dapo17k", "rollout.max_staleness=2", "rollout.sync_every=2")
        )


@pytest.mark.parametrize("name", POLARIS)
def test_polaris_recipes_are_refused_naming_the_data_set(name):
    with pytest.raises(ValueError, match=r"^data\.dataset: .*'polaris'"):
        recipe_to_nemo_rl_overrides(load_recipe(ROOT / f"recipes/{name}.yaml", USER))


def test_every_nemo_rl_path_the_table_names_exists_in_the_stock_config():
    register_omegaconf_resolvers()
    cfg = load_config(stock_config_path())
    heads = r"(?:policy|grpo|loss_fn|data|env|checkpointing|logger|cluster)"
    paths = set()
    for where in TRANSLATED.values():
        paths |= {p for p in re.findall(rf"\b{heads}\.[\w.]*\w", where) if ".ba_" not in p}
    paths -= set(schema_keys())  # the recipe's own keys the table mentions (grpo.steps, ...)
    assert len(paths) > 40
    missing = [p for p in sorted(paths) if OmegaConf.select(cfg, p, default=KeyError) is KeyError]
    assert not missing, missing


def test_a_misspelt_key_is_rejected_by_nemo_rls_hydra():
    """Negative control: the struct-mode override path can fail."""
    good = recipe_to_nemo_rl_overrides(_recipe("qwen3-1.7b-dapo17k"))
    bad = [o.replace("ratio_clip_max", "ratio_clip_mxa") for o in good]
    with pytest.raises(OverridesError, match="ratio_clip_mxa"):
        _master(bad)


def test_a_wrong_type_is_rejected_by_nemo_rls_master_config():
    """Negative control: the MasterConfig validation can fail."""
    good = recipe_to_nemo_rl_overrides(_recipe("qwen3-1.7b-dapo17k"))
    bad = [
        "grpo.num_prompts_per_step=many" if o.startswith("grpo.num_prompts_per_step=") else o
        for o in good
    ]
    with pytest.raises(ValidationError, match="num_prompts_per_step"):
        _master(bad)


def test_the_command_is_execd_with_the_stock_config_and_the_prompt_file(
    monkeypatch, capsys, tmp_path
):
    """`megatron-ba train RECIPE backend=nemo_rl` (NeMo-RL imports here): the command on stdout,
    the validation prompt template written, then exec of run_grpo_balanced; that entry point's
    own `--check` accepts the exec'd arguments."""
    from megatron_ba.commands import train

    calls = []
    monkeypatch.setattr(train.os, "execv", lambda *a: calls.append(a))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["recipes/qwen3-1.7b-dapo17k.yaml", *USER, "--run-dir", str(tmp_path)])
    monkeypatch.chdir(ROOT)
    train.run(args)
    printed = capsys.readouterr().out.strip()
    (path, argv) = calls[0]
    assert path == sys.executable and argv[1:3] == ENTRY
    assert argv[3:5] == ["--config", stock_config_path()]
    assert printed.startswith("python " + " ".join(ENTRY)) and printed.endswith(argv[-1])
    prompt = (tmp_path / "data" / "nemo_rl_eval_prompt.txt").read_text()
    assert prompt.format("What is 1+1?") == render_prompt("What is 1+1?", "dapo")
    # `--resume RUN_DIR` reads the recipe written there and execs the same command
    train.run(parser.parse_args(["recipes/qwen3-1.7b-dapo17k.yaml", "--resume", str(tmp_path)]))
    assert calls[1] == calls[0]
    monkeypatch.setattr(sys, "argv", [argv[0], *argv[3:], "--check"])
    run_grpo_balanced.main()
    assert "[megatron-ba] checked: BalancedPGLossFn rule=balanced scope=group" in (
        capsys.readouterr().out
    )


def test_a_benchmark_file_loads_through_nemo_rls_response_dataset(monkeypatch, tmp_path):
    """The exec'd data.validation entries, filled from data.default as setup_response_data fills
    them, load a local DIR/NAME.jsonl through NeMo-RL's load_response_dataset: the problem goes
    into the written template, the answer is the math environment's ground truth."""
    from nemo_rl.data.datasets.response_datasets import load_response_dataset
    from nemo_rl.data.datasets.utils import update_single_dataset_config

    from megatron_ba.commands import train

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "aime24.jsonl").write_text('{"problem": "Find x if 2x = {4}.", "answer": "2"}\n')
    calls = []
    monkeypatch.setattr(train.os, "execv", lambda *a: calls.append(a))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    extra = ["eval.benchmarks=aime24", f"eval.data_dir={bench}", "--run-dir", str(tmp_path)]
    monkeypatch.chdir(ROOT)
    train.run(parser.parse_args(["recipes/qwen3-1.7b-dapo17k.yaml", *USER, *extra]))
    ((_, argv),) = calls
    master = _master(argv[5:])
    (cfg,) = master.data["validation"]
    update_single_dataset_config(cfg, master.data["default"])
    data = load_response_dataset(cfg)
    (row,) = list(data.dataset)
    user, assistant = row["messages"]
    assert data.task_spec.prompt.format(user["content"]) == render_prompt(
        "Find x if 2x = {4}.", "dapo"
    )
    assert assistant["content"] == "2" and cfg["env_name"] == "math"
