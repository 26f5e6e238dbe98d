"""Where each recipe key goes in NeMo-RL v0.7.0's GRPO config, or why it cannot.

The base config is NeMo-RL's stock examples/configs/grpo_math_1B_megatron.yaml (grpo_math_1B.yaml
with `policy.megatron_cfg.enabled`). TRANSLATED: recipe key -> the NeMo-RL override(s)
nemo_rl_recipe.py writes for it (or the only values accepted); LOCAL_ONLY: keys NeMo-RL has no
counterpart for, accepted only at the schema's default (else refused by name); DISPLAY_ONLY: this
project's console options. Together they are every key of the schema
(tests/test_backend_nemo_rl.py checks it; tests/nemorl/test_nemo_rl_recipe.py checks that each
NeMo-RL path named exists in the stock config); docs/integrations.md's NeMo-RL table is these
dicts.
"""

from __future__ import annotations

from megatron_ba.integrations.verl_recipe_keys import CHECKPOINT_SHAPE_KEYS, keys_table

_SHAPE = "the checkpoint's config.json decides the model under NeMo-RL; leave it out"
_ARITHMETIC = "the arithmetic task's (NeMo-RL trains on DAPO-Math-17k's release)"
_WARMSTART = "the local backend's warm start of a fresh tiny model (NeMo-RL starts from " \
    "model.pretrained)"  # fmt: skip
_CORRECTION = "the local backend's rollout correction"
# Keys NeMo-RL has no counterpart for: accepted only at the schema's default value.
LOCAL_ONLY: dict[str, str] = {
    **dict.fromkeys(CHECKPOINT_SHAPE_KEYS, _SHAPE),
    "model.init_std": _WARMSTART,
    "model.attention": "the local spec's core attention (NeMo-RL's megatron uses its own)",
    "tokenizer.vocab_size": "the trained BPE's (NeMo-RL uses the checkpoint's tokenizer)",
    "data.train_prompts": "NeMo-RL's DAPOMath17K data set reads the whole release",
    "data.on_conflict": "how this project's loader reads the release (NeMo-RL reads every row)",
    "data.eval_prompts": "prompts held out of data.path; NeMo-RL validates on eval.benchmarks "
    "files",
    **{f"data.{k}": _ARITHMETIC for k in ("min_terms", "max_terms", "sloppy_restates", "seed")},
    "reward.timeout_s": "this project's math-verify workers' limit (NeMo-RL's math environment "
    "scores with its own)",
    **{f"warmstart.{k}": _WARMSTART for k in (
        "steps", "batch_size", "lr", "correct_fraction", "seed")},
    "grpo.drop_zero_variance": "NeMo-RL's GRPO keeps every group in the batch",
    "grpo.dynamic_sampling": "NeMo-RL's use_dynamic_sampling assembles a batch from several "
    "generation rounds; not checked with BalancedPGLossFn's plan here",
    "grpo.max_sampling_rounds": "dynamic sampling's (not translated for NeMo-RL)",
    "loss.reg_rule": "BalancedPGLossFn keeps NeMo-RL's KL term: a token mean over the batch",
    "loss.reg_scope": "BalancedPGLossFn keeps NeMo-RL's KL term: a token mean over the batch",
    "loss.entropy_coef": "NeMo-RL's ClippedPGLossFn has no entropy bonus",
    "loss.rollout_correction.cap": _CORRECTION,
    "loss.rollout_correction.low": _CORRECTION,
    "loss.rollout_correction.high": _CORRECTION,
    "parallel.logprob_chunk_size": "the local backend's vocab-parallel log-softmax (not "
    "translated to NeMo-RL's policy.logprob_chunk_size)",
    "rollout.in_process": "the local backend's engine placement (NeMo-RL places its own)",
    "rollout.kv_cache_gb": "vLLM's CPU KV cache (NeMo-RL runs vLLM on GPUs)",
    "rollout.threads": "the local trainer's torch threads",
    "rollout.refit_bucket_mb": "the local backend's refit (NeMo-RL refits weights itself)",
    "rollout.routing_replay": "the local backend's MoE routing replay (not translated to NeMo-RL)",
    "logging.wandb.entity": "NeMo-RL's logger has no key for it (set WANDB_ENTITY)",
}  # fmt: skip
_MC, _GEN, _VLLM = "policy.megatron_cfg", "policy.generation", "policy.generation.vllm_cfg"
_OPT, _SCHED = f"{_MC}.optimizer", f"{_MC}.scheduler"
# Every other recipe key: where it goes in NeMo-RL's config (the docs' table is this dict).
TRANSLATED: dict[str, str] = {
    "name": "logger.wandb.name",
    "backend": "nemo_rl: this translation",
    "seed": "grpo.seed (NeMo-RL's set_seed in setup; data.train.seed follows it)",
    "model.pretrained": "policy.model_name (a Hugging Face folder or id; .nemo refused)",
    "model.precision": "bf16 only (policy.precision=bfloat16); fp32 refused",
    "model.transformer_impl": "auto / transformer_engine (NeMo-RL's megatron builds its own "
    "spec); local refused",
    "tokenizer.kind": "hf (required with model.pretrained)",
    "tokenizer.path": "policy.tokenizer.name",
    "data.task": "math only; arithmetic refused",
    "data.path": "BytedTsinghua-SIA/DAPO-Math-17k only: data.train.dataset_name=DAPOMath17K "
    "(NeMo-RL loads that hub release itself), data.train.split_validation_size=0",
    "data.dataset": "dapo-math-17k only; polaris refused (NeMo-RL has no Polaris data set)",
    "data.template": "dapo only (the prompts of DAPO-Math-17k's release): "
    "data.default.prompt_file=null, env.math.math_verify_impl=dapo_math_verify",
    "data.max_prompt_tokens": "data.max_input_seq_length (NeMo-RL cuts a longer prompt and gives "
    "it loss_multiplier 0), policy.max_total_sequence_length = it + grpo.max_new_tokens "
    "(required)",
    "reward.workers": "env.math.num_workers",
    "warmstart.enabled": "false (required with model.pretrained)",
    "grpo.steps": "grpo.max_num_steps (grpo.max_num_epochs = the same: the steps bound binds)",
    "grpo.prompts_per_step": "grpo.num_prompts_per_step",
    "grpo.group_size": "grpo.num_generations_per_prompt",
    "grpo.max_new_tokens": f"{_GEN}.max_new_tokens",
    "grpo.temperature": f"{_GEN}.temperature",
    "grpo.mini_batches": "1 only: policy.train_global_batch_size = prompts_per_step x "
    "group_size (BalancedPGLossFn: one optimizer step per rollout batch); others refused",
    "grpo.normalize_std": "grpo.normalize_rewards, grpo.use_leave_one_out_baseline=false",
    "grpo.std": "NeMo-RL divides by the sample std: sample is exact, population (the default) "
    "becomes sample (every advantage x sqrt(G/(G-1)))",
    "loss.rule": "loss_fn.ba_rule (BalancedPGLossFn)",
    "loss.scope": "loss_fn.ba_scope",
    "loss.max_length": "loss_fn.ba_max_length (dr_grpo; default grpo.max_new_tokens)",
    "loss.neutral_eps": "loss_fn.ba_neutral_eps",
    "loss.clip_low": "loss_fn.ratio_clip_min",
    "loss.clip_high": "loss_fn.ratio_clip_max",
    "loss.dual_clip": "loss_fn.ratio_clip_c (null: none)",
    "loss.kl_coef": "loss_fn.reference_policy_kl_penalty (NeMo-RL's k3, its clamps 20 / 10)",
    "loss.rollout_correction.mode": "none only (refused when the recipe loads)",
    "parallel.tp": f"{_MC}.tensor_model_parallel_size",
    "parallel.pp": f"{_MC}.pipeline_model_parallel_size",
    "parallel.cp": f"{_MC}.context_parallel_size",
    "parallel.ep": f"{_MC}.expert_model_parallel_size",
    "parallel.etp": f"{_MC}.expert_tensor_parallel_size (null: parallel.tp, megatron-core's "
    "default; NeMo-RL's own default is 1)",
    "parallel.micro_batch_size": "policy.train_micro_batch_size (policy.logprob_batch_size "
    "follows it; NeMo-RL's sequence packing: micro-batches of micro_batch_size x "
    "max_total_sequence_length tokens)",
    "parallel.max_tokens_per_microbatch": "policy.sequence_packing.train_mb_tokens, "
    "policy.sequence_packing.logprob_mb_tokens",
    "parallel.sequence_parallel": f"{_MC}.sequence_parallel",
    "parallel.recompute": f"{_MC}.activation_checkpointing (none: false), "
    f"{_MC}.recompute_granularity (full / selective: core attention)",
    "rollout.engine": f"{_GEN}.backend=vllm; builtin refused",
    "rollout.engine_tp": f"{_VLLM}.tensor_parallel_size",
    "rollout.sleep": f"true only: {_GEN}.colocated.enabled=true (NeMo-RL's colocated vLLM "
    "frees its memory while the policy trains)",
    "rollout.gpu_memory_utilization": f"{_VLLM}.gpu_memory_utilization",
    "rollout.dtype": f"auto / bfloat16 ({_VLLM}.precision follows policy.precision); float32 "
    "refused",
    "optimizer.lr": f"{_OPT}.lr, {_OPT}.min_lr (constant after warm-up)",
    "optimizer.weight_decay": f"{_OPT}.weight_decay",
    "optimizer.beta1": f"{_OPT}.adam_beta1",
    "optimizer.beta2": f"{_OPT}.adam_beta2",
    "optimizer.eps": f"{_OPT}.adam_eps",
    "optimizer.grad_clip": "policy.max_grad_norm",
    "optimizer.warmup_steps": f"{_SCHED}.lr_warmup_iters ({_SCHED}.lr_warmup_init=0, "
    f"{_SCHED}.lr_decay_style=constant, {_SCHED}.lr_decay_iters = grpo.steps)",
    "checkpoint.every": "checkpointing.save_period (0: grpo.steps), checkpointing.enabled=true, "
    "checkpointing.checkpoint_dir=RUN_DIR/checkpoints (NeMo-RL resumes from its latest)",
    "checkpoint.keep": "checkpointing.keep_top_k (checkpointing.metric_name=null: the latest)",
    "eval.every": "grpo.val_period (0: grpo.steps), grpo.val_at_start=true, grpo.val_at_end=true",
    "eval.samples": "1 only (NeMo-RL's validation generates one response per prompt); others "
    "refused",
    "eval.temperature": f"only grpo.temperature (NeMo-RL validates with {_GEN}); others refused",
    "eval.benchmarks": "data.validation: one ResponseDataset per name, "
    "eval.data_dir/NAME.jsonl (input_key problem, output_key answer); livecodebench refused "
    "(NeMo-RL's math environment scores answers, not programs); grpo.max_val_samples large "
    "enough for all",
    "eval.data_dir": "data.validation's data_path (required: local files)",
    "eval.template": "dapo only: each data.validation entry's prompt_file "
    "(RUN_DIR/data/nemo_rl_eval_prompt.txt, written by the command)",
    "eval.max_new_tokens": f"null or grpo.max_new_tokens (NeMo-RL validates with "
    f"{_GEN}.max_new_tokens); others refused",
    "logging.tensorboard": "logger.tensorboard_enabled",
    "logging.wandb.mode": "online: logger.wandb_enabled=true; offline refused",
    "logging.wandb.project": "logger.wandb.project (default megatron-ba)",
}
# Display options of this project's console: NeMo-RL logs through its own logger.
DISPLAY_ONLY = ("logging.progress", "logging.plots")


def markdown_table() -> str:
    """docs/integrations.md's table: every recipe key and where it goes in NeMo-RL, or why not."""
    display = "not passed on: this project's console display (NeMo-RL logs through `logger`)"
    return keys_table(TRANSLATED, LOCAL_ONLY, "in NeMo-RL", display)
