"""Our recipe (megatron_ba.recipe.Recipe) as NeMo-RL v0.7.0 GRPO overrides, BalancedPGLossFn's loss.

    overrides = recipe_to_nemo_rl_overrides(recipe, nodes=1, gpus_per_node=8, run_dir="/abs/x")
    nemo_rl_command("python", stock_config_path(), overrides)
    # python -m megatron_ba.integrations.nemo_rl.run_grpo_balanced \\
    #     --config NEMO_RL/examples/configs/grpo_math_1B_megatron.yaml OVERRIDES

`megatron-ba train RECIPE backend=nemo_rl --print-overrides` prints the overrides; without the flag
it prints the command and execs it. The overrides apply to NeMo-RL's stock
examples/configs/grpo_math_1B_megatron.yaml (its megatron-core policy) the way
examples/run_grpo.py applies them (Hydra syntax, struct mode: a key the stock config lacks needs
`++`, which only BalancedPGLossFn's `loss_fn.ba_*` keys use). What NeMo-RL cannot honour is
refused with the recipe key named: a key of LOCAL_ONLY (nemo_rl_recipe_keys.py, with the table of
where every other key goes) at a value other than its default, and the values `_refuse_values`
names (the arithmetic task, the Polaris data set, several optimizer steps per rollout batch, ...).

This module imports neither NeMo-RL nor torch.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path

from megatron_ba.integrations.hydra_values import hydra_value
from megatron_ba.integrations.nemo_rl_recipe_keys import LOCAL_ONLY
from megatron_ba.integrations.verl_recipe_keys import refuse_local_only

ENTRY = ["-m", "megatron_ba.integrations.nemo_rl.run_grpo_balanced"]
STOCK_CONFIG = "examples/configs/grpo_math_1B_megatron.yaml"  # in a NeMo-RL checkout
DAPO_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"  # what NeMo-RL's DAPOMath17K data set loads
EVAL_PROMPT_FILE = "data/nemo_rl_eval_prompt.txt"  # in the run folder
# grpo.max_val_samples: NeMo-RL validates max_val_samples // val_batch_size batches (stock 256 //
# 256: one batch, which would cut MATH-500); this bound lets every benchmark prompt through
ALL_VAL_SAMPLES = 100_000
MC, OPT, SCHED = (
    "policy.megatron_cfg",
    "policy.megatron_cfg.optimizer",
    "policy.megatron_cfg.scheduler",
)
GEN, VLLM = "policy.generation", "policy.generation.vllm_cfg"


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")


def refuse_unsupported(recipe) -> None:
    """ValueError naming the first recipe key NeMo-RL cannot honour (see the module's doc)."""
    _refuse_values(recipe)
    refuse_local_only(recipe, LOCAL_ONLY, "nemo_rl")


def _refuse_values(recipe) -> None:
    _refuse_data(recipe.data)
    _refuse_model_and_rollout(recipe)
    _refuse_eval_and_logging(recipe)


def _refuse_data(d) -> None:
    _need(d.task == "math", "data.task", f"NeMo-RL trains on a math data set, got {d.task!r}")
    _need(
        d.dataset == "dapo-math-17k",
        "data.dataset",
        f"NeMo-RL v0.7.0 has a DAPO-Math-17k data set (DAPOMath17K) and none for {d.dataset!r}; "
        f"this project does not convert other releases for NeMo-RL yet",
    )
    _need(
        d.path == DAPO_HUB_ID,
        "data.path",
        f"NeMo-RL's DAPOMath17K loads the hub release {DAPO_HUB_ID} itself (its cache serves "
        f"offline runs), got {d.path!r}",
    )
    _need(
        d.template == "dapo",
        "data.template",
        f"DAPOMath17K's prompts are the dapo template's, got {d.template!r}",
    )
    _need(
        d.max_prompt_tokens is not None,
        "data.max_prompt_tokens",
        "NeMo-RL needs a prompt budget (data.max_input_seq_length); set it",
    )


def _refuse_model_and_rollout(recipe) -> None:
    m, r, g = recipe.model, recipe.rollout, recipe.grpo
    _need(
        m.pretrained is not None and not str(m.pretrained).endswith(".nemo"),
        "model.pretrained",
        f"NeMo-RL starts from a Hugging Face folder or id, got {m.pretrained!r}",
    )
    _need(
        m.precision == "bf16",
        "model.precision",
        f"NeMo-RL's megatron policy here trains in bf16, got {m.precision!r}",
    )
    _need(
        m.transformer_impl != "local",
        "model.transformer_impl",
        "NeMo-RL's megatron builds its own layer spec (Transformer Engine); use auto",
    )
    _need(r.engine == "vllm", "rollout.engine", f"NeMo-RL's rollout here is vllm, got {r.engine!r}")
    _need(
        r.sleep,
        "rollout.sleep",
        "NeMo-RL's colocated vLLM always frees its memory while the policy trains; set true",
    )
    _need(
        r.dtype in ("auto", "bfloat16"),
        "rollout.dtype",
        f"vLLM follows policy.precision (bfloat16) under NeMo-RL, got {r.dtype!r}",
    )
    _need(
        g.mini_batches == 1,
        "grpo.mini_batches",
        f"BalancedPGLossFn takes one optimizer step per rollout batch (its plan is the whole "
        f"batch's; NeMo-RL shards a batch over DP ranks before splitting it into steps), got "
        f"{g.mini_batches}; set 1",
    )


def _refuse_eval_and_logging(recipe) -> None:
    e, g = recipe.eval, recipe.grpo
    _need(
        bool(e.benchmarks),
        "eval.benchmarks",
        "NeMo-RL validates on files: name the benchmarks and eval.data_dir",
    )
    _need(
        "livecodebench" not in e.benchmarks,
        "eval.benchmarks",
        "livecodebench: NeMo-RL's math environment scores answers, not programs; leave it out",
    )
    _need(
        e.data_dir is not None,
        "eval.data_dir",
        "NeMo-RL reads local benchmark files, DIR/NAME.jsonl (problem, answer); set the folder",
    )
    _need(
        e.samples == 1,
        "eval.samples",
        f"NeMo-RL's validation generates one response per prompt, got {e.samples}; set 1",
    )
    _need(
        e.temperature == g.temperature,
        "eval.temperature",
        f"NeMo-RL validates with the training sampler ({g.temperature}), got {e.temperature}",
    )
    _need(
        e.max_new_tokens in (None, g.max_new_tokens),
        "eval.max_new_tokens",
        f"NeMo-RL validates with the training budget ({g.max_new_tokens}); use null",
    )
    _need(
        e.template == "dapo",
        "eval.template",
        "one math environment scores training and validation (dapo_math_verify); use dapo",
    )
    _need(
        recipe.logging.wandb.mode != "offline",
        "logging.wandb.mode",
        "NeMo-RL's logger has wandb online only; use online or disabled",
    )


def _model_pairs(recipe, nodes: int, gpus_per_node: int) -> list[tuple[str, object]]:
    m, p, g = recipe.model, recipe.parallel, recipe.grpo
    pairs: list[tuple[str, object]] = [
        ("policy.model_name", m.pretrained),
        ("policy.precision", "bfloat16"),
        ("cluster.num_nodes", nodes),
        ("cluster.gpus_per_node", gpus_per_node),
        (f"{MC}.tensor_model_parallel_size", p.tp),
        (f"{MC}.pipeline_model_parallel_size", p.pp),
        (f"{MC}.context_parallel_size", p.cp),
        (f"{MC}.expert_model_parallel_size", p.ep),
        # megatron-core's default expert TP (the local backend's) is tp; NeMo-RL's yaml says 1
        (f"{MC}.expert_tensor_parallel_size", p.tp if p.etp is None else p.etp),
        (f"{MC}.sequence_parallel", p.sequence_parallel),
        (f"{MC}.activation_checkpointing", p.recompute != "none"),
        ("policy.train_global_batch_size", g.prompts_per_step * g.group_size),
        ("policy.train_micro_batch_size", p.micro_batch_size),
        ("policy.max_grad_norm", recipe.optimizer.grad_clip),
    ]
    if p.recompute != "none":
        pairs.append((f"{MC}.recompute_granularity", p.recompute))
    if recipe.tokenizer.path is not None:
        pairs.append(("policy.tokenizer.name", recipe.tokenizer.path))
    if p.max_tokens_per_microbatch is not None:
        packing = "policy.sequence_packing"
        pairs += [(f"{packing}.train_mb_tokens", p.max_tokens_per_microbatch),
                  (f"{packing}.logprob_mb_tokens", p.max_tokens_per_microbatch)]  # fmt: skip
    return pairs


def _data_pairs(recipe, run_dir: str | None) -> list[tuple[str, object]]:
    d, g, e = recipe.data, recipe.grpo, recipe.eval
    prompt_file = eval_prompt_path(run_dir)
    validation = [{"dataset_name": "ResponseDataset", "data_path": f"{e.data_dir}/{name}.jsonl",
                   "input_key": "problem", "output_key": "answer", "prompt_file": prompt_file}
                  for name in e.benchmarks]  # fmt: skip
    return [
        ("data.train.dataset_name", "DAPOMath17K"),
        ("data.train.split_validation_size", 0),
        ("data.validation", validation),
        ("data.default.prompt_file", None),  # the release's prompts are templated already
        ("data.max_input_seq_length", d.max_prompt_tokens),
        ("policy.max_total_sequence_length", d.max_prompt_tokens + g.max_new_tokens),
        ("env.math.num_workers", recipe.reward.workers),
        ("env.math.math_verify_impl", "dapo_math_verify"),
    ]


def _grpo_pairs(recipe) -> list[tuple[str, object]]:
    g, r, e = recipe.grpo, recipe.rollout, recipe.eval
    return [
        ("grpo.seed", recipe.seed),
        ("grpo.num_prompts_per_step", g.prompts_per_step),
        ("grpo.num_generations_per_prompt", g.group_size),
        ("grpo.max_num_steps", g.steps),
        ("grpo.max_num_epochs", g.steps),  # an epoch holds >= 1 step: the steps bound binds
        ("grpo.normalize_rewards", g.normalize_std),
        ("grpo.use_leave_one_out_baseline", False),
        ("grpo.val_period", e.every or g.steps),
        ("grpo.val_at_start", True),
        ("grpo.val_at_end", True),
        ("grpo.max_val_samples", ALL_VAL_SAMPLES),
        (f"{GEN}.backend", "vllm"),
        (f"{GEN}.max_new_tokens", g.max_new_tokens),
        (f"{GEN}.temperature", g.temperature),
        (f"{GEN}.colocated.enabled", True),
        (f"{VLLM}.tensor_parallel_size", r.engine_tp),
        (f"{VLLM}.gpu_memory_utilization", r.gpu_memory_utilization),
    ]


def _loss_pairs(recipe) -> list[tuple[str, object]]:
    loss = recipe.loss
    pairs: list[tuple[str, object]] = [
        ("++loss_fn.ba_rule", loss.rule),
        ("++loss_fn.ba_scope", loss.scope),
        ("++loss_fn.ba_neutral_eps", loss.neutral_eps),
        ("loss_fn.ratio_clip_min", loss.clip_low),
        ("loss_fn.ratio_clip_max", loss.clip_high),
        ("loss_fn.ratio_clip_c", loss.dual_clip),
        ("loss_fn.reference_policy_kl_penalty", loss.kl_coef),
    ]
    if loss.rule == "dr_grpo":
        pairs.append(("++loss_fn.ba_max_length", loss.max_length or recipe.grpo.max_new_tokens))
    return pairs


def _optimizer_and_logging_pairs(recipe, run_dir: str | None) -> list[tuple[str, object]]:
    opt, ck, g, wandb = recipe.optimizer, recipe.checkpoint, recipe.grpo, recipe.logging.wandb
    pairs: list[tuple[str, object]] = [
        (f"{OPT}.lr", opt.lr),
        (f"{OPT}.min_lr", opt.lr),
        (f"{OPT}.weight_decay", opt.weight_decay),
        (f"{OPT}.adam_beta1", opt.beta1),
        (f"{OPT}.adam_beta2", opt.beta2),
        (f"{OPT}.adam_eps", opt.eps),
        (f"{SCHED}.lr_warmup_iters", opt.warmup_steps),
        (f"{SCHED}.lr_warmup_init", 0.0),
        (f"{SCHED}.lr_decay_style", "constant"),
        (f"{SCHED}.lr_decay_iters", g.steps),
        ("checkpointing.enabled", True),
        ("checkpointing.save_period", ck.every or g.steps),
        ("checkpointing.keep_top_k", ck.keep),
        ("checkpointing.metric_name", None),  # keep the latest, not the best by a metric
        ("logger.tensorboard_enabled", recipe.logging.tensorboard),
        ("logger.wandb_enabled", wandb.mode == "online"),
        ("logger.wandb.project", wandb.project or "megatron-ba"),
        ("logger.wandb.name", recipe.name),
    ]
    if run_dir is not None:
        pairs += [("checkpointing.checkpoint_dir", f"{run_dir}/checkpoints"),
                  ("logger.log_dir", f"{run_dir}/logs")]  # fmt: skip
    return pairs


def recipe_to_nemo_rl_overrides(
    recipe, *, nodes: int = 1, gpus_per_node: int = 8, run_dir: str | None = None
) -> list[str]:
    """The overrides of NeMo-RL's stock grpo_math_1B_megatron.yaml for `recipe` (ValueError
    naming the recipe key NeMo-RL cannot honour). run_dir: checkpoints and logs go there."""
    refuse_unsupported(recipe)
    _need(isinstance(nodes, int) and nodes >= 1, "nodes", f"must be >= 1, got {nodes!r}")
    _need(
        isinstance(gpus_per_node, int) and gpus_per_node >= 1,
        "gpus_per_node",
        f"must be >= 1, got {gpus_per_node!r}",
    )
    pairs = [
        *_model_pairs(recipe, nodes, gpus_per_node),
        *_data_pairs(recipe, run_dir),
        *_grpo_pairs(recipe),
        *_loss_pairs(recipe),
        *_optimizer_and_logging_pairs(recipe, run_dir),
    ]
    return [f"{k}={hydra_value(v)}" for k, v in pairs]


def eval_prompt_path(run_dir: str | None) -> str:
    """Where the command writes the validation prompt template (NeMo-RL's prompt_file;
    `megatron-ba train` writes it, commands/train.py)."""
    return f"{run_dir or 'RUN_DIR'}/{EVAL_PROMPT_FILE}"


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


def translation_notes(recipe) -> list[str]:
    """What the translation changes without refusing it (printed by `megatron-ba train`)."""
    g = recipe.grpo
    if not (g.normalize_std and g.std == "population"):
        return []
    factor = (g.group_size / (g.group_size - 1)) ** 0.5
    return [
        f"grpo.std: population; NeMo-RL divides by the sample std, so every advantage is "
        f"{factor:.4f} times the recipe's (sqrt(G/(G-1)), G={g.group_size}); grpo.std=sample "
        f"is exact"
    ]


def nemo_rl_command(python: str, config: str, overrides: list[str]) -> str:
    """The shell command that runs NeMo-RL's GRPO with BalancedPGLossFn and `overrides`."""
    return shlex.join([python, *ENTRY, "--config", config, *overrides])
