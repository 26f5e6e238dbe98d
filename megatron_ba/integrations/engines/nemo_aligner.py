"""Our recipe as NeMo-Aligner `++key=value` overrides of train_grpo: the engines' table's
NeMo-Aligner column, in the order of conf/gpt_grpo_balanced.yaml's sections.

    recipe_to_nemo_overrides(recipe, num_nodes=2, devices=8)
    # ['++trainer.num_nodes=2', '++trainer.devices=8', '++model.tensor_model_parallel_size=2', ...]

The keys are those of integrations/nemo_aligner/conf/gpt_grpo_balanced.yaml (NeMo-Aligner's
REINFORCE layout plus our `model.grpo` section). What does not carry over fails with the recipe
key named: context and expert parallelism, the entropy bonus, RoPE scaling (the .nemo file's own
config decides), a Hugging Face checkpoint (convert it to `.nemo` first, docs/nemo-aligner.md),
token-budget micro-batches and an explicit log-prob chunk, batches that do not split over the
data-parallel ranks. With accelerator="cpu" the run is fp32 with torch's AdamW (the settings of
apex's Adam removed: `~key`). `megatron-ba train RECIPE backend=nemo_aligner` writes the
recipe's prompts and runs train_grpo with these overrides (launch.py).
"""

from __future__ import annotations

from megatron_ba.integrations.engines import table
from megatron_ba.integrations.engines.cells import Job
from megatron_ba.integrations.engines.run_rows import APEX_ADAM_KEYS
from megatron_ba.integrations.engines.translation import Engine

ENTRY = ["-m", "megatron_ba.integrations.nemo_aligner.train_grpo"]
_RF, _TR, _G = "model.reinforce", "trainer.reinforce", "model.grpo"
__all__ = ["APEX_ADAM_KEYS"]

NEMO_ALIGNER = Engine(
    "nemo_aligner",
    print_order=(
        # the trainer and the model's layout
        "trainer.num_nodes",
        "trainer.devices",
        "trainer.accelerator",
        "model.tensor_model_parallel_size",
        "model.pipeline_model_parallel_size",
        "model.sequence_parallel",
        "model.activations_checkpoint_granularity",
        "model.activations_checkpoint_method",
        "model.activations_checkpoint_num_layers",
        "trainer.precision",
        "model.megatron_amp_O2",
        "pretrained_checkpoint.restore_from_path",
        "model.seed",
        # the REINFORCE loop's sizes
        f"{_TR}.max_steps",
        f"{_TR}.num_rollouts_per_prompt",
        f"{_RF}.num_rollout_samples",
        f"{_RF}.length_params.max_length",
        f"{_RF}.sampling_params.temperature",
        "model.micro_batch_size",
        f"{_RF}.forward_micro_batch_size",
        "model.global_batch_size",
        f"{_TR}.model_gbs",
        f"{_TR}.model_mbs",
        f"{_RF}.rollout_micro_batch_size",
        f"{_RF}.num_val_samples",
        f"{_RF}.val_rollout_micro_batch_size",
        f"{_TR}.val_check_interval",
        f"{_TR}.save_interval",
        # the optimizer and model.grpo (integrations/nemo_aligner/config.py's GRPOSettings)
        "model.optim.lr",
        "model.optim.weight_decay",
        "model.optim.betas",
        "model.optim.eps",
        f"{_TR}.gradient_clip_val",
        f"{_G}.rule",
        f"{_G}.scope",
        f"{_G}.reg_rule",
        f"{_G}.reg_scope",
        f"{_G}.neutral_eps",
        f"{_G}.clip_low",
        f"{_G}.clip_high",
        f"{_G}.dual_clip",
        f"{_G}.kl_coef",
        f"{_G}.max_length",
        f"{_G}.normalize_std",
        f"{_G}.std",
        f"{_G}.drop_zero_variance",
        # the run folder, then what a CPU run changes
        "model.data.data_prefix.train",
        "model.data.data_prefix.validation",
        "exp_manager.explicit_log_dir",
        "model.optim.name",
        f"{_RF}.offload_adam_states",
        *(f"model.optim.{k}" for k in APEX_ADAM_KEYS),
    ),
    check_order=(
        "loss.rollout_correction.mode",  # the local backend's: refused first
        "rollout.routing_replay",  # the local backend's: refused first
        "rollout.max_staleness",  # the local backend's: refused first
        "rollout.sync_every",
        "rollout.engine_cores",
        "parallel.cp",
        "parallel.pp_first_stage_layers",
        "parallel.pp_last_stage_layers",
        "loss.entropy_coef",
        "parallel.ep",
        "parallel.etp",
        "parallel.max_tokens_per_microbatch",
        "parallel.logprob_chunk_size",
        "--accelerator",
        "--nodes",
        "--devices",
        "grpo.prompts_per_step",
        "parallel.micro_batch_size",
        "data.eval_prompts",
        "model.pretrained",
        "model.rope_scaling.type",
        "model.rope_scaling.factor",
        "model.rope_scaling.original_max_position_embeddings",
        "checkpoint.every",
        "model.precision",
    ),
    prefix="++",
)

TRANSLATED = table.translated("nemo_aligner")
LOCAL_ONLY = table.local_only("nemo_aligner")
NOT_PASSED_ON = table.not_passed_on("nemo_aligner")


def recipe_to_nemo_overrides(
    recipe,
    *,
    num_nodes: int = 1,
    devices: int | None = None,
    hf_checkpoint: str = "refuse",
    accelerator: str = "gpu",
    prompt_files: tuple[str, str] | None = None,
    log_dir: str | None = None,
) -> list[str]:
    """The overrides of `python -m megatron_ba.integrations.nemo_aligner.train_grpo` for `recipe`.

    devices: GPUs per node (default TP x PP: one data-parallel replica per node), or processes
    per node with accelerator="cpu" (gloo; fp32, torch's AdamW: apex's needs a GPU).
    hf_checkpoint: what a Hugging Face `model.pretrained` becomes: "refuse" (a ValueError naming
    the key: NeMo-Aligner restores .nemo files) or "placeholder" (`???`, Hydra's mandatory value,
    for printing a translation that the user completes with the converted .nemo file).
    prompt_files: the train and validation JSONL files (train/prompt_files.py writes the
    recipe's); log_dir: NeMo's log folder (logs, checkpoints, metrics.jsonl; resumes from there).
    """
    p = recipe.parallel
    job = Job(
        recipe,
        nodes=num_nodes,
        devices=p.tp * p.pp if devices is None else devices,
        run_dir=log_dir,
        accelerator=accelerator,
        prompt_files=prompt_files,
        hf_checkpoint=hf_checkpoint,
    )
    return NEMO_ALIGNER.overrides(job)


def markdown_table() -> str:
    """docs/nemo-aligner.md's table: every recipe key and where it goes in NeMo-Aligner, or why
    not."""
    return table.markdown_table("nemo_aligner", "in NeMo-Aligner")
