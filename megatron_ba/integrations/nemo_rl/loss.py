"""`BalancedPGLossFn`: a NeMo-RL `LossFunction` whose policy-gradient term is a megatron-ba plan.

NeMo-RL (read at v0.7.0, commit 81aa43dd; the contract is checked in tests) calls a loss function on
each micro-batch as `loss_fn(next_token_logprobs=..., data=mb, global_valid_seqs=...,
global_valid_toks=...)`, sums the returned losses over micro-batches and cancels the
data-parallel gradient mean (`loss = result * dp_size * cp_size` in its DTensor/automodel path,
`* num_microbatches / cp_size` against Megatron's averaging): each call must return its
micro-batch's additive share of the global loss. Its own `ClippedPGLossFn` gets that share by
dividing by the global token or sequence count; no hook receives a prompt-group id.

Here the plan is built on the driver, where `policy.train(train_data, loss_fn)` still holds the
whole global batch (`attach_plan`): whole-response lengths from token_mask * sample_mask, one
advantage per response, group ids from GRPO's layout (prompts repeated `num_generations_per_prompt`
times, consecutively). The per-group statistics are reduced there, by the core, to per-sequence
weights, which are carried in the data dict as rows (`ba_weights`, `ba_reg_weights`), the only form
that survives NeMo-RL's slicing of the dict into DP shards and micro-batches. The loss applies them
with the core's `grpo_loss`; `global_valid_seqs/toks` are not needed (the weights are global).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from megatron_ba.errors import SettingError
from megatron_ba.integrations._common import sequence_advantages
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.rules import AggregationSettings

try:  # NeMo-RL compares these by identity with its own enums
    from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
except ImportError:  # not installable here: same names and values (checked by the contract test)

    class LossType(enum.Enum):
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class LossInputType(enum.Enum):
        LOGPROB = "logprob"


PLAN_KEYS = ("ba_weights", "ba_reg_weights")
# The data-dict keys each step reads, and where NeMo-RL's GRPO puts them (for the error message).
DATA_KEYS = {
    "token_mask": "GRPO's train_data",
    "sample_mask": "GRPO's train_data",
    "advantages": "GRPO's train_data (computed from rewards before policy.train)",
    "prev_logprobs": "GRPO's train_data (policy.get_logprobs before policy.train)",
}
REF_KEY = "reference_policy_logprobs"

# ClippedPGLossFn settings whose effect this loss would drop: value allowed, and why.
_IGNORED = {
    "disable_ppo_ratio": (False, "the core's term is the clipped PPO ratio"),
    "use_cispo": (False, "CISPO is not the core's PPO term"),
    "force_on_policy_ratio": (False, "the ratio is taken against prev_logprobs"),
    "sequence_level_importance_ratios": (False, "GSPO's sequence ratios are not a token plan"),
    "use_importance_sampling_correction": (False, "the core has no per-token IS factor"),
    "token_level_loss": (True, "ba_rule decides the normalisation; ba_rule=sequence is the "
                         "sequence-level mean"),
}  # fmt: skip
# ... and those that only matter when the KL term is on (the core's KL is plain k3).
_IGNORED_WITH_KL = {
    "reference_policy_kl_type": ("k3", "the core's KL term is k3"),
    "use_on_policy_kl_approximation": (False, "the core's KL has no importance weights"),
    "kl_input_clamp_value": (None, "the core's KL is not clamped"),
    "kl_output_clamp_value": (None, "the core's KL is not clamped"),
}
# AggregationSettings field -> its key in NeMo-RL's loss_fn config
CONFIG_KEYS = {f: f"ba_{f}" for f in ("rule", "scope", "max_length", "neutral_eps")}


class BalancedPGLossFn:
    """NeMo-RL LossFunction: the clipped PG loss with per-sequence weights from `attach_plan`.

    Args:
        cfg: NeMo-RL's `loss_fn` config (ClippedPGLossConfig or a dict): reads ratio_clip_min,
            ratio_clip_max, ratio_clip_c, reference_policy_kl_penalty and, as extra keys (the
            pydantic model allows them), ba_rule, ba_scope, ba_neutral_eps.
        group_size: responses per prompt (grpo.num_generations_per_prompt).

    A `loss_fn` setting of ClippedPGLossFn whose effect this loss would drop (`_IGNORED`, and
    `_IGNORED_WITH_KL` when the KL term is on) raises ValueError naming it, as does a data dict
    without a key the step reads (`DATA_KEYS`, the plan's keys, `reference_policy_logprobs` with
    the KL term) or with plan rows that are not this micro-batch's.
    """

    # TOKEN_LEVEL so that NeMo-RL checks `token_mask` is present; the plan, not this flag,
    # decides the normalisation.
    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: Any, *, group_size: int):
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        try:
            self.aggregation = AggregationSettings(
                rule=get("ba_rule", "balanced"),
                scope=get("ba_scope", "group"),
                max_length=get("ba_max_length", None),
                neutral_eps=float(get("ba_neutral_eps", 0.0)),
            )
        except SettingError as e:
            raise ValueError(e.renamed(CONFIG_KEYS, prefix="loss_fn.")) from None
        if not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size: must be an integer >= 1, got {group_size!r}")
        for key, (allowed, why) in _IGNORED.items():
            if get(key, allowed) != allowed:
                raise ValueError(
                    f"loss_fn.{key}: BalancedPGLossFn supports only {allowed!r} ({why}), got "
                    f"{get(key)!r}; set loss_fn.{key}={allowed!r} or use NeMo-RL's ClippedPGLossFn"
                )
        # As in ClippedPGLossFn: with use_kl_in_reward the KL is in the reward, not the loss.
        kl_coef = 0.0 if get("use_kl_in_reward", False) else get("reference_policy_kl_penalty", 0.0)
        if kl_coef:
            for key, (allowed, why) in _IGNORED_WITH_KL.items():
                if get(key, allowed) != allowed:
                    raise ValueError(
                        f"loss_fn.{key}: BalancedPGLossFn supports only {allowed!r} when "
                        f"reference_policy_kl_penalty != 0 ({why}), got {get(key)!r}"
                    )
        self.group_size = group_size
        self.config = GRPOLossConfig(
            clip_low=get("ratio_clip_min", 0.2),
            clip_high=get("ratio_clip_max", 0.2),
            dual_clip=get("ratio_clip_c", None),
            kl_coef=kl_coef or 0.0,
        )

    @staticmethod
    def _mask(data) -> torch.Tensor:
        # NeMo-RL's layout: token t's log-prob is predicted at t-1, hence the [:, 1:] shift.
        return data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)

    @staticmethod
    def _require(data, keys, where: str) -> None:
        """ValueError naming each key of `keys` missing from `data` (not a KeyError deep inside)."""
        missing = [k for k in keys if k not in data]
        if missing:
            sources = "; ".join(f"{k}: {DATA_KEYS.get(k, where)}" for k in missing)
            raise ValueError(f"data: missing {missing} ({sources})")

    def attach_plan(self, data) -> None:
        """Add the plan's weights to the global batch `data` (in place), before policy.train."""
        self._require(data, ("token_mask", "sample_mask", "advantages"), "")
        mask = self._mask(data)
        lengths = mask.to(torch.float64).sum(dim=1)
        advantages = sequence_advantages(data["advantages"][:, 1:], mask, name="advantages")
        n = lengths.numel()
        if n % self.group_size:
            raise ValueError(
                f"data: {n} sequences are not whole groups of group_size={self.group_size}"
            )
        group_ids = torch.arange(n) // self.group_size
        plan = LossPlan.build(self.aggregation, lengths, advantages.to(torch.float64), group_ids)
        data["ba_weights"] = plan.pg_weights
        data["ba_reg_weights"] = plan.reg_weights

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data,
        global_valid_seqs: torch.Tensor | None = None,
        global_valid_toks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        missing = [k for k in PLAN_KEYS if k not in data]
        if missing:
            raise ValueError(
                f"data: missing {missing}; call attach_plan(train_data) on the global batch "
                "before policy.train (the entry script run_grpo_balanced does this)"
            )
        needed = [*DATA_KEYS, REF_KEY] if self.config.kl_coef > 0 else list(DATA_KEYS)
        self._require(data, needed, "policy.get_reference_policy_logprobs (KL term on)")
        mask = self._mask(data).bool()
        rows = mask.shape[0]
        for key in PLAN_KEYS:
            if tuple(data[key].shape) != (rows,):
                raise ValueError(
                    f"data[{key!r}]: must hold one weight per row of this micro-batch ({rows}), "
                    f"got shape {tuple(data[key].shape)}; attach_plan must run on the global batch "
                    f"before NeMo-RL slices it"
                )
        advantages = sequence_advantages(data["advantages"][:, 1:], mask, name="advantages")
        plan = LossPlan(data["ba_weights"], data["ba_reg_weights"], advantages)
        ref = data[REF_KEY][:, 1:] if self.config.kl_coef > 0 else None
        loss, metrics = grpo_loss(
            next_token_logprobs,
            data["prev_logprobs"][:, 1:],
            mask,
            plan,
            self.config,
            ref_logprobs=ref,
        )
        # NeMo-RL sums metrics over micro-batches: report additive shares only.
        out = {
            "loss": float(loss.detach()),
            "pg_loss": float(metrics["pg_loss"]),
            "ba_weight_pos_sum": float(metrics["weight_pos_sum"]),
            "ba_weight_neg_sum": float(metrics["weight_neg_sum"]),
            "num_valid_samples": float(data["sample_mask"].sum()),
        }
        if "kl" in metrics:
            out["kl_penalty"] = float(metrics["kl"])
        return loss, out
