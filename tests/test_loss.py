"""The clipped GRPO loss: hand-computed token terms, gradients, regularisers, metrics, errors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def _single_token_batch(ratios, advantages):
    """N one-token sequences with given ratios rho and advantages, weights 1 (a plain sum)."""
    n = len(ratios)
    logp = t64([math.log(r) for r in ratios]).reshape(n, 1).requires_grad_()
    old = torch.zeros(n, 1, dtype=torch.float64)
    mask = torch.ones(n, 1, dtype=torch.bool)
    plan = LossPlan(
        torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64), t64(advantages)
    )
    return logp, old, mask, plan


# (rho, A) -> phi by hand with clip_low 0.2, clip_high 0.28, and d phi / d log rho
CASES = [
    (1.5, 1.0, 1.28, 0.0),  # above 1 + eps_high with A > 0: clipped, no gradient
    (0.5, 1.0, 0.5, 0.5),  # below 1 - eps_low with A > 0: the unclipped (smaller) branch
    (0.5, -1.0, -0.8, 0.0),  # A < 0 and rho < 1 - eps_low: clipped
    (1.5, -1.0, -1.5, -1.5),  # A < 0 and rho large: unclipped (pessimistic) branch
    (1.1, 2.0, 2.2, 2.2),  # inside the trust region
]


def test_hand_computed_token_terms_and_gradients():
    rho, adv, phi, dphi = (list(x) for x in zip(*CASES, strict=True))
    logp, old, mask, plan = _single_token_batch(rho, adv)
    for i in range(len(CASES)):
        loss, _ = grpo_loss(
            logp[i : i + 1], old[i : i + 1], mask[i : i + 1], plan.select(slice(i, i + 1))
        )
        assert abs(loss.item() + phi[i]) < 1e-12, CASES[i]
        (g,) = torch.autograd.grad(loss, logp)
        # d(-phi)/d logp = -A rho on the unclipped branch, 0 when clipped
        assert abs(float(g[i, 0]) + dphi[i]) < 1e-12, CASES[i]
    loss, metrics = grpo_loss(logp, old, mask, plan)
    assert abs(loss.item() + sum(phi)) < 1e-12
    assert float(metrics["clip_high_frac"]) == pytest.approx(1 / 5)
    assert float(metrics["clip_low_frac"]) == pytest.approx(1 / 5)


def test_asymmetric_clip_bounds_are_used():
    logp, old, mask, plan = _single_token_batch([1.25, 1.3], [1.0, 1.0])
    loss, _ = grpo_loss(logp, old, mask, plan, GRPOLossConfig(clip_low=0.2, clip_high=0.28))
    assert abs(loss.item() + (1.25 + 1.28)) < 1e-12
    loss, _ = grpo_loss(logp, old, mask, plan, GRPOLossConfig(clip_low=0.2, clip_high=0.2))
    assert abs(loss.item() + (1.2 + 1.2)) < 1e-12  # negative control: symmetric clip differs


def test_dual_clip_bounds_negative_advantages_only():
    logp, old, mask, plan = _single_token_batch([4.0, 4.0], [-1.0, 1.0])
    cfg = GRPOLossConfig(dual_clip=3.0)
    loss, metrics = grpo_loss(logp, old, mask, plan, cfg)
    # A < 0: min(-4, -1.28) = -4, floored at 3 * A = -3; A > 0: min(4, 1.28) = 1.28
    assert abs(loss.item() - (3.0 - 1.28)) < 1e-12
    assert float(metrics["dual_clip_frac"]) == 0.5
    (g,) = torch.autograd.grad(loss, logp)
    assert float(g.abs().sum()) == 0.0  # both branches are constant in rho here
    loss_plain, _ = grpo_loss(logp, old, mask, plan)
    assert abs(loss_plain.item() - (4.0 - 1.28)) < 1e-12


def test_kl_k3_and_entropy_use_the_regulariser_plan():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -torch.rand(3, 4, generator=g, dtype=torch.float64)
    ent = torch.rand(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    mask = t64([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    pg_w, reg_w = t64([0.0, 0.0, 0.0]), t64([0.1, 0.2, 0.3])  # PG switched off
    plan = LossPlan(pg_w, reg_w, t64([1.0, -1.0, 0.5]))
    cfg = GRPOLossConfig(kl_coef=0.5, entropy_coef=0.01)
    loss, metrics = grpo_loss(logp, logp.detach(), mask, plan, cfg, ref_logprobs=ref, entropy=ent)
    d = ref - logp.detach()
    k3 = d.exp() - d - 1
    kl = sum(float(reg_w[i] * k3[i][mask[i]].sum()) for i in range(3))
    h = sum(float(reg_w[i] * ent.detach()[i][mask[i]].sum()) for i in range(3))
    assert abs(float(metrics["kl"]) - kl) < 1e-13 and kl > 0
    assert abs(float(metrics["entropy"]) - h) < 1e-13
    assert abs(loss.item() - (0.5 * kl - 0.01 * h)) < 1e-13
    (g_ent,) = torch.autograd.grad(loss, ent)
    torch.testing.assert_close(g_ent, -0.01 * reg_w[:, None] * mask)


def test_loss_gradient_matches_float64_reference_formula():
    """Autograd through the plan-weighted loss == the closed-form policy gradient."""
    g = torch.Generator().manual_seed(1)
    n, T = 6, 7
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = (-torch.rand(n, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.15 * torch.randn(n, T, generator=g, dtype=torch.float64)
    adv = t64([1.2, -0.4, 0.7, -1.5, 0.3, -0.3])
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    plan = LossPlan.build(AggregationSettings("balanced"), lengths, adv, ids)
    loss, _ = grpo_loss(logp, old, mask, plan)
    (grad,) = torch.autograd.grad(loss, logp)
    rho = (logp.detach() - old).exp()
    a = adv[:, None]
    unclipped = torch.where(a > 0, rho <= 1.28, rho >= 0.8)  # where rho*A is the min branch
    expected = -plan.pg_weights[:, None] * a * rho * unclipped * mask
    torch.testing.assert_close(grad, expected, rtol=1e-13, atol=1e-15)


def test_importance_weights_multiply_each_tokens_term_value_and_gradient():
    """c_{i,t} on the closed form of the test above: value -sum w c phi, gradient -w c A rho 1[.];
    padded and packed alike. Control: the same loss without the weights differs."""
    g = torch.Generator().manual_seed(3)
    n, T = 5, 6
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = (-torch.rand(n, T, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.15 * torch.randn(n, T, generator=g, dtype=torch.float64)
    c = torch.rand(n, T, generator=g, dtype=torch.float64) * 2  # some above 1, some near 0
    c[~mask] = float("nan")  # off the mask a weight is never read
    adv = t64([1.2, -0.4, 0.7, -1.5, 0.3])
    plan = LossPlan.build(AggregationSettings("balanced"), lengths, adv, torch.tensor([0] * 5))
    loss, _ = grpo_loss(logp, old, mask, plan, is_weights=c)
    (grad,) = torch.autograd.grad(loss, logp)
    rho = (logp.detach() - old).exp()
    a, w = adv[:, None], plan.pg_weights[:, None]
    phi = torch.minimum(rho * a, rho.clamp(0.8, 1.28) * a)
    unclipped = torch.where(a > 0, rho <= 1.28, rho >= 0.8)
    cm = torch.where(mask, c, 0.0)
    torch.testing.assert_close(loss.detach(), -(w * cm * phi * mask).sum(), rtol=1e-13, atol=0)
    torch.testing.assert_close(grad, -w * cm * a * rho * unclipped * mask, rtol=1e-13, atol=1e-15)
    seq_index = torch.arange(n).repeat_interleave(lengths)
    packed, _ = grpo_loss(logp.detach()[mask], old[mask], seq_index, plan, is_weights=c[mask])
    torch.testing.assert_close(packed, loss.detach(), rtol=1e-13, atol=0)
    unweighted, _ = grpo_loss(logp.detach(), old, mask, plan)
    assert abs(float(unweighted - loss)) > 1e-3
    with pytest.raises(ValueError, match=r"is_weights: must have the shape of logprobs"):
        grpo_loss(logp.detach(), old, mask, plan, is_weights=c[:, :2])


def test_packed_equals_padded_loss():
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([2, 5, 3])
    T = 5
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(3, T, generator=g, dtype=torch.float64)
    old = logp + 0.2 * torch.randn(3, T, generator=g, dtype=torch.float64)
    plan = LossPlan.build(
        AggregationSettings("balanced"), lengths, t64([0.9, -0.9, 0.4]), torch.tensor([0, 0, 0])
    )
    padded, pm = grpo_loss(logp, old, mask, plan)
    seq_index = torch.arange(3).repeat_interleave(lengths)
    packed, km = grpo_loss(logp[mask], old[mask], seq_index, plan)
    torch.testing.assert_close(packed, padded, rtol=1e-14, atol=0)
    for key in ("clip_low_frac", "clip_high_frac", "weight_pos_sum", "weight_neg_sum"):
        torch.testing.assert_close(km[key], pm[key])


def test_weight_shares_in_metrics():
    lengths = torch.tensor([2, 6, 2, 6])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    z = torch.zeros(4, 6, dtype=torch.float64)
    adv, ids = t64([1.0, -1.0, 1.0, -1.0]), torch.zeros(4, dtype=torch.long)
    _, m_tok = grpo_loss(
        z, z, mask, LossPlan.build(AggregationSettings("token"), lengths, adv, ids)
    )
    _, m_bal = grpo_loss(
        z, z, mask, LossPlan.build(AggregationSettings("balanced"), lengths, adv, ids)
    )
    assert float(m_tok["weight_pos_share"]) == pytest.approx(4 / 16, abs=1e-15)
    assert float(m_bal["weight_pos_share"]) == pytest.approx(0.5, abs=1e-15)


def test_padding_garbage_never_leaks():
    logp = t64([[-0.5, float("nan")], [-0.2, -0.1]]).requires_grad_()
    old = t64([[-0.4, float("inf")], [-0.3, -0.1]])
    mask = t64([[1, 0], [1, 1]]).bool()
    plan = LossPlan.build(
        AggregationSettings("balanced"),
        torch.tensor([1, 2]),
        t64([1.0, -1.0]),
        torch.tensor([0, 0]),
    )
    loss, metrics = grpo_loss(logp, old, mask, plan)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_high=float("nan")), "clip_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(kl_coef=-1.0), "kl_coef"),
    ],
)
def test_config_errors(kwargs, argument):
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        GRPOLossConfig(**kwargs)


def test_missing_inputs_are_named():
    logp, old, mask, plan = _single_token_batch([1.0], [1.0])
    with pytest.raises(ValueError, match=r"^ref_logprobs:"):
        grpo_loss(logp, old, mask, plan, GRPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match=r"^entropy:"):
        grpo_loss(logp, old, mask, plan, GRPOLossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match=r"^old_logprobs:"):
        grpo_loss(logp, old[:, :0], mask, plan)
    with pytest.raises(ValueError, match=r"^mask:"):
        grpo_loss(logp, old, mask[:, :0], plan)
