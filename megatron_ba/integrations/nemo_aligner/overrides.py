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
`model.activations_checkpoint_*`.
"""

from __future__ import annotations


def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def recipe_to_nemo_overrides(
    recipe, *, num_nodes: int = 1, devices: int | None = None, hf_checkpoint: str = "refuse"
) -> list[str]:
    """The overrides of `python -m megatron_ba.integrations.nemo_aligner.train_grpo` for `recipe`.

    devices: GPUs per node (default TP x PP: one data-parallel replica per node).
    hf_checkpoint: what a Hugging Face `model.pretrained` becomes: "refuse" (a ValueError naming
    the key: NeMo-Aligner restores .nemo files) or "placeholder" (`???`, Hydra's mandatory value,
    for printing a translation that the user completes with the converted .nemo file).
    """
    _refuse_local_only_keys(recipe)
    devices = recipe.parallel.tp * recipe.parallel.pp if devices is None else devices
    step_sequences = _sequences_per_optimizer_step(recipe, num_nodes, devices)
    restore = _restore_path(recipe.model.pretrained, hf_checkpoint)
    pairs = [
        ("trainer.num_nodes", num_nodes),
        ("trainer.devices", devices),
        *_model_pairs(recipe, restore, step_sequences),
        *_optimizer_pairs(recipe),
        *_grpo_pairs(recipe),
    ]
    return [f"++{k}={_fmt(v)}" for k, v in pairs]


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
    for key, value in (
        ("max_tokens_per_microbatch", p.max_tokens_per_microbatch),
        ("logprob_chunk_size", p.logprob_chunk_size),
    ):
        if value is not None:  # NeMo-Aligner's actor micro-batches by sequences, its own log-probs
            raise ValueError(
                f"parallel.{key}: not available on the nemo_aligner backend, got {value}; "
                "use null (the local backend has it)"
            )


def _sequences_per_optimizer_step(recipe, num_nodes: int, devices: int) -> int:
    """Sequences per optimizer step over all DP ranks, once they split evenly (else ValueError:
    prompts over DP ranks, each rank's sequences into micro-batches)."""
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
    return step_sequences


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
        ("pretrained_checkpoint.restore_from_path", restore),
        ("model.seed", recipe.seed),
        ("trainer.reinforce.max_steps", g.steps),
        ("trainer.reinforce.num_rollouts_per_prompt", g.group_size),
        ("model.reinforce.num_rollout_samples", g.prompts_per_step),
        ("model.reinforce.length_params.max_length", g.max_new_tokens),
        ("model.reinforce.sampling_params.temperature", g.temperature),
        ("model.micro_batch_size", p.micro_batch_size),
        ("model.global_batch_size", step_sequences),
        ("trainer.reinforce.model_gbs", step_sequences),
        ("trainer.reinforce.model_mbs", p.micro_batch_size),
    ]


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
