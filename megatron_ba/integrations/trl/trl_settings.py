"""What both TRL trainers of megatron-ba read from their arguments: the plan's settings under the
names TRL users pass them (`aggregation=` for the core's `rule`), and the clipped PPO term's
coefficients from TRL's own clipping arguments."""

from __future__ import annotations

from megatron_ba.errors import SettingError
from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig

# The trainers' keyword for the core's `rule` (TRL's own `loss_type` names its per-token losses).
_NAMES = {"rule": "aggregation"}


def aggregation_settings(aggregation: str, scope: str, **settings) -> AggregationSettings:
    """AggregationSettings of the trainer's keywords; a bad value raises SettingError naming the
    keyword (`aggregation`, `scope`, `neutral_eps`, ...), before TRL builds anything."""
    try:
        return AggregationSettings(rule=aggregation, scope=scope, **settings)
    except SettingError as e:
        raise SettingError(_NAMES.get(e.key, e.key), e.problem) from None


def clip_config(epsilon_low: float, epsilon_high: float, **coefficients) -> GRPOLossConfig:
    """The core's loss coefficients with TRL's clipping bounds (args.epsilon, args.epsilon_high:
    rho is clipped to [1 - epsilon_low, 1 + epsilon_high], as in TRL's own loss)."""
    return GRPOLossConfig(clip_low=epsilon_low, clip_high=epsilon_high, **coefficients)
