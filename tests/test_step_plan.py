"""Plans for optimiser steps holding parts of groups (megatron_ba/step_plan.py, docs/math.md
section 10), against a float64 reference written from the definition in exact fractions.

    python -m pytest tests/test_step_plan.py

The reference weighs each response from its whole group's statistics and divides by the step's
group count Gamma_t = sum_g |g in t| / |g|. Checked: a hand-computed split, the reference on
random splits (hypothesis), the reduction to today's plan when a step holds whole groups, and
that the steps add up to the synchronous objective (sum_t Gamma_t J_t = Gamma J). Control: the
same steps planned from each part's own statistics (what a per-step plan of a cut batch does)
differs from the whole-group weights and does not add up.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ba.aggregation import apply_weights, sequence_weights
from megatron_ba.step_plan import split_step_weights, step_group_count, whole_group_weights

LENGTHS = [4, 6, 2, 8, 3, 3]
ADV = [1.0, -1.0, 1.0, -1.0, 0.5, -0.5]
GROUPS = [0, 0, 0, 0, 1, 1]
GROUP_RULES = ("token", "sequence", "balanced", "balanced_mass", "group_token_mean")


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def reference(rule, lengths, advantages, groups, in_step):
    """Exact weights of a group-scope rule on one step, from the definition (Fractions)."""
    live = [t > 0 for t in lengths]
    members = {g: [i for i, h in enumerate(groups) if h == g and live[i]] for g in set(groups)}
    held = sum(
        (Fraction(sum(in_step[i] for i in m), len(m)) for m in members.values() if m),
        Fraction(0),
    )
    out = []
    for i, g in enumerate(groups):
        if not (in_step[i] and live[i]) or held == 0:
            out.append(Fraction(0))
            continue
        m = members[g]
        if rule in ("token", "group_token_mean"):
            w = Fraction(1, sum(lengths[j] for j in m))
        elif rule == "sequence":
            w = Fraction(1, len(m) * lengths[i])
        else:
            sign = (advantages[i] > 0) - (advantages[i] < 0)
            same = [j for j in m if (advantages[j] > 0) - (advantages[j] < 0) == sign]
            if sign == 0:
                w = Fraction(0)
            elif rule == "balanced":
                w = Fraction(len(same), len(m)) / sum(lengths[j] for j in same)
            else:  # balanced_mass
                mass = sum(Fraction(abs(advantages[j])) for j in same)
                w = (mass / len(m)) / sum(Fraction(abs(advantages[j])) * lengths[j] for j in same)
        out.append(w / held)
    return out


def test_hand_computed_split():
    """Group 0 (k = 2 of 4, N+ = 6, N- = 14) cut after its second response; group 1 whole in
    step 1. Whole-group BA: 1/24 per positive, 1/56 per negative token of group 0 (Gamma = 2).
    Step 1 holds 1/2 + 1 groups: x 2/1.5; step 2 holds 1/2 group: x 4."""
    first = torch.tensor([True, True, False, False, True, True])
    w1 = split_step_weights("balanced", t64(LENGTHS), t64(ADV), torch.tensor(GROUPS), first)
    w2 = split_step_weights("balanced", t64(LENGTHS), t64(ADV), torch.tensor(GROUPS), ~first)
    assert w1.tolist() == pytest.approx([1 / 18, 1 / 42, 0, 0, 1 / 9, 1 / 9], rel=1e-15)
    assert w2.tolist() == pytest.approx([0, 0, 1 / 6, 1 / 14, 0, 0], rel=1e-15)
    assert step_group_count(t64(LENGTHS), torch.tensor(GROUPS), first).item() == 1.5
    assert [float(x) for x in reference("balanced", LENGTHS, ADV, GROUPS, first.tolist())] == (
        pytest.approx(w1.tolist(), rel=1e-15)
    )


def test_the_control_per_part_statistics_differ_and_do_not_add_up():
    """Planning the cut-off part on its own (k = 1 of 2, N+ = 2, N- = 8) gives 1/4 and 1/16:
    the part's lengths now set its signs' weights, and the steps no longer add up."""
    L, A, g = t64(LENGTHS), t64(ADV), torch.tensor(GROUPS)
    second = torch.tensor([False, False, True, True, False, False])
    per_part = sequence_weights("balanced", L[second], A[second], g[second])
    assert per_part.tolist() == pytest.approx([1 / 4, 1 / 16], rel=1e-15)
    split = split_step_weights("balanced", L, A, g, second)[second]
    assert not torch.allclose(per_part, split)
    phi = torch.randn(6, 8, dtype=torch.float64)
    mask = torch.arange(8)[None, :] < L[:, None]
    sync = apply_weights(phi, mask, sequence_weights("balanced", L, A, g))
    first = ~second
    gammas = [step_group_count(L, g, s) for s in (first, second)]
    part_plans = [sequence_weights("balanced", L[s], A[s], g[s]) for s in (first, second)]
    per_part_sum = sum(
        G * apply_weights(phi[s], mask[s], w)
        for G, s, w in zip(gammas, (first, second), part_plans, strict=True)
    )
    assert not torch.isclose(per_part_sum, 2 * sync)


@st.composite
def split_batches(draw):
    """Groups of 2-5 responses (lengths 0-9: 0 is padding; advantages with ties and zeros) and
    a random assignment of every response to one of 1-3 steps."""
    num_groups = draw(st.integers(1, 4))
    sizes = [draw(st.integers(2, 5)) for _ in range(num_groups)]
    n = sum(sizes)
    lengths = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    advantages = draw(
        st.lists(st.sampled_from([-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]), min_size=n, max_size=n)
    )
    groups = [g for g, s in enumerate(sizes) for _ in range(s)]
    steps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    return lengths, advantages, groups, steps


@settings(max_examples=150, deadline=None)
@given(split_batches(), st.sampled_from(GROUP_RULES))
def test_split_weights_equal_the_exact_reference(batch, rule):
    lengths, advantages, groups, steps = batch
    for step in set(steps):
        in_step = [s == step for s in steps]
        w = split_step_weights(rule, t64(lengths), t64(advantages), torch.tensor(groups),
                               torch.tensor(in_step))  # fmt: skip
        want = [float(x) for x in reference(rule, lengths, advantages, groups, in_step)]
        assert w.tolist() == pytest.approx(want, rel=1e-12, abs=0)


@settings(max_examples=100, deadline=None)
@given(split_batches(), st.sampled_from(GROUP_RULES))
def test_steps_add_up_to_the_synchronous_objective(batch, rule):
    """sum_t Gamma_t w_t = Gamma w_sync for every response (each is in one step)."""
    lengths, advantages, groups, steps = batch
    L, A, g = t64(lengths), t64(advantages), torch.tensor(groups)
    sync = sequence_weights(rule, L, A, g)
    gamma = float(len({x for x, t in zip(groups, lengths, strict=True) if t > 0}))
    total = torch.zeros_like(L)
    for step in set(steps):
        s = torch.tensor([x == step for x in steps])
        total += step_group_count(L, g, s) * split_step_weights(rule, L, A, g, s)
    torch.testing.assert_close(total, gamma * sync, rtol=1e-12, atol=1e-15)


@settings(max_examples=100, deadline=None)
@given(split_batches(), st.sampled_from(GROUP_RULES))
def test_weights_of_each_group_alone_are_its_weights_in_the_batch(batch, rule):
    """whole_group_weights of one group, computed alone (where a trainer scores it), equals its
    rows of the whole batch's: a group's weights and shares need no other group."""
    lengths, advantages, groups, _ = batch
    L, A, g = t64(lengths), t64(advantages), torch.tensor(groups)
    whole, share = whole_group_weights(rule, L, A, g)
    for x in set(groups):
        rows = g == x
        alone = whole_group_weights(rule, L[rows], A[rows], torch.zeros_like(g[rows]))
        torch.testing.assert_close(alone[0], whole[rows], rtol=1e-13, atol=0)
        torch.testing.assert_close(alone[1], share[rows], rtol=0, atol=0)


RULE_SCOPES = [
    *((r, scope) for r in GROUP_RULES for scope in ("group", "batch")),
    ("dr_grpo", "group"),
]


@settings(max_examples=100, deadline=None)
@given(split_batches(), st.sampled_from(RULE_SCOPES))
def test_whole_groups_in_a_step_reduce_to_todays_plan(batch, rule_scope):
    """A step holding whole groups (of any policy versions: the plan never reads them) is
    planned as sequence_weights on its own sequences, at both scopes and for dr_grpo."""
    rule, scope = rule_scope
    lengths, advantages, groups, steps = batch
    group_step = {g: steps[i] for i, g in enumerate(groups)}  # each group whole in one step
    L, A, g = t64(lengths), t64(advantages), torch.tensor(groups)
    for step in set(group_step.values()):
        s = torch.tensor([group_step[x] == step for x in groups])
        w = split_step_weights(rule, L, A, g, s, scope=scope, max_length=9)
        today = sequence_weights(rule, L[s], A[s], g[s], scope=scope, max_length=9)
        torch.testing.assert_close(w[s], today, rtol=1e-13, atol=0)
        assert not w[~s].any()


def test_bad_inputs_are_refused_by_name():
    L, A, g = t64(LENGTHS), t64(ADV), torch.tensor(GROUPS)
    with pytest.raises(ValueError, match="in_step: must be a bool mask"):
        split_step_weights("balanced", L, A, g, torch.ones(6))
    with pytest.raises(ValueError, match="in_step=5"):
        split_step_weights("balanced", L, A, g, torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="rule"):
        split_step_weights("mean", L, A, g, torch.ones(6, dtype=torch.bool))
