"""Group-relative advantages for GRPO.

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     normalize_std=True  (GRPO)
    A_i =  r_i - mean_g(r)                         normalize_std=False (Dr.GRPO)

std_g is the *population* standard deviation (divide by G, not G - 1) by default: with it, binary
rewards give A+ = sqrt((G-k)/k) and A- = -sqrt(k/(G-k)) exactly as in the BA paper's analysis
(docs/math.md). `std="sample"` gives the unbiased (G - 1) estimator some trainers use. eps (default
1e-6) only guards against division by tiny spreads; groups whose rewards are all equal
(zero variance) get A = 0 exactly, whatever eps, rather than rounding noise divided by eps.

Zero-variance groups carry no policy-gradient signal. DAPO's dynamic sampling drops them and
samples more prompts; `drop_zero_variance=True` returns a `keep` mask for that, and the report
always says how many groups had zero variance, whether or not they are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ba._checks import check_choice, check_finite_1d, check_integer_1d, check_same_length


@dataclass(frozen=True)
class AdvantageReport:
    """What `group_advantages` computed and what it chose to drop."""

    advantages: torch.Tensor  # [N] float64 (or the rewards' dtype if float32)
    keep: torch.Tensor  # [N] bool: False for sequences of dropped zero-variance groups
    num_groups: int
    num_zero_variance_groups: int
    num_dropped_sequences: int
    group_mean: torch.Tensor  # [N] the mean reward of each sequence's group
    group_std: torch.Tensor  # [N] the std (as chosen) of each sequence's group

    def metrics(self) -> dict[str, float]:
        return {
            "adv/num_groups": float(self.num_groups),
            "adv/zero_variance_groups": float(self.num_zero_variance_groups),
            "adv/zero_variance_fraction": self.num_zero_variance_groups / max(self.num_groups, 1),
            "adv/dropped_sequences": float(self.num_dropped_sequences),
        }


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    std: str = "population",
    eps: float = 1e-6,
    drop_zero_variance: bool = False,
) -> AdvantageReport:
    """Group-normalised advantages of `rewards` ([N]) within groups given by `group_ids` ([N])."""
    r = check_finite_1d("rewards", rewards)
    ids = check_integer_1d("group_ids", group_ids)
    check_same_length(rewards=r, group_ids=ids)
    check_choice("std", std, ("population", "sample"))
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")

    uniq, row = torch.unique(ids, return_inverse=True)
    num_groups = int(uniq.numel())
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, row, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, row, r) / count
    centred = r - mean[row]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, row, centred * centred)
    if std == "sample":
        if bool((count < 2).any()):
            raise ValueError("std: 'sample' needs at least 2 responses in every group")
        var = sq / (count - 1)
    else:
        var = sq / count
    group_std = var.sqrt()
    # Zero variance decided on the rewards themselves (max == min), not on a rounded std.
    r_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64)
    r_max.scatter_reduce_(0, row, r, "amax")
    r_min = torch.full((num_groups,), torch.inf, dtype=torch.float64)
    r_min.scatter_reduce_(0, row, r, "amin")
    zero_var = r_max == r_min

    adv = centred / (group_std[row] + eps) if normalize_std else centred
    adv = torch.where(zero_var[row], torch.zeros_like(adv), adv)
    keep = ~zero_var[row] if drop_zero_variance else torch.ones_like(adv, dtype=torch.bool)
    out_dtype = torch.float32 if rewards_dtype(rewards) == torch.float32 else torch.float64
    return AdvantageReport(
        advantages=adv.to(out_dtype),
        keep=keep,
        num_groups=num_groups,
        num_zero_variance_groups=int(zero_var.sum()),
        num_dropped_sequences=int((~keep).sum()),
        group_mean=mean[row].to(out_dtype),
        group_std=group_std[row].to(out_dtype),
    )


def rewards_dtype(rewards) -> torch.dtype:
    return rewards.dtype if isinstance(rewards, torch.Tensor) else torch.float64
