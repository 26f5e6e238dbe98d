"""Off-policy (importance-sampling) corrections for rollouts sampled by another engine.

The rollout engine (vLLM) samples response tokens from pi_rollout; the trainer's old policy
pi_old (the same weights in megatron-core) gives slightly different log-probs. Per valid token,

    r_{i,t} = exp(old_{i,t} - rollout_{i,t})                     token ratio
    R_i     = exp(sum_{t valid} (old_{i,t} - rollout_{i,t}))      sequence ratio, on its tokens

(TRL 1.16's `vllm_importance_sampling_*`, verl 0.9.1's `compute_rollout_correction_weights`; the
log-ratio, or its sum, is clamped to +-MAX_LOG_RATIO before exp, as verl does). With q the token
ratio (token_*) or the sequence ratio (sequence_*), the modes give a detached weight c_{i,t}, the
`is_weights` of `megatron_ba.loss.grpo_loss`, and possibly a smaller mask:

    none                 c = 1
    *_truncate  (TIS)    c = min(q, cap)
    *_mask      (MIS)    c = q if low <= q <= high else 0
    *_reject             c = 1; tokens (token_reject) or whole sequences (sequence_reject) with
                         q outside [low, high] leave the mask

Denominators. A *masked* token (c = 0) stays in the mask: it still counts in the plan's lengths
N_g^s, T_i, and its sequence still counts in G_g, |S_g^s|; only its term is zeroed. A *rejected*
token leaves the mask before `LossPlan.build`: the plan is the one of the reduced batch (T_i
counts the kept tokens only; a sequence with none left has T_i = 0 and is padding for every rule,
counted in no G_g). So rejection equals BA computed on the batch without those tokens.

Layouts: padded [N, T] with a boolean mask, or packed [num_tokens] with an integer sequence
index (negative: padding), as in `megatron_ba.loss`. Pure torch, no collectives: the statistics
(`correction_statistics`) are additive over parts (but the max), to be reduced by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ba.loss import MAX_LOG_RATIO
from megatron_ba.loss_settings import ROLLOUT_CORRECTION_MODES, RolloutCorrectionSettings

__all__ = [
    "ROLLOUT_CORRECTION_MODES",
    "RolloutCorrection",
    "RolloutCorrectionSettings",
    "correct_rows",
    "correction_diagnostics",
    "correction_statistics",
    "rollout_correction",
]

# correction_statistics' entries: sums over valid tokens (additive over parts and ranks) but the
# last, a max (reduce it with MAX).
GAP_SUM, VALID, CORRECTED, KEPT, WEIGHT_SUM, WEIGHT_MAX = range(6)
NUM_STATISTICS = 6
DIAGNOSTIC_PREFIX = "rollout_correction/"


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction of one batch, in the inputs' layout.

    weights: c_{i,t}, detached, 0 off `mask`. mask: the input mask less the rejected tokens (a
    bool mask padded; packed, the sequence index with rejected tokens set to -1). ratio: q_{i,t}
    (1 off the input mask). corrected: the valid tokens whose weight is not q, i.e. truncated,
    masked or rejected.
    """

    weights: torch.Tensor
    mask: torch.Tensor
    ratio: torch.Tensor
    corrected: torch.Tensor


def _valid_and_index(mask: torch.Tensor, like: torch.Tensor):
    """(valid tokens, packed sequence index or None), checked against `like`'s layout."""
    if mask.shape != like.shape:
        raise ValueError(f"mask: must have shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    if like.dim() == 2:
        return mask.bool(), None
    if like.dim() != 1:
        raise ValueError(
            f"old_logprobs: must be [N, T] (padded) or [num_tokens] (packed), got "
            f"{tuple(like.shape)}"
        )
    if mask.dtype.is_floating_point or mask.dtype == torch.bool:
        raise ValueError(
            f"mask: packed log-probs need an integer sequence index (-1: padding), got {mask.dtype}"
        )
    return mask >= 0, mask.long()


def _log_ratio(old, rollout, valid, *, check: bool = True) -> torch.Tensor:
    """old - rollout on the valid tokens, 0 elsewhere; non-finite on a valid token raises (the
    correction's), or counts as 0 with check=False (the diagnostics of mode none, which must not
    stop a run that asked for no correction)."""
    if rollout.shape != old.shape:
        raise ValueError(
            f"rollout_logprobs: must have the shape of old_logprobs {tuple(old.shape)}, got "
            f"{tuple(rollout.shape)}"
        )
    diff = (old.detach() - rollout.detach()).to(torch.promote_types(old.dtype, torch.float32))
    zero = torch.zeros((), dtype=diff.dtype, device=diff.device)
    diff = torch.where(valid, diff, zero)
    if not check:
        return torch.where(torch.isfinite(diff), diff, zero)
    if not bool(torch.isfinite(diff).all()):  # one host read per batch
        raise ValueError(
            "rollout_logprobs: old_logprobs - rollout_logprobs must be finite on every valid token"
        )
    return diff


def _sequence_sums(x: torch.Tensor, index: torch.Tensor | None, num_sequences: int | None):
    """Each valid token's sequence sum of x (x is 0 off the mask), in x's layout."""
    if index is None:
        return x.sum(dim=1, keepdim=True).expand_as(x)
    if num_sequences is None:
        n = int(index.max()) + 1 if index.numel() else 0
    else:
        n = int(num_sequences)
    if index.numel() and int(index.max()) >= n:
        raise ValueError(f"num_sequences: {n} but the sequence index reaches {int(index.max())}")
    bins = x.new_zeros(n + 1)
    slot = torch.where(index >= 0, index, n)  # padding into the last bin, never read back
    bins.index_add_(0, slot, x)
    return torch.where(index >= 0, bins[slot], torch.zeros_like(x))


def rollout_correction(
    settings: RolloutCorrectionSettings,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_sequences: int | None = None,
) -> RolloutCorrection:
    """The weights (and the mask, for the rejecting modes) of `settings` (module docstring).

    `num_sequences` (packed only): the number of sequences the index counts (default: its max
    + 1). Sequence modes need whole sequences: call once per global batch (or per rank when a
    rank holds whole sequences), never on a context-parallel shard.
    """
    if not isinstance(settings, RolloutCorrectionSettings):
        raise ValueError(f"settings: must be a RolloutCorrectionSettings, got {type(settings)}")
    valid, index = _valid_and_index(mask, old_logprobs)
    lr = _log_ratio(old_logprobs, rollout_logprobs, valid)
    mode = settings.mode
    if mode.startswith("sequence_"):
        lr = _sequence_sums(lr, index, num_sequences)
    one = torch.ones((), dtype=lr.dtype, device=lr.device)
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    q = torch.where(valid, lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp(), one)
    accepted = (q >= settings.low) & (q <= settings.high)
    new_mask, kept = mask, valid
    if mode == "none":
        weights, corrected = one.expand_as(q), torch.zeros_like(valid)
    elif mode.endswith("_truncate"):
        weights, corrected = q.clamp(max=settings.cap), q > settings.cap
    elif mode.endswith("_mask"):
        weights, corrected = torch.where(accepted, q, zero), ~accepted
    else:  # *_reject: the rejected tokens leave the mask (module docstring, "Denominators")
        weights, corrected, kept = one.expand_as(q), ~accepted, valid & accepted
        new_mask = kept if index is None else torch.where(accepted, index, -1)
    weights = torch.where(kept, weights, zero)
    return RolloutCorrection(weights, new_mask, q, corrected & valid)


def correct_rows(
    settings: RolloutCorrectionSettings,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What a rank does to its own whole sequences before the plan is built: (the mask, less the
    rejected tokens; the weights, None with mode none; their correction_statistics, the gap
    alone with mode none). The trainer's update and the layout check both call it."""
    if settings.mode == "none":
        return mask, None, correction_statistics(old_logprobs, rollout_logprobs, mask)
    c = rollout_correction(settings, old_logprobs, rollout_logprobs, mask)
    return c.mask, c.weights, correction_statistics(old_logprobs, rollout_logprobs, mask, c)


def correction_statistics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection | None = None,
) -> torch.Tensor:
    """[NUM_STATISTICS] float64 of one part of a batch, over its valid tokens (input mask):
    sum |old - rollout|, valid tokens, corrected tokens, tokens kept in the loss, the kept
    tokens' weight sum, and the weight max. All but the max add up over parts (a DP all-reduce
    SUM of the first five, MAX of the last). `correction` None: no correction (weights 1); a
    non-finite log-prob difference then counts as a 0 gap instead of raising."""
    valid, _ = _valid_and_index(mask, old_logprobs)
    gap = _log_ratio(old_logprobs, rollout_logprobs, valid, check=False).abs().double()
    n_valid = valid.sum().double()
    if correction is None:
        n_corrected, n_kept = n_valid.new_zeros(()), n_valid
        w_sum, w_max = n_valid, (n_valid > 0).double()
    else:
        kept, _ = _valid_and_index(correction.mask, old_logprobs)
        w = torch.where(kept, correction.weights.double(), 0.0)
        n_corrected, n_kept = correction.corrected.sum().double(), kept.sum().double()
        w_sum, w_max = w.sum(), (w.max() if w.numel() else w.new_zeros(()))
    return torch.stack([gap.sum(), n_valid, n_corrected, n_kept, w_sum, w_max.double()])


def correction_diagnostics(statistics: torch.Tensor) -> dict[str, float]:
    """The logged diagnostics of (reduced) `correction_statistics`: the train/rollout log-prob
    gap (mean |old - rollout| over valid tokens), the fraction of valid tokens truncated, masked
    or rejected, and the mean and max weight of the tokens kept in the loss (masked ones: 0)."""
    s = [float(v) for v in statistics.detach().double().cpu().tolist()]
    if len(s) != NUM_STATISTICS:
        raise ValueError(f"statistics: must hold {NUM_STATISTICS} entries, got {len(s)}")
    valid, kept = max(s[VALID], 1.0), max(s[KEPT], 1.0)
    p = DIAGNOSTIC_PREFIX
    return {
        p + "logprob_gap": s[GAP_SUM] / valid,
        p + "fraction_corrected": s[CORRECTED] / valid,
        p + "weight_mean": s[WEIGHT_SUM] / kept,
        p + "weight_max": s[WEIGHT_MAX],
    }
