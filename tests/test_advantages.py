"""Group advantages: population std, Dr.GRPO centring, zero-variance groups reported."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ba import group_advantages


def test_binary_population_std_matches_paper():
    G, k = 16, 5
    r = torch.tensor([1.0] * k + [0.0] * (G - k), dtype=torch.float64)
    rep = group_advantages(r, torch.zeros(G, dtype=torch.long), eps=0.0)
    assert rep.advantages.dtype == torch.float64
    torch.testing.assert_close(
        rep.advantages[:k], torch.full((k,), math.sqrt((G - k) / k), dtype=torch.float64)
    )
    torch.testing.assert_close(
        rep.advantages[k:], torch.full((G - k,), -math.sqrt(k / (G - k)), dtype=torch.float64)
    )


def test_hand_computed_groups_and_options():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    ids = torch.tensor([7, 7, 7, 3, 3])  # non-contiguous ids
    rep = group_advantages(r, ids, eps=0.0)
    # group 7: mean 1/3, population std sqrt(2)/3; group 3: mean 3, std 1
    s = math.sqrt(2) / 3
    expected = [(1 - 1 / 3) / s, -1 / 3 / s, -1 / 3 / s, -1.0, 1.0]
    torch.testing.assert_close(rep.advantages, torch.tensor(expected, dtype=torch.float64))
    sample = group_advantages(r, ids, std="sample", eps=0.0).advantages
    torch.testing.assert_close(
        sample[3:], torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)], dtype=torch.float64)
    )
    dr = group_advantages(r, ids, normalize_std=False).advantages
    torch.testing.assert_close(
        dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0], dtype=torch.float64)
    )


def test_zero_variance_groups_are_exactly_zero_and_reported():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.3, 0.3], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    rep = group_advantages(r, ids)
    assert (rep.advantages[:3] == 0).all() and (rep.advantages[5:] == 0).all()
    assert rep.num_zero_variance_groups == 2 and rep.num_groups == 3
    assert rep.keep.all() and rep.num_dropped_sequences == 0  # reported, not dropped
    dropped = group_advantages(r, ids, drop_zero_variance=True)
    assert dropped.keep.tolist() == [False, False, False, True, True, False, False]
    assert dropped.num_dropped_sequences == 5
    assert dropped.metrics()["adv/zero_variance_fraction"] == pytest.approx(2 / 3)


def test_advantage_errors():
    with pytest.raises(ValueError, match=r"^rewards:"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"^group_ids:"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match=r"^std:"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), std="biased")
    with pytest.raises(ValueError, match=r"^std:"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), std="sample")
    with pytest.raises(ValueError, match=r"rewards=3, group_ids=2"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0]))
