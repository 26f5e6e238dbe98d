"""The paper's batch statistics: what makes token or sequence aggregation biased on this batch.

- length variance and the positive-negative mean length gap (T̄+ - T̄-): the regime that decides
  whether token or sequence aggregation does better (paper, Section 5);
- the share of the total objective weight that each sign gets under token, sequence and balanced
  aggregation: the sign-length coupling made visible (token's positive share is N+ / N, balanced's
  is the sequence count share, whatever the lengths);
- the PG objective at rho = 1 under each rule, sum_i w_i T_i A_i: zero for sequence and balanced
  with symmetric advantages, the "drift from zero" of token aggregation otherwise;
- the zero-advantage fraction (responses in groups that carry no signal).

All statistics are over sequences with T_i > 0 and come back as plain floats for logging.
"""

from __future__ import annotations

import torch

from megatron_ba import aggregation as agg
from megatron_ba.aggregation import Reduce, plan_statistics, weights_from_statistics

COMPARED_RULES = ("token", "sequence", "balanced")


def batch_diagnostics(
    lengths: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scope: str = "group",
    neutral_eps: float = 0.0,
    reduce: Reduce | None = None,
    num_groups: int | None = None,
) -> dict[str, float]:
    """Length statistics per sign and each rule's per-sign weight shares for one batch.

    With `reduce`/`num_groups` (as in `sequence_weights`) the statistics are global; the shares and
    rho = 1 objectives are then this rank's additive parts (keys ending in `_part`) plus the global
    shares computed from the reduced table.
    """
    stats = plan_statistics(
        lengths,
        advantages,
        group_ids,
        neutral_eps=neutral_eps,
        num_groups=num_groups,
        reduce=reduce,
    )

    total = stats.table.sum(dim=0)
    out: dict[str, float] = {}
    n_pos, n_neg = total[agg.POS_COUNT], total[agg.NEG_COUNT]
    n_live = total[agg.COUNT]
    len_pos = total[agg.POS_LENGTH] / n_pos if n_pos > 0 else torch.tensor(float("nan"))
    len_neg = total[agg.NEG_LENGTH] / n_neg if n_neg > 0 else torch.tensor(float("nan"))
    out["num_sequences"] = float(n_live)
    out["num_pos"] = float(n_pos)
    out["num_neg"] = float(n_neg)
    out["zero_adv_fraction"] = float((n_live - n_pos - n_neg) / n_live) if n_live > 0 else 0.0
    out["length_mean"] = float(total[agg.LENGTH] / n_live) if n_live > 0 else 0.0
    out["length_mean_pos"] = float(len_pos)
    out["length_mean_neg"] = float(len_neg)
    out["length_gap_pos_minus_neg"] = float(len_pos - len_neg)

    live = stats.lengths > 0
    T = stats.lengths[live]
    if reduce is None:
        # Variance needs the lengths themselves; the table has only sums, so it is computed
        # where all lengths are at hand (the single-process case).
        out["length_var"] = float(T.var(unbiased=False)) if T.numel() else 0.0
        for sign, mask in (("pos", stats.sign > 0), ("neg", stats.sign < 0)):
            t = stats.lengths[mask]
            out[f"length_var_{sign}"] = float(t.var(unbiased=False)) if t.numel() else float("nan")

    adv = torch.as_tensor(advantages).to(torch.float64)
    for rule in COMPARED_RULES:
        w = weights_from_statistics(rule, stats, scope=scope)
        mass = w * stats.lengths  # each sequence's total token weight
        pos = float(mass[stats.sign > 0].sum())
        neg = float(mass[stats.sign < 0].sum())
        suffix = "_part" if reduce is not None else ""
        if reduce is None:
            out[f"{rule}/weight_share_pos"] = pos / (pos + neg) if pos + neg > 0 else float("nan")
        out[f"{rule}/weight_pos{suffix}"] = pos
        out[f"{rule}/weight_neg{suffix}"] = neg
        out[f"{rule}/objective_at_rho1{suffix}"] = float((mass * adv).sum())
    return out
