"""megatron-ba: Balanced Aggregation (BA) for GRPO, exact under megatron-core parallelism.

The core (this package's top level) is pure torch: aggregation plans, the GRPO loss, group
advantages and diagnostics. The megatron-core adapters (megatron_ba.megatron) and the vLLM engine
(megatron_ba.generation) live in subpackages and import their frameworks only when used.
"""

from megatron_ba.advantages import AdvantageReport, group_advantages
from megatron_ba.aggregation import (
    RULES,
    SCOPES,
    PlanStatistics,
    apply_weights,
    apply_weights_packed,
    plan_statistics,
    sequence_weights,
    weights_from_statistics,
)
from megatron_ba.loss import GRPOLossConfig, grpo_loss

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "SCOPES",
    "AdvantageReport",
    "GRPOLossConfig",
    "PlanStatistics",
    "apply_weights",
    "apply_weights_packed",
    "group_advantages",
    "grpo_loss",
    "plan_statistics",
    "sequence_weights",
    "weights_from_statistics",
]
