"""The GRPO token loss, aggregated by a per-sequence weight plan.

Per token (rho = pi_theta / pi_old, asymmetric "clip-higher" bounds of DAPO):

    phi_{i,t} = min(rho A_i, clip(rho, 1 - clip_low, 1 + clip_high) A_i)
    dual clip (Ye et al. 2020, A_i < 0 only):  phi_{i,t} = max(phi_{i,t}, dual_clip * A_i)

    loss = - sum_i w_i sum_t phi_{i,t}                      (policy gradient, the plan's rule)
           + kl_coef      * sum_i v_i sum_t k3_{i,t}        (KL to a reference policy)
           - entropy_coef * sum_i v_i sum_t H_{i,t}         (entropy bonus)

with w the policy-gradient plan (balanced by default) and v the regulariser plan (token mean by
default); k3 = exp(ref - logp) - (ref - logp) - 1 is Schulman's unbiased, positive KL estimator.
Both plans come from `LossPlan.build` (one statistics reduction for both), so the loss of any
micro-batch or shard is its exact share of the global loss: summing over parts gives the whole.

Tensors are padded [N, T] with a boolean mask, or packed [num_tokens] with a sequence index in place
of the mask (-1 for padding), as in `megatron_ba.aggregation.apply_weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_ba.aggregation import (
    Reduce,
    apply_weights,
    plan_statistics,
    weights_from_statistics,
)

# exp() of a log-ratio beyond this is a broken rollout, not a policy update; bounding it keeps a
# single bad token from producing inf (and then NaN through 0 * inf in the gradient).
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class GRPOLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
        if self.clip_low >= 1:
            raise ValueError(
                f"clip_low: must be < 1 (1 - clip_low bounds a ratio), got {self.clip_low}"
            )
        dual = self.dual_clip
        if dual is not None and not (math.isfinite(dual) and dual > 1):
            raise ValueError(f"dual_clip: must be a finite number > 1 or None, got {dual!r}")


@dataclass(frozen=True)
class LossPlan:
    """Per-sequence weights of the policy-gradient term and of the regularisers."""

    pg_weights: torch.Tensor  # [N]
    reg_weights: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N], kept for per-sign metrics

    @classmethod
    def build(
        cls,
        rule: str,
        lengths: torch.Tensor,
        advantages: torch.Tensor,
        group_ids: torch.Tensor,
        *,
        scope: str = "group",
        reg_rule: str = "token",
        reg_scope: str = "batch",
        max_length: int | None = None,
        neutral_eps: float = 0.0,
        reduce: Reduce | None = None,
        num_groups: int | None = None,
    ) -> LossPlan:
        """Both plans from one statistics table (one `reduce` call for the whole global batch)."""
        stats = plan_statistics(
            lengths,
            advantages,
            group_ids,
            neutral_eps=neutral_eps,
            num_groups=num_groups,
            reduce=reduce,
        )
        pg = weights_from_statistics(rule, stats, scope=scope, max_length=max_length)
        reg = weights_from_statistics(reg_rule, stats, scope=reg_scope, max_length=max_length)
        adv = advantages if isinstance(advantages, torch.Tensor) else torch.as_tensor(advantages)
        return cls(pg.to(stats.out_dtype), reg.to(stats.out_dtype), adv)

    def select(self, index: torch.Tensor | slice) -> LossPlan:
        """The plan of a subset of the sequences (a micro-batch), weights unchanged."""
        return LossPlan(self.pg_weights[index], self.reg_weights[index], self.advantages[index])

    def padded_to(self, n: int) -> LossPlan:
        """The plan with zero-weight, zero-advantage entries appended up to `n` sequences (the
        masked padding rows of a micro-batch: they add exactly 0 to the loss)."""
        extra = n - self.pg_weights.numel()
        if extra < 0:
            raise ValueError(f"n: {n} is below the plan's {self.pg_weights.numel()} sequences")
        if extra == 0:
            return self

        def pad(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(extra)])

        return LossPlan(pad(self.pg_weights), pad(self.reg_weights), pad(self.advantages))


def _per_token(per_sequence: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence value to the token layout of `like` (padded or packed)."""
    per_sequence = per_sequence.to(like.dtype)
    if like.dim() == 2:
        return per_sequence[:, None].expand_as(like)
    return per_sequence[mask.clamp(min=0)]


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dim() == 2:
        if mask.shape != like.shape:
            raise ValueError(f"mask: must have shape {tuple(like.shape)}, got {tuple(mask.shape)}")
        return mask.bool()
    return mask >= 0


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    plan: LossPlan,
    config: GRPOLossConfig = GRPOLossConfig(),
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This part of the batch's share of the global GRPO loss, and its metrics.

    Returns (loss, metrics). `loss` is differentiable in logprobs (and entropy). Metrics ending in
    `_sum` are additive over micro-batches and ranks (sum them); the rest describe this part only.
    """
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"old_logprobs: must have the shape of logprobs {tuple(logprobs.shape)}, got "
            f"{tuple(old_logprobs.shape)}"
        )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when kl_coef > 0")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy: required when entropy_coef > 0")
    valid = _valid(mask, logprobs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = _per_token(plan.advantages, mask, logprobs)

    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    phi = torch.minimum(ratio * adv, clipped * adv)
    dual_active = torch.zeros_like(valid)
    if config.dual_clip is not None:
        floor = config.dual_clip * adv
        dual_active = valid & (adv < 0) & (phi < floor)
        phi = torch.where(adv < 0, torch.maximum(phi, floor), phi)
    pg_loss = -apply_weights(phi, mask, plan.pg_weights)
    loss = pg_loss

    metrics: dict[str, torch.Tensor] = {"pg_loss": pg_loss.detach()}
    if ref_logprobs is not None:
        d = torch.where(valid, ref_logprobs - logprobs, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = apply_weights(d.exp() - d - 1.0, mask, plan.reg_weights)
        metrics["kl"] = kl.detach()
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
    if entropy is not None:
        ent = apply_weights(entropy, mask, plan.reg_weights)
        metrics["entropy"] = ent.detach()
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent

    with torch.no_grad():
        n_tokens = valid.sum()
        low = valid & (adv < 0) & (ratio < 1.0 - config.clip_low)
        high = valid & (adv > 0) & (ratio > 1.0 + config.clip_high)
        denom = n_tokens.clamp(min=1).to(logprobs.dtype)
        metrics["clip_low_frac"] = low.sum() / denom
        metrics["clip_high_frac"] = high.sum() / denom
        metrics["dual_clip_frac"] = dual_active.sum() / denom
        metrics["num_tokens_sum"] = n_tokens.to(logprobs.dtype)
        # The objective weight each sign's tokens carry in this part (additive: the global
        # shares are the sums over parts, divided by their total).
        token_w = torch.where(valid, _per_token(plan.pg_weights, mask, logprobs), zero)
        w_pos = token_w[valid & (adv > 0)].sum()
        w_neg = token_w[valid & (adv < 0)].sum()
        metrics["weight_pos_sum"] = w_pos
        metrics["weight_neg_sum"] = w_neg
        total = w_pos + w_neg
        metrics["weight_pos_share"] = torch.where(total > 0, w_pos / total.clamp(min=1e-300), zero)
        metrics["ratio_mean"] = torch.where(valid, ratio, zero).sum() / denom
    return loss, metrics
