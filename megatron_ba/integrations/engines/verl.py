"""Our recipe as verl 0.9.1 Hydra overrides of `ppo_megatron_trainer`: the engines' table's verl
column, in verl's order.

    overrides = recipe_to_verl_overrides(recipe, nodes=1, gpus_per_node=8, run_dir="runs/x")
    environment = verl_environment(recipe)   # MEGATRON_BA_SCOPE / _NEUTRAL_EPS where needed
    verl_command("python", overrides, environment)  # python -m ...verl.main_ppo --config-name ...

`megatron-ba train RECIPE backend=verl --print-overrides` prints the overrides; without the flag
it prints the command and execs it (launch.py). What verl cannot honour is refused with the
recipe key named: a key the table marks Absent for verl at a value other than its default, and
the values its verl cells refuse (the arithmetic task, a hub id for data.path, the builtin
rollout engine, ...). This module imports neither verl nor torch.
"""

from __future__ import annotations

import shlex

from megatron_ba.integrations.engines import table
from megatron_ba.integrations.engines.cells import Job
from megatron_ba.integrations.engines.data_rows import REWARD_FUNCTION
from megatron_ba.integrations.engines.layout_rows import OVER
from megatron_ba.integrations.engines.loss_rows import NO_DUAL_CLIP, PLAN_RULES
from megatron_ba.integrations.engines.model_rows import A, M, R
from megatron_ba.integrations.engines.translation import OTHER_ABSENT_KEYS, Engine

ENTRY = ["-m", "megatron_ba.integrations.verl.main_ppo", "--config-name", "ppo_megatron_trainer"]
_CF = "reward.custom_reward_function"

VERL = Engine(
    "verl",
    print_order=(
        # the model and its layout
        "actor_rollout_ref.model.path",
        f"{M}.use_remove_padding",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
        f"{M}.tensor_model_parallel_size",
        f"{M}.pipeline_model_parallel_size",
        f"+{OVER}.num_layers_in_first_pipeline_stage",
        f"+{OVER}.num_layers_in_last_pipeline_stage",
        f"{M}.context_parallel_size",
        f"{M}.expert_model_parallel_size",
        f"{M}.expert_tensor_parallel_size",
        f"{M}.sequence_parallel",
        "actor_rollout_ref.ref.megatron.sequence_parallel",
        f"{M}.seed",
        "actor_rollout_ref.model.tokenizer_path",
        f"{OVER}.recompute_granularity",
        f"{OVER}.recompute_method",
        f"{OVER}.recompute_num_layers",
        f"{A}.use_dynamic_bsz",
        f"{A}.ppo_max_token_len_per_gpu",
        f"{A}.ppo_micro_batch_size_per_gpu",
        f"{R}.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        # the data and its reward
        "data.train_files",
        "data.val_files",
        "data.max_prompt_length",
        "data.filter_overlong_prompts",
        "data.max_response_length",
        "data.train_batch_size",
        "data.seed",
        "reward.num_workers",
        f"{_CF}.path",
        f"{_CF}.name",
        f"+{_CF}.reward_kwargs.timeout_s",
        "data.train_max_samples",
        # the rollout and validation sampling
        f"{R}.name",
        f"{R}.tensor_model_parallel_size",
        f"{R}.gpu_memory_utilization",
        f"{R}.free_cache_engine",
        f"{R}.dtype",
        f"{R}.n",
        f"{R}.temperature",
        f"{R}.seed",
        f"{R}.val_kwargs.n",
        f"{R}.val_kwargs.temperature",
        f"{R}.val_kwargs.do_sample",
        # the estimator and the loss
        "algorithm.adv_estimator",
        f"{A}.policy_loss.loss_mode",
        f"{A}.loss_agg_mode",
        "algorithm.norm_adv_by_std_in_grpo",
        f"{A}.ppo_mini_batch_size",
        f"{A}.ppo_epochs",
        f"{A}.clip_ratio_low",
        f"{A}.clip_ratio_high",
        f"{A}.clip_ratio_c",
        f"{A}.use_kl_loss",
        f"{A}.kl_loss_coef",
        f"{A}.kl_loss_type",
        "algorithm.use_kl_in_reward",
        f"{A}.entropy_coeff",
        # the optimizer and the trainer
        f"{A}.optim.lr",
        f"{A}.optim.weight_decay",
        f"{A}.optim.betas",
        f"{A}.optim.clip_grad",
        f"{A}.optim.lr_warmup_steps",
        "trainer.total_training_steps",
        "trainer.save_freq",
        "trainer.max_actor_ckpt_to_keep",
        "trainer.resume_mode",
        "trainer.test_freq",
        "trainer.val_before_train",
        "trainer.project_name",
        "trainer.experiment_name",
        "trainer.logger",
        "trainer.default_local_dir",
    ),
    check_order=(
        "loss.rollout_correction.mode",  # the local backend's: refused first
        "data.task",
        "data.path",
        "data.dataset",
        "data.template",
        "data.max_prompt_tokens",
        "model.pretrained",
        "rollout.engine",
        "model.precision",
        "model.transformer_impl",
        "loss.rule",
        "loss.scope",
        "loss.neutral_eps",
        "eval.benchmarks",
        "eval.data_dir",
        "eval.max_new_tokens",
        "logging.wandb.mode",
        OTHER_ABSENT_KEYS,
        "--nodes",
        "--devices",
    ),
)

TRANSLATED = table.translated("verl")
LOCAL_ONLY = table.local_only("verl")
DISPLAY_ONLY = table.not_passed_on("verl")
schema_keys = table.schema_keys
__all__ = ["NO_DUAL_CLIP", "PLAN_RULES", "REWARD_FUNCTION", "schema_keys"]


def _job(recipe, nodes: int = 1, gpus_per_node: int = 8, run_dir: str | None = None) -> Job:
    return Job(recipe, nodes=nodes, devices=gpus_per_node, run_dir=run_dir)


def refuse_unsupported(recipe) -> None:
    """ValueError naming the first recipe key verl cannot honour."""
    if (found := VERL.refusal(_job(recipe))) is not None:
        raise ValueError(found)


def recipe_to_verl_overrides(
    recipe, *, nodes: int = 1, gpus_per_node: int = 8, run_dir: str | None = None
) -> list[str]:
    """The `key=value` overrides of verl's ppo_megatron_trainer for `recipe` (ValueError naming
    the recipe key that verl cannot honour). run_dir: checkpoints go to RUN_DIR/checkpoints."""
    return VERL.overrides(_job(recipe, nodes, gpus_per_node, run_dir))


def verl_environment(recipe) -> dict[str, str]:
    """MEGATRON_BA_* settings the balanced estimator reads (verl/adapter.py), where the recipe's
    differ from the estimator's defaults (scope group, neutral_eps 0)."""
    return VERL.environment(_job(recipe))


def translation_notes(recipe) -> list[str]:
    """What the translation changes without refusing it (printed by `megatron-ba train`)."""
    return VERL.notes(_job(recipe))


def verl_command(python: str, overrides: list[str], environment: dict[str, str]) -> str:
    """The shell command that runs verl with `overrides` (the environment as a prefix)."""
    words = [f"{k}={v}" for k, v in environment.items()] + [python, *ENTRY, *overrides]
    return shlex.join(words)


def markdown_table() -> str:
    """docs/integrations.md's verl table: every recipe key and where it goes in verl, or why
    not."""
    return table.markdown_table("verl", "in verl")
