"""megatron-ba: Balanced Aggregation (BA) for GRPO, exact under megatron-core parallelism.

The core (this package's top level) is pure torch: aggregation plans, the GRPO loss, group
advantages and diagnostics. The megatron-core adapters (megatron_ba.megatron) and the vLLM engine
(megatron_ba.generation) live in subpackages and import their frameworks only when used.

The names below are imported on first use (PEP 562), so that `import megatron_ba.cli` (and so
`megatron-ba --help`) does not import torch; `from megatron_ba import sequence_weights` works as
before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "AdvantageReport": "megatron_ba.advantages",
    "group_advantages": "megatron_ba.advantages",
    "RULES": "megatron_ba.aggregation",
    "SCOPES": "megatron_ba.aggregation",
    "PlanStatistics": "megatron_ba.aggregation",
    "apply_weights": "megatron_ba.aggregation",
    "apply_weights_packed": "megatron_ba.aggregation",
    "plan_statistics": "megatron_ba.aggregation",
    "sequence_weights": "megatron_ba.aggregation",
    "weights_from_statistics": "megatron_ba.aggregation",
    "GRPOLossConfig": "megatron_ba.loss",
    "LossPlan": "megatron_ba.loss",
    "grpo_loss": "megatron_ba.loss",
    "AggregationSettings": "megatron_ba.loss_settings",
}

__all__ = [
    "RULES",
    "SCOPES",
    "AdvantageReport",
    "AggregationSettings",
    "GRPOLossConfig",
    "LossPlan",
    "PlanStatistics",
    "apply_weights",
    "apply_weights_packed",
    "group_advantages",
    "grpo_loss",
    "plan_statistics",
    "sequence_weights",
    "weights_from_statistics",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ below imports them
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
    from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
    from megatron_ba.loss_settings import AggregationSettings


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_ba' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
