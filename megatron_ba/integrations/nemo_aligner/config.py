"""The `model.grpo` section of a NeMo-Aligner config: what our actor and trainer read.

NeMo-Aligner's configs nest everything under `model` (the actor) and `trainer.reinforce` (the
loop); our GRPO settings live in `model.grpo` so that the actor, which only sees `model`, can
read them. Unknown keys fail with the key named (a typo must not silently mean a default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_ba.aggregation import RULES, SCOPES
from megatron_ba.loss import GRPOLossConfig


@dataclass(frozen=True)
class GRPOSettings:
    rule: str = "balanced"
    scope: str = "group"
    reg_rule: str = "token"
    reg_scope: str = "batch"
    max_length: int | None = None  # dr_grpo's budget
    neutral_eps: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    temperature: float = 1.0  # log-probs at this temperature (NeMo's inference log-probs use 1)
    logprob_chunk_size: int | None = None
    num_groups: int | None = None  # default: model.reinforce.num_rollout_samples (prompts/step)
    normalize_std: bool = True
    std: str = "population"
    drop_zero_variance: bool = False
    reward: str = "math"  # verifiable math answers (megatron_ba.rewards.math_score_batch)

    @property
    def loss(self) -> GRPOLossConfig:
        return GRPOLossConfig(self.clip_low, self.clip_high, self.dual_clip, self.kl_coef, 0.0)


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
    s = GRPOSettings(**data)
    if s.rule not in RULES:
        raise ValueError(f"model.grpo.rule: must be one of {', '.join(RULES)}, got {s.rule!r}")
    if s.reg_rule not in RULES:
        raise ValueError(
            f"model.grpo.reg_rule: must be one of {', '.join(RULES)}, got {s.reg_rule!r}"
        )
    for key in ("scope", "reg_scope"):
        if getattr(s, key) not in SCOPES:
            raise ValueError(
                f"model.grpo.{key}: must be one of {', '.join(SCOPES)}, got {getattr(s, key)!r}"
            )
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
    _ = s.loss  # GRPOLossConfig validates clip_low, clip_high, dual_clip, kl_coef
    return s
