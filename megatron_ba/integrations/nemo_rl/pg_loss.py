"""`BalancedPGLossFn`: NeMo-RL's clipped policy-gradient loss, its policy-gradient term aggregated
by a megatron-ba plan.

NeMo-RL (v0.7.0) calls a loss function on each micro-batch as `loss_fn(next_token_logprobs=...,
data=mb, global_valid_seqs=..., global_valid_toks=...)`, sums the returned losses over
micro-batches and cancels the data-parallel gradient mean (`loss * dp_size * cp_size` in its
automodel path, `* num_microbatches / cp_size` against Megatron's averaging): each call returns its
micro-batch's additive share of the global loss. No hook receives a prompt-group id.

The plan is built on the driver, where `policy.train(train_data, loss_fn)` still holds the whole
rollout batch (`attach_plan`): whole-response lengths from token_mask * sample_mask, one advantage
per response, group ids from GRPO's layout (prompts repeated `num_generations_per_prompt` times,
consecutively). One plan per optimizer step: `policy.train` cuts the batch into consecutive chunks
of `train_global_batch_size` rows, one per step, before sharding each over the DP ranks
(`BatchedDataDict.shard_by_batch_size`), so with `step_size` (that size, a multiple of the group
size) each chunk holds whole groups and gets the plan of its own rows: the paper's mini-batches. The
core reduces the per-group statistics to per-sequence weights, carried in the data dict as rows
(`ba_weights`), the only form that survives NeMo-RL's slicing of the dict into DP shards, length-
sorted dynamic batches and packed sequences.

Per micro-batch, the loss is NeMo-RL's own `ClippedPGLossFn` on the micro-batch with each response's
advantage multiplied by its plan weight and by the normaliser that ClippedPGLossFn divides by:

    A'_i = w_i * (global_valid_toks + 1e-8) * A_i        (masked_mean's denominator, token level)

Its policy-gradient term is positively homogeneous in the advantage (the clipped min/max of
r A and clip(r) A, the dual clip c A, CISPO's sg(clip(r)) A log p and REINFORCE's A log p all scale
with A >= 0 factors; w_i >= 0), so it becomes sum_i w_i sum_t c_it phi_it(A_i) exactly: the plan's
aggregation, with NeMo-RL's own per-token factor c (its importance-sampling correction: plain,
`tis`, `icepop`, `seq-mask-tis`) and its own PPO variant. Everything else in that call is NeMo-RL's
and untouched by the advantages: the KL term (every `reference_policy_kl_type`, the clamps,
`use_on_policy_kl_approximation`, and the factor exp(lp - stopgrad(lp)) it puts on k3 otherwise),
normalised by the global token count, and every diagnostic `grpo_train` logs
(`token_mult_prob_error`, `gen_kl_error`, `probs_ratio*`, `is_oob_ratio`, ...). The same folding
makes verl's integration exact (megatron_ba/integrations/verl/adapter.py, docs/math.md).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ba.errors import SettingError
from megatron_ba.integrations._common import sequence_advantages
from megatron_ba.loss import LossPlan
from megatron_ba.loss_settings import AggregationSettings

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

# ClippedPGLossFn settings whose effect this loss cannot keep: the value it accepts, and why.
REFUSED = {
    "token_level_loss": (True, "ba_rule decides the normalisation of the policy-gradient term "
                         "(ba_rule=sequence is the sequence-level mean); NeMo-RL's sequence level "
                         "would divide it again"),
    "sequence_level_importance_ratios": (False, "GSPO's sequence ratios need NeMo-RL's sequence "
                                         "level (token_level_loss=false)"),
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


def _step_size(step_size, group_size: int) -> int | None:
    """step_size checked: None, or a positive multiple of group_size (whole groups per step)."""
    if step_size is None:
        return None
    if isinstance(step_size, bool) or not (isinstance(step_size, int) and step_size >= 1):
        raise ValueError(f"step_size: must be an integer >= 1, got {step_size!r}")
    if step_size % group_size:
        raise ValueError(
            f"step_size: {step_size} rows per optimizer step are not whole groups of "
            f"group_size={group_size} (each step's plan needs its groups whole)"
        )
    return step_size


class BalancedPGLossFn:
    """NeMo-RL LossFunction: the clipped PG loss with per-sequence weights from `attach_plan`.

    Args:
        cfg: NeMo-RL's `loss_fn` config, a `ClippedPGLossConfig` (what `MasterConfig.loss_fn`
            holds) or a dict of its fields (validated by it, with its defaults). Besides its
            fields, the extra keys ba_rule, ba_scope, ba_neutral_eps, ba_max_length choose the
            plan (megatron_ba.loss_settings.AggregationSettings).
        group_size: responses per prompt (grpo.num_generations_per_prompt).
        step_size: rows of one optimizer step (policy.train_global_batch_size), a multiple of
            group_size; None: the whole rollout batch is one step.

    A setting of `REFUSED` at another value, or an unknown `ba_*` key, raises ValueError naming
    it, as does a data dict without a key the step reads (`DATA_KEYS`, the plan's keys) or with
    plan rows that are not this micro-batch's.
    """

    def __init__(self, cfg: Any, *, group_size: int, step_size: int | None = None):
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
        self.step_size = _step_size(step_size, group_size)
        # NeMo-RL's own loss, called with folded advantages (module docstring).
        self.clipped = nemo_loss.ClippedPGLossFn(cfg)
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
        step = self.step_size or n
        if n % step:
            raise ValueError(
                f"data: {n} sequences do not split into optimizer steps of step_size={step} "
                "(policy.train_global_batch_size)"
            )
        weights = torch.empty(n, dtype=torch.float64)
        for start in range(0, n, step):  # one plan per optimizer step (module docstring)
            rows = slice(start, start + step)
            group_ids = torch.arange(step) // self.group_size
            plan = LossPlan.build(
                self.aggregation, lengths[rows], advantages[rows].to(torch.float64), group_ids
            )
            weights[rows] = plan.pg_weights.to(torch.float64)
        data[PLAN_KEY] = weights

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data,
        global_valid_seqs: torch.Tensor | None = None,
        global_valid_toks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        self._check_micro_batch(data)
        mask = self._mask(data)
        weights = data[PLAN_KEY]
        # What NeMo-RL's token-level masked_mean divides by: the global count, or this
        # micro-batch's when none is passed, plus its 1e-8.
        tokens = mask.sum() if global_valid_toks is None else global_valid_toks
        scale = weights.to(torch.float64) * (float(tokens) + 1e-8)
        folded = data["advantages"] * scale.to(data["advantages"].dtype)[:, None]
        loss, metrics = self.clipped(
            next_token_logprobs, {**data, "advantages": folded}, global_valid_seqs,
            global_valid_toks, **kwargs,
        )  # fmt: skip
        # NeMo-RL sums metrics over micro-batches: each is an additive share, as its own are.
        signs = sequence_advantages(data["advantages"][:, 1:], mask, name="advantages").sign()
        carried = weights * mask.sum(dim=1).to(weights.dtype)  # sum over its tokens of w_i
        metrics["ba_weight_pos_sum"] = float(carried[signs > 0].sum())
        metrics["ba_weight_neg_sum"] = float(carried[signs < 0].sum())
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
