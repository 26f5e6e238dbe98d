"""The `model.grpo` section of a NeMo-Aligner config: what our actor and trainer read.

NeMo-Aligner's configs nest everything under `model` (the actor) and `trainer.reinforce` (the
loop); our GRPO settings live in `model.grpo` so that the actor, which only sees `model`, can
read them. Unknown keys fail with the key named (a typo must not silently mean a default), and so
do a missing section and the REINFORCE settings it replaces (`check_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_ba.errors import SettingError
from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig


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
    """GRPOSettings from `cfg.grpo` (an OmegaConf node or dict); ValueError on bad keys/values.

    `cfg` is the `model` section. A missing `grpo` section is refused (NeMo-Aligner's REINFORCE
    config has none, and its defaults would be a silent choice of rule); an empty one means the
    defaults. `num_groups` must be `reinforce.num_rollout_samples`, the group ids' range.
    """
    section = cfg.get("grpo", None)
    if section is None:
        raise ValueError(
            "model.grpo: missing; the GRPO actor reads its aggregation rule and loss from this "
            "section, which NeMo-Aligner's REINFORCE config lacks. Start from "
            "megatron_ba/integrations/nemo_aligner/conf/gpt_grpo_balanced.yaml (or give "
            "model.grpo: {} for its defaults)"
        )
    data = dict(section.items()) if hasattr(section, "items") else {}
    known = {f.name for f in fields(GRPOSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"model.grpo: unknown keys {unknown}; known keys: {sorted(known)}")
    prompts = (cfg.get("reinforce", None) or {}).get("num_rollout_samples", None)
    if data.get("num_groups") is None:
        data["num_groups"] = prompts
    elif prompts is not None and data["num_groups"] != prompts:
        # The trainer numbers each step's prompts 0..num_rollout_samples-1: another count would
        # size the plan's statistics for groups that do not exist (or miss some).
        raise ValueError(
            f"model.grpo.num_groups: is {data['num_groups']} but model.reinforce."
            f"num_rollout_samples (the prompts, hence groups, per step) is {prompts}; set "
            f"model.grpo.num_groups=null"
        )
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


def check_reinforce_keys(reinforce) -> None:
    """ValueError for the `trainer.reinforce` settings the GRPO trainer replaces or cannot use.

    `initial_policy_kl_penalty` is the parent's KL-in-reward, which the GRPO trainer's
    `generate_reinforce_data` does not compute (model.grpo.kl_coef is the KL, in the loss);
    `num_rollouts_per_prompt` is the group size G, and a group of one has advantage 0.
    """
    penalty = reinforce.get("initial_policy_kl_penalty", 0.0) or 0.0
    if penalty != 0:
        raise ValueError(
            f"trainer.reinforce.initial_policy_kl_penalty: is {penalty}, REINFORCE's KL in the "
            f"reward, which the GRPO trainer does not apply; set it to 0 and put the KL "
            f"coefficient in model.grpo.kl_coef (a k3 term of the loss)"
        )
    group_size = reinforce.get("num_rollouts_per_prompt", None)
    if group_size is not None and int(group_size) < 2:
        raise ValueError(
            f"trainer.reinforce.num_rollouts_per_prompt: is {group_size}; GRPO's groups need 2 "
            f"or more responses per prompt (one alone has advantage 0)"
        )


def check_config(cfg) -> GRPOSettings:
    """The whole train_grpo config: `trainer.reinforce` keys checked, `model.grpo` read."""
    check_reinforce_keys(cfg.get("trainer", {}).get("reinforce", None) or {})
    return grpo_settings(cfg.get("model", None) or {})
