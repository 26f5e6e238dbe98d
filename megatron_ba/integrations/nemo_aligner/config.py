"""The `model.grpo` section of a NeMo-Aligner config: what our actor and trainer read.

NeMo-Aligner's configs nest everything under `model` (the actor) and `trainer.reinforce` (the
loop); our GRPO settings live in `model.grpo` so that the actor, which only sees `model`, can
read them. Unknown keys fail with the key named (a typo must not silently mean a default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_ba.errors import SettingError
from megatron_ba.rules import AggregationSettings, GRPOLossConfig


@dataclass(frozen=True)
class GRPOSettings(GRPOLossConfig, AggregationSettings):
    """The aggregation settings (rule, scope, reg_rule, reg_scope, max_length, neutral_eps), the
    clipped loss's coefficients (entropy_coef must stay 0: the actor computes no entropy), then
    the log-probs' and the advantages' settings."""

    temperature: float = 1.0  # log-probs at this temperature (NeMo's inference log-probs use 1)
    logprob_chunk_size: int | None = None
    num_groups: int | None = None  # default: model.reinforce.num_rollout_samples (prompts/step)
    normalize_std: bool = True
    std: str = "population"
    drop_zero_variance: bool = False
    reward: str = "math"  # verifiable math answers (megatron_ba.rewards.math_score_batch)

    def __post_init__(self) -> None:
        AggregationSettings.__post_init__(self)
        GRPOLossConfig.__post_init__(self)
        if self.entropy_coef != 0:
            raise SettingError(
                "entropy_coef",
                f"the GRPO actor has no entropy bonus (use 0), got {self.entropy_coef!r}",
            )

    @property
    def loss(self) -> GRPOLossConfig:
        return self.loss_config()


def grpo_settings(cfg) -> GRPOSettings:
    """GRPOSettings from `cfg.grpo` (an OmegaConf node or dict); ValueError on bad keys/values."""
    section = cfg.get("grpo", None) or {}
    data = dict(section.items()) if hasattr(section, "items") else {}
    known = {f.name for f in fields(GRPOSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"model.grpo: unknown keys {unknown}; known keys: {sorted(known)}")
    if data.get("num_groups") is None:
        reinforce = cfg.get("reinforce", None) or {}
        data["num_groups"] = reinforce.get("num_rollout_samples", None)
    try:
        s = GRPOSettings(**data)
    except SettingError as e:
        raise ValueError(e.renamed(prefix="model.grpo.")) from None
    if not (isinstance(s.num_groups, int) and s.num_groups >= 1):
        raise ValueError(
            "model.grpo.num_groups: must be an integer >= 1 (prompts per step; default "
            f"model.reinforce.num_rollout_samples), got {s.num_groups!r}"
        )
    if s.std not in ("population", "sample"):
        raise ValueError(f"model.grpo.std: population or sample, got {s.std!r}")
    if s.reward != "math":
        raise ValueError(
            f"model.grpo.reward: only 'math' (verifiable answers) is built in, got {s.reward!r}"
        )
    return s
