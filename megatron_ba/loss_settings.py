"""The loss's settings without torch: the aggregation rules and scopes, the one settings type
that chooses among them, and the clipped loss's coefficients (GRPOLossConfig).

    settings = AggregationSettings(rule="balanced", scope="group", max_length=1024)
    plan = LossPlan.build(settings, lengths, advantages, group_ids)     # megatron_ba.loss

Kept apart from aggregation.py, which imports torch, so that the command line can offer the names
as choices in `--help` and argument errors, and the recipe can hold the settings, without
importing torch. Every place that aggregates (the recipe's `loss` section, the GRPO step, the
NeMo-Aligner, NeMo-RL, TRL and verl adapters) holds an AggregationSettings, validated once when
it is made. The clipped loss's coefficients are declared once too: the recipe's `loss` section and
NeMo-Aligner's `model.grpo` extend GRPOLossConfig, the other adapters build one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from megatron_ba.errors import SettingError

RULES = ("token", "sequence", "dr_grpo", "balanced", "balanced_mass", "group_token_mean")
SCOPES = ("group", "batch")
# The rules whose weights the scope does not change (docs/math.md, section 1): dr_grpo divides
# by a constant, group_token_mean is per prompt group by definition.
SCOPE_FREE_RULES = ("dr_grpo", "group_token_mean")
# How a report names each scope: the mean over prompt groups of each group's objective (the
# paper's formula), or the whole batch pooled as one group (verl's, DAPO's, SkyRL's token-mean).
SCOPE_NAMES = {"group": "per-group mean", "batch": "pooled batch mean"}


def aggregation_label(rule: str, scope: str) -> str:
    """A run's aggregation as a report names it: the rule, and which mean where the scope
    changes its weights. aggregation_label("token", "batch") == "token (pooled batch mean)";
    aggregation_label("dr_grpo", "batch") == "dr_grpo"."""
    if rule in SCOPE_FREE_RULES:
        return rule
    return f"{rule} ({SCOPE_NAMES.get(scope, f'scope {scope}')})"


def split_rule_value(value: str) -> tuple[str, str | None]:
    """A rule as a study's grid or `compare --rules` takes it: RULE (the recipe's loss.scope) or
    RULE@SCOPE (that scope): "token@batch" -> ("token", "batch"), "token" -> ("token", None).
    ValueError naming the value for an unknown rule or scope, or a scope on a rule it does not
    change (SCOPE_FREE_RULES)."""
    rule, sep, scope = value.partition("@")
    if rule not in RULES:
        raise ValueError(f"{value!r}: unknown rule {rule!r}; choose from {', '.join(RULES)}")
    if not sep:
        return rule, None
    if scope not in SCOPES:
        raise ValueError(f"{value!r}: unknown scope {scope!r}; choose from {', '.join(SCOPES)}")
    if rule in SCOPE_FREE_RULES:
        raise ValueError(f"{value!r}: the scope does not change {rule}'s weights; give {rule}")
    return rule, scope


@dataclass(frozen=True)
class AggregationSettings:
    """How the per-token terms of a GRPO loss are aggregated into one number.

    rule / scope: the policy-gradient term's plan (megatron_ba.aggregation). reg_rule / reg_scope:
    the plan of the regularisers (KL, entropy); a token mean over the batch by default.
    max_length: the generation budget dr_grpo divides by (None: the caller's default, else an
    error for dr_grpo). neutral_eps: responses with |A| <= neutral_eps count for neither sign.
    A bad value raises SettingError naming the field.
    """

    rule: str = "balanced"
    scope: str = "group"
    reg_rule: str = "token"
    reg_scope: str = "batch"
    max_length: int | None = None
    neutral_eps: float = 0.0

    def __post_init__(self) -> None:
        for key, choices in (
            ("rule", RULES),
            ("scope", SCOPES),
            ("reg_rule", RULES),
            ("reg_scope", SCOPES),
        ):
            value = getattr(self, key)
            if value not in choices:
                raise SettingError(key, f"must be one of {', '.join(choices)}, got {value!r}")
        eps = self.neutral_eps
        if (
            isinstance(eps, bool)
            or not isinstance(eps, int | float)
            or not (math.isfinite(eps) and eps >= 0)
        ):
            raise SettingError("neutral_eps", f"must be a finite number >= 0, got {eps!r}")

    def aggregation_settings(self) -> AggregationSettings:
        """These settings alone (a settings section that extends them, e.g. the recipe's `loss`,
        without its other fields)."""
        return AggregationSettings(
            **{f.name: getattr(self, f.name) for f in fields(AggregationSettings)}
        )


@dataclass(frozen=True)
class GRPOLossConfig:
    """The clipped GRPO loss's coefficients (the formula: megatron_ba.loss). clip_low / clip_high:
    the ratio's asymmetric bounds 1 - clip_low, 1 + clip_high; dual_clip: the lower bound of a
    negative advantage's term in units of A (None: off); kl_coef, entropy_coef: the regularisers'
    weights. A bad value raises SettingError naming the field."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (
                isinstance(v, int | float) and math.isfinite(v) and v >= 0
            ):
                raise SettingError(name, f"must be a finite number >= 0, got {v!r}")
        if self.clip_low >= 1:
            raise SettingError(
                "clip_low", f"must be < 1 (1 - clip_low bounds a ratio), got {self.clip_low}"
            )
        dual = self.dual_clip
        if dual is not None and (
            isinstance(dual, bool)
            or not isinstance(dual, int | float)
            or not (math.isfinite(dual) and dual > 1)
        ):
            raise SettingError("dual_clip", f"must be a finite number > 1 or None, got {dual!r}")

    def loss_config(self) -> GRPOLossConfig:
        """These coefficients alone (a settings section that extends them, without its other
        fields)."""
        return GRPOLossConfig(**{f.name: getattr(self, f.name) for f in fields(GRPOLossConfig)})


ROLLOUT_CORRECTION_MODES = (
    "none",
    "token_truncate",
    "token_mask",
    "token_reject",
    "sequence_truncate",
    "sequence_mask",
    "sequence_reject",
)


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    """The off-policy correction of the rollout engine's sampling (formulas:
    megatron_ba.rollout_correction). mode: one of ROLLOUT_CORRECTION_MODES; cap: the truncating
    modes' upper bound on the weight; low / high: the accepted ratios [low, high] of the masking
    and rejecting modes. A bad value raises SettingError naming the field."""

    mode: str = "none"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_CORRECTION_MODES:
            raise SettingError(
                "mode", f"must be one of {', '.join(ROLLOUT_CORRECTION_MODES)}, got {self.mode!r}"
            )
        for name in ("cap", "low", "high"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (
                isinstance(v, int | float) and math.isfinite(v) and v >= 0
            ):
                raise SettingError(name, f"must be a finite number >= 0, got {v!r}")
        if self.cap <= 0:
            raise SettingError("cap", f"must be > 0 (a weight bound), got {self.cap}")
        if not self.low <= self.high or self.high <= 0:
            raise SettingError(
                "high", f"must be > 0 and >= low ({self.low}) to accept any ratio, got {self.high}"
            )
