"""The plan weight folded into the advantage: `grpo_loss` against the formula that multiplies
every token's phi by its sequence's weight (tests/loss_reference.py), in float64.

w min(rho A, clip(rho) A) = min(rho wA, clip(rho) wA) for w >= 0 (loss.py's docstring):
hand-computed cases, then every rule and scope on random batches with clipped tokens,
zero-advantage groups, neutral responses, dual clip, KL and entropy, padded and packed. A negative
weight breaks the identity (the negative control) and `LossPlan.build` refuses one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_reference import reference_grpo_loss

from megatron_ba import group_advantages
from megatron_ba import loss as loss_module
from megatron_ba.aggregation import NEG_COUNT, POS_COUNT, RULES, SCOPES
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings

METRICS = (
    "pg_loss",
    "clip_low_frac",
    "clip_high_frac",
    "dual_clip_frac",
    "num_tokens_sum",
    "weight_pos_sum",
    "weight_neg_sum",
    "weight_pos_share",
    "ratio_mean",
)


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def _pack(x: torch.Tensor, mask: torch.Tensor, garbage: float = float("nan")):
    """Padded [N, T] -> packed tokens with a padding token (index -1, garbage value) after every
    sequence: the sequence-index form of the same batch."""
    values, index = [], []
    for i in range(x.shape[0]):
        values += [x[i][mask[i]], x.new_full((1,), garbage)]
        index += [torch.full((int(mask[i].sum()),), i), torch.tensor([-1])]
    return torch.cat(values), torch.cat(index)


def test_hand_computed_weighted_clipped_terms_and_gradients():
    # seq 0: w = 1/2, A = 2, rho = (1.5: clipped at 1.28, 1.1: inside);
    # seq 1: w = 1/4, A = -1, rho = (0.5: clipped at 0.8, 1.5: the unclipped, pessimistic branch);
    # seq 2: w = 0 (a neutral response), A = 0.3; seq 3: w = 1/8, A = 0 (a zero-variance group).
    rho = t64([[1.5, 1.1], [0.5, 1.5], [1.5, 0.5], [2.0, 0.1]])
    logp = rho.log().requires_grad_()
    old = torch.zeros(4, 2, dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    plan = LossPlan(t64([0.5, 0.25, 0.0, 0.125]), t64([1.0] * 4), t64([2.0, -1.0, 0.3, 0.0]))
    loss, metrics = grpo_loss(logp, old, mask, plan)
    # -(1/2 (1.28 * 2 + 1.1 * 2) + 1/4 (0.8 * -1 + 1.5 * -1)) = -(2.38 - 0.575)
    assert abs(loss.item() + 1.805) < 1e-14
    (g,) = torch.autograd.grad(loss, logp)
    # d(-w phi)/d logp = -w A rho on the unclipped branch, 0 when clipped or w A = 0
    expected = t64([[0.0, -0.5 * 2 * 1.1], [0.0, 0.25 * 1.5], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-15)
    # seq 2 counts in the clip metrics although its weight is 0 (rho 1.5 > 1.28 with A > 0)
    assert float(metrics["clip_high_frac"]) == pytest.approx(2 / 8)
    assert float(metrics["clip_low_frac"]) == pytest.approx(1 / 8)
    assert float(metrics["weight_pos_sum"]) == pytest.approx(0.5 * 2)
    assert float(metrics["weight_neg_sum"]) == pytest.approx(0.25 * 2)
    packed, index = _pack(logp.detach(), mask)
    packed.requires_grad_()
    p_loss, p_metrics = grpo_loss(packed, _pack(old, mask, 0.0)[0], index, plan)
    assert abs(p_loss.item() + 1.805) < 1e-14
    for key in METRICS:
        torch.testing.assert_close(p_metrics[key], metrics[key], rtol=1e-15, atol=0)


def test_hand_computed_dual_clip_on_a_weighted_negative_sequence():
    # A = -1, w = 1/2, rho = 4: min(-4, -1.28) = -4 is floored at 3 A = -3; weighted: -1.5
    logp = t64([[4.0]]).log().requires_grad_()
    plan = LossPlan(t64([0.5]), t64([0.0]), t64([-1.0]), folded_signs=True)
    cfg = GRPOLossConfig(dual_clip=3.0)
    loss, m = grpo_loss(
        logp, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1).bool(), plan, cfg
    )
    assert loss.item() == 1.5 and float(m["dual_clip_frac"]) == 1.0
    (g,) = torch.autograd.grad(loss, logp)
    assert float(g) == 0.0  # the floor is constant in rho


@st.composite
def batches(draw):
    """A GRPO batch: groups of binary, graded or all-equal (zero-advantage) rewards, lengths 0..9,
    log-ratios spread wide enough that both clip bounds and the dual clip are hit."""
    groups = draw(st.integers(1, 4))
    rewards, ids = [], []
    for g in range(groups):
        size = draw(st.integers(1, 5))
        kind = draw(st.sampled_from(["binary", "graded", "constant"]))
        values = {"binary": [0.0, 1.0], "graded": [0.0, 0.3, 0.7, 1.0], "constant": [0.5]}[kind]
        rewards += draw(st.lists(st.sampled_from(values), min_size=size, max_size=size))
        ids += [g] * size
    n = len(ids)
    lengths = torch.tensor(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)))
    ids_t = torch.tensor(ids)
    adv = group_advantages(t64(rewards), ids_t).advantages
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    T = max(int(lengths.max()), 1)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.8
    logp[~mask] = float("nan")  # padding holds garbage: it must never leak
    ref = logp + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.5
    ent = torch.rand(n, T, generator=g, dtype=torch.float64)
    return lengths, adv, ids_t, mask, logp, old, ref, ent


def _compare(plan, cfg, mask, logp, old, ref, ent, packed: bool):
    """grpo_loss (padded or packed) == the reference: value, gradients, every metric."""
    logp_r = logp.clone().requires_grad_()
    ent_r = ent.clone().requires_grad_()
    want, want_m = reference_grpo_loss(
        logp_r, old, mask, plan.pg_weights, plan.reg_weights, plan.advantages, cfg, ref, ent_r
    )
    args = (logp, old, ref, ent)
    if packed:
        (x, index), *rest = [_pack(a, mask) for a in args]
        args, m = (x, *(r[0] for r in rest)), index
    else:
        m = mask
    x, o, r, e = (a.clone() for a in args)
    x.requires_grad_()
    e.requires_grad_()
    got, got_m = grpo_loss(x, o, m, plan, cfg, ref_logprobs=r, entropy=e)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for key in (*METRICS, "kl", "entropy"):
        torch.testing.assert_close(got_m[key], want_m[key], rtol=1e-12, atol=1e-14, msg=key)
    g_want = torch.autograd.grad(want, (logp_r, ent_r), allow_unused=True)
    g_got = torch.autograd.grad(got, (x, e), allow_unused=True)
    for gw, gg in zip(g_want, g_got, strict=True):
        gw = torch.where(mask, gw, 0.0)
        want_tokens = _pack(gw, mask, 0.0)[0] if packed else gw
        torch.testing.assert_close(gg, want_tokens, rtol=1e-12, atol=1e-14)


@settings(max_examples=80, deadline=None)
@given(
    batches(),
    st.sampled_from(RULES),
    st.sampled_from(SCOPES),
    st.sampled_from(RULES),
    st.sampled_from([0.0, 0.3]),
    st.sampled_from([None, 3.0]),
    st.booleans(),
)
def test_folded_loss_equals_the_weighted_formula(batch, rule, scope, reg_rule, eps, dual, packed):
    lengths, adv, ids, mask, logp, old, ref, ent = batch
    plan = LossPlan.build(
        AggregationSettings(rule, scope=scope, reg_rule=reg_rule, max_length=9, neutral_eps=eps),
        lengths,
        adv,
        ids,
    )
    assert bool((plan.pg_weights >= 0).all())
    # the flag says exactly whether sign(w A) = sign(A) on every sequence
    assert plan.folded_signs == bool(((plan.pg_weights > 0) | (plan.advantages == 0)).all())
    cfg = GRPOLossConfig(dual_clip=dual, kl_coef=0.1, entropy_coef=0.01)
    _compare(plan, cfg, mask, logp, old, ref, ent, packed)
    # a hand-built plan (flag False: signs read off A) gives the same
    bare = LossPlan(plan.pg_weights, plan.reg_weights, plan.advantages)
    _compare(bare, cfg, mask, logp, old, ref, ent, packed)


def test_zero_weight_on_a_nonzero_advantage_keeps_its_clip_metrics():
    """neutral_eps leaves a response weight 0 with A != 0: the flag is False and its clipped
    tokens still count, as they did. Forcing the flag (a planted wrong plan) miscounts them."""
    lengths, ids = torch.tensor([2, 2, 2]), torch.tensor([0, 0, 0])
    adv = t64([1.0, -0.9, -0.1])  # |A| = 0.1 <= eps: neutral
    plan = LossPlan.build(AggregationSettings("balanced", neutral_eps=0.2), lengths, adv, ids)
    assert float(plan.pg_weights[2]) == 0.0 and not plan.folded_signs
    logp = t64([[1.0, 1.0], [1.0, 1.0], [0.5, 0.5]]).log()  # seq 2: rho = 0.5, A < 0: clipped
    mask = torch.ones(3, 2, dtype=torch.bool)
    old = torch.zeros(3, 2, dtype=torch.float64)
    _, m = grpo_loss(logp, old, mask, plan)
    assert float(m["clip_low_frac"]) == pytest.approx(2 / 6)
    forced = LossPlan(plan.pg_weights, plan.reg_weights, plan.advantages, folded_signs=True)
    _, m_forced = grpo_loss(logp, old, mask, forced)
    assert float(m_forced["clip_low_frac"]) == 0.0  # why the flag exists


def test_a_negative_weight_breaks_the_fold_and_build_refuses_it():
    """The identity needs w >= 0: with w < 0 the min becomes a max (negative control), so a plan
    with a negative weight (only a reduce that does not return sums can make one) is refused."""
    logp = t64([[1.5]]).log()
    args = (logp, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    plan = LossPlan(t64([-1.0]), t64([0.0]), t64([1.0]))
    got, _ = grpo_loss(*args, plan)
    want, _ = reference_grpo_loss(*args, plan.pg_weights, plan.reg_weights, plan.advantages)
    assert abs(float(got - want)) > 0.2  # -min(-1.5, -1.28) = 1.5 vs -(-1) min(1.5, 1.28) = 1.28

    def flips_a_count(table):  # a broken all-reduce: the positive count's sign flipped
        out = table.clone()
        out[:, POS_COUNT] = -out[:, POS_COUNT]
        return out

    lengths, adv, ids = torch.tensor([2, 3]), t64([1.0, -1.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"^reduce: the plan has a negative weight"):
        LossPlan.build(
            AggregationSettings("balanced"), lengths, adv, ids, reduce=flips_a_count, num_groups=1
        )
    assert NEG_COUNT != POS_COUNT  # the other column stays positive


def test_packed_indices_below_minus_one_are_padding():
    """Any negative sequence index is padding (as apply_weights treats it), garbage included."""
    lengths, ids, adv = torch.tensor([2, 1]), torch.tensor([0, 0]), t64([1.0, -1.0])
    plan = LossPlan.build(AggregationSettings("balanced"), lengths, adv, ids)
    x = t64([-0.5, float("nan"), -0.2, -0.1, float("inf")]).requires_grad_()
    old = t64([-0.4, 0.0, -0.3, -0.1, 0.0])
    index = torch.tensor([0, -2, 0, 1, -7])
    loss, m = grpo_loss(x, old, index, plan)
    keep = index >= 0
    want, _ = grpo_loss(x.detach()[keep], old[keep], index[keep], plan)
    torch.testing.assert_close(loss, want, rtol=1e-15, atol=0)
    (g,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(g).all() and float(g[1]) == float(g[4]) == 0.0
    assert float(m["num_tokens_sum"]) == 3.0


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.zeros(4, dtype=torch.float64), r"^mask: packed logprobs \(4,\) need an integer"),
        (torch.zeros(3, dtype=torch.long), r"^mask: packed logprobs \(4,\) need an integer"),
    ],
)
def test_packed_index_errors_are_named(mask, match):
    plan = LossPlan.build(
        AggregationSettings("token"), torch.tensor([4]), t64([1.0]), torch.tensor([0])
    )
    with pytest.raises(ValueError, match=match):
        grpo_loss(
            torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), mask, plan
        )


def test_padded_plan_size_is_checked():
    plan = LossPlan.build(
        AggregationSettings("token"), torch.tensor([1, 1]), t64([1.0, -1.0]), torch.tensor([0, 0])
    )
    z = torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^plan: has 2 sequences but logprobs has 3 rows"):
        grpo_loss(z, z, torch.ones(3, 2, dtype=torch.bool), plan)


def test_packed_sign_weights_count_tokens_where_they_lie():
    """The packed part's sign weights (CPU: token counts by scatter; GPU: a gather of the signed
    weight) equal the hand sum over tokens of w_i, on an index whose sequences are interleaved,
    with padding spelled -1 and -7 and a sequence with no token in this part."""
    plan = LossPlan(t64([0.5, 0.25, 0.125, 2.0]), t64([1.0] * 4), t64([1.0, -2.0, 0.0, 3.0]))
    index = torch.tensor([1, 0, -1, 1, 0, 0, -7, 1, 2, 2])  # seq 3 holds no token here
    logp = torch.zeros(index.shape, dtype=torch.float64)
    _, metrics = grpo_loss(logp, logp, index, plan)
    # positive: seq 0, 3 tokens x 1/2; seq 3 has none; negative: seq 1, 3 tokens x 1/4
    assert float(metrics["weight_pos_sum"]) == 1.5
    assert float(metrics["weight_neg_sum"]) == 0.75
    assert float(metrics["num_tokens_sum"]) == 8
    valid_index = torch.where(index >= 0, index, 4)
    by_gather = loss_module._packed_sign_weights_by_gather(plan, valid_index, logp)
    assert [float(x) for x in by_gather] == [1.5, 0.75]
