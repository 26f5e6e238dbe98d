"""`BalancedPGLossFn`: NeMo-RL's clipped policy-gradient loss, its policy-gradient term aggregated
by a megatron-ba plan.

NeMo-RL (v0.7.0) calls a loss function on each micro-batch as `loss_fn(next_token_logprobs=...,
data=mb, global_valid_seqs=..., global_valid_toks=...)`, sums the returned losses over
micro-batches and cancels the data-parallel gradient mean (`loss * dp_size * cp_size` in its
automodel path, `* num_microbatches / cp_size` against Megatron's averaging): each call returns its
micro-batch's additive share of the global loss. No hook receives a prompt-group id.

The plan is built on the driver, where `policy.train(train_data, loss_fn)` still holds the whole
global batch (`attach_plan`): whole-response lengths from token_mask * sample_mask, one advantage
per response, group ids from GRPO's layout (prompts repeated `num_generations_per_prompt` times,
consecutively). The core reduces the per-group statistics to per-sequence weights, carried in the
data dict as rows (`ba_weights`), the only form that survives NeMo-RL's slicing of the dict into DP
shards, length-sorted dynamic batches and packed sequences.

Per micro-batch, the loss is the sum of two parts, each from the code that defines it:
- the policy-gradient term: the core's clipped PPO term with the plan's weights
  (`megatron_ba.loss.grpo_loss`);
- everything else: NeMo-RL's own `ClippedPGLossFn` on the same micro-batch with the advantages set
  to 0, which makes its policy-gradient term exactly 0 in value and gradient. What remains of it
  is its KL term (every `reference_policy_kl_type`, the clamps, `use_on_policy_kl_approximation`
  and the score-function factor exp(lp - stopgrad(lp)) it applies otherwise, normalised by the
  global token count) and every diagnostic `grpo_train` logs (`token_mult_prob_error`,
  `gen_kl_error`, `probs_ratio*`, ...), computed by NeMo-RL from the same inputs (the advantages
  enter none of them).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ba.errors import SettingError
from megatron_ba.integrations._common import sequence_advantages
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.rules import AggregationSettings

PLAN_KEY = "ba_weights"
# The data-dict keys each step reads, and where NeMo-RL's GRPO puts them (for the error message).
DATA_KEYS = {
    "token_mask": "GRPO's train_data",
    "sample_mask": "GRPO's train_data",
    "advantages": "GRPO's train_data (computed from rewards before policy.train)",
    "prev_logprobs": "GRPO's train_data (policy.get_logprobs before policy.train)",
    "generation_logprobs": "GRPO's train_data (the rollout engine's log-probs)",
    "reference_policy_logprobs": "GRPO's train_data (policy.get_reference_policy_logprobs; "
    "read with reference_policy_kl_penalty != 0)",
}
# AggregationSettings field -> its key in NeMo-RL's loss_fn config
CONFIG_KEYS = {f: f"ba_{f}" for f in ("rule", "scope", "max_length", "neutral_eps")}

# ClippedPGLossFn settings whose effect on the policy-gradient term this loss would drop: the
# value it accepts, and why.
REFUSED = {
    "disable_ppo_ratio": (False, "the core's term is the clipped PPO ratio"),
    "use_cispo": (False, "CISPO is not the core's PPO term"),
    "force_on_policy_ratio": (False, "the ratio is taken against prev_logprobs"),
    "sequence_level_importance_ratios": (False, "GSPO's sequence ratios are not a token plan"),
    "use_importance_sampling_correction": (False, "the core's term has no per-token IS factor"),
    "token_level_loss": (True, "ba_rule decides the normalisation of the policy-gradient term; "
                         "ba_rule=sequence is the sequence-level mean"),
    "positive_example_nll_weight": (0.0, "VAPO's NLL reads data['rewards'], which GRPO's "
                                    "train_data does not hold in NeMo-RL v0.7.0 (ClippedPGLossFn "
                                    "skips it silently there), and is normalised per micro-batch"),
}  # fmt: skip


def _nemo_rl_loss():
    """NeMo-RL's loss module (imported on use: this package imports without NeMo-RL)."""
    try:
        from nemo_rl.algorithms import loss
        from nemo_rl.algorithms.loss import interfaces
    except ImportError as e:
        raise ImportError(
            f"BalancedPGLossFn runs inside NeMo-RL, which is not importable here ({e}); install "
            "megatron-ba into NeMo-RL's environment (docs/integrations.md#nemo-rl)"
        ) from e
    return loss, interfaces


class BalancedPGLossFn:
    """NeMo-RL LossFunction: the clipped PG loss with per-sequence weights from `attach_plan`.

    Args:
        cfg: NeMo-RL's `loss_fn` config, a `ClippedPGLossConfig` (what `MasterConfig.loss_fn`
            holds) or a dict of its fields (validated by it, with its defaults). Besides its
            fields, the extra keys ba_rule, ba_scope, ba_neutral_eps, ba_max_length choose the
            plan (megatron_ba.rules.AggregationSettings).
        group_size: responses per prompt (grpo.num_generations_per_prompt).

    A setting of `REFUSED` at another value, or an unknown `ba_*` key, raises ValueError naming
    it, as does a data dict without a key the step reads (`DATA_KEYS`, the plan's keys) or with
    plan rows that are not this micro-batch's.
    """

    def __init__(self, cfg: Any, *, group_size: int):
        nemo_loss, interfaces = _nemo_rl_loss()
        if not isinstance(cfg, nemo_loss.ClippedPGLossConfig):
            cfg = nemo_loss.ClippedPGLossConfig(**dict(cfg))
        extra = dict(cfg.model_extra or {})
        unknown = sorted(k for k in extra if k.startswith("ba_") and k not in CONFIG_KEYS.values())
        if unknown:
            raise ValueError(
                f"loss_fn.{unknown[0]}: unknown key; BalancedPGLossFn reads "
                f"{', '.join(CONFIG_KEYS.values())}"
            )
        defaults = AggregationSettings()
        try:
            self.aggregation = AggregationSettings(
                **{f: extra.get(key, getattr(defaults, f)) for f, key in CONFIG_KEYS.items()}
            )
        except SettingError as e:
            raise ValueError(e.renamed(CONFIG_KEYS, prefix="loss_fn.")) from None
        if isinstance(group_size, bool) or not (isinstance(group_size, int) and group_size >= 1):
            raise ValueError(f"group_size: must be an integer >= 1, got {group_size!r}")
        for key, (allowed, why) in REFUSED.items():
            if getattr(cfg, key) != allowed:
                raise ValueError(
                    f"loss_fn.{key}: BalancedPGLossFn supports only {allowed!r} ({why}), got "
                    f"{getattr(cfg, key)!r}; set loss_fn.{key}={allowed!r} or use NeMo-RL's "
                    f"ClippedPGLossFn"
                )
        self.group_size = group_size
        # NeMo-RL's own loss, for its KL term and diagnostics (module docstring).
        self.clipped = nemo_loss.ClippedPGLossFn(cfg)
        self.config = GRPOLossConfig(
            clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max, dual_clip=cfg.ratio_clip_c
        )
        # What NeMo-RL reads off a loss function: its enums (compared by identity), and the KL
        # coefficient (prepare_loss_input computes the unfiltered log-probs the KL needs under
        # top-k/top-p sampling only when it finds it non-zero).
        self.loss_type = interfaces.LossType.TOKEN_LEVEL
        self.input_type = interfaces.LossInputType.LOGPROB
        self.reference_policy_kl_penalty = self.clipped.reference_policy_kl_penalty

    @staticmethod
    def _mask(data) -> torch.Tensor:
        # NeMo-RL's layout: token t's log-prob is predicted at t-1, hence the [:, 1:] shift.
        return data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)

    @staticmethod
    def _require(data, keys) -> None:
        """ValueError naming each key of `keys` missing from `data` (not a KeyError deep inside)."""
        missing = [k for k in keys if k not in data]
        if missing:
            sources = "; ".join(f"{k}: {DATA_KEYS[k]}" for k in missing)
            raise ValueError(f"data: missing {missing} ({sources})")

    def attach_plan(self, data) -> None:
        """Add the plan's weights to the global batch `data` (in place), before policy.train."""
        self._require(data, ("token_mask", "sample_mask", "advantages"))
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
        data[PLAN_KEY] = plan.pg_weights

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data,
        global_valid_seqs: torch.Tensor | None = None,
        global_valid_toks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        self._check_micro_batch(data)
        mask = self._mask(data).bool()
        advantages = sequence_advantages(data["advantages"][:, 1:], mask, name="advantages")
        # The regularisers are NeMo-RL's (below): the core's plan carries no weights for them.
        weights = data[PLAN_KEY]
        plan = LossPlan(weights, torch.zeros_like(weights), advantages)
        pg_loss, pg_metrics = grpo_loss(
            next_token_logprobs, data["prev_logprobs"][:, 1:], mask, plan, self.config
        )
        no_pg = {**data, "advantages": torch.zeros_like(data["advantages"])}
        rest, metrics = self.clipped(
            next_token_logprobs, no_pg, global_valid_seqs, global_valid_toks, **kwargs
        )
        loss = pg_loss + rest
        # NeMo-RL sums metrics over micro-batches: each is an additive share, as its own are.
        metrics["loss"] = float(loss.detach())
        metrics["ba_pg_loss"] = float(pg_metrics["pg_loss"])
        metrics["ba_weight_pos_sum"] = float(pg_metrics["weight_pos_sum"])
        metrics["ba_weight_neg_sum"] = float(pg_metrics["weight_neg_sum"])
        return loss, metrics

    def _check_micro_batch(self, data) -> None:
        if PLAN_KEY not in data:
            raise ValueError(
                f"data: missing ['{PLAN_KEY}']; call attach_plan(train_data) on the global batch "
                "before policy.train (the entry script run_grpo_balanced does this)"
            )
        needed = [k for k in DATA_KEYS if k != "reference_policy_logprobs"]
        if self.reference_policy_kl_penalty != 0:
            needed.append("reference_policy_logprobs")
        self._require(data, needed)
        rows = data["token_mask"].shape[0]
        if tuple(data[PLAN_KEY].shape) != (rows,):
            raise ValueError(
                f"data[{PLAN_KEY!r}]: must hold one weight per row of this micro-batch ({rows}), "
                f"got shape {tuple(data[PLAN_KEY].shape)}; attach_plan must run on the global "
                f"batch before NeMo-RL slices it"
            )
