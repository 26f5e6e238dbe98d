"""Our recipe (megatron_ba.recipe.Recipe) as NeMo-Aligner `++key=value` overrides of train_grpo.

    recipe_to_nemo_overrides(recipe, num_nodes=2, devices=8)
    # ['++trainer.num_nodes=2', '++trainer.devices=8', '++model.tensor_model_parallel_size=2', ...]

The keys are those of conf/gpt_grpo_balanced.yaml (NeMo-Aligner's REINFORCE layout plus our
`model.grpo` section). What does not carry over fails with the recipe key named: context
parallelism (NeMo-Aligner's actor does not shard sequences), the entropy bonus (not wired in the
actor), a Hugging Face checkpoint (convert it to `.nemo` first, docs/nemo-aligner.md), token-budget
micro-batches and an explicit log-prob chunk (`parallel.max_tokens_per_microbatch`,
`parallel.logprob_chunk_size`: the local backend's). Precision, sequence parallelism and
recomputation map to NeMo's `trainer.precision`, `model.sequence_parallel` and
`model.activations_checkpoint_*`. With accelerator="cpu" the run is fp32 with torch's AdamW (the
settings of apex's Adam removed: `~key`). `megatron-ba train RECIPE backend=nemo_aligner` writes
the recipe's prompts (train/prompt_files.py) and runs train_grpo with these overrides.
"""

from __future__ import annotations

from megatron_ba.integrations.hydra_values import hydra_value


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
    _refuse_local_only_keys(recipe)
    if accelerator not in ("gpu", "cpu"):
        raise ValueError(f"accelerator: must be gpu or cpu, got {accelerator!r}")
    devices = recipe.parallel.tp * recipe.parallel.pp if devices is None else devices
    step_sequences, dp = _sequences_per_optimizer_step(recipe, num_nodes, devices)
    restore = _restore_path(recipe.model.pretrained, hf_checkpoint)
    if recipe.model.rope_scaling.type is not None:
        raise ValueError(
            "model.rope_scaling: the nemo_aligner backend restores a .nemo whose own config "
            "decides the position embedding (this translation writes no RoPE scaling); leave it out"
        )
    pairs = [
        ("trainer.num_nodes", num_nodes),
        ("trainer.devices", devices),
        ("trainer.accelerator", accelerator),
        *_model_pairs(recipe, restore, step_sequences),
        *_rollout_pairs(recipe, dp),
        *_interval_pairs(recipe),
        *_optimizer_pairs(recipe),
        *_grpo_pairs(recipe),
    ]
    if prompt_files is not None:
        pairs += [
            ("model.data.data_prefix.train", prompt_files[0]),
            ("model.data.data_prefix.validation", prompt_files[1]),
        ]
    if log_dir is not None:
        pairs.append(("exp_manager.explicit_log_dir", log_dir))
    removed = []
    if accelerator == "cpu":
        pairs += _cpu_pairs(recipe)
        # apex's distributed Adam's settings, which torch's AdamW (NeMo's `adamw`) refuses
        removed = [f"~model.optim.{k}" for k in APEX_ADAM_KEYS]
    return [f"++{k}={hydra_value(v)}" for k, v in pairs] + removed


# The keys of the config's model.optim that only apex's distributed_fused_adam takes.
APEX_ADAM_KEYS = ("bucket_cap_mb", "overlap_grad_sync", "contiguous_grad_buffer")


def _refuse_local_only_keys(recipe) -> None:
    """ValueError for the recipe settings NeMo-Aligner's actor has no counterpart for."""
    p, loss = recipe.parallel, recipe.loss
    if p.cp != 1:
        raise ValueError(
            f"parallel.cp: NeMo-Aligner's actor has no context parallelism, got cp={p.cp}"
        )
    if loss.entropy_coef != 0:
        raise ValueError(
            "loss.entropy_coef: the NeMo-Aligner GRPO actor has no entropy bonus (use 0)"
        )
    if p.ep != 1 or p.etp is not None:
        key, value = ("parallel.ep", p.ep) if p.ep != 1 else ("parallel.etp", p.etp)
        raise ValueError(
            f"{key}: expert parallelism is the local backend's (not translated to NeMo-Aligner), "
            f"got {value}"
        )
    for key, value in (
        ("max_tokens_per_microbatch", p.max_tokens_per_microbatch),
        ("logprob_chunk_size", p.logprob_chunk_size),
    ):
        if value is not None:  # NeMo-Aligner's actor micro-batches by sequences, its own log-probs
            raise ValueError(
                f"parallel.{key}: not available on the nemo_aligner backend, got {value}; "
                "use null (the local backend has it)"
            )


def _sequences_per_optimizer_step(recipe, num_nodes: int, devices: int) -> tuple[int, int]:
    """Sequences per optimizer step over all DP ranks and the DP size, once they split evenly
    (else ValueError: prompts over DP ranks, each rank's sequences into micro-batches)."""
    p, g = recipe.parallel, recipe.grpo
    if not (isinstance(num_nodes, int) and num_nodes >= 1):
        raise ValueError(f"num_nodes: must be an integer >= 1, got {num_nodes!r}")
    world = num_nodes * devices
    if world % (p.tp * p.pp):
        raise ValueError(
            f"devices: num_nodes x devices = {world} is not a multiple of TP x PP = {p.tp * p.pp}"
        )
    dp = world // (p.tp * p.pp)
    if g.prompts_per_step % dp:
        raise ValueError(
            f"grpo.prompts_per_step: {g.prompts_per_step} prompts do not split over {dp} "
            "data-parallel ranks (each rank generates and trains on its own prompts)"
        )
    step_sequences = g.prompts_per_step * g.group_size // g.mini_batches
    if step_sequences % (dp * p.micro_batch_size):
        raise ValueError(
            f"parallel.micro_batch_size: {step_sequences} sequences per optimizer step do not "
            f"split into micro-batches of {p.micro_batch_size} on {dp} DP ranks"
        )
    if recipe.data.eval_prompts % dp:
        raise ValueError(
            f"data.eval_prompts: {recipe.data.eval_prompts} held-out prompts do not split over "
            f"{dp} data-parallel ranks (each rank validates on its own part)"
        )
    return step_sequences, dp


def _restore_path(pretrained: str | None, hf_checkpoint: str) -> str:
    """The .nemo file NeMo-Aligner restores, or `???` (OmegaConf's "mandatory, missing":
    train_grpo fails until it is given)."""
    if pretrained is None:
        return "???"
    if not str(pretrained).endswith(".nemo") and hf_checkpoint == "placeholder":
        return "???"
    if not str(pretrained).endswith(".nemo"):
        raise ValueError(
            f"model.pretrained: NeMo-Aligner restores a .nemo checkpoint, got {pretrained!r}; "
            "convert a Hugging Face model with NeMo's converter first (docs/nemo-aligner.md)"
        )
    return pretrained


def _model_pairs(recipe, restore: str, step_sequences: int) -> list[tuple[str, object]]:
    p, g = recipe.parallel, recipe.grpo
    # NeMo's megatron GPT config: activations_checkpoint_* (selective: core attention; full:
    # uniform over blocks of one layer, as the local backend's parallel.recompute=full).
    full = p.recompute == "full"
    recompute = None if p.recompute == "none" else p.recompute
    return [
        ("model.tensor_model_parallel_size", p.tp),
        ("model.pipeline_model_parallel_size", p.pp),
        ("model.sequence_parallel", p.sequence_parallel),
        ("model.activations_checkpoint_granularity", recompute),
        ("model.activations_checkpoint_method", "uniform" if full else None),
        ("model.activations_checkpoint_num_layers", 1 if full else None),
        ("trainer.precision", "bf16" if recipe.model.precision == "bf16" else 32),
        # O2 keeps fp32 master weights for bf16 training; fp32 weights need none
        ("model.megatron_amp_O2", recipe.model.precision == "bf16"),
        ("pretrained_checkpoint.restore_from_path", restore),
        # NeMo refuses seed 0 ("should be a positive integer"; the shipped recipes use 0): the
        # recipe's seed s is NeMo's s + 1 (the backends' random streams differ anyway)
        ("model.seed", recipe.seed + 1),
        ("trainer.reinforce.max_steps", g.steps),
        ("trainer.reinforce.num_rollouts_per_prompt", g.group_size),
        ("model.reinforce.num_rollout_samples", g.prompts_per_step),
        ("model.reinforce.length_params.max_length", g.max_new_tokens),
        ("model.reinforce.sampling_params.temperature", g.temperature),
        ("model.micro_batch_size", p.micro_batch_size),
        ("model.reinforce.forward_micro_batch_size", p.micro_batch_size),
        ("model.global_batch_size", step_sequences),
        ("trainer.reinforce.model_gbs", step_sequences),
        ("trainer.reinforce.model_mbs", p.micro_batch_size),
    ]


def _rollout_pairs(recipe, dp: int) -> list[tuple[str, object]]:
    """Each DP rank generates for all its prompts at once (the local backend's vLLM call takes
    the step's prompts together) and validates on its share of data.eval_prompts."""
    g, eval_prompts = recipe.grpo, recipe.data.eval_prompts
    return [
        ("model.reinforce.rollout_micro_batch_size", g.prompts_per_step // dp),
        ("model.reinforce.num_val_samples", eval_prompts),
        ("model.reinforce.val_rollout_micro_batch_size", eval_prompts // dp),
    ]


def _interval_pairs(recipe) -> list[tuple[str, object]]:
    """eval.every / checkpoint.every as NeMo-Aligner's intervals. Both loops also validate and
    save after the last step; 0 (the recipe's "only at the end") becomes grpo.steps. NeMo-Aligner
    saves only on steps it validates: a checkpoint interval that is no multiple of the
    evaluation interval fails here, naming both keys, rather than in its assertion."""
    steps = recipe.grpo.steps
    val = recipe.eval.every or steps
    save = recipe.checkpoint.every or steps
    if save % val:
        raise ValueError(
            f"checkpoint.every: NeMo-Aligner checkpoints only on evaluation steps; "
            f"checkpoint.every ({save}) must be a multiple of eval.every ({val}; 0 means "
            f"grpo.steps = {steps})"
        )
    return [
        ("trainer.reinforce.val_check_interval", val),
        ("trainer.reinforce.save_interval", save),
    ]


def _cpu_pairs(recipe) -> list[tuple[str, object]]:
    """What a CPU run needs: fp32, torch's AdamW, the optimizer state kept where it is."""
    if recipe.model.precision != "fp32":
        raise ValueError(
            f"model.precision: the nemo_aligner backend on CPU trains in fp32, "
            f"got {recipe.model.precision!r}"
        )
    return [("model.optim.name", "adamw"), ("model.reinforce.offload_adam_states", False)]


def _optimizer_pairs(recipe) -> list[tuple[str, object]]:
    opt = recipe.optimizer
    return [
        ("model.optim.lr", opt.lr),
        ("model.optim.weight_decay", opt.weight_decay),
        ("model.optim.betas", f"[{opt.beta1},{opt.beta2}]"),
        ("model.optim.eps", opt.eps),
        ("trainer.reinforce.gradient_clip_val", opt.grad_clip),
    ]


def _grpo_pairs(recipe) -> list[tuple[str, object]]:
    """model.grpo (integrations/nemo_aligner/config.py's GRPOSettings) from the recipe's loss
    and grpo sections."""
    loss, g = recipe.loss, recipe.grpo
    return [
        ("model.grpo.rule", loss.rule),
        ("model.grpo.scope", loss.scope),
        ("model.grpo.reg_rule", loss.reg_rule),
        ("model.grpo.reg_scope", loss.reg_scope),
        ("model.grpo.neutral_eps", loss.neutral_eps),
        ("model.grpo.clip_low", loss.clip_low),
        ("model.grpo.clip_high", loss.clip_high),
        ("model.grpo.dual_clip", loss.dual_clip),
        ("model.grpo.kl_coef", loss.kl_coef),
        (
            "model.grpo.max_length",
            loss.max_length if loss.max_length is not None else g.max_new_tokens,
        ),
        ("model.grpo.normalize_std", g.normalize_std),
        ("model.grpo.std", g.std),
        ("model.grpo.drop_zero_variance", g.drop_zero_variance),
    ]
