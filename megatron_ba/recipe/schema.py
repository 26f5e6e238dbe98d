"""The recipe's schema: one dataclass per section, the Recipe that holds them (docs/recipes.md
lists every key). A section that checks its own values (the loss: its aggregation settings; the
parallel keys: their ParallelLayout) raises naming the key; the cross-field checks are
megatron_ba.recipe.validation'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ba.errors import SettingError, UserError
from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig, RolloutCorrectionSettings
from megatron_ba.model_shape import PRESETS, ModelShape
from megatron_ba.parallel.parallel_layout import RECIPE_KEYS, LayoutError, ParallelLayout
from megatron_ba.step_settings import MicroBatching, StepSettings


class RecipeError(UserError):
    """A recipe that cannot be loaded; the message names the key."""


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
    """The policy: a Hugging Face checkpoint (`pretrained`), or a fresh decoder of the shape keys
    below: Qwen2-shaped (RMSNorm, SwiGLU, RoPE, GQA, QKV bias, untied output layer) by default,
    or the architecture of the `preset` the recipe names."""

    pretrained: str | None = None  # a Hugging Face folder: weights and architecture
    # A fresh model's architecture: a megatron_ba.model_shape preset (e.g. tiny-qwen3.5, the
    # hybrid Gated DeltaNet decoder) that fills every field the shape keys below leave out;
    # null: "tiny" (Qwen2), or "tiny-moe"'s family (Qwen3-MoE) with experts.
    preset: str | None = None
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
        """The shape keys, the preset's (default TINY_SHAPE) filling those the recipe leaves out
        (no checkpoint)."""
        base = TINY_SHAPE if self.preset is None else vars(PRESETS[self.preset])
        return {k: base[k] if v is None else v for k, v in self._shape_keys().items()}

    def set_shape_keys(self) -> dict[str, Any]:
        """The shape keys the recipe sets (with a checkpoint they must agree with its config)."""
        return {k: v for k, v in self._shape_keys().items() if v is not None}

    def fresh_shape(self, vocab_size: int) -> ModelShape:
        """The fresh model these keys describe, with the tokenizer's `vocab_size`: the "tiny"
        preset's family (Qwen2), or with experts the "tiny-moe" preset's (Qwen3-MoE: q/k norms,
        no QKV bias); untied, the head dimension hidden / heads. With `preset`, that preset with
        the shape keys the recipe sets (its other fields, e.g. Qwen3.5's DeltaNet heads and
        layer pattern, kept). What the warm start builds and the planner plans for."""
        shape = self.shape()
        if self.preset is not None:
            if PRESETS[self.preset].family == "qwen3_5_moe":
                # Every layer's MLP is its experts: config.json holds no dense width and reads
                # the experts' back as ffn_hidden_size (recipe validation refuses another).
                shape["ffn_hidden_size"] = shape["moe_ffn_hidden_size"]
            return dataclasses.replace(PRESETS[self.preset], vocab_size=vocab_size, **shape)
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


@dataclass
class ParallelSection:
    """The parallel layout's keys (tp, pp and its uneven stages, cp, ep, etp, sequence_parallel:
    `layout()` builds the
    megatron_ba.parallel.parallel_layout.ParallelLayout they describe, which holds every rule they
    must keep; dp is what the world leaves), then the step's micro-batching and memory keys."""

    tp: int = 1
    pp: int = 1
    # Uneven pipeline stages (megatron-core's num_layers_in_first / last_pipeline_stage): the
    # first / last stage's layers, the rest shared evenly by the stages between; null: even.
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    cp: int = 1
    ep: int = 1  # expert parallelism (mixture-of-experts models), carved out of DP x CP
    etp: int | None = None  # expert tensor parallelism; null: megatron-core's default, tp
    micro_batch_size: int = 64  # sequences per micro-batch on each data-parallel rank
    # Token-budget micro-batches (prompt + response tokens, rows x longest on CPU); null: fixed
    # micro_batch_size sequences. Replaces micro_batch_size when set.
    max_tokens_per_microbatch: int | None = None
    # Tokens per chunk of the vocab-parallel log-softmax; null: auto (step_settings.AUTO_CHUNK).
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
                pp_first_stage_layers=self.pp_first_stage_layers,
                pp_last_stage_layers=self.pp_last_stage_layers,
            )
        except LayoutError as e:
            raise RecipeError(e.renamed(RECIPE_KEYS)) from None

    def micro_batching(self) -> MicroBatching:
        """The step's micro-batching these keys describe (RecipeError naming a bad key)."""
        try:
            return MicroBatching(
                self.micro_batch_size, self.max_tokens_per_microbatch, self.logprob_chunk_size
            )
        except SettingError as e:
            raise RecipeError(e.renamed(prefix="parallel.")) from None


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
    # asynchronous GRPO (train/rollout_schedule.py): the engines generate the next step's
    # rollouts while the trainer updates, on samples at most max_staleness steps old (0: the
    # synchronous loop); the engines are refit every sync_every steps (<= max_staleness)
    max_staleness: int = 0
    sync_every: int = 1
    # asynchronous single-process CPU runs: the cores the engine binds to (the last ones; the
    # trainer keeps the rest); default half of them, at least one
    engine_cores: int | None = None


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

    def step_settings(self) -> StepSettings:
        """The GRPO update's settings, built once from the loss, grpo and parallel sections:
        the aggregation (dr_grpo's budget: loss.max_length, default grpo.max_new_tokens), the
        loss's coefficients, the sampling temperature, the rollout correction, the
        micro-batching and the optimiser steps per rollout batch."""
        loss, grpo = self.loss, self.grpo
        return StepSettings(
            aggregation=dataclasses.replace(
                loss.aggregation_settings(), max_length=loss.max_length or grpo.max_new_tokens
            ),
            loss=loss.loss_config(),
            temperature=grpo.temperature,
            rollout_correction=loss.rollout_correction,
            micro_batching=self.parallel.micro_batching(),
            mini_batches=grpo.mini_batches,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def dump(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
