"""Training recipes: one YAML format for every backend, loaded strictly, with key=value overrides.

    recipe = load_recipe("recipes/tiny-cpu.yaml", ["loss.rule=token", "grpo.steps=20"])
    recipe.loss.rule, recipe.to_dict(), recipe.dump(path)

The schema is the dataclass tree below (docs/recipes.md lists every key). Loading is strict: an
unknown key fails with its dotted path named (and the closest known key suggested), a value of the
wrong type fails with the key and the expected type. Overrides use Hydra/NeMo's `a.b.c=value`
syntax; values are parsed as YAML (`x=null`, `x=[1,2]`, `x=1e-4`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ba.errors import SettingError, UserError
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.parallel.layout import RECIPE_KEYS, LayoutError, ParallelLayout
from megatron_ba.rules import AggregationSettings, GRPOLossConfig, RolloutCorrectionSettings

BACKENDS = ("local", "nemo_aligner", "verl", "nemo_rl")
TASKS = ("arithmetic", "math")
TOKENIZERS = ("trained-bpe", "hf")
DATASETS = ("dapo-math-17k", "polaris")
# The evaluation sets `eval.benchmarks` may name (megatron_ba.data.benchmarks.BENCHMARKS; spelled
# out here so that loading a recipe imports no data code).
MATH_TEMPLATE_NAMES = ("dapo", "boxed", "plain", "polaris")  # megatron_ba.data.templates
BENCHMARK_NAMES = ("math500", "aime24", "aime25", "olympiad", "minerva", "livecodebench")

# Keys a user may expect that no code reads yet: setting one is an error that says so, rather
# than a setting that is silently ignored. Each is added to the schema with the code that reads it.
NOT_IMPLEMENTED: dict[str, str] = {}


@dataclass
class RopeScalingSection:
    """RoPE scaling the checkpoint's config.json must have (megatron_ba.rope_scaling): the recipe
    states it and the run refuses a checkpoint that says otherwise. type: null (the checkpoint
    decides), `default` (plain RoPE) or `yarn` (with factor and original_max_position_embeddings,
    as Qwen documents them; needs model.pretrained: a fresh model has plain RoPE)."""

    type: str | None = None
    factor: float | None = None
    original_max_position_embeddings: int | None = None

    def settings(self):
        """The RopeScaling it names (None for null or default)."""
        from megatron_ba.rope_scaling import RopeScaling

        if self.type != "yarn":
            return None
        return RopeScaling(self.factor, self.original_max_position_embeddings, type=self.type)


@dataclass
class ModelSection:
    """The policy: a Hugging Face checkpoint (`pretrained`), or a fresh Qwen2-shaped decoder
    (RMSNorm, SwiGLU, RoPE, GQA, QKV bias, untied output layer) of the shape keys below."""

    pretrained: str | None = None  # a Hugging Face folder: weights and architecture
    hidden_size: int | None = None
    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    max_position_embeddings: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    # Mixture of experts (a fresh model: Qwen3-MoE, every layer's MLP a router over num_experts
    # SwiGLU experts of moe_ffn_hidden_size, moe_router_topk per token; 0 experts: dense).
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_aux_loss_coeff: float | None = None
    rope_scaling: RopeScalingSection = field(default_factory=RopeScalingSection)
    init_std: float = 0.02
    # fp32 | bf16 (CUDA only: bf16 parameters, fp32 main weights, megatron-core's distributed
    # optimiser); megatron_ba.megatron.build_options checks it against the rank's device.
    precision: str = "fp32"
    # auto (Transformer Engine when it imports and the device is a GPU, else local) | local |
    # transformer_engine
    transformer_impl: str = "auto"
    # The local spec's core attention: auto (sdpa on CUDA, unfused on the CPU) | sdpa (torch's
    # scaled_dot_product_attention) | unfused (megatron-core's DotProductAttention)
    attention: str = "auto"

    def _shape_keys(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "ffn_hidden_size": self.ffn_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "norm_eps": self.norm_eps,
            "num_experts": self.num_experts,
            "moe_router_topk": self.moe_router_topk,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "moe_aux_loss_coeff": self.moe_aux_loss_coeff,
        }

    def shape(self) -> dict[str, Any]:
        """The shape keys, TINY_SHAPE filling those the recipe leaves out (no checkpoint)."""
        return {k: TINY_SHAPE[k] if v is None else v for k, v in self._shape_keys().items()}

    def set_shape_keys(self) -> dict[str, Any]:
        """The shape keys the recipe sets (with a checkpoint they must agree with its config)."""
        return {k: v for k, v in self._shape_keys().items() if v is not None}

    def fresh_shape(self, vocab_size: int) -> ModelShape:
        """The fresh model these keys describe, with the tokenizer's `vocab_size`: the "tiny"
        preset's family (Qwen2), or with experts the "tiny-moe" preset's (Qwen3-MoE: q/k norms,
        no QKV bias); untied, the head dimension hidden / heads. What the warm start builds and
        the planner plans for."""
        shape = self.shape()
        base = PRESETS["tiny-moe"] if shape["num_experts"] else PRESETS["tiny"]
        return dataclasses.replace(
            base, vocab_size=vocab_size, kv_channels=None, tie_word_embeddings=False, **shape
        )


# The model.* shape keys (fields of megatron_ba.model_shape.ModelShape; the vocabulary is the
# tokenizer's) and what they mean when a recipe leaves them out and does not start from a
# checkpoint (with `model.pretrained` the checkpoint's config.json decides): the "tiny" preset.
TINY_SHAPE: dict[str, Any] = {k: getattr(PRESETS["tiny"], k) for k in ModelSection()._shape_keys()}


@dataclass
class TokenizerSection:
    """`trained-bpe`: a byte-level BPE trained on the task's corpus; `hf`: a saved tokenizer."""

    kind: str = "trained-bpe"
    vocab_size: int = 320  # trained-bpe only
    path: str | None = None  # hf: the tokenizer folder (default: model.pretrained)


@dataclass
class DataSection:
    task: str = "arithmetic"  # arithmetic: the synthetic CPU task; math: a real data set (path)
    path: str | None = None  # math: a local parquet / JSON Lines file, or a hub id
    dataset: str = "dapo-math-17k"  # math: the file's layout, dapo-math-17k or polaris
    template: str = "dapo"  # math: the prompt template (data/templates.py)
    train_prompts: int | None = None  # math: keep at most this many prompts of the pool
    max_prompt_tokens: int | None = None  # math: drop longer prompts (counted)
    on_conflict: str = "drop"  # dapo-math-17k: one prompt with two truths: drop or keep_first
    eval_prompts: int = 128
    min_terms: int = 2
    max_terms: int = 4
    sloppy_restates: int = 1  # arithmetic: how much longer the warm start's wrong style is
    seed: int = 1234


@dataclass
class RewardSection:
    """The verifiable math reward: worker processes with a hard wall-clock limit per answer."""

    workers: int = 1
    timeout_s: float = 5.0


@dataclass
class WarmstartSection:
    """Supervised warm start on a correct/sloppy mixture, cached by its inputs' hash."""

    enabled: bool = True  # the arithmetic task's; false with model.pretrained
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    correct_fraction: float = 0.35
    # null: the run's seed. A fixed value gives every seed of a study one starting policy, as
    # runs from one pretrained checkpoint share theirs; the seeds then differ only in GRPO.
    seed: int | None = None


@dataclass
class GRPOSection:
    steps: int = 40
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    mini_batches: int = 1  # optimiser steps per rollout batch (whole groups each)
    normalize_std: bool = True
    std: str = "population"
    drop_zero_variance: bool = False
    dynamic_sampling: bool = False  # DAPO: resample prompts until every group has variance
    max_sampling_rounds: int = 4  # dynamic_sampling: rollout rounds per step at most


@dataclass(frozen=True)
class LossSection(GRPOLossConfig, AggregationSettings):
    """The aggregation settings (rule, scope, reg_rule, reg_scope, max_length: dr_grpo's budget,
    default grpo.max_new_tokens; neutral_eps), then the clipped loss's coefficients (clip_low,
    clip_high, dual_clip, kl_coef, entropy_coef); both checked when the section is built.
    rollout_correction: the off-policy correction of the rollout engine's sampling (mode, cap,
    low, high; megatron_ba.rollout_correction), checked when its section is built."""

    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)

    def __post_init__(self) -> None:
        AggregationSettings.__post_init__(self)
        GRPOLossConfig.__post_init__(self)


# `parallel.logprob_chunk_size: null` (auto): a micro-batch above AUTO_CHUNK_ABOVE tokens walks
# its vocab-parallel log-softmax AUTO_CHUNK tokens at a time, so the fp32 softmax buffers stay
# O(AUTO_CHUNK x V/TP) (2 x 1024 x 152k/TP x 4 bytes = 1.2 GB at TP=1 for Qwen2's vocabulary)
# instead of O(T x V/TP). The step (megatron_ba.megatron.grpo_step) and the planner read them.
AUTO_CHUNK_ABOVE, AUTO_CHUNK = 4096, 1024


@dataclass
class ParallelSection:
    """The parallel layout's keys (tp, pp, cp, ep, etp, sequence_parallel: `layout()` builds the
    megatron_ba.parallel.layout.ParallelLayout they describe, which holds every rule they must
    keep; dp is what the world leaves), then the step's micro-batching and memory keys."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism (mixture-of-experts models), carved out of DP x CP
    etp: int | None = None  # expert tensor parallelism; null: megatron-core's default, tp
    micro_batch_size: int = 64  # sequences per micro-batch on each data-parallel rank
    # Token-budget micro-batches (prompt + response tokens, rows x longest on CPU); null: fixed
    # micro_batch_size sequences. Replaces micro_batch_size when set.
    max_tokens_per_microbatch: int | None = None
    # Tokens per chunk of the vocab-parallel log-softmax; null: auto (AUTO_CHUNK above).
    logprob_chunk_size: int | None = None
    sequence_parallel: bool = False  # needs tp > 1; on CUDA the Transformer Engine spec
    recompute: str = "none"  # none | selective (core attention) | full (every layer)

    def layout(self, dp: int | None = None) -> ParallelLayout:
        """The ParallelLayout these keys describe (dp: None until the world is known); a rule
        it breaks is a RecipeError naming the key."""
        try:
            return ParallelLayout(
                tp=self.tp,
                pp=self.pp,
                cp=self.cp,
                dp=dp,
                ep=self.ep,
                etp=self.etp,
                sequence_parallel=self.sequence_parallel,
            )
        except LayoutError as e:
            raise RecipeError(e.renamed(RECIPE_KEYS)) from None


# vLLM's share of each GPU while it generates (weights + KV cache), colocated with training: the
# one default of `rollout.gpu_memory_utilization`, which the engine and the layout planner read.
VLLM_GPU_MEMORY_UTILIZATION = 0.6


@dataclass
class RolloutSection:
    engine: str = "vllm"  # vllm | builtin (slower, only when asked for)
    in_process: bool = False  # vLLM in the trainer's process (single-process runs only)
    kv_cache_gb: float = 1.0
    threads: int | None = None  # torch threads; default: all cores
    engine_tp: int = 1  # each replica's vLLM engine's tensor parallelism (CUDA only above 1)
    sleep: bool = False  # vLLM sleep mode between rollout and update (CUDA only)
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION  # CUDA only; see above
    refit_bucket_mb: int = 256  # MiB of weights per in-memory refit bucket
    # the engine's weights and arithmetic: auto = bfloat16 on GPUs, float32 on CPU; bfloat16 on CPU
    # gives the train/rollout log-prob gap GPU runs have (what loss.rollout_correction corrects)
    dtype: str = "auto"
    # MoE: the engine records each token's experts and the trainer's forwards replay them
    # (megatron_ba.megatron.routing_replay); vLLM engine, local backend, tp = pp = cp = 1
    routing_replay: bool = False


@dataclass
class OptimizerSection:
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0


@dataclass
class CheckpointSection:
    every: int = 10  # optimiser steps between checkpoints (0: only at the end)
    keep: int = 2


@dataclass
class EvalSection:
    every: int = 10
    samples: int = 4  # k of Acc@k at the sampling temperature
    temperature: float = 1.0
    benchmarks: list[str] = field(default_factory=list)  # empty: the task's held-out prompts
    data_dir: str | None = None  # local benchmark files (else each benchmark's hub mirror)
    template: str = "dapo"  # math benchmarks' prompt template
    max_new_tokens: int | None = None  # default grpo.max_new_tokens


@dataclass
class WandbSection:
    """Weights & Biases (the `wandb` package): offline runs sync later with `wandb sync`."""

    mode: str = "disabled"  # disabled | offline | online
    project: str | None = None  # required unless disabled
    entity: str | None = None


@dataclass
class LoggingSection:
    progress: bool = True
    plots: bool = True
    tensorboard: bool = False  # event files in RUN_DIR/tb (a study's element: STUDY/tb/<name>)
    wandb: WandbSection = field(default_factory=WandbSection)


@dataclass
class Recipe:
    name: str = "unnamed"
    backend: str = "local"
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    warmstart: WarmstartSection = field(default_factory=WarmstartSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    loss: LossSection = field(default_factory=LossSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dump(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


class RecipeError(UserError):
    """A recipe that cannot be loaded; the message names the key."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp` (int accepted for float)."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # a key=value override: a comma-separated list
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list of {_type_name(item)}, got {value!r}")
        return [_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(path, value, option)
            except RecipeError:
                pass
        names = " or ".join(_type_name(o) for o in options)
        raise RecipeError(f"{path}: expected {names}, got {value!r}")
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads exponents without a dot, like 1e-6, as strings.
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise RecipeError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{path or 'recipe'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields and where in NOT_IMPLEMENTED:
            raise RecipeError(f"{where}: not implemented yet: {NOT_IMPLEMENTED[where]}; remove it")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"{where}: unknown key{hint}; known keys: {', '.join(fields)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, where)
        else:
            kwargs[key] = _coerce(where, value, tp)
    try:
        return cls(**kwargs)
    except SettingError as e:  # a section that checks its own values (loss: the aggregation's)
        raise RecipeError(e.renamed(prefix=f"{path}." if path else "")) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    import yaml

    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise RecipeError(f"override {text!r}: empty key")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    return data


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
    _need(
        recipe.backend == "local" or recipe.loss.rollout_correction.mode == "none",
        "loss.rollout_correction.mode",
        f"the local backend's (the {recipe.backend} backend has none); use none",
    )
    _need(r.engine_tp >= 1, "rollout.engine_tp", "must be >= 1")
    _need(r.dtype in ("auto", "float32", "bfloat16"), "rollout.dtype", "auto, float32 or bfloat16")
    _need(r.refit_bucket_mb >= 1, "rollout.refit_bucket_mb", "must be >= 1")
    if r.routing_replay:
        _need(
            recipe.backend == "local" and r.engine == "vllm",
            "rollout.routing_replay",
            "records the experts in the vLLM engine of the local backend (rollout.engine=vllm)",
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


def _check_parallel(p: ParallelSection) -> None:
    """The layout (ParallelLayout's rules), then the micro-batching and memory keys."""
    layout = p.layout()
    try:
        layout.check_micro_batching(token_budget=p.max_tokens_per_microbatch is not None)
    except LayoutError as e:
        raise RecipeError(e.renamed(RECIPE_KEYS)) from None
    _need(p.micro_batch_size >= 1, "parallel.micro_batch_size", "must be >= 1")
    for k in ("max_tokens_per_microbatch", "logprob_chunk_size"):
        v = getattr(p, k)
        _need(v is None or v >= 1, f"parallel.{k}", f"must be a positive integer or null, got {v}")
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
        return
    _need(recipe.warmstart.enabled, "warmstart.enabled", "false needs model.pretrained")
    _need(d.task == "arithmetic", "data.task", "math needs model.pretrained")
    _need(recipe.tokenizer.kind == "trained-bpe", "tokenizer.kind", "hf needs model.pretrained")
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


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe: no such file {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: {path} must hold a mapping at the top level")
    data = apply_overrides(data, list(overrides or []))
    return validate(_build(Recipe, data, ""))
