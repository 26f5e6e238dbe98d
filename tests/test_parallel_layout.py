"""Sharding layouts (TP strided shards, CP load-balanced chunks) and CP at the loss level.

    python -m pytest tests/test_parallel_layout.py

Pure torch in this process: the layouts against hand-written cases and against megatron-core's
own CPU initialisation (`_initialize_affine_weight_cpu`'s split), and the
loss-level CP property: with weights from whole-sequence statistics, the losses of the CP shards
add up to the whole sequence's loss, and so do their gradients w.r.t. the logits (float64).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.megatron.vocab_parallel import vocab_parallel_logprobs
from megatron_ba.parallel.sharding import (
    cp_positions,
    cp_shard,
    cp_unshard,
    tp_shard,
    tp_unshard,
)

# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def test_cp_positions_hand_computed():
    # S = 8, CP = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # CP = 4 on S = 8: chunks of 1: rank r holds r and 7 - r.
    assert [cp_positions(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_tp_shard_hand_computed_stride_2():
    # SwiGLU's fc1: full = [gate (rows 0-3); up (rows 4-7)], TP = 2: rank r holds [gate_r; up_r].
    full = torch.arange(8).view(8, 1)
    assert tp_shard(full, dim=0, stride=2, rank=0, size=2).view(-1).tolist() == [0, 1, 4, 5]
    assert tp_shard(full, dim=0, stride=2, rank=1, size=2).view(-1).tolist() == [2, 3, 6, 7]
    assert tp_shard(full, dim=0, stride=1, rank=1, size=2).view(-1).tolist() == [4, 5, 6, 7]


def test_tp_shard_hand_computed_unequal_sections():
    # A fused weight of unequal parts [q (4 rows); k (4); v (2)] at TP = 2: every rank holds its
    # half of each part, in order (megatron-core's Gated DeltaNet in_proj and conv1d).
    full = torch.arange(10).view(10, 1)
    sections = (4, 4, 2)
    rank0 = tp_shard(full, dim=0, stride=sections, rank=0, size=2).view(-1).tolist()
    rank1 = tp_shard(full, dim=0, stride=sections, rank=1, size=2).view(-1).tolist()
    assert rank0 == [0, 1, 4, 5, 8]
    assert rank1 == [2, 3, 6, 7, 9]
    # A uniform stride of 3 over the same rows would give different pieces: sections matter.
    assert tp_shard(torch.arange(12).view(12, 1), dim=0, stride=3, rank=0, size=2).view(
        -1
    ).tolist() == [0, 1, 4, 5, 8, 9]
    with pytest.raises(ValueError, match=r"parts \(4, 4, 3\) must add up"):
        tp_shard(torch.zeros(11, 1), dim=0, stride=(4, 4, 3), rank=0, size=2)


@settings(max_examples=30, deadline=None)
@given(
    size=st.sampled_from([1, 2, 4]),
    parts=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 1000),
)
def test_tp_unshard_inverts_sectioned_shard(size, parts, dim, seed):
    sections = tuple(p * size for p in parts)
    g = torch.Generator().manual_seed(seed)
    shape = [sum(sections), 3] if dim == 0 else [3, sum(sections)]
    full = torch.randn(shape, generator=g)
    shards = [tp_shard(full, dim=dim, stride=sections, rank=r, size=size) for r in range(size)]
    assert torch.equal(tp_unshard(shards, dim=dim, stride=sections), full)


@settings(max_examples=40, deadline=None)
@given(
    size=st.sampled_from([1, 2, 4]),
    stride=st.sampled_from([1, 2, 3]),
    dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 1000),
)
def test_tp_unshard_inverts_shard(size, stride, dim, seed):
    g = torch.Generator().manual_seed(seed)
    shape = [2 * stride * size, 3] if dim == 0 else [3, 2 * stride * size]
    full = torch.randn(shape, generator=g)
    shards = [tp_shard(full, dim=dim, stride=stride, rank=r, size=size) for r in range(size)]
    assert torch.equal(tp_unshard(shards, dim=dim, stride=stride), full)


@settings(max_examples=30, deadline=None)
@given(cp=st.sampled_from([1, 2, 4]), chunks=st.integers(1, 4), seed=st.integers(0, 1000))
def test_cp_unshard_inverts_shard_and_positions_partition(cp, chunks, seed):
    s = 2 * cp * chunks
    x = torch.randn(3, s, 2, generator=torch.Generator().manual_seed(seed))
    parts = [cp_shard(x, cp=cp, rank=r, dim=1) for r in range(cp)]
    assert torch.equal(cp_unshard(parts, dim=1), x)
    seen = torch.cat([cp_positions(s, cp, r) for r in range(cp)]).sort().values
    assert seen.tolist() == list(range(s))


def test_tp_sharding_matches_megatron_core_initialisation():
    """megatron-core's CPU initialisation splits a full weight exactly as tp_shard does.

    (The CP layout is compared with megatron-core's get_batch_on_this_cp_rank inside the gloo
    layout checks, where a real CP group exists: tests/test_layout_matrix.py.)
    """
    pytest.importorskip("megatron.core")
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    full = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    for stride in (1, 2):
        for r in range(2):
            weight = torch.empty(6, 5)
            _initialize_affine_weight_cpu(
                weight, 12, 5, 6, 0, init_method=lambda w: w.copy_(full), stride=stride,
                rank=r, world_size=2,
            )  # fmt: skip
            assert torch.equal(weight, tp_shard(full, dim=0, stride=stride, rank=r, size=2))


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match=r"seq_len: .*multiple of 4"):
        cp_positions(6, 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        cp_positions(8, 2, 2)
    with pytest.raises(ValueError, match="does not split into 4 blocks"):
        tp_shard(torch.zeros(6, 2), dim=0, stride=2, rank=0, size=2)


# --- CP at the loss level -----------------------------------------------------------------------


def _cp_batch(seed: int, s: int = 16, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    n = 6
    logits = torch.randn(n, s, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n, s), generator=g)
    lengths = torch.tensor([3, 9, 5, 12, 2, 7])
    start = torch.tensor([1, 2, 1, 3, 4, 2])
    pos = torch.arange(s)[None]
    mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
    adv = torch.tensor([1.2, -0.8, -0.4, 0.9, -1.0, 0.3], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    old = torch.randn(n, s, generator=g, dtype=torch.float64) * 0.3 - 2.0
    ref = old + 0.1 * torch.randn(n, s, generator=g, dtype=torch.float64)
    return logits, targets, mask, lengths, adv, groups, old, ref


def _loss_and_grad(logits, targets, mask, plan, old, ref, config):
    x = logits.detach().clone().requires_grad_()
    lp, h = vocab_parallel_logprobs(x, targets, with_entropy=True)
    loss, _ = grpo_loss(lp.double(), old, mask, plan, config, ref_logprobs=ref, entropy=h.double())
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("rule", ["token", "sequence", "balanced", "balanced_mass"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_shard_losses_and_logit_gradients_add_up(rule, cp):
    logits, targets, mask, lengths, adv, groups, old, ref = _cp_batch(seed=cp)
    config = GRPOLossConfig(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01)
    # Weights from whole-sequence statistics (what the DP reduction provides), then per shard.
    plan = LossPlan.build(AggregationSettings(rule), lengths.double(), adv, groups)
    whole_loss, whole_grad = _loss_and_grad(logits, targets, mask, plan, old, ref, config)
    total, grad = torch.zeros((), dtype=torch.float64), torch.zeros_like(logits)
    for r in range(cp):
        idx = cp_positions(logits.shape[1], cp, r)
        part, g = _loss_and_grad(
            *(cp_shard(t, cp=cp, rank=r, dim=1) for t in (logits, targets, mask)),
            plan, *(cp_shard(t, cp=cp, rank=r, dim=1) for t in (old, ref)), config,
        )  # fmt: skip
        total += part
        grad[:, idx] += g
    assert abs(float(total - whole_loss)) < 1e-12
    assert float((grad - whole_grad).abs().max()) < 1e-12


def test_cp_shard_lengths_would_be_wrong():
    """Negative control: weights from a shard's own lengths do not add up (what the check sees)."""
    logits, targets, mask, lengths, adv, groups, old, ref = _cp_batch(seed=0)
    config = GRPOLossConfig()
    plan = LossPlan.build(AggregationSettings("balanced"), lengths.double(), adv, groups)
    whole_loss, _ = _loss_and_grad(logits, targets, mask, plan, old, ref, config)
    total = 0.0
    for r in range(2):
        shard_mask = cp_shard(mask, cp=2, rank=r, dim=1)
        shard_plan = LossPlan.build(
            AggregationSettings("balanced"), shard_mask.sum(1).double(), adv, groups
        )
        part, _ = _loss_and_grad(
            cp_shard(logits, cp=2, rank=r, dim=1), cp_shard(targets, cp=2, rank=r, dim=1),
            shard_mask, shard_plan, cp_shard(old, cp=2, rank=r, dim=1),
            cp_shard(ref, cp=2, rank=r, dim=1), config,
        )  # fmt: skip
        total += float(part)
    assert abs(total - float(whole_loss)) > 1e-3
