"""Our recipe (megatron_ba.recipe.Recipe) as verl 0.9.1 Hydra overrides of `ppo_megatron_trainer`.

    overrides = recipe_to_verl_overrides(recipe, nodes=1, gpus_per_node=8, run_dir="runs/x")
    environment = verl_environment(recipe)   # MEGATRON_BA_SCOPE / _NEUTRAL_EPS where needed
    verl_command("python", overrides, environment)  # python -m ...verl.main_ppo --config-name ...

`megatron-ba train RECIPE backend=verl --print-overrides` prints the overrides; without the flag
it prints the command and execs it. The keys are those of verl's own config
(verl/trainer/config/ppo_megatron_trainer.yaml). What verl cannot honour is refused with the
recipe key named (`refuse_unsupported`, called by recipe_to_verl_overrides): a key of
LOCAL_ONLY (verl_recipe_keys.py, with the table of where every other key goes) at a value
other than its default, and the values `_refuse_values` names (the
arithmetic task, a hub id for data.path, the builtin rollout engine, ...).

This module imports neither verl nor torch: the recipe loader calls it in any environment.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_ba.integrations.hydra_values import hydra_value
from megatron_ba.integrations.verl_recipe_keys import LOCAL_ONLY, refuse_local_only

PLAN_RULES = ("balanced", "balanced_mass", "group_token_mean")  # the estimator + loss pairs
ENTRY = ["-m", "megatron_ba.integrations.verl.main_ppo", "--config-name", "ppo_megatron_trainer"]
ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
# verl loads its custom reward function by file path: this project's math reward (verl/reward.py)
REWARD_FUNCTION = Path(__file__).resolve().parent / "verl" / "reward.py"
# recipe `loss.dual_clip: null` (no dual clip): verl's losses always apply clip_ratio_c; at this
# bound -c A never binds (a ratio above 1e9 would be needed)
NO_DUAL_CLIP = 1.0e9


def refuse_unsupported(recipe) -> None:
    """ValueError naming the first recipe key verl cannot honour (see the module's doc)."""
    _refuse_values(recipe)
    refuse_local_only(recipe, LOCAL_ONLY, "verl")


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")


def _refuse_values(recipe) -> None:
    _refuse_data(recipe.data)
    _refuse_model_and_loss(recipe)
    _refuse_eval_and_logging(recipe)


def _refuse_data(d) -> None:
    _need(
        d.task == "math",
        "data.task",
        f"the verl backend trains on a data file (math), got {d.task!r}",
    )
    _need(
        str(d.path).endswith(".parquet"),
        "data.path",
        f"verl reads a local parquet file in its own layout (prompt messages, reward_model."
        f"ground_truth, data_source), got {d.path!r}; DAPO-Math-17k's release file is in it",
    )
    _need(
        d.dataset == "dapo-math-17k",
        "data.dataset",
        f"verl reads the file's rows as they are; only DAPO-Math-17k's release (in verl's "
        f"layout, data_source math_dapo) is translated, got {d.dataset!r}; this project does "
        f"not convert other releases to verl's layout yet",
    )
    _need(
        d.template == "dapo",
        "data.template",
        "verl uses the prompts the file holds (DAPO-Math-17k's: the dapo template), "
        f"got {d.template!r}",
    )
    _need(
        d.max_prompt_tokens is not None,
        "data.max_prompt_tokens",
        "verl needs a prompt budget (data.max_prompt_length); set it",
    )


def _refuse_model_and_loss(recipe) -> None:
    m, loss, r = recipe.model, recipe.loss, recipe.rollout
    _need(
        m.pretrained is not None and not str(m.pretrained).endswith(".nemo"),
        "model.pretrained",
        f"verl starts from a Hugging Face folder, got {m.pretrained!r}",
    )
    _need(r.engine == "vllm", "rollout.engine", f"verl's rollout here is vllm, got {r.engine!r}")
    _need(
        m.precision == "bf16",
        "model.precision",
        f"verl's megatron trainer trains in bf16 (megatron.dtype), got {m.precision!r}",
    )
    _need(
        m.transformer_impl != "local",
        "model.transformer_impl",
        "verl's megatron builds its own layer spec (Transformer Engine); use auto",
    )
    _need(
        loss.rule in (*PLAN_RULES, "token", "sequence"),
        "loss.rule",
        f"{loss.rule!r} is not translated for verl (balanced, balanced_mass, "
        f"group_token_mean, token, sequence are)",
    )
    if loss.rule not in PLAN_RULES:
        _need(
            loss.scope == "batch",
            "loss.scope",
            f"verl's {loss.rule} aggregation (loss_agg_mode) pools the batch: set loss.scope="
            f"batch, or loss.rule=group_token_mean for a per-group token mean",
        )
        _need(loss.neutral_eps == 0, "loss.neutral_eps", "the balanced rules' only; use 0")


def _refuse_eval_and_logging(recipe) -> None:
    e, wandb = recipe.eval, recipe.logging.wandb
    _need(
        bool(e.benchmarks),
        "eval.benchmarks",
        "verl validates on files (data.val_files): name the benchmarks and eval.data_dir",
    )
    _need(
        e.data_dir is not None,
        "eval.data_dir",
        "verl reads local benchmark files in its layout, DIR/NAME.parquet; set the folder",
    )
    _need(
        e.max_new_tokens in (None, recipe.grpo.max_new_tokens),
        "eval.max_new_tokens",
        f"verl validates with the training budget data.max_response_length "
        f"({recipe.grpo.max_new_tokens}); use null",
    )
    _need(
        wandb.mode != "offline",
        "logging.wandb.mode",
        "verl's trainer.logger has wandb online only; use online or disabled",
    )


def _model_pairs(recipe, nodes: int, gpus_per_node: int) -> list[tuple[str, object]]:
    m, p = recipe.model, recipe.parallel
    pairs: list[tuple[str, object]] = [
        ("actor_rollout_ref.model.path", m.pretrained),
        ("trainer.nnodes", nodes),
        ("trainer.n_gpus_per_node", gpus_per_node),
        (f"{ACTOR}.megatron.tensor_model_parallel_size", p.tp),
        (f"{ACTOR}.megatron.pipeline_model_parallel_size", p.pp),
        (f"{ACTOR}.megatron.context_parallel_size", p.cp),
        # verl's reference model reads both from the actor's (its megatron_ref.yaml)
        (f"{ACTOR}.megatron.expert_model_parallel_size", p.ep),
        (f"{ACTOR}.megatron.expert_tensor_parallel_size", p.etp),
        (f"{ACTOR}.megatron.sequence_parallel", p.sequence_parallel),
        # the reference model's engine has its own (not inherited from the actor's)
        ("actor_rollout_ref.ref.megatron.sequence_parallel", p.sequence_parallel),
        (f"{ACTOR}.megatron.seed", recipe.seed),
    ]
    if recipe.tokenizer.path is not None:
        pairs.append(("actor_rollout_ref.model.tokenizer_path", recipe.tokenizer.path))
    if p.recompute != "none":
        over = f"{ACTOR}.megatron.override_transformer_config"
        pairs.append((f"{over}.recompute_granularity", p.recompute))
        if p.recompute == "full":
            pairs += [(f"{over}.recompute_method", "uniform"), (f"{over}.recompute_num_layers", 1)]
    if p.max_tokens_per_microbatch is not None:
        pairs += [(f"{ACTOR}.use_dynamic_bsz", True),
                  (f"{ACTOR}.ppo_max_token_len_per_gpu", p.max_tokens_per_microbatch)]  # fmt: skip
    else:
        pairs += [
            (f"{ACTOR}.ppo_micro_batch_size_per_gpu", p.micro_batch_size),
            (f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", p.micro_batch_size),
            ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", p.micro_batch_size),
        ]
    return pairs


def _data_pairs(recipe) -> list[tuple[str, object]]:
    d, g, e = recipe.data, recipe.grpo, recipe.eval
    pairs: list[tuple[str, object]] = [
        ("data.train_files", d.path),
        ("data.val_files", [f"{e.data_dir}/{name}.parquet" for name in e.benchmarks]),
        ("data.max_prompt_length", d.max_prompt_tokens),
        ("data.filter_overlong_prompts", True),  # longer prompts dropped, as the local loader does
        ("data.max_response_length", g.max_new_tokens),
        ("data.train_batch_size", g.prompts_per_step),
        ("data.seed", recipe.seed),
        ("reward.num_workers", recipe.reward.workers),
        ("reward.custom_reward_function.path", str(REWARD_FUNCTION)),
        ("reward.custom_reward_function.name", "compute_score"),
        ("+reward.custom_reward_function.reward_kwargs.timeout_s", recipe.reward.timeout_s),
    ]
    if d.train_prompts is not None:
        pairs.append(("data.train_max_samples", d.train_prompts))
    return pairs


def _rollout_pairs(recipe) -> list[tuple[str, object]]:
    g, r, e = recipe.grpo, recipe.rollout, recipe.eval
    return [
        (f"{ROLLOUT}.name", "vllm"),
        (f"{ROLLOUT}.tensor_model_parallel_size", r.engine_tp),
        (f"{ROLLOUT}.gpu_memory_utilization", r.gpu_memory_utilization),
        (f"{ROLLOUT}.free_cache_engine", r.sleep),
        (f"{ROLLOUT}.dtype", "bfloat16" if r.dtype == "auto" else r.dtype),
        (f"{ROLLOUT}.n", g.group_size),
        (f"{ROLLOUT}.temperature", g.temperature),
        (f"{ROLLOUT}.seed", recipe.seed),
        (f"{ROLLOUT}.val_kwargs.n", e.samples),
        (f"{ROLLOUT}.val_kwargs.temperature", e.temperature),
        (f"{ROLLOUT}.val_kwargs.do_sample", e.temperature > 0),
    ]


def _loss_pairs(recipe) -> list[tuple[str, object]]:
    g, loss = recipe.grpo, recipe.loss
    plan = loss.rule in PLAN_RULES
    agg = "seq-mean-token-mean" if loss.rule == "sequence" else "token-mean"
    return [
        ("algorithm.adv_estimator", loss.rule if plan else "grpo"),
        (f"{ACTOR}.policy_loss.loss_mode", loss.rule if plan else "vanilla"),
        (f"{ACTOR}.loss_agg_mode", agg),
        ("algorithm.norm_adv_by_std_in_grpo", g.normalize_std),
        (f"{ACTOR}.ppo_mini_batch_size", g.prompts_per_step // g.mini_batches),
        (f"{ACTOR}.ppo_epochs", 1),
        (f"{ACTOR}.clip_ratio_low", loss.clip_low),
        (f"{ACTOR}.clip_ratio_high", loss.clip_high),
        (f"{ACTOR}.clip_ratio_c", NO_DUAL_CLIP if loss.dual_clip is None else loss.dual_clip),
        (f"{ACTOR}.use_kl_loss", loss.kl_coef > 0),
        (f"{ACTOR}.kl_loss_coef", loss.kl_coef),
        (f"{ACTOR}.kl_loss_type", "k3"),
        ("algorithm.use_kl_in_reward", False),
        (f"{ACTOR}.entropy_coeff", loss.entropy_coef),
    ]  # fmt: skip


def _optimizer_and_trainer_pairs(recipe, run_dir: str | None) -> list[tuple[str, object]]:
    opt, g, ck, e = recipe.optimizer, recipe.grpo, recipe.checkpoint, recipe.eval
    wandb, logger = recipe.logging.wandb, ["console"]
    logger += ["tensorboard"] if recipe.logging.tensorboard else []
    logger += ["wandb"] if wandb.mode == "online" else []
    pairs: list[tuple[str, object]] = [
        (f"{ACTOR}.optim.lr", opt.lr),
        (f"{ACTOR}.optim.weight_decay", opt.weight_decay),
        (f"{ACTOR}.optim.betas", [opt.beta1, opt.beta2]),
        (f"{ACTOR}.optim.clip_grad", opt.grad_clip),
        (f"{ACTOR}.optim.lr_warmup_steps", opt.warmup_steps),
        ("trainer.total_training_steps", g.steps),
        # recipe 0: only at the end; verl saves and validates on multiples of these and at the end
        ("trainer.save_freq", ck.every or g.steps),
        ("trainer.max_actor_ckpt_to_keep", ck.keep),
        ("trainer.resume_mode", "auto"),
        ("trainer.test_freq", e.every or g.steps),
        ("trainer.val_before_train", True),
        ("trainer.project_name", wandb.project or "megatron-ba"),
        ("trainer.experiment_name", recipe.name),
        ("trainer.logger", logger),
    ]
    if run_dir is not None:
        pairs.append(("trainer.default_local_dir", f"{run_dir}/checkpoints"))
    return pairs


def recipe_to_verl_overrides(
    recipe, *, nodes: int = 1, gpus_per_node: int = 8, run_dir: str | None = None
) -> list[str]:
    """The `key=value` overrides of verl's ppo_megatron_trainer for `recipe` (ValueError naming
    the recipe key that verl cannot honour). run_dir: checkpoints go to RUN_DIR/checkpoints."""
    refuse_unsupported(recipe)
    _need(isinstance(nodes, int) and nodes >= 1, "nodes", f"must be >= 1, got {nodes!r}")
    _need(isinstance(gpus_per_node, int) and gpus_per_node >= 1, "gpus_per_node",
          f"must be >= 1, got {gpus_per_node!r}")  # fmt: skip
    pairs = [
        *_model_pairs(recipe, nodes, gpus_per_node),
        *_data_pairs(recipe),
        *_rollout_pairs(recipe),
        *_loss_pairs(recipe),
        *_optimizer_and_trainer_pairs(recipe, run_dir),
    ]
    return [f"{k}={hydra_value(v)}" for k, v in pairs]


def verl_environment(recipe) -> dict[str, str]:
    """MEGATRON_BA_* settings the balanced estimator reads (adapter.py), where the recipe's
    differ from the estimator's defaults (scope group, neutral_eps 0)."""
    loss, env = recipe.loss, {}
    if loss.rule in PLAN_RULES and loss.scope != "group":
        env["MEGATRON_BA_SCOPE"] = loss.scope
    if loss.rule in PLAN_RULES and loss.neutral_eps != 0:
        env["MEGATRON_BA_NEUTRAL_EPS"] = str(loss.neutral_eps)
    return env


def translation_notes(recipe) -> list[str]:
    """What the translation changes without refusing it (printed by `megatron-ba train`)."""
    g = recipe.grpo
    if not (g.normalize_std and g.std == "population"):
        return []
    factor = (g.group_size / (g.group_size - 1)) ** 0.5
    return [
        f"grpo.std: population; verl's estimators divide by the sample std, so every advantage "
        f"is {factor:.4f} times the recipe's (sqrt(G/(G-1)), G={g.group_size}); "
        f"grpo.std=sample is exact"
    ]


def verl_command(python: str, overrides: list[str], environment: dict[str, str]) -> str:
    """The shell command that runs verl with `overrides` (the environment as a prefix)."""
    words = [f"{k}={v}" for k, v in environment.items()] + [python, *ENTRY, *overrides]
    return shlex.join(words)
