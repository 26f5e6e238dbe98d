"""The GRPO token loss, aggregated by a per-sequence weight plan.

Per token (rho = pi_theta / pi_old, asymmetric "clip-higher" bounds of DAPO):

    phi_{i,t} = min(rho A_i, clip(rho, 1 - clip_low, 1 + clip_high) A_i)
    dual clip (Ye et al. 2020, A_i < 0 only):  phi_{i,t} = max(phi_{i,t}, dual_clip * A_i)

    loss = - sum_i w_i sum_t c_{i,t} phi_{i,t}              (policy gradient, the plan's rule)
           + kl_coef      * sum_i v_i sum_t k3_{i,t}        (KL to a reference policy)
           - entropy_coef * sum_i v_i sum_t H_{i,t}         (entropy bonus)

with w the policy-gradient plan (balanced by default), c an optional per-token importance weight
(`is_weights`: a correction for the rollout engine sampling from another distribution than the
trainer's, detached, 1 by default) and v the regulariser plan (token mean by default);
k3 = exp(ref - logp) - (ref - logp) - 1 is Schulman's unbiased, positive KL estimator.
Both plans come from `LossPlan.build` (one statistics reduction for both), so the loss of any
micro-batch or shard is its exact share of the global loss: summing over parts gives the whole.

The plan weight is folded into the advantage. For w >= 0 and any reals a, b:
w min(a, b) = min(w a, w b) and w max(a, b) = max(w a, w b) (multiplying by w >= 0 keeps order;
w = 0 makes both sides 0). Hence, with c = clip(rho) and s_i = w_i A_i,

    w_i min(rho A_i, c A_i) = min(rho s_i, c s_i)
    w_i max(phi, dual A_i)  = max(w_i phi, dual s_i)

and the dual clip's branch condition A_i < 0 is s_i < 0 whenever w_i > 0 (for w_i = 0 both
branches give 0). So w_i phi_{i,t}(A_i) = phi_{i,t}(s_i) as functions of rho: the same value and
the same gradient. The loss expands s_i (one number per sequence) to the tokens, the expansion a
token-mean loss makes of A_i anyway, and never a per-token weight: balanced aggregation adds no
per-token work. Every rule's weights are >= 0 (ratios of sums of counts, lengths and |A|, or 0;
`LossPlan.build` checks it, since a negative w would turn the min into a max). Zero weights are
exact: s_i = 0 gives a 0 term with 0 gradient, as 0 * phi did. The regularisers have no advantage
to carry their weight: padded, v_i multiplies each row's sum (never expanded); packed, v is
expanded once for both.

Tensors are padded [N, T] with a boolean mask, or packed [num_tokens] with a sequence index in place
of the mask (any negative value for padding), as in `megatron_ba.aggregation.apply_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ba.aggregation import Reduce, plan_statistics, weights_from_statistics
from megatron_ba.loss_settings import AggregationSettings, GRPOLossConfig

# exp() of a log-ratio beyond this is a broken rollout, not a policy update; bounding it keeps a
# single bad token from producing inf (and then NaN through 0 * inf in the gradient).
MAX_LOG_RATIO = 20.0

# The clipped loss's default coefficients (frozen, so one instance serves every call).
DEFAULT_LOSS_CONFIG = GRPOLossConfig()


@dataclass(frozen=True)
class LossPlan:
    """Per-sequence weights of the policy-gradient term and of the regularisers.

    `pg_weights` must be >= 0 (every rule's are; `build` checks): `grpo_loss` folds them into the
    advantages, which is exact for w >= 0 only (module docstring). `folded_signs` is True when no
    sequence has w_i = 0 with A_i != 0, so sign(w_i A_i) = sign(A_i) and the loss reads each
    token's advantage sign (clip metrics) off the folded w_i A_i; False, the safe default of a
    hand-built plan, makes it expand A_i once more for those metrics. Exact either way.
    """

    pg_weights: torch.Tensor  # [N]
    reg_weights: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    folded_signs: bool = False

    @classmethod
    def build(
        cls,
        settings: AggregationSettings,
        lengths: torch.Tensor,
        advantages: torch.Tensor,
        group_ids: torch.Tensor,
        *,
        reduce: Reduce | None = None,
        num_groups: int | None = None,
    ) -> LossPlan:
        """Both plans of `settings` (the policy gradient's rule and scope, the regularisers'
        reg_rule and reg_scope) from one statistics table: one `reduce` call for the whole
        global batch."""
        s = settings
        stats = plan_statistics(
            lengths,
            advantages,
            group_ids,
            neutral_eps=s.neutral_eps,
            num_groups=num_groups,
            reduce=reduce,
        )
        pg = weights_from_statistics(s.rule, stats, scope=s.scope, max_length=s.max_length)
        reg = weights_from_statistics(s.reg_rule, stats, scope=s.reg_scope, max_length=s.max_length)
        adv = advantages if isinstance(advantages, torch.Tensor) else torch.as_tensor(advantages)
        pg, reg = pg.to(stats.out_dtype), reg.to(stats.out_dtype)
        # One host read per global batch, like plan_statistics' own checks.
        negative, signs = torch.stack([(pg < 0).any(), ((pg > 0) | (adv == 0)).all()]).tolist()
        if negative:
            raise ValueError(
                f"reduce: the plan has a negative weight ({pg.min().item():.6g}); every rule's "
                "weights are >= 0 when the statistics table holds sums of counts, lengths and "
                "|A| over ranks, which reduce must return"
            )
        return cls(pg, reg, adv, folded_signs=bool(signs))

    def select(self, index: torch.Tensor | slice) -> LossPlan:
        """The plan of a subset of the sequences (a micro-batch), weights unchanged."""
        return LossPlan(
            self.pg_weights[index],
            self.reg_weights[index],
            self.advantages[index],
            folded_signs=self.folded_signs,
        )

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

        # w = 0 with A = 0 keeps sign(w A) = sign(A): the flag carries over.
        return LossPlan(
            pad(self.pg_weights),
            pad(self.reg_weights),
            pad(self.advantages),
            folded_signs=self.folded_signs,
        )


def _layout(mask: torch.Tensor, like: torch.Tensor, n: int):
    """(valid tokens, packed sequence index or None): the index has its padding at n, so that a
    gather from a per-sequence vector with a 0 appended reads 0 there, and a scatter into n + 1
    bins counts it in the last."""
    if like.dim() == 2:
        if mask.shape != like.shape:
            raise ValueError(f"mask: must have shape {tuple(like.shape)}, got {tuple(mask.shape)}")
        if n != like.shape[0]:
            raise ValueError(f"plan: has {n} sequences but logprobs has {like.shape[0]} rows")
        return mask.bool(), None
    if like.dim() != 1:
        raise ValueError(
            f"logprobs: must be [N, T] (padded) or [num_tokens] (packed), got {tuple(like.shape)}"
        )
    if mask.shape != like.shape or mask.dtype.is_floating_point or mask.dtype == torch.bool:
        raise ValueError(
            f"mask: packed logprobs {tuple(like.shape)} need an integer sequence index of the same "
            f"shape (-1: padding), got {mask.dtype} {tuple(mask.shape)}"
        )
    valid = mask >= 0
    return valid, torch.where(valid, mask, n).long()


def _per_token(per_sequence: torch.Tensor, index: torch.Tensor | None, like: torch.Tensor):
    """A per-sequence value on the token layout of `like`: padded, a broadcast view (no copy);
    packed, one gather by the sequence index, padding reading 0."""
    v = per_sequence.to(like.dtype)
    if index is None:
        return v[:, None].expand_as(like)
    return torch.take(torch.cat([v, v.new_zeros(1)]), index)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    plan: LossPlan,
    config: GRPOLossConfig = DEFAULT_LOSS_CONFIG,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This part of the batch's share of the global GRPO loss, and its metrics.

    `is_weights`: c_{i,t} of the module docstring, one per token in logprobs' layout (a
    sequence-level weight repeated on its tokens), >= 0 (not checked here); used detached.
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
    valid, index = _layout(mask, logprobs, plan.pg_weights.numel())
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # s_i = w_i A_i, expanded once: the plan rides on the advantage (module docstring).
    folded = _per_token(plan.pg_weights * plan.advantages, index, logprobs)

    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # exactly 1 on padding
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    psi = torch.minimum(ratio * folded, clipped * folded)  # w_i phi_{i,t}
    if config.dual_clip is not None:
        psi = torch.where(folded < 0, torch.maximum(psi, config.dual_clip * folded), psi)
    if is_weights is not None:
        psi = psi * _importance_weights(is_weights, valid, logprobs)
    # Packed padding has s = 0 and rho = 1: a term of exactly 0. A padded row broadcasts its s_i
    # over its padding too, so there the mask is applied.
    pg_loss = -(psi.sum() if index is not None else torch.where(valid, psi, zero).sum())

    metrics: dict[str, torch.Tensor] = {"pg_loss": pg_loss.detach()}
    loss = _add_regularisers(
        pg_loss, metrics, logprobs, valid, index, plan.reg_weights, config, ref_logprobs, entropy
    )
    with torch.no_grad():
        metrics.update(_token_metrics(plan, config, valid, index, ratio, folded))
    return loss, metrics


def _importance_weights(is_weights: torch.Tensor, valid: torch.Tensor, like: torch.Tensor):
    """c_{i,t} detached, 0 off the mask (where psi may be nonzero on a padded row's padding)."""
    if is_weights.shape != like.shape:
        raise ValueError(
            f"is_weights: must have the shape of logprobs {tuple(like.shape)} (one weight per "
            f"token), got {tuple(is_weights.shape)}"
        )
    # Not checked for c >= 0 here (a host read per micro-batch): megatron_ba.rollout_correction
    # makes them, once per global batch, and checks them there.
    c = is_weights.detach().to(like.dtype)
    return torch.where(valid, c, torch.zeros((), dtype=like.dtype, device=like.device))


def _add_regularisers(loss, metrics, logprobs, valid, index, reg_weights, config, ref, entropy):
    """loss + kl_coef sum_i v_i sum_t k3 - entropy_coef sum_i v_i sum_t H; fills metrics."""
    if ref is None and entropy is None:
        return loss
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    v_tok = None if index is None else _per_token(reg_weights, index, logprobs)  # once for both

    def weighted(x: torch.Tensor) -> torch.Tensor:
        x = torch.where(valid, x, zero)
        if v_tok is None:  # padded: each row's sum times its v_i, the weight never expanded
            return (x.sum(dim=1) * reg_weights.to(x.dtype)).sum()
        return (x * v_tok).sum()

    if ref is not None:
        d = torch.where(valid, ref - logprobs, zero).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = weighted(d.exp() - d - 1.0)
        metrics["kl"] = kl.detach()
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
    if entropy is not None:
        ent = weighted(entropy)
        metrics["entropy"] = ent.detach()
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent
    return loss


def _token_metrics(plan, config, valid, index, ratio, folded) -> dict[str, torch.Tensor]:
    """Clip fractions, token count, each sign's objective weight and the mean ratio of this part."""
    dtype = ratio.dtype
    zero = torch.zeros((), dtype=dtype, device=ratio.device)
    n_tokens = torch.count_nonzero(valid)
    denom = n_tokens.clamp(min=1).to(dtype)
    # Each token's advantage sign: read off w_i A_i where the plan keeps signs, else off A_i.
    sign = folded if plan.folded_signs else _per_token(plan.advantages, index, ratio)
    # rho = 1 on padding, which none of these accepts (clip bounds >= 0, dual_clip > 1). The dual
    # floor binds, A < 0, where min(rho, clip(rho)) A < dual A, i.e. where rho > dual_clip.
    low = torch.count_nonzero((sign < 0) & (ratio < 1.0 - config.clip_low))
    high = torch.count_nonzero((sign > 0) & (ratio > 1.0 + config.clip_high))
    out = {
        "clip_low_frac": low / denom,
        "clip_high_frac": high / denom,
        "dual_clip_frac": zero,
        "num_tokens_sum": n_tokens.to(dtype),
    }
    if config.dual_clip is not None:
        dual = torch.count_nonzero((sign < 0) & (ratio > config.dual_clip))
        out["dual_clip_frac"] = dual / denom
    w_pos, w_neg = _sign_weights(plan, valid, index, ratio)
    out["weight_pos_sum"], out["weight_neg_sum"] = w_pos, w_neg
    total = w_pos + w_neg
    out["weight_pos_share"] = torch.where(total > 0, w_pos / total.clamp(min=1e-300), zero)
    out["ratio_mean"] = torch.where(valid, ratio, zero).sum() / denom
    return out


def _sign_weights(plan, valid, index, like) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective weight each sign's tokens carry in this part: sum over its tokens of w_i
    (additive over parts; the global shares are the sums over parts, divided by their total)."""
    adv, w = plan.advantages, plan.pg_weights
    if index is not None and like.device.type != "cpu":
        return _packed_sign_weights_by_gather(plan, index, like)
    if index is None:  # padded: w_i times each row's token count
        carried = w * torch.count_nonzero(valid, dim=1)
    else:
        # packed on CPU: one scatter of each token into its sequence's count (padding into the
        # last bin), then O(N); the gather costs a pass for the gather and two per sign.
        counts = torch.zeros(w.numel() + 1, dtype=torch.long, device=index.device)
        counts.scatter_add_(0, index, torch.ones((), dtype=torch.long).expand(index.shape))
        carried = w * counts[:-1].to(w.device)
    zero = torch.zeros((), dtype=carried.dtype, device=carried.device)
    pos = torch.where(adv > 0, carried, zero).sum()  # where, not a boolean index: no sync on GPU
    neg = torch.where(adv < 0, carried, zero).sum()
    return pos.to(like.dtype), neg.to(like.dtype)


def _packed_sign_weights_by_gather(plan, index, like) -> tuple[torch.Tensor, torch.Tensor]:
    """_sign_weights of a packed part on GPU, where a scatter's atomics would pile onto a few
    thousand addresses: one gather of the weight signed by A, padding reading 0 (no histogram,
    no sync)."""
    adv, w = plan.advantages, plan.pg_weights
    signed = torch.where(adv > 0, w, torch.where(adv < 0, -w, torch.zeros_like(w)))
    u = _per_token(signed, index, like)
    return u.clamp(min=0).sum(), -u.clamp(max=0).sum()
