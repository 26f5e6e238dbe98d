"""The GRPO trainer's pure parts (rollouts.py): explicit groups, masks, advantages, filtering.

No NeMo imports: runs in any environment.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ba.integrations.nemo_aligner.rollout_batch import (
    global_group_ids,
    grpo_training_data,
    response_mask,
    response_texts,
)
from megatron_ba.loss_settings import AggregationSettings


def test_group_ids_are_global_over_dp_ranks():
    assert global_group_ids(3, 4, 0).tolist() == [0, 1, 2]
    assert global_group_ids(4, 4, 1).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="num_local_prompts"):
        global_group_ids(5, 4, 1)


def test_response_mask_matches_nemo_aligner_create_mask_layout():
    # prompt 2 tokens, response up to length 5: tokens 2,3,4 are scored at positions 1,2,3
    m = response_mask(torch.tensor([2, 3]), torch.tensor([5, 4]), 6)
    assert m.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]


def _rollout(tokens_b=6, seq=8):
    return {
        "response_tokens": torch.arange(tokens_b * seq).reshape(tokens_b, seq),
        "prompt_lengths": torch.full((tokens_b,), 2),
        "response_lengths": torch.tensor([8, 4, 6, 5, 5, 5]),
        "logprobs": torch.zeros(tokens_b, seq - 1),
    }


def test_advantages_keyed_by_group_ids_not_prompt_rows():
    # Two groups with identical prompt rows (all rollouts share prompt tokens here): explicit ids
    # keep them apart; merging them (NeMo-Aligner's prompt-row equality) would change A.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    data, metrics = grpo_training_data(_rollout(), rewards=rewards, group_ids=ids)
    a = data["advantages"].double()
    std = math.sqrt(2) / 3  # population std of (1, 0, 0); group_advantages adds eps = 1e-6
    expected = [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)]
    assert a[:3].tolist() == pytest.approx(expected, rel=1e-6)
    assert a[3:].tolist() == [0.0, 0.0, 0.0]  # zero-variance group: A = 0 exactly
    merged, _ = grpo_training_data(
        _rollout(), rewards=rewards, group_ids=torch.zeros(6, dtype=torch.long)
    )
    assert not torch.allclose(merged["advantages"], data["advantages"])
    assert metrics["zero_variance_groups"] == 1.0 and metrics["reward_sum"] == 4.0
    assert data["mask"].sum(1).tolist() == [6, 2, 4, 3, 3, 3]


def test_zero_variance_filtering_zeroes_the_group_lengths_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    kept, _ = grpo_training_data(_rollout(), rewards=rewards, group_ids=ids)
    data, metrics = grpo_training_data(
        _rollout(), rewards=rewards, group_ids=ids, drop_zero_variance=True
    )
    assert (
        data["mask"].shape == kept["mask"].shape
    )  # shapes stay: every rank runs the same schedule
    assert data["mask"][3:].sum() == 0 and torch.equal(data["mask"][:3], kept["mask"][:3])
    assert metrics["dropped_sequences"] == 3.0


def test_filtered_group_leaves_the_plan_like_an_absent_group():
    """With lengths 0 the token rule's denominators ignore the dropped group entirely."""
    from megatron_ba.loss import LossPlan

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    data, _ = grpo_training_data(
        _rollout(), rewards=rewards, group_ids=ids, drop_zero_variance=True
    )
    plan = LossPlan.build(
        AggregationSettings("token", scope="batch"),
        data["mask"].sum(1).double(),
        data["advantages"].double(),
        ids,
    )
    alone = LossPlan.build(
        AggregationSettings("token", scope="batch"),
        data["mask"][:3].sum(1).double(),
        data["advantages"][:3].double(),
        ids[:3],
    )
    assert torch.allclose(plan.pg_weights[:3], alone.pg_weights) and plan.pg_weights[3:].sum() == 0


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="rewards, group_ids"):
        grpo_training_data(
            _rollout(), rewards=torch.zeros(5), group_ids=torch.zeros(6, dtype=torch.long)
        )


def test_response_texts_decode_the_generated_part():
    tokens = torch.tensor([[1, 2, 3, 4, 0]])
    got = response_texts(
        tokens, torch.tensor([2]), torch.tensor([4]), lambda ids: ",".join(map(str, ids))
    )
    assert got == ["3,4"]
