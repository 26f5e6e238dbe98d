"""Our recipe as NeMo-RL v0.7.0 GRPO overrides, BalancedPGLossFn's loss: the engines' table's
NeMo-RL column, in NeMo-RL's order.

    overrides = recipe_to_nemo_rl_overrides(recipe, nodes=1, gpus_per_node=8, run_dir="/abs/x")
    nemo_rl_command("python", stock_config_path(), overrides)
    # python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced \\
    #     --config NEMO_RL/examples/configs/grpo_math_1B_megatron.yaml OVERRIDES

`megatron-ba train RECIPE backend=nemo_rl --print-overrides` prints the overrides; without the flag
it prints the command and execs it (launch.py). The overrides apply to NeMo-RL's stock
examples/configs/grpo_math_1B_megatron.yaml (its megatron-core policy) the way
examples/run_grpo.py applies them (Hydra syntax, struct mode: a key the stock config lacks needs
`++`, which only BalancedPGLossFn's `loss_fn.ba_*` keys use). What NeMo-RL cannot honour is
refused with the recipe key named (the arithmetic task, the Polaris data set, several optimizer
steps per rollout batch, ...). This module imports neither NeMo-RL nor torch.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path

from megatron_ba.integrations.engines import table
from megatron_ba.integrations.engines.cells import Job
from megatron_ba.integrations.engines.data_rows import DAPO_HUB_ID
from megatron_ba.integrations.engines.eval_rows import (
    ALL_VAL_SAMPLES,
    EVAL_PROMPT_FILE,
    eval_prompt_path,
)
from megatron_ba.integrations.engines.layout_rows import VLLM
from megatron_ba.integrations.engines.model_rows import GEN, MC
from megatron_ba.integrations.engines.run_rows import OPT, SCHED
from megatron_ba.integrations.engines.translation import OTHER_ABSENT_KEYS, Engine

ENTRY = ["-m", "megatron_ba.integrations.nemo_rl.run_grpo_balanced"]
STOCK_CONFIG = "examples/configs/grpo_math_1B_megatron.yaml"  # in a NeMo-RL checkout
__all__ = ["ALL_VAL_SAMPLES", "DAPO_HUB_ID", "EVAL_PROMPT_FILE", "eval_prompt_path"]

NEMO_RL = Engine(
    "nemo_rl",
    print_order=(
        # the policy and its layout
        "policy.model_name",
        "policy.precision",
        "cluster.num_nodes",
        "cluster.gpus_per_node",
        f"{MC}.tensor_model_parallel_size",
        f"{MC}.pipeline_model_parallel_size",
        f"{MC}.num_layers_in_first_pipeline_stage",
        f"{MC}.num_layers_in_last_pipeline_stage",
        f"{MC}.context_parallel_size",
        f"{MC}.expert_model_parallel_size",
        f"{MC}.expert_tensor_parallel_size",
        f"{MC}.sequence_parallel",
        f"{MC}.activation_checkpointing",
        "policy.train_global_batch_size",
        "policy.train_micro_batch_size",
        "policy.max_grad_norm",
        f"{MC}.recompute_granularity",
        "policy.tokenizer.name",
        "policy.sequence_packing.train_mb_tokens",
        "policy.sequence_packing.logprob_mb_tokens",
        # the data and the math environment
        "data.train.dataset_name",
        "data.train.split_validation_size",
        "data.validation",
        "data.default.prompt_file",
        "data.max_input_seq_length",
        "policy.max_total_sequence_length",
        "env.math.num_workers",
        "env.math.math_verify_impl",
        # GRPO and the generation
        "grpo.seed",
        "grpo.num_prompts_per_step",
        "grpo.num_generations_per_prompt",
        "grpo.max_num_steps",
        "grpo.max_num_epochs",
        "grpo.normalize_rewards",
        "grpo.use_leave_one_out_baseline",
        "grpo.val_period",
        "grpo.val_at_start",
        "grpo.val_at_end",
        "grpo.max_val_samples",
        f"{GEN}.backend",
        f"{GEN}.max_new_tokens",
        f"{GEN}.temperature",
        f"{GEN}.colocated.enabled",
        f"{VLLM}.tensor_parallel_size",
        f"{VLLM}.gpu_memory_utilization",
        # asynchronous GRPO (rollout.max_staleness > 0)
        "grpo.async_grpo.enabled",
        "grpo.async_grpo.max_trajectory_age_steps",
        f"{VLLM}.async_engine",
        "loss_fn.use_importance_sampling_correction",
        # BalancedPGLossFn
        "++loss_fn.ba_rule",
        "++loss_fn.ba_scope",
        "++loss_fn.ba_neutral_eps",
        "loss_fn.ratio_clip_min",
        "loss_fn.ratio_clip_max",
        "loss_fn.ratio_clip_c",
        "loss_fn.reference_policy_kl_penalty",
        "++loss_fn.ba_max_length",
        # the optimizer, checkpoints and logs
        f"{OPT}.lr",
        f"{OPT}.min_lr",
        f"{OPT}.weight_decay",
        f"{OPT}.adam_beta1",
        f"{OPT}.adam_beta2",
        f"{OPT}.adam_eps",
        f"{SCHED}.lr_warmup_iters",
        f"{SCHED}.lr_warmup_init",
        f"{SCHED}.lr_decay_style",
        f"{SCHED}.lr_decay_iters",
        "checkpointing.enabled",
        "checkpointing.save_period",
        "checkpointing.keep_top_k",
        "checkpointing.metric_name",
        "logger.tensorboard_enabled",
        "logger.wandb_enabled",
        "logger.wandb.project",
        "logger.wandb.name",
        "checkpointing.checkpoint_dir",
        "logger.log_dir",
    ),
    check_order=(
        "loss.rollout_correction.mode",  # the local backend's: refused first
        "data.task",
        "data.dataset",
        "data.path",
        "data.template",
        "data.max_prompt_tokens",
        "model.pretrained",
        "model.precision",
        "model.transformer_impl",
        "rollout.engine",
        "rollout.sleep",
        "rollout.dtype",
        "eval.benchmarks",
        "eval.data_dir",
        "eval.samples",
        "eval.temperature",
        "eval.max_new_tokens",
        "eval.template",
        "logging.wandb.mode",
        OTHER_ABSENT_KEYS,
        "--nodes",
        "--devices",
    ),
)

TRANSLATED = table.translated("nemo_rl")
LOCAL_ONLY = table.local_only("nemo_rl")
DISPLAY_ONLY = table.not_passed_on("nemo_rl")


def _job(recipe, nodes: int = 1, gpus_per_node: int = 8, run_dir: str | None = None) -> Job:
    return Job(recipe, nodes=nodes, devices=gpus_per_node, run_dir=run_dir)


def refuse_unsupported(recipe) -> None:
    """ValueError naming the first recipe key NeMo-RL cannot honour."""
    if (found := NEMO_RL.refusal(_job(recipe))) is not None:
        raise ValueError(found)


def recipe_to_nemo_rl_overrides(
    recipe, *, nodes: int = 1, gpus_per_node: int = 8, run_dir: str | None = None
) -> list[str]:
    """The overrides of NeMo-RL's stock grpo_math_1B_megatron.yaml for `recipe` (ValueError
    naming the recipe key NeMo-RL cannot honour). run_dir: checkpoints and logs go there."""
    return NEMO_RL.overrides(_job(recipe, nodes, gpus_per_node, run_dir))


def translation_notes(recipe) -> list[str]:
    """What the translation changes without refusing it (printed by `megatron-ba train`)."""
    return NEMO_RL.notes(_job(recipe))


def stock_config_path() -> str:
    """NeMo-RL's stock megatron GRPO config: under NEMO_RL_ROOT, else next to the installed
    `nemo_rl` package (found without importing it), else relative to a NeMo-RL checkout."""
    root = os.environ.get("NEMO_RL_ROOT")
    if root is None:
        spec = importlib.util.find_spec("nemo_rl")
        if spec is None or spec.origin is None:
            return STOCK_CONFIG
        root = str(Path(spec.origin).resolve().parents[1])
    return str(Path(root) / STOCK_CONFIG)


def nemo_rl_command(python: str, config: str, overrides: list[str]) -> str:
    """The shell command that runs NeMo-RL's GRPO with BalancedPGLossFn and `overrides`."""
    return shlex.join([python, *ENTRY, "--config", config, *overrides])


def markdown_table() -> str:
    """docs/integrations.md's NeMo-RL table: every recipe key and where it goes in NeMo-RL, or
    why not."""
    return table.markdown_table("nemo_rl", "in NeMo-RL")
