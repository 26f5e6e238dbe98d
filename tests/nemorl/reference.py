"""Float64 references for the NeMo-RL tests, written out term by term (no megatron-ba code).

`plan_weights` gives one weight per response for a rule, from lengths, advantages and GRPO's group
layout (consecutive blocks of `group_size`); `reference_loss` is the loss BalancedPGLossFn must
equal: -sum_i w_i sum_t min(r A_i, clip(r) A_i) (dual clip for A_i < 0) plus NeMo-RL's k3 KL term
with its score-function factor exp(lp - stopgrad(lp)), clamps and global token mean.
"""

from __future__ import annotations

import torch


def plan_weights(rule: str, lengths, advantages, group_size: int) -> torch.Tensor:
    """Per-response weights of `rule` (docs/math.md), in float64, by explicit loops."""
    lengths = [float(x) for x in lengths]
    adv = [float(a) for a in advantages]
    n = len(lengths)
    groups = [list(range(s, s + group_size)) for s in range(0, n, group_size)]
    live_groups = [g for g in groups if any(lengths[i] > 0 for i in g)]
    gamma = len(live_groups)
    total = sum(lengths)
    w = [0.0] * n
    for g in live_groups:
        live = [i for i in g if lengths[i] > 0]
        n_g = sum(lengths[i] for i in live)
        pos = [i for i in live if adv[i] > 0]
        neg = [i for i in live if adv[i] < 0]
        for i in live:
            if rule == "token":  # batch scope: the global token mean
                w[i] = 1.0 / total
            elif rule == "group_token_mean":
                w[i] = 1.0 / (gamma * n_g)
            elif rule == "balanced":
                side = pos if adv[i] > 0 else neg if adv[i] < 0 else None
                if side:
                    w[i] = (len(side) / len(live)) / (gamma * sum(lengths[j] for j in side))
            else:
                raise ValueError(rule)
    return torch.tensor(w, dtype=torch.float64)


def reference_loss(logp, data, weights, *, clip=(0.2, 0.28), dual_clip=None, kl=0.0,
                   kl_clamps=(20.0, 10.0), score_function=True, is_weights=None):  # fmt: skip
    """The loss of a whole batch (NeMo-RL's data dict, [:, 1:] shifted), float64; `is_weights`
    (per token) multiply each token's policy-gradient term."""
    mask = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).to(torch.float64)
    a = data["advantages"][:, 1:].to(torch.float64)
    ratio = (logp - data["prev_logprobs"][:, 1:]).exp()
    term = torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a)
    if dual_clip is not None:
        term = torch.where(a < 0, torch.maximum(term, dual_clip * a), term)
    if is_weights is not None:
        term = term * is_weights
    loss = -(weights[:, None] * term * mask).sum()
    if kl:
        logr = (data["reference_policy_logprobs"][:, 1:] - logp).clamp(-kl_clamps[0], kl_clamps[0])
        k3 = logr.exp() - 1 - logr
        if score_function:
            k3 = k3 * (logp - logp.detach()).exp()
        k3 = k3.clamp(-kl_clamps[1], kl_clamps[1])
        loss = loss + kl * (k3 * mask).sum() / mask.sum()
    return loss


def importance_weights(data, kind: str | None, low: float | None, high: float | None):
    """NeMo-RL's importance-sampling correction as its docs define it, per token (float64):
    r = exp(prev - generation); `tis` clamps r to [low or 0, high], `icepop` zeroes tokens with r
    outside [low, high], `seq-mask-tis` zeroes whole responses whose geometric-mean r (over their
    tokens) lies outside [low, high] and keeps r on the others; None keeps r."""
    r = (data["prev_logprobs"][:, 1:] - data["generation_logprobs"][:, 1:]).double().exp()
    if kind is None:
        return r
    if kind == "tis":
        return r.clamp(min=low or 0.0, max=high)
    if kind == "icepop":
        return torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))
    if kind == "seq-mask-tis":
        tokens = data["token_mask"][:, 1:].double()
        log_mean = (r.log() * tokens).sum(1) / tokens.sum(1)
        keep = (log_mean.exp() >= low) & (log_mean.exp() <= high)
        return r * keep[:, None]
    raise ValueError(kind)
