"""One GRPO update's settings, one type passed whole: the loss (its aggregation plan, the clipped
loss's coefficients, the sampling temperature), the rollout correction, how each rank's rows are
cut into micro-batches, and the optimiser steps per rollout batch.

    settings = recipe.step_settings()            # the recipe builds it once (megatron_ba.recipe)
    settings = StepSettings(AggregationSettings("balanced", max_length=64), temperature=1.0)
    settings.micro_batching.count(13)            # micro-batches of a rank's 13 rows
    settings.micro_batching.logprob_chunk(8192)  # tokens per chunk of the log-softmax (or None)

The trainer's update (megatron_ba.train.update), the megatron-core step (megatron_ba.megatron.
grpo_step) and the layout check read it; the planner reads the chunking rule. Pure Python: no
torch, no framework. A bad value raises SettingError naming the field (a recipe renames it:
`parallel.micro_batch_size`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ba.errors import SettingError
from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig, RolloutCorrectionSettings

# `logprob_chunk_size: None` (auto): a micro-batch above AUTO_CHUNK_ABOVE tokens walks its
# vocab-parallel log-softmax AUTO_CHUNK tokens at a time, so the fp32 softmax buffers stay
# O(AUTO_CHUNK x V/TP) (2 x 1024 x 152k/TP x 4 bytes = 1.2 GB at TP=1 for Qwen2's vocabulary)
# instead of O(T x V/TP). The step and the planner (its recipe overrides) read them.
AUTO_CHUNK_ABOVE, AUTO_CHUNK = 4096, 1024


def _positive_or_none(key: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SettingError(key, f"must be a positive integer or null, got {value!r}")


@dataclass(frozen=True)
class MicroBatching:
    """How a rank's rows are cut for the schedule: micro_batch_size sequences each (the sizes
    differ by one where they do not divide), or token-budget micro-batches of at most
    max_tokens_per_microbatch tokens (prompt + response; rows x longest on CPU); and the tokens
    per chunk of the vocab-parallel log-softmax (None: auto, `logprob_chunk`)."""

    micro_batch_size: int = 64
    max_tokens_per_microbatch: int | None = None
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        m = self.micro_batch_size
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise SettingError("micro_batch_size", f"must be >= 1, got {m!r}")
        _positive_or_none("max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        _positive_or_none("logprob_chunk_size", self.logprob_chunk_size)

    def count(self, rows: int) -> int:
        """Micro-batches of `rows` sequences (fixed sizes; a token budget cuts its own)."""
        return -(-rows // min(self.micro_batch_size, rows)) if rows else 0

    def logprob_chunk(self, num_tokens: int) -> int | None:
        """The chunk of a micro-batch of `num_tokens` tokens: logprob_chunk_size, else
        AUTO_CHUNK above AUTO_CHUNK_ABOVE tokens and unchunked (None) below."""
        if self.logprob_chunk_size is not None:
            return self.logprob_chunk_size
        return AUTO_CHUNK if num_tokens > AUTO_CHUNK_ABOVE else None


@dataclass(frozen=True)
class StepSettings:
    """Everything one GRPO update is configured by (module docstring). aggregation.max_length
    is dr_grpo's budget, resolved (the recipe's default: grpo.max_new_tokens); mini_batches:
    optimiser steps per rollout batch, each over whole prompt groups with its own plan."""

    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    temperature: float = 1.0  # the sampler's: logits are divided by it before the softmax
    rollout_correction: RolloutCorrectionSettings = field(default_factory=RolloutCorrectionSettings)
    micro_batching: MicroBatching = field(default_factory=MicroBatching)
    mini_batches: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and self.temperature > 0):
            raise SettingError("temperature", f"must be > 0, got {self.temperature!r}")
        m = self.mini_batches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise SettingError("mini_batches", f"must be >= 1, got {m!r}")
