"""Aggregation rules for GRPO as per-sequence weight plans.

Every rule this project knows gives all tokens of response i the same weight w_i, so the
objective is linear in the per-token terms phi_{i,t}:

    J = sum_i w_i * sum_t phi_{i,t}

A *plan* is the vector w. It is computed once per global batch from small statistics (whole-sequence
lengths T_i, advantage signs and masses, group ids) and then applied to any part of the batch: a
micro-batch, a data-parallel rank's share, a context-parallel shard. Because applying is a weighted
sum, the parts add up to the full-batch objective exactly. Planning and applying are kept apart:

    stats = plan_statistics(lengths, advantages, group_ids, reduce=...)  # one all-reduce, if any
    w = weights_from_statistics("balanced", stats)                      # pure arithmetic
    J = apply_weights(phi, mask, w)                                     # per micro-batch

Rules (Gamma = groups in the batch, M = sequences with T_i > 0, G_g = group size, S_g^+/- = the
responses of g with A > eps / A < -eps, N_g^s = their total length; see docs/math.md):

    token          batch: 1 / sum_j T_j                group: 1 / (Gamma N_g)
    sequence       batch: 1 / (M T_i)                  group: 1 / (Gamma G_g T_i)
    dr_grpo        1 / (M max_length)  (a global constant by design; the scope does not change it)
    balanced       batch: (|S^s| / M) / N^s            group: (|S_g^s| / G_g) / (Gamma N_g^s)
    balanced_mass  like balanced with counts and lengths weighted by |A|:
                   group: (sum_{S_g^s} |A_j| / G_g) / (Gamma sum_{S_g^s} |A_j| T_j)
    group_token_mean  1 / (Gamma N_g) whatever the scope: token at scope "group" (SkyRL's
                   prompt_mean), a name for it where a framework's default scope is the batch

"balanced" is eq. 19 of Zeng et al., "Balanced Aggregation: Understanding and Fixing Aggregation
Bias in GRPO" (arXiv 2605.04077). Neutral responses (|A_i| <= neutral_eps) get weight 0 under the
balanced rules. Zero-length sequences (T_i = 0) are padding: they are left out of every statistic
(M, G_g, |S|, Gamma) and get weight 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_ba._checks import (
    check_choice,
    check_finite_1d,
    check_integer_1d,
    check_same_length,
)
from megatron_ba.loss_settings import RULES, SCOPES  # the names, kept where torch is not needed

Reduce = Callable[[torch.Tensor], torch.Tensor]

# Columns of the statistics table: one row per group, all sums (so that summing tables from
# several ranks gives the statistics of the union of their sequences).
COUNT, LENGTH = 0, 1  # sequences with T > 0, their total length
POS_COUNT, NEG_COUNT = 2, 3  # |S^+|, |S^-|
POS_LENGTH, NEG_LENGTH = 4, 5  # N^+, N^-
POS_MASS, NEG_MASS = 6, 7  # sum |A| over S^+, S^-
POS_MASS_LENGTH, NEG_MASS_LENGTH = 8, 9  # sum |A| T over S^+, S^-
NUM_COLUMNS = 10


@dataclass(frozen=True)
class PlanStatistics:
    """What every rule's weights are computed from.

    `table` holds per-group sums over *all* ranks (after `reduce`); the other fields describe this
    process's own sequences, in their order.
    """

    table: torch.Tensor  # [num_rows, NUM_COLUMNS] float64
    row: torch.Tensor  # [N] int64: the table row of each local sequence
    lengths: torch.Tensor  # [N] float64
    sign: torch.Tensor  # [N] int64: +1 / -1 / 0 (neutral or T = 0)
    abs_advantage: torch.Tensor  # [N] float64
    out_dtype: torch.dtype  # float64 if the inputs were, else float32


def plan_statistics(
    lengths: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    neutral_eps: float = 0.0,
    num_groups: int | None = None,
    reduce: Reduce | None = None,
) -> PlanStatistics:
    """Per-group statistics of a batch, summed over ranks by `reduce` (one call).

    With `reduce`, every rank must build a table of the same shape, so group ids must be global
    and lie in [0, num_groups): pass `num_groups` (e.g. prompts per global batch). Without
    `reduce`, any non-negative ids work (they are relabelled densely).
    """
    lengths_ = check_finite_1d("lengths", lengths)
    if bool((lengths_ < 0).any()):
        raise ValueError(f"lengths: must be >= 0, got min {lengths_.min().item()}")
    advantages_ = check_finite_1d("advantages", advantages)
    ids = check_integer_1d("group_ids", group_ids)
    check_same_length(lengths=lengths_, advantages=advantages_, group_ids=ids)
    if not (neutral_eps >= 0.0 and neutral_eps < float("inf")):
        raise ValueError(f"neutral_eps: must be a finite number >= 0, got {neutral_eps!r}")
    if bool((ids < 0).any()):
        raise ValueError(f"group_ids: must be >= 0, got min {ids.min().item()}")

    row, num_rows = _table_rows(ids, num_groups, reduce is not None)

    live = lengths_ > 0
    pos = live & (advantages_ > neutral_eps)
    neg = live & (advantages_ < -neutral_eps)
    abs_adv = advantages_.abs()
    columns = _statistic_columns(lengths_, abs_adv, live, pos, neg)
    table = torch.zeros(num_rows, NUM_COLUMNS, dtype=torch.float64, device=lengths_.device)
    table.index_add_(0, row, columns)
    if reduce is not None:
        reduced = reduce(table)
        if not isinstance(reduced, torch.Tensor) or reduced.shape != table.shape:
            raise ValueError(
                f"reduce: must return a tensor of shape {tuple(table.shape)} (the table summed "
                f"over ranks), got {getattr(reduced, 'shape', type(reduced))}"
            )
        table = reduced.to(torch.float64)
    sign = pos.long() - neg.long()
    out_dtype = (
        torch.float64
        if torch.float64 in (advantages.dtype, getattr(lengths, "dtype", None))
        else torch.float32
    )
    return PlanStatistics(table, row, lengths_, sign, abs_adv, out_dtype)


def _table_rows(ids: torch.Tensor, num_groups: int | None, reduced: bool):
    """(each sequence's row of the statistics table, the table's rows): the global group ids
    under a reduction (num_groups required, so every rank's table has one shape), else ids
    below num_groups, else the ids relabelled densely."""
    if reduced and num_groups is None:
        raise ValueError(
            "num_groups: required with reduce, so that every rank builds a statistics "
            "table of the same shape (group ids must be global, in [0, num_groups))"
        )
    if num_groups is None:
        uniq, row = torch.unique(ids, return_inverse=True)
        return row, int(uniq.numel())
    if ids.numel() and int(ids.max()) >= num_groups:
        with_reduce = " with reduce" if reduced else ""
        raise ValueError(
            f"group_ids: must be < num_groups={num_groups}{with_reduce}, got {int(ids.max())}"
        )
    return ids, int(num_groups)


def _statistic_columns(lengths, abs_adv, live, pos, neg) -> torch.Tensor:
    """[N, NUM_COLUMNS] per-sequence contributions (the table's columns, in order)."""
    zero = torch.zeros_like(lengths)
    return torch.stack(
        [
            live.double(),
            lengths,
            pos.double(),
            neg.double(),
            torch.where(pos, lengths, zero),
            torch.where(neg, lengths, zero),
            torch.where(pos, abs_adv, zero),
            torch.where(neg, abs_adv, zero),
            torch.where(pos, abs_adv * lengths, zero),
            torch.where(neg, abs_adv * lengths, zero),
        ],
        dim=1,
    )


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0 (empty subsets and padding carry no weight, never NaN)."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.zeros_like(num))


def weights_from_statistics(
    rule: str,
    stats: PlanStatistics,
    *,
    scope: str = "group",
    max_length: int | None = None,
) -> torch.Tensor:
    """Per-sequence weights (float64) of `rule` from already-reduced statistics."""
    check_choice("rule", rule, RULES)
    check_choice("scope", scope, SCOPES)
    if rule == "group_token_mean":
        # Per prompt group by definition, as dr_grpo is a constant by definition: the rule is
        # token at the group scope, so that it can be named where the scope is fixed to "batch".
        rule, scope = "token", "group"
    table, row = stats.table, stats.row
    if scope == "batch":
        # The batch scope is the group scope with the whole batch as one group.
        table = table.sum(dim=0, keepdim=True)
        row = torch.zeros_like(row)
    group = table.index_select(0, row)  # [N, NUM_COLUMNS]: the statistics of each sequence's group
    num_groups = (table[:, COUNT] > 0).sum().to(torch.float64)
    live = stats.lengths > 0
    T = stats.lengths
    one = torch.ones_like(T)

    if rule == "token":
        w = _ratio(one, num_groups * group[:, LENGTH])
    elif rule == "sequence":
        w = _ratio(one, num_groups * group[:, COUNT] * T)
    elif rule == "dr_grpo":
        if max_length is None or not (max_length > 0):
            raise ValueError(
                f"max_length: the dr_grpo rule needs a positive max_length (the generation "
                f"budget it divides by), got {max_length!r}"
            )
        if bool((T > max_length).any()):
            raise ValueError(
                f"max_length: {max_length} is below the longest sequence ({T.max().item():.0f})"
            )
        total_sequences = stats.table[:, COUNT].sum()
        w = _ratio(one, total_sequences * float(max_length) * one)
    else:
        pos, neg = stats.sign > 0, stats.sign < 0
        if rule == "balanced":  # subset share |S|/G, token mean inside the subset
            share_num = torch.where(pos, group[:, POS_COUNT], group[:, NEG_COUNT])
            within_den = torch.where(pos, group[:, POS_LENGTH], group[:, NEG_LENGTH])
        else:  # balanced_mass: share sum|A|/G, |A|-weighted token mean inside the subset
            share_num = torch.where(pos, group[:, POS_MASS], group[:, NEG_MASS])
            within_den = torch.where(pos, group[:, POS_MASS_LENGTH], group[:, NEG_MASS_LENGTH])
        share = _ratio(share_num, group[:, COUNT])
        w = _ratio(share, num_groups * within_den)
        w = torch.where(pos | neg, w, torch.zeros_like(w))
    return torch.where(live, w, torch.zeros_like(w))


def sequence_weights(
    rule: str,
    lengths: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scope: str = "group",
    max_length: int | None = None,
    neutral_eps: float = 0.0,
    reduce: Reduce | None = None,
    num_groups: int | None = None,
) -> torch.Tensor:
    """One weight per sequence for `rule`; J = sum_i w_i sum_t phi_{i,t}.

    Args:
        rule: "token", "sequence", "dr_grpo", "balanced", "balanced_mass" or
            "group_token_mean" (module docstring).
        lengths: [N] whole-sequence response lengths T_i (never a context-parallel shard's).
        advantages: [N] per-sequence advantages A_i.
        group_ids: [N] integer prompt-group ids (global ids when `reduce` is given).
        scope: "group" (mean over groups of per-group objectives) or "batch" (pooled); neither
            changes "dr_grpo" or "group_token_mean".
        max_length: the generation budget; required by "dr_grpo".
        neutral_eps: responses with |A_i| <= neutral_eps belong to neither sign (weight 0 under
            the balanced rules): a guard against noisy sign splits in tiny-variance groups.
        reduce: called once on the [num_groups, 10] float64 statistics table; must return it
            summed over every rank holding part of the batch. None: this process holds it all.
        num_groups: the global number of groups (an upper bound on group id + 1); required
            with `reduce`.

    Returns:
        [N] weights, float64 if the inputs are float64, else float32.
    """
    check_choice("rule", rule, RULES)
    check_choice("scope", scope, SCOPES)
    stats = plan_statistics(
        lengths,
        advantages,
        group_ids,
        neutral_eps=neutral_eps,
        num_groups=num_groups,
        reduce=reduce,
    )
    w = weights_from_statistics(rule, stats, scope=scope, max_length=max_length)
    return w.to(stats.out_dtype)


def apply_weights(
    token_values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """sum_i w_i sum_t mask_{i,t} x_{i,t}: the aggregated objective of (part of) a batch.

    Padded form: token_values and mask are [N, T], weights [N].
    Packed form: token_values is [num_tokens] (sequences concatenated) and `mask` is the
    [num_tokens] integer sequence index of each token (-1: padding); see `apply_weights_packed`.
    Differentiable in token_values; the result is a 0-dim tensor of token_values' dtype.
    """
    if token_values.dim() == 1:
        return apply_weights_packed(token_values, mask, weights)
    if token_values.dim() != 2:
        raise ValueError(
            f"token_values: must be [N, T] (padded) or [num_tokens] (packed), got shape "
            f"{tuple(token_values.shape)}"
        )
    if mask.shape != token_values.shape:
        raise ValueError(
            f"mask: must have the shape of token_values {tuple(token_values.shape)}, got "
            f"{tuple(mask.shape)}"
        )
    if weights.shape != token_values.shape[:1]:
        raise ValueError(
            f"weights: must be [N] with N={token_values.shape[0]} (one per row of token_values), "
            f"got {tuple(weights.shape)}"
        )
    # where, not a product with the mask: padding positions may hold inf/NaN (never propagate).
    masked = torch.where(mask.bool(), token_values, torch.zeros((), dtype=token_values.dtype))
    return (masked.sum(dim=1) * weights.to(token_values.dtype)).sum()


def apply_weights_packed(
    token_values: torch.Tensor,
    sequence_index: torch.Tensor | None,
    weights: torch.Tensor,
    *,
    counts: torch.Tensor | list[int] | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Packed `apply_weights`: token j belongs to sequence sequence_index[j] (-1: padding).

    `counts` (optional, [N] token counts: a tensor, or host-known Python ints) declares the pack
    contiguous: sequence 0's tokens first, then sequence 1's, ..., then padding; `sequence_index`
    may then be None. The per-token weight vector is then built by `token_weights` (no host
    synchronisation: nothing here reads a device value back, so a GPU never stalls in the loss)
    and applied as one
    multiply-sum whose gradient is that vector times the incoming gradient.
    """
    if counts is not None:
        if token_values.dim() != 1:
            raise ValueError(f"token_values: packed form is 1-D, got {tuple(token_values.shape)}")
        return _WeightedSum.apply(token_values, token_weights(weights, counts, token_values))
    if sequence_index is None:
        raise ValueError("sequence_index: required unless counts declares a contiguous pack")
    if token_values.dim() != 1 or sequence_index.shape != token_values.shape:
        raise ValueError(
            f"sequence_index: packed token_values {tuple(token_values.shape)} need a sequence "
            f"index of the same shape, got {tuple(sequence_index.shape)}"
        )
    if sequence_index.dtype.is_floating_point or sequence_index.dtype == torch.bool:
        raise ValueError(f"sequence_index: must be integer, got {sequence_index.dtype}")
    if sequence_index.numel() and int(sequence_index.max()) >= weights.numel():
        raise ValueError(
            f"sequence_index: refers to sequence {int(sequence_index.max())} but weights has "
            f"{weights.numel()} entries"
        )
    w = weights.to(token_values.dtype)
    valid = sequence_index >= 0
    token_weight = w[sequence_index.clamp(min=0)]
    zero = torch.zeros((), dtype=token_values.dtype, device=token_values.device)
    return torch.where(valid, token_values * token_weight, zero).sum()


def token_weights(
    weights: torch.Tensor, counts: torch.Tensor | list[int] | tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """The [num_tokens] weight of every token of a contiguous pack shaped like `like`.

    Sequence i's counts[i] tokens get weights[i]; the trailing padding (num_tokens - sum(counts)
    tokens) gets 0. Built once per micro-batch and plan; dtype and device of `like`. No host
    synchronisation either way:

    * `counts` a tensor (on the device): one `repeat_interleave` whose output size is `like`'s
      (known on the host); bad counts fail a device-side assertion naming `counts`. The GPU
      form: a fixed handful of kernels whatever the number of sequences.
    * `counts` Python ints (host-known, as a packer that laid the pack out has them): one `cat`
      of each weight expanded to its count. About 3x faster on CPU, where `repeat_interleave`
      builds an int64 index in one thread; on a GPU `cat` of N inputs is several launches.
    """
    num_tokens = like.numel()
    if isinstance(counts, list | tuple):
        sizes = [int(c) for c in counts]
        if len(sizes) != weights.numel() or any(c < 0 for c in sizes) or sum(sizes) > num_tokens:
            raise ValueError(
                f"counts: must be {weights.numel()} token counts >= 0 summing to at most the "
                f"pack's {num_tokens} tokens, got {len(sizes)} summing to {sum(sizes)}"
            )
        w = weights.to(like.dtype).unbind()
        pieces = [v.expand(c) for v, c in zip(w, sizes, strict=True)]
        return torch.cat([*pieces, like.new_zeros(num_tokens - sum(sizes))])
    if counts.dim() != 1 or counts.shape != weights.shape:
        raise ValueError(
            f"counts: must be [N] token counts ({weights.numel()} entries, one per weight), got "
            f"shape {tuple(counts.shape)}"
        )
    if counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"counts: must be integer token counts, got {counts.dtype}")
    counts = counts.to(device=like.device, dtype=torch.long)
    padding = num_tokens - counts.sum()
    torch._assert_async(
        (counts >= 0).all() & (padding >= 0),
        f"counts: must be token counts >= 0 summing to at most the pack's {num_tokens} tokens",
    )
    repeats = torch.cat([counts, padding.reshape(1)])
    w = torch.cat([weights.to(like.dtype), like.new_zeros(1)])
    return torch.repeat_interleave(w, repeats, output_size=num_tokens)


class _WeightedSum(torch.autograd.Function):
    """sum_j v_j x_j for a per-token weight vector v: forward one multiply-sum (a dot product),
    backward v * grad_out (v is not differentiated: the plan is a constant of the step)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_weight)
        return torch.dot(values, token_weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (token_weight,) = ctx.saved_tensors
        return token_weight * grad_out, None
