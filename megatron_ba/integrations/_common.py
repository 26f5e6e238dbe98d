"""What the three adapters share: reading per-sequence facts out of token-level framework tensors.

Frameworks hand a loss hook token-level advantages ([N, T], the sequence's advantage repeated on its
tokens) and a loss mask. The core plans from per-sequence values, so these helpers take them back
out, and refuse (naming the argument) inputs a per-sequence plan cannot represent, e.g. GAE
advantages that vary along a response.
"""

from __future__ import annotations

import torch


def sequence_lengths(mask: torch.Tensor, *, name: str = "mask") -> torch.Tensor:
    """[N] number of loss tokens per row of a [N, T] 0/1 (or bool) mask, as float64."""
    if mask.dim() != 2:
        raise ValueError(f"{name}: must be [N, T] (one row per sequence), got {tuple(mask.shape)}")
    m = mask.to(torch.float64)
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError(f"{name}: must hold only 0 and 1, got values {torch.unique(m).tolist()}")
    return m.sum(dim=1)


def sequence_advantages(
    token_advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    name: str = "advantages",
    atol: float = 1e-6,
) -> torch.Tensor:
    """[N] per-sequence advantage from [N, T] token advantages constant on each row's masked tokens.

    [N] input is returned as it is. Rows without a masked token get 0 (they are padding for the
    plan: length 0, weight 0).
    """
    if token_advantages.dim() == 1:
        return token_advantages
    if token_advantages.shape != mask.shape:
        raise ValueError(
            f"{name}: must be [N] or have the mask's shape {tuple(mask.shape)}, got "
            f"{tuple(token_advantages.shape)}"
        )
    valid = mask.bool()
    adv = token_advantages.to(torch.float64)
    count = valid.sum(dim=1)
    zero = torch.zeros((), dtype=torch.float64, device=adv.device)
    total = torch.where(valid, adv, zero).sum(dim=1)
    mean = torch.where(count > 0, total / count.clamp(min=1), zero)
    spread = torch.where(valid, (adv - mean[:, None]).abs(), zero).amax(dim=1)
    if bool((spread > atol * (1.0 + mean.abs())).any()):
        i = int((spread > atol * (1.0 + mean.abs())).nonzero()[0, 0])
        raise ValueError(
            f"{name}: balanced aggregation plans per sequence and needs one advantage per "
            f"response (outcome rewards, as in GRPO); row {i} varies by {float(spread[i]):.3g} "
            f"along its tokens"
        )
    return mean.to(token_advantages.dtype)
