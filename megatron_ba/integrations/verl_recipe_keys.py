"""Where each recipe key goes in verl 0.9.1's ppo_megatron_trainer config, or why it cannot.

TRANSLATED: recipe key -> the verl override(s) verl_recipe.py writes for it (or the only values
accepted); LOCAL_ONLY: keys verl has no counterpart for, accepted only at the schema's default
(else refused by name); DISPLAY_ONLY: this project's console options. Together they are every key
of the schema (tests/test_backend_verl.py checks it and that each verl path named exists in verl's
composed config); docs/integrations.md's verl table is these dicts.
"""

from __future__ import annotations

import dataclasses

_SHAPE = "the checkpoint's config.json decides the model under verl; leave it out"
_ARITHMETIC = "the arithmetic task's (verl trains on the data.path file)"
_WARMSTART = (
    "the local backend's warm start of a fresh tiny model (verl starts from model.pretrained)"
)
# The model keys a Hugging Face checkpoint's config.json decides under an engine (verl, NeMo-RL).
CHECKPOINT_SHAPE_KEYS = tuple(f"model.{k}" for k in (
    "hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "max_position_embeddings", "rope_theta", "norm_eps", "rope_scaling.type",
    "rope_scaling.factor", "rope_scaling.original_max_position_embeddings", "num_experts",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff"))  # fmt: skip
# Keys verl has no counterpart for: accepted only at the schema's default value.
LOCAL_ONLY: dict[str, str] = {
    **dict.fromkeys(CHECKPOINT_SHAPE_KEYS, _SHAPE),
    "model.init_std": _WARMSTART,
    "model.attention": "the local spec's core attention (verl's megatron uses its own)",
    "tokenizer.vocab_size": "the trained BPE's (verl uses the checkpoint's tokenizer)",
    "data.on_conflict": "how this project's loader reads the release (verl reads every row)",
    "data.eval_prompts": "prompts held out of data.path; verl validates on eval.benchmarks files",
    **{f"data.{k}": _ARITHMETIC for k in ("min_terms", "max_terms", "sloppy_restates", "seed")},
    **{f"warmstart.{k}": _WARMSTART for k in (
        "steps", "batch_size", "lr", "correct_fraction", "seed")},
    "grpo.drop_zero_variance": "verl's GRPO has no such option",
    "grpo.dynamic_sampling": "verl's filter_groups belongs to its DAPO recipe, not to main_ppo",
    "grpo.max_sampling_rounds": "dynamic sampling's (not available under verl)",
    "loss.max_length": "dr_grpo's constant (dr_grpo is not translated)",
    "loss.reg_rule": "verl aggregates KL and entropy by loss_agg_mode (token-mean: token, batch)",
    "loss.reg_scope": "verl aggregates KL and entropy by loss_agg_mode (token-mean: token, batch)",
    "loss.rollout_correction.cap": "the local backend's rollout correction",
    "loss.rollout_correction.low": "the local backend's rollout correction",
    "loss.rollout_correction.high": "the local backend's rollout correction",
    "parallel.logprob_chunk_size": "the local backend's vocab-parallel log-softmax",
    "rollout.in_process": "the local backend's engine placement (verl places its own)",
    "rollout.kv_cache_gb": "vLLM's CPU KV cache (verl runs on GPUs)",
    "rollout.threads": "the local trainer's torch threads",
    "rollout.refit_bucket_mb": "the local backend's refit (verl syncs weights itself)",
    "rollout.routing_replay": "the local backend's MoE routing replay (not translated to verl)",
    "optimizer.eps": "verl's megatron optimizer config has no eps (megatron-core's Adam: 1e-8)",
    "eval.template": "verl uses the benchmark files' prompts as they are",
    "logging.wandb.entity": "verl's trainer has no key for it (set WANDB_ENTITY)",
}  # fmt: skip
_A, _R, _M = (
    "actor_rollout_ref.actor",
    "actor_rollout_ref.rollout",
    "actor_rollout_ref.actor.megatron",
)
# Every other recipe key: where it goes in verl's config (the docs' table is this dict).
TRANSLATED: dict[str, str] = {
    "name": "trainer.experiment_name",
    "backend": "verl: this translation",
    "seed": f"{_M}.seed, {_R}.seed, data.seed",
    "model.pretrained": "actor_rollout_ref.model.path (a Hugging Face folder; .nemo refused)",
    "model.precision": f"bf16 only ({_M}.dtype is bfloat16); fp32 refused",
    "model.transformer_impl": "auto / transformer_engine (verl's megatron builds its own spec); "
    "local refused",
    "tokenizer.kind": "hf (required with model.pretrained)",
    "tokenizer.path": "actor_rollout_ref.model.tokenizer_path",
    "data.task": "math only; arithmetic refused",
    "data.path": "data.train_files (a local parquet in verl's layout; a hub id refused)",
    "data.dataset": "dapo-math-17k only (its release is in verl's layout); polaris refused",
    "data.template": "dapo only (the prompts DAPO-Math-17k's file holds); others refused",
    "data.train_prompts": "data.train_max_samples (verl: a random subset seeded by data.seed, "
    "then the long prompts dropped)",
    "data.max_prompt_tokens": "data.max_prompt_length, data.filter_overlong_prompts=true",
    "reward.workers": "reward.num_workers",
    "reward.timeout_s": "the timeout_s of reward.custom_reward_function's reward_kwargs (verl "
    "scores with this project's math reward: compute_score in integrations/verl/)",
    "warmstart.enabled": "false (required with model.pretrained)",
    "grpo.steps": "trainer.total_training_steps",
    "grpo.prompts_per_step": "data.train_batch_size",
    "grpo.group_size": f"{_R}.n",
    "grpo.max_new_tokens": "data.max_response_length",
    "grpo.temperature": f"{_R}.temperature",
    "grpo.mini_batches": f"{_A}.ppo_mini_batch_size = prompts_per_step / mini_batches, "
    f"{_A}.ppo_epochs=1",
    "grpo.normalize_std": "algorithm.norm_adv_by_std_in_grpo",
    "grpo.std": "verl's estimators divide by the sample std: sample is exact, population "
    "(the default) becomes sample (every advantage x sqrt(G/(G-1)))",
    "loss.rule": "balanced / balanced_mass / group_token_mean: algorithm.adv_estimator and "
    f"{_A}.policy_loss.loss_mode = the rule; token: grpo + vanilla + loss_agg_mode token-mean; "
    "sequence: grpo + vanilla + seq-mean-token-mean; dr_grpo refused",
    "loss.scope": "the balanced rules: MEGATRON_BA_SCOPE (set by the command when batch); "
    "token / sequence: batch only (verl pools the batch)",
    "loss.neutral_eps": "MEGATRON_BA_NEUTRAL_EPS (the balanced rules; set when not 0)",
    "loss.clip_low": f"{_A}.clip_ratio_low",
    "loss.clip_high": f"{_A}.clip_ratio_high",
    "loss.dual_clip": f"{_A}.clip_ratio_c (null: 1e9, a bound that never binds)",
    "loss.kl_coef": f"{_A}.use_kl_loss, {_A}.kl_loss_coef, {_A}.kl_loss_type=k3",
    "loss.entropy_coef": f"{_A}.entropy_coeff",
    "loss.rollout_correction.mode": "none only (refused when the recipe loads)",
    "parallel.tp": f"{_M}.tensor_model_parallel_size",
    "parallel.pp": f"{_M}.pipeline_model_parallel_size",
    "parallel.cp": f"{_M}.context_parallel_size",
    "parallel.ep": f"{_M}.expert_model_parallel_size (the reference model's follows it)",
    "parallel.etp": f"{_M}.expert_tensor_parallel_size (null: megatron-core's default, tp)",
    "parallel.micro_batch_size": f"{_A}.ppo_micro_batch_size_per_gpu, "
    f"{_R}.log_prob_micro_batch_size_per_gpu, "
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "parallel.max_tokens_per_microbatch": f"{_A}.use_dynamic_bsz=true, "
    f"{_A}.ppo_max_token_len_per_gpu",
    "parallel.sequence_parallel": f"{_M}.sequence_parallel, actor_rollout_ref.ref.megatron."
    "sequence_parallel",
    "parallel.recompute": f"{_M}.override_transformer_config.recompute_granularity (full: "
    "recompute_method=uniform, recompute_num_layers=1)",
    "rollout.engine": f"{_R}.name=vllm; builtin refused",
    "rollout.engine_tp": f"{_R}.tensor_model_parallel_size",
    "rollout.sleep": f"{_R}.free_cache_engine",
    "rollout.gpu_memory_utilization": f"{_R}.gpu_memory_utilization",
    "rollout.dtype": f"{_R}.dtype (auto: bfloat16)",
    "optimizer.lr": f"{_A}.optim.lr",
    "optimizer.weight_decay": f"{_A}.optim.weight_decay",
    "optimizer.beta1": f"{_A}.optim.betas",
    "optimizer.beta2": f"{_A}.optim.betas",
    "optimizer.grad_clip": f"{_A}.optim.clip_grad",
    "optimizer.warmup_steps": f"{_A}.optim.lr_warmup_steps",
    "checkpoint.every": "trainer.save_freq (0: grpo.steps), trainer.resume_mode=auto, "
    "trainer.default_local_dir=RUN_DIR/checkpoints (absolute)",
    "checkpoint.keep": "trainer.max_actor_ckpt_to_keep",
    "eval.every": "trainer.test_freq (0: grpo.steps), trainer.val_before_train=true",
    "eval.samples": f"{_R}.val_kwargs.n",
    "eval.temperature": f"{_R}.val_kwargs.temperature, {_R}.val_kwargs.do_sample",
    "eval.benchmarks": "data.val_files = eval.data_dir/NAME.parquet each (required)",
    "eval.data_dir": "data.val_files (required: verl reads local files)",
    "eval.max_new_tokens": "null or grpo.max_new_tokens (verl validates with "
    "data.max_response_length); others refused",
    "logging.tensorboard": "trainer.logger += tensorboard",
    "logging.wandb.mode": "online: trainer.logger += wandb; offline refused",
    "logging.wandb.project": "trainer.project_name (default megatron-ba)",
}
# Display options of this project's console: verl logs through trainer.logger whatever they say.
DISPLAY_ONLY = ("logging.progress", "logging.plots")


def schema_keys() -> list[str]:
    """Every leaf key of the recipe schema, dotted (for the docs' table and its test)."""
    from megatron_ba.recipe import Recipe

    def walk(obj, prefix: str) -> list[str]:
        keys = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            name = f"{prefix}{f.name}"
            keys += walk(value, name + ".") if dataclasses.is_dataclass(value) else [name]
        return keys

    return walk(Recipe(), "")


def refuse_local_only(recipe, local_only: dict[str, str], backend: str) -> None:
    """ValueError naming the first key of `local_only` that `recipe` sets away from the schema's
    default, with why `backend` has no counterpart for it."""
    from megatron_ba.recipe import Recipe

    default = Recipe()
    for key, why in local_only.items():
        value, usual = recipe, default
        for part in key.split("."):
            value, usual = getattr(value, part), getattr(usual, part)
        if value != usual:
            fix = "leave it out" if usual is None else f"use the default {usual!r}"
            raise ValueError(
                f"{key}: not available on the {backend} backend ({why}); got {value!r}, {fix}"
            )


def keys_table(translated: dict, local_only: dict, column: str, display: str) -> str:
    """A backend's table of every recipe key: where `translated` sends it, `local_only`'s
    refusal (with the default it is accepted at), or `display` for DISPLAY_ONLY keys."""
    from megatron_ba.recipe import Recipe

    default, rows = Recipe(), [f"| recipe key | {column} |", "|---|---|"]
    for key in schema_keys():
        if key in translated:
            where = translated[key]
        elif key in local_only:
            value = default
            for part in key.split("."):
                value = getattr(value, part)
            at = "left out" if value is None else f"`{value}`"
            where = f"refused unless {at}: {local_only[key]}"
        else:
            where = display
        rows.append(f"| `{key}` | " + where.replace("|", "\\|") + " |")
    return "\n".join(rows) + "\n"


def markdown_table() -> str:
    """docs/integrations.md's table: every recipe key and where it goes in verl, or why not."""
    display = "not passed on: this project's console display (verl logs through `trainer.logger`)"
    return keys_table(TRANSLATED, LOCAL_ONLY, "in verl", display)
