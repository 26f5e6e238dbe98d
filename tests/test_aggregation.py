"""Exact numbers for every aggregation rule: hand-computed weights, the paper's identities."""

from __future__ import annotations

import math
from fractions import Fraction as F

import pytest
import torch

from megatron_ba import group_advantages, sequence_weights
from megatron_ba.aggregation import RULES, apply_weights, apply_weights_packed, plan_statistics

# Two groups: g0 has two right (short) and two wrong (long) answers, g1 one of each.
LENGTHS = [4, 6, 2, 8, 3, 3]
ADV = [1.0, -1.0, 1.0, -1.0, 0.5, -0.5]
GROUPS = [0, 0, 0, 0, 1, 1]

# Weights worked out by hand (docs/math.md, "worked example"). Gamma = 2, M = 6.
HAND = {
    ("token", "group"): [F(1, 40)] * 4 + [F(1, 12)] * 2,
    ("token", "batch"): [F(1, 26)] * 6,
    ("sequence", "group"): [F(1, 32), F(1, 48), F(1, 16), F(1, 64), F(1, 12), F(1, 12)],
    ("sequence", "batch"): [F(1, 6 * t) for t in LENGTHS],
    ("dr_grpo", "group"): [F(1, 60)] * 6,
    ("dr_grpo", "batch"): [F(1, 60)] * 6,
    # g0: k=2 of G=4, N+ = 6, N- = 14 -> (1/2)/(2*6), (1/2)/(2*14); g1: (1/2)/(2*3)
    ("balanced", "group"): [F(1, 24), F(1, 56), F(1, 24), F(1, 56), F(1, 12), F(1, 12)],
    # pooled: |S+| = 3 of M = 6, N+ = 9, N- = 17
    ("balanced", "batch"): [F(1, 18), F(1, 34), F(1, 18), F(1, 34), F(1, 18), F(1, 34)],
    ("balanced_mass", "group"): [F(1, 24), F(1, 56), F(1, 24), F(1, 56), F(1, 12), F(1, 12)],
    # mass+ = mass- = 5/2, sum|A|T: + 15/2, - 31/2 -> (5/12)/(15/2) = 1/18, (5/12)/(31/2) = 5/186
    ("balanced_mass", "batch"): [F(1, 18), F(5, 186), F(1, 18), F(5, 186), F(1, 18), F(5, 186)],
    # per group whatever the scope: N_0 = 20, N_1 = 6 -> 1/(2*20), 1/(2*6)
    ("group_token_mean", "group"): [F(1, 40)] * 4 + [F(1, 12)] * 2,
    ("group_token_mean", "batch"): [F(1, 40)] * 4 + [F(1, 12)] * 2,
}


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize(("rule", "scope"), sorted(HAND))
def test_hand_computed_weights(rule, scope):
    w = sequence_weights(
        rule, t64(LENGTHS), t64(ADV), torch.tensor(GROUPS), scope=scope, max_length=10
    )
    assert w.dtype == torch.float64
    expected = torch.tensor([float(x) for x in HAND[(rule, scope)]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-15, atol=0)


def test_hand_weights_negative_control():
    """The comparison above can fail: one length off by one, or another rule, is caught."""
    expected = torch.tensor([float(x) for x in HAND[("balanced", "group")]], dtype=torch.float64)
    off_by_one = t64([5, *LENGTHS[1:]])
    w = sequence_weights("balanced", off_by_one, t64(ADV), torch.tensor(GROUPS))
    assert not torch.allclose(w, expected, rtol=1e-15, atol=0)
    w = sequence_weights("token", t64(LENGTHS), t64(ADV), torch.tensor(GROUPS))
    assert not torch.allclose(w, expected, rtol=1e-15, atol=0)


def test_group_token_mean_is_token_at_the_group_scope_whatever_the_scope():
    """Equal to token@group at both scopes; token@batch (the pooled mean) differs: the control."""
    L, A, g = t64(LENGTHS), t64(ADV), torch.tensor(GROUPS)
    token_group = sequence_weights("token", L, A, g, scope="group")
    for scope in ("group", "batch"):
        w = sequence_weights("group_token_mean", L, A, g, scope=scope)
        torch.testing.assert_close(w, token_group, rtol=0, atol=0)
    token_batch = sequence_weights("token", L, A, g, scope="batch")
    assert not torch.allclose(sequence_weights("group_token_mean", L, A, g), token_batch)


def test_output_dtype_follows_inputs():
    L, A, g = torch.tensor(LENGTHS), torch.tensor(ADV), torch.tensor(GROUPS)
    assert sequence_weights("balanced", L, A, g).dtype == torch.float32
    assert sequence_weights("balanced", L, A.double(), g).dtype == torch.float64
    assert sequence_weights("token", L.double(), A, g).dtype == torch.float64


def test_neutral_responses_get_zero_but_count_in_group_size():
    # g0: +, -, neutral (|A| <= eps); the neutral one still counts in G = 3.
    L, A, g = t64([2, 4, 6]), t64([1.0, -1.0, 0.05]), torch.tensor([0, 0, 0])
    w = sequence_weights("balanced", L, A, g, neutral_eps=0.1)
    torch.testing.assert_close(w, t64([(1 / 3) / 2, (1 / 3) / 4, 0.0]), rtol=1e-15, atol=0)
    w0 = sequence_weights("balanced", L, A, g, neutral_eps=0.0)  # now it is positive
    torch.testing.assert_close(w0, t64([(2 / 3) / 8, (1 / 3) / 4, (2 / 3) / 8]), rtol=1e-15, atol=0)


def test_zero_length_sequences_are_padding_and_never_nan():
    L, A, g = t64([0, 3, 5, 0]), t64([1.0, 1.0, -1.0, -1.0]), torch.tensor([0, 0, 0, 1])
    for rule in RULES:
        for scope in ("group", "batch"):
            w = sequence_weights(rule, L, A, g, scope=scope, max_length=8)
            assert torch.isfinite(w).all(), (rule, scope)
            assert w[0] == 0 and w[3] == 0, (rule, scope)
    # group 1 holds only padding: Gamma = 1, G_0 = 2
    w = sequence_weights("sequence", L, A, g)
    torch.testing.assert_close(w, t64([0.0, 1 / 6, 1 / 10, 0.0]), rtol=1e-15, atol=0)
    assert (
        sequence_weights("balanced", t64([0, 0]), t64([1, -1]), torch.tensor([0, 0])) == 0
    ).all()


def _binary_batch(seed: int, groups: int = 3, G: int = 8):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(groups * G, generator=g) < 0.4).double()
    rewards[::G], rewards[1::G] = 1.0, 0.0  # both signs in every group
    lengths = torch.randint(1, 40, (groups * G,), generator=g).double()
    lengths = torch.where(rewards > 0, lengths, lengths + 25)  # wrong answers longer
    ids = torch.arange(groups).repeat_interleave(G)
    return rewards, lengths, ids


def _objective_at_rho1(rule, L, A, ids, **kw):
    """J = sum_i w_i sum_t phi_{i,t} with phi = A_i on every token (rho = 1)."""
    w = sequence_weights(rule, L, A, ids, **kw)
    return float((w * L * A).sum())


def test_objective_at_rho1_zero_for_sequence_and_balanced():
    rewards, L, ids = _binary_batch(0)
    A = group_advantages(rewards, ids, eps=0.0).advantages
    for rule in ("sequence", "balanced", "balanced_mass"):
        assert abs(_objective_at_rho1(rule, L, A, ids, scope="group")) < 1e-12, rule
    # Pooled over the batch, sequence (sum A_i / M) and balanced_mass (mass+ = mass- summed over
    # groups) stay exactly zero; pooled balanced mixes groups' advantage scales and does not.
    for rule in ("sequence", "balanced_mass"):
        assert abs(_objective_at_rho1(rule, L, A, ids, scope="batch")) < 1e-12, rule
    assert abs(_objective_at_rho1("balanced", L, A, ids, scope="batch")) > 1e-4


def test_token_objective_at_rho1_is_length_weighted_advantage():
    rewards, L, ids = _binary_batch(1)
    A = group_advantages(rewards, ids, eps=0.0).advantages
    j = _objective_at_rho1("token", L, A, ids, scope="batch")
    expected = float((A * L).sum() / L.sum())
    assert abs(j - expected) < 1e-15
    assert j < -0.1  # wrong answers are longer: the token loss drifts away from zero


def test_balanced_equals_paper_prefactor_formula():
    """One binary group: J_BA = sqrt(k(G-k))/G * (mean delta over S+ tokens - over S- tokens)."""
    g = torch.Generator().manual_seed(3)
    G, k = 8, 3
    rewards = t64([1.0] * k + [0.0] * (G - k))
    L = torch.randint(2, 30, (G,), generator=g).double()
    ids = torch.zeros(G, dtype=torch.long)
    A = group_advantages(rewards, ids, eps=0.0).advantages
    torch.testing.assert_close(A[:k], torch.full((k,), math.sqrt((G - k) / k), dtype=torch.float64))
    T = int(L.max())
    delta = torch.rand(G, T, generator=g, dtype=torch.float64) * 2  # per-token factor of A_i
    mask = torch.arange(T)[None, :] < L[:, None]
    w = sequence_weights("balanced", L, A, ids)
    J = float(apply_weights(delta * A[:, None], mask, w))
    pos_mean = float(delta[:k][mask[:k]].mean())
    neg_mean = float(delta[k:][mask[k:]].mean())
    assert abs(J - math.sqrt(k * (G - k)) / G * (pos_mean - neg_mean)) < 1e-14
    # sequence aggregation has the same prefactor with per-sequence means inside each sign
    ws = sequence_weights("sequence", L, A, ids)
    Js = float(apply_weights(delta * A[:, None], mask, ws))
    seq_means = torch.stack([delta[i][mask[i]].mean() for i in range(G)])
    expected = math.sqrt(k * (G - k)) / G * float(seq_means[:k].mean() - seq_means[k:].mean())
    assert abs(Js - expected) < 1e-14


def test_equal_lengths_make_token_sequence_balanced_agree():
    rewards, _, ids = _binary_batch(4)
    L = torch.full_like(rewards, 7.0)
    A = group_advantages(rewards, ids).advantages
    w = {r: sequence_weights(r, L, A, ids) for r in ("token", "sequence", "balanced")}
    torch.testing.assert_close(w["token"], w["sequence"], rtol=1e-15, atol=0)
    torch.testing.assert_close(w["token"], w["balanced"], rtol=1e-15, atol=0)


@pytest.mark.parametrize("c", [0.25, 3.0, 10.0])
def test_scaling_one_signs_lengths(c):
    """Balanced: each sign's total weight stays |S^s|/G; token's is N^s/N and moves with c."""
    G, k = 6, 2
    rewards = t64([1.0] * k + [0.0] * (G - k))
    ids = torch.zeros(G, dtype=torch.long)
    L = t64([4, 9, 5, 7, 3, 8])
    A = group_advantages(rewards, ids).advantages
    L2 = torch.where(A < 0, L * c, L)
    for lengths in (L, L2):
        wb = sequence_weights("balanced", lengths, A, ids)
        assert abs(float((wb * lengths)[A > 0].sum()) - k / G) < 1e-15
        assert abs(float((wb * lengths)[A < 0].sum()) - (G - k) / G) < 1e-15
    share = [float((sequence_weights("token", x, A, ids) * x)[A < 0].sum()) for x in (L, L2)]
    assert abs(share[0] - float(L[A < 0].sum() / L.sum())) < 1e-15
    assert abs(share[1] - float(L2[A < 0].sum() / L2.sum())) < 1e-15
    assert abs(share[1] - share[0]) > 1e-3  # the coupling: token's share moved with c


def test_balanced_mass_equals_balanced_on_binary_rewards():
    for seed in range(5):
        rewards, L, ids = _binary_batch(seed, groups=4, G=16)
        A = group_advantages(rewards, ids).advantages
        a = sequence_weights("balanced", L, A, ids)
        b = sequence_weights("balanced_mass", L, A, ids)
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
    # Pooled over groups with different k (different A+/A- scales) the two differ: the mass
    # rule weighs groups by advantage mass, the count rule does not (docs/math.md).
    a = sequence_weights("balanced", L, A, ids, scope="batch")
    b = sequence_weights("balanced_mass", L, A, ids, scope="batch")
    assert not torch.allclose(a, b)


def test_balanced_mass_differs_on_graded_rewards():
    L, ids = t64([3, 5, 9, 4]), torch.zeros(4, dtype=torch.long)
    A = group_advantages(t64([1.0, 0.5, 0.0, 0.2]), ids).advantages
    a = sequence_weights("balanced", L, A, ids)
    b = sequence_weights("balanced_mass", L, A, ids)
    assert not torch.allclose(a, b)
    assert abs(float((b * L * A).sum())) < 1e-12  # still zero at rho = 1 (mass+ = mass-)


def test_packed_form_equals_padded():
    g = torch.Generator().manual_seed(5)
    L = torch.tensor([3, 1, 4, 2])
    T = 5
    values = torch.randn(4, T, generator=g, dtype=torch.float64)
    mask = torch.arange(T)[None, :] < L[:, None]
    values[~mask] = float("nan")  # padding may hold garbage: must not leak
    w = torch.rand(4, generator=g, dtype=torch.float64)
    padded = apply_weights(values, mask, w)
    seq_index = torch.arange(4).repeat_interleave(L)
    packed_values = values[mask]
    # add two padding tokens at the end of the pack
    packed_values = torch.cat([packed_values, t64([float("inf"), 1.0])])
    seq_index = torch.cat([seq_index, torch.tensor([-1, -1])])
    assert torch.isfinite(padded)
    torch.testing.assert_close(apply_weights_packed(packed_values, seq_index, w), padded)
    torch.testing.assert_close(apply_weights(packed_values, seq_index, w), padded)


def test_statistics_table_is_a_sum_over_ranks():
    """reduce sees one [num_groups, 10] table; summing the ranks' tables gives the global one."""
    rewards, L, ids = _binary_batch(6, groups=3, G=4)
    A = group_advantages(rewards, ids).advantages
    full = plan_statistics(L, A, ids, num_groups=3).table
    parts = [slice(0, 5), slice(5, 12)]
    tables = [plan_statistics(L[p], A[p], ids[p], num_groups=3).table for p in parts]
    torch.testing.assert_close(tables[0] + tables[1], full, rtol=0, atol=0)
    calls = []

    def reduce(t):
        calls.append(t.shape)
        return full

    sequence_weights(
        "balanced", L[parts[0]], A[parts[0]], ids[parts[0]], reduce=reduce, num_groups=3
    )
    assert calls == [torch.Size([3, 10])]


def test_token_drift_closed_form_one_binary_group():
    """J_tok(rho=1) = sqrt(k(G-k)) (mean T+ - mean T-) / N  (docs/math.md, section 2)."""
    G, k = 8, 3
    rewards = t64([1.0] * k + [0.0] * (G - k))
    L = t64([5, 9, 4, 20, 31, 12, 18, 25])
    ids = torch.zeros(G, dtype=torch.long)
    A = group_advantages(rewards, ids, eps=0.0).advantages
    j = _objective_at_rho1("token", L, A, ids)
    expected = math.sqrt(k * (G - k)) * float(L[:k].mean() - L[k:].mean()) / float(L.sum())
    assert abs(j - expected) < 1e-15


def test_balanced_mass_sign_mass_is_length_free():
    """sum_{S^s} w_i |A_i| T_i = m^s / G whatever the lengths (docs/math.md, section 5)."""
    ids = torch.zeros(5, dtype=torch.long)
    A = group_advantages(t64([1.0, 0.6, 0.1, 0.0, 0.3]), ids).advantages
    for L in (t64([3, 8, 2, 9, 4]), t64([3, 8, 20, 90, 40])):
        w = sequence_weights("balanced_mass", L, A, ids)
        for sign in (A > 0, A < 0):
            got = float((w * A.abs() * L)[sign].sum())
            assert abs(got - float(A.abs()[sign].sum()) / 5) < 1e-15
