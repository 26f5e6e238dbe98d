"""`group_token_mean` and `balanced` written from their definitions, in float64, for the tests of
every place that offers the rules (the core, TRL, verl, NeMo-Aligner) to compare against.

The rule: per prompt group, one token mean over all its responses' tokens; then the mean over the
groups that have tokens. Nothing here calls megatron_ba: the weights are exact fractions of the
lengths, the objective is a loop over groups.

    w = group_token_mean_weights(lengths, group_ids)          # [N] float64, 1 / (Gamma N_g)
    J = group_token_mean_objective(values, mask, group_ids)   # (1/Gamma) sum_g mean_{tokens of g}
    phi = clipped_terms(logp, old, advantages, 0.2, 0.28)     # the PPO term per token
    J = balanced_objective(values, mask, advantages, group_ids)  # BA, the same way

A negative control of the same shape: pass every sequence one group id (the batch token mean).
"""

from __future__ import annotations

from fractions import Fraction

import torch


def group_token_mean_weights(lengths, group_ids) -> torch.Tensor:
    """[N] float64: 1 / (Gamma N_g) for a response of group g with tokens, else 0."""
    lengths = [int(t) for t in torch.as_tensor(lengths).tolist()]
    groups = [int(g) for g in torch.as_tensor(group_ids).tolist()]
    totals: dict[int, int] = {}
    for t, g in zip(lengths, groups, strict=True):
        totals[g] = totals.get(g, 0) + t
    gamma = sum(1 for n in totals.values() if n > 0)
    w = [
        Fraction(1, gamma * totals[g]) if t > 0 else Fraction(0)
        for t, g in zip(lengths, groups, strict=True)
    ]
    return torch.tensor([float(x) for x in w], dtype=torch.float64)


def group_token_mean_objective(values, mask, group_ids) -> torch.Tensor:
    """(1/Gamma) sum_g (sum of values over g's masked tokens) / (g's token count), float64.

    `values` [N, T] (differentiable), `mask` [N, T] bool; groups without tokens are left out."""
    values = values.to(torch.float64)
    mask = torch.as_tensor(mask).bool()
    group_ids = torch.as_tensor(group_ids)
    means = []
    for g in torch.unique(group_ids).tolist():
        rows = group_ids == g
        m = mask[rows]
        if int(m.sum()) > 0:
            means.append(values[rows][m].sum() / int(m.sum()))
    if not means:  # no tokens at all: the objective is 0 (still a function of values)
        return (values * 0).sum()
    return torch.stack(means).mean()


def clipped_terms(
    logp, old, advantages, clip_low: float, clip_high: float, dual_clip: float | None = None
) -> torch.Tensor:
    """[N, T] min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A), A constant along a row;
    with `dual_clip` c, max(that, c A) where A < 0."""
    ratio = torch.exp(logp.to(torch.float64) - old.to(torch.float64))
    a = torch.as_tensor(advantages).to(torch.float64)[:, None]
    phi = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    if dual_clip is not None:
        phi = torch.where(a < 0, torch.maximum(phi, dual_clip * a), phi)
    return phi


def balanced_objective(values, mask, advantages, group_ids, neutral_eps: float = 0.0):
    """BA (eq. 19) at the group scope from its definition, float64: per prompt group g, the token
    mean of `values` inside each sign's subset S_g^s (|A| > neutral_eps), weighted |S_g^s| / G_g
    (G_g: g's responses with tokens); then the mean over the Gamma groups with tokens.

    `values` [N, T] (differentiable, e.g. c_{i,t} phi_{i,t}), `mask` [N, T] bool: a subset's token
    count N_g^s counts every masked token, whatever its value."""
    values = values.to(torch.float64)
    mask = torch.as_tensor(mask).bool()
    adv = [float(a) for a in torch.as_tensor(advantages).tolist()]
    groups = [int(g) for g in torch.as_tensor(group_ids).tolist()]
    lengths = [int(t) for t in mask.sum(1).tolist()]
    terms = []
    for g in sorted(set(groups)):
        live = [i for i in range(len(adv)) if groups[i] == g and lengths[i] > 0]
        if not live:
            continue
        term = values.new_zeros(())
        for sign in (1.0, -1.0):
            subset = [i for i in live if sign * adv[i] > neutral_eps]
            if subset:
                tokens = sum(lengths[i] for i in subset)
                total = sum(values[i][mask[i]].sum() for i in subset)
                term = term + (len(subset) / len(live)) * total / tokens
        terms.append(term)
    if not terms:
        return (values * 0).sum()
    return torch.stack(terms).mean()
