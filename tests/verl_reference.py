"""Float64 references for the verl rollout-correction tests, written out by loops (no megatron-ba
code): the balanced plan's weights from lengths, advantages and group ids, and the loss
-sum_i w_i sum_t c_{i,t} phi_{i,t} with phi the clipped PPO term (tests/rule_reference.py).

Zero-length responses (every token rejected) are left out of their group: not in G_g, |S_g| or
N_g^s, weight 0; a group without tokens is left out of Gamma.

    w = balanced_weights(lengths, advantages, group_ids)      # [N] float64
    loss = weighted_loss(logp, old, a, mask, w, c)            # differentiable in logp
"""

from __future__ import annotations

import torch
from rule_reference import clipped_terms


def balanced_weights(lengths, advantages, group_ids) -> torch.Tensor:
    """[N] float64: (|S_g^s| / G_g) / (Gamma N_g^s) for a response of sign s with tokens, else 0."""
    lengths = [float(t) for t in torch.as_tensor(lengths).tolist()]
    adv = [float(a) for a in torch.as_tensor(advantages).tolist()]
    groups = [int(g) for g in torch.as_tensor(group_ids).tolist()]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        if lengths[i] > 0:
            members.setdefault(g, []).append(i)
    gamma = len(members)
    w = [0.0] * len(lengths)
    for live in members.values():
        for side in ([i for i in live if adv[i] > 0], [i for i in live if adv[i] < 0]):
            length = sum(lengths[j] for j in side)
            for i in side:
                w[i] = (len(side) / len(live)) / (gamma * length)
    return torch.tensor(w, dtype=torch.float64)


def weighted_loss(logp, old, advantages, mask, weights, is_weights=None, dual_clip=3.0):
    """-sum_i w_i sum_t mask c phi (float64): PPO clip 0.2 / 0.28, dual clip, `is_weights` c per
    token (None: 1) multiplying each token's clipped term."""
    phi = clipped_terms(logp, old, advantages, 0.2, 0.28, dual_clip=dual_clip)
    if is_weights is not None:
        phi = phi * is_weights.to(torch.float64)
    m = torch.as_tensor(mask).to(torch.float64)
    return -(torch.as_tensor(weights).to(torch.float64)[:, None] * phi * m).sum()
