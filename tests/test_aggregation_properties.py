"""Plan properties (hypothesis): splits add up, permutations commute, bad input is refused."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rule_reference import (
    clipped_terms,
    group_token_mean_objective,
    group_token_mean_weights,
)

from megatron_ba import group_advantages, sequence_weights
from megatron_ba.aggregation import RULES, SCOPES, apply_weights, plan_statistics
from megatron_ba.loss import LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings


@st.composite
def grpo_batches(draw, max_groups=4, max_group_size=6, max_len=12):
    groups = draw(st.integers(1, max_groups))
    sizes = [draw(st.integers(1, max_group_size)) for _ in range(groups)]
    n = sum(sizes)
    ids = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])
    lengths = torch.tensor(draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n)))
    rewards = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=n, max_size=n)),
        dtype=torch.float64,
    )
    adv = group_advantages(rewards, ids).advantages
    seed = draw(st.integers(0, 2**16))
    return lengths, adv, ids, seed


def _token_tensors(lengths, seed, T=None):
    g = torch.Generator().manual_seed(seed)
    n = lengths.numel()
    T = T or max(int(lengths.max()) if n else 1, 1)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = (-torch.rand(n, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.3
    return logp, old, mask


@settings(max_examples=60, deadline=None)
@given(grpo_batches(), st.sampled_from(RULES), st.sampled_from(SCOPES), st.data())
def test_any_split_reproduces_full_loss_and_gradient(batch, rule, scope, data):
    """Micro-batches / DP ranks: stats summed over parts, per-part losses summed == full loss."""
    lengths, adv, ids, seed = batch
    logp, old, mask = _token_tensors(lengths, seed)
    settings = AggregationSettings(rule, scope=scope, max_length=12)
    full_plan = LossPlan.build(settings, lengths, adv, ids, num_groups=int(ids.max()) + 1)
    full, _ = grpo_loss(logp, old, mask, full_plan)
    (g_full,) = torch.autograd.grad(full, logp)
    parts = data.draw(st.lists(st.integers(0, 2), min_size=ids.numel(), max_size=ids.numel()))
    total, g_parts = _loss_over_parts(settings, batch, torch.tensor(parts), logp, old, mask)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-15)


@settings(max_examples=40, deadline=None)
@given(grpo_batches(), st.sampled_from(SCOPES), st.data())
def test_group_token_mean_over_parts_equals_its_float64_reference(batch, scope, data):
    """group_token_mean split over micro-batches / ranks (statistics reduced) is the definition:
    minus the mean over groups of each group's token mean of the PPO term, at either scope."""
    lengths, adv, ids, seed = batch
    logp, old, mask = _token_tensors(lengths, seed)
    parts = data.draw(st.lists(st.integers(0, 2), min_size=ids.numel(), max_size=ids.numel()))
    settings = AggregationSettings("group_token_mean", scope=scope)
    total, g_parts = _loss_over_parts(settings, batch, torch.tensor(parts), logp, old, mask)
    ref = -group_token_mean_objective(clipped_terms(logp, old, adv, 0.2, 0.28), mask, ids)
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(total, ref, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_parts, g_ref, rtol=1e-12, atol=1e-15)


def _loss_over_parts(settings, batch, parts, logp, old, mask):
    """(sum of the parts' losses, its gradient in logp): each part plans with the global
    statistics table (what the all-reduce returns), reduced exactly once."""
    lengths, adv, ids, _ = batch
    num_groups = int(ids.max()) + 1
    global_table = plan_statistics(lengths, adv, ids, num_groups=num_groups).table
    total = 0.0
    for p in range(3):
        idx = (parts == p).nonzero().flatten()
        calls = []

        def reduce(t, calls=calls):
            calls.append(1)
            # what an all-reduce returns: every part's table summed
            return global_table

        plan = LossPlan.build(
            settings, lengths[idx], adv[idx], ids[idx], reduce=reduce, num_groups=num_groups
        )
        assert len(calls) == 1
        part_loss, _ = grpo_loss(logp[idx], old[idx], mask[idx], plan)
        total = total + part_loss
    (g_parts,) = torch.autograd.grad(total, logp)
    return total, g_parts


@settings(max_examples=30, deadline=None)
@given(grpo_batches(), st.sampled_from(RULES), st.integers(1, 5))
def test_token_shards_add_up(batch, rule, shards):
    """Context parallelism: cutting every sequence's tokens into shards, weights unchanged."""
    lengths, adv, ids, seed = batch
    logp, old, mask = _token_tensors(lengths, seed)
    plan = LossPlan.build(AggregationSettings(rule, max_length=12), lengths, adv, ids)
    full, _ = grpo_loss(logp, old, mask, plan)
    cuts = torch.linspace(0, logp.shape[1], shards + 1).round().long().tolist()
    total = sum(
        grpo_loss(logp[:, a:b], old[:, a:b], mask[:, a:b], plan)[0]
        for a, b in itertools.pairwise(cuts)
    )
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-15)


def test_per_microbatch_normalisation_does_not_add_up():
    """Negative control: planning each micro-batch on its own (NeMo-Aligner style) is biased."""
    lengths = torch.tensor([3, 9, 4, 12, 2, 7, 5, 10])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]), ids).advantages
    logp, old, mask = _token_tensors(lengths, 0)
    for rule in ("token", "balanced"):
        full, _ = grpo_loss(
            logp, old, mask, LossPlan.build(AggregationSettings(rule), lengths, adv, ids)
        )
        local = sum(
            grpo_loss(
                logp[s],
                old[s],
                mask[s],
                LossPlan.build(AggregationSettings(rule), lengths[s], adv[s], ids[s]),
            )[0]
            for s in (slice(0, 3), slice(3, 8))
        )
        assert abs(float((local - full).detach())) > 1e-3, rule


@settings(max_examples=40, deadline=None)
@given(grpo_batches(), st.sampled_from(RULES), st.sampled_from(SCOPES), st.randoms())
def test_permutation_invariance(batch, rule, scope, rnd):
    lengths, adv, ids, _ = batch
    perm = list(range(lengths.numel()))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    w = sequence_weights(rule, lengths, adv, ids, scope=scope, max_length=12)
    wp = sequence_weights(rule, lengths[perm], adv[perm], ids[perm], scope=scope, max_length=12)
    torch.testing.assert_close(wp, w[perm], rtol=1e-15, atol=0)


@settings(max_examples=40, deadline=None)
@given(grpo_batches(), st.sampled_from(RULES), st.sampled_from(SCOPES))
def test_weights_finite_nonnegative_and_total_mass(batch, rule, scope):
    lengths, adv, ids, _ = batch
    w = sequence_weights(rule, lengths, adv, ids, scope=scope, max_length=12)
    assert torch.isfinite(w).all() and (w >= 0).all()
    live = lengths > 0
    mass = float((w * lengths).sum())
    if rule in ("token", "sequence", "group_token_mean") and live.any():
        assert abs(mass - 1.0) < 1e-12  # every rule of this kind is a normalised mean
    if rule == "balanced" and scope == "batch":
        signed = live & (adv != 0)
        assert abs(mass - float(signed.sum()) / max(float(live.sum()), 1.0)) < 1e-12


@settings(max_examples=60, deadline=None)
@given(grpo_batches(), st.sampled_from(SCOPES))
def test_group_token_mean_weights_equal_their_float64_reference(batch, scope):
    """1 / (Gamma N_g) from the definition (exact fractions), zero-length padding included; where
    two live groups differ in total length, the pooled batch token mean (one group) differs."""
    lengths, adv, ids, _ = batch
    w = sequence_weights("group_token_mean", lengths, adv.double(), ids, scope=scope)
    torch.testing.assert_close(w, group_token_mean_weights(lengths, ids), rtol=1e-15, atol=0)
    totals = torch.zeros(int(ids.max()) + 1, dtype=torch.long).index_add_(0, ids, lengths)
    if len(set(totals.tolist()) - {0}) > 1:
        pooled = group_token_mean_weights(lengths, torch.zeros_like(ids))
        assert not torch.allclose(w, pooled, rtol=1e-12, atol=0)


BAD_INPUTS = [
    (dict(rule="mean"), "rule"),
    (dict(scope="global"), "scope"),
    (dict(rule="dr_grpo", max_length=None), "max_length"),
    (dict(rule="dr_grpo", max_length=2), "max_length"),
    (dict(lengths=torch.tensor([1.0, float("nan"), 2.0])), "lengths"),
    (dict(lengths=torch.tensor([1, -2, 3])), "lengths"),
    (dict(lengths=torch.tensor([1, 2])), "lengths, advantages, group_ids"),
    (dict(advantages=torch.tensor([0.5, float("inf"), -1.0])), "advantages"),
    (dict(advantages=torch.tensor([[0.5, 1.0, -1.0]])), "advantages"),
    (dict(group_ids=torch.tensor([0.0, 0.0, 1.0])), "group_ids"),
    (dict(group_ids=torch.tensor([0, -1, 1])), "group_ids"),
    (dict(neutral_eps=-0.1), "neutral_eps"),
    (dict(reduce=lambda t: t), "num_groups"),
    (dict(reduce=lambda t: t, num_groups=1), "group_ids"),
    (dict(reduce=lambda t: t[:1], num_groups=2), "reduce"),
]


@pytest.mark.parametrize(("override", "argument"), BAD_INPUTS)
def test_bad_input_names_the_argument(override, argument):
    args = dict(
        rule="balanced",
        lengths=torch.tensor([3, 4, 5]),
        advantages=torch.tensor([0.5, -0.5, 1.0]),
        group_ids=torch.tensor([0, 0, 1]),
        max_length=4,
    )
    args.update(override)
    rule, lengths, adv, ids = (args.pop(k) for k in ("rule", "lengths", "advantages", "group_ids"))
    with pytest.raises(ValueError, match=rf"^{re.escape(argument)}:"):
        sequence_weights(rule, lengths, adv, ids, **args)


def test_apply_weights_shape_errors():
    v, m, w = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
    with pytest.raises(ValueError, match=r"^mask:"):
        apply_weights(v, m[:, :2], w)
    with pytest.raises(ValueError, match=r"^weights:"):
        apply_weights(v, m, torch.zeros(3))
    with pytest.raises(ValueError, match=r"^sequence_index:"):
        apply_weights(torch.zeros(4), torch.tensor([0, 1, 2, 3]), w)
    with pytest.raises(ValueError, match=r"^token_values:"):
        apply_weights(torch.zeros(1, 2, 3), m, w)
