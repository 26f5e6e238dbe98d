"""Rollout (off-policy) corrections: each mode's weights and mask by hand in float64, packed
equal to padded, rejection equal to BA on the reduced batch, and the controls that show the
comparisons fail when a weight is placed wrongly or a masked token leaves the denominators."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ba.aggregation import sequence_weights
from megatron_ba.errors import SettingError
from megatron_ba.loss import LossPlan, grpo_loss
from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.rollout_correction import (
    ROLLOUT_CORRECTION_MODES,
    RolloutCorrectionSettings,
    correction_diagnostics,
    correction_statistics,
    rollout_correction,
)

T64 = torch.float64
MASK = torch.tensor([[True, True, True], [True, True, False]])
# Token ratios train/rollout; row 0's sequence ratio is 0.6 * 1.5 * 3 = 2.7, row 1's 0.76.
RATIOS = [[0.6, 1.5, 3.0], [0.4, 1.9, 7.0]]
SETTINGS = dict(cap=2.0, low=0.5, high=2.0)
# mode: (weights, corrected, mask after the correction), by hand from RATIOS and SETTINGS.
EXPECTED = {
    "none": ([[1, 1, 1], [1, 1, 0]], [[0, 0, 0], [0, 0, 0]], MASK.tolist()),
    "token_truncate": ([[0.6, 1.5, 2], [0.4, 1.9, 0]], [[0, 0, 1], [0, 0, 0]], MASK.tolist()),
    "token_mask": ([[0.6, 1.5, 0], [0, 1.9, 0]], [[0, 0, 1], [1, 0, 0]], MASK.tolist()),
    "token_reject": ([[1, 1, 0], [0, 1, 0]], [[0, 0, 1], [1, 0, 0]], [[1, 1, 0], [0, 1, 0]]),
    "sequence_truncate": ([[2, 2, 2], [0.76, 0.76, 0]], [[1, 1, 1], [0, 0, 0]], MASK.tolist()),
    "sequence_mask": ([[0, 0, 0], [0.76, 0.76, 0]], [[1, 1, 1], [0, 0, 0]], MASK.tolist()),
    "sequence_reject": ([[0, 0, 0], [1, 1, 0]], [[1, 1, 1], [0, 0, 0]], [[0, 0, 0], [1, 1, 0]]),
}


def _logprobs():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]], dtype=T64)
    old = rollout + torch.tensor(RATIOS, dtype=T64).log()
    return old, rollout


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTION_MODES)
def test_each_mode_by_hand_padded_and_packed(mode):
    old, rollout = _logprobs()
    out = rollout_correction(RolloutCorrectionSettings(mode, **SETTINGS), old, rollout, MASK)
    weights, corrected, mask = EXPECTED[mode]
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=T64), rtol=1e-14, atol=0)
    assert out.corrected.tolist() == [[bool(v) for v in row] for row in corrected]
    assert out.mask.tolist() == [[bool(v) for v in row] for row in mask]
    index = torch.tensor([0, 0, 0, 1, 1])
    packed = rollout_correction(
        RolloutCorrectionSettings(mode, **SETTINGS), old[MASK], rollout[MASK], index
    )
    torch.testing.assert_close(packed.weights, out.weights[MASK], rtol=1e-14, atol=0)
    kept = torch.tensor(mask, dtype=torch.bool)[MASK]
    assert packed.mask.tolist() == torch.where(kept, index, -1).tolist()


def test_the_hand_values_are_what_a_wrong_setting_would_change():
    """Control of the table above: another cap changes token_truncate's weights."""
    old, rollout = _logprobs()
    other = rollout_correction(
        RolloutCorrectionSettings("token_truncate", cap=2.5), old, rollout, MASK
    )
    assert not torch.allclose(other.weights, torch.tensor(EXPECTED["token_truncate"][0], dtype=T64))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        (dict(mode="tis"), "mode"),
        (dict(cap=0.0), "cap"),
        (dict(cap=float("inf")), "cap"),
        (dict(low=-1.0), "low"),
        (dict(low=3.0, high=2.0), "high"),
        (dict(high=True), "high"),
    ],
)
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"^{key}: "):
        RolloutCorrectionSettings(**kwargs)
    assert issubclass(SettingError, ValueError)


def test_bad_inputs_name_the_argument():
    old, rollout = _logprobs()
    s = RolloutCorrectionSettings("token_truncate")
    with pytest.raises(ValueError, match=r"rollout_logprobs: must have the shape"):
        rollout_correction(s, old, rollout[:, :2], MASK)
    with pytest.raises(ValueError, match=r"mask: must have shape"):
        rollout_correction(s, old, rollout, MASK[:, :2])
    bad = rollout.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_logprobs: .* finite"):
        rollout_correction(s, old, bad, MASK)
    # mode none's diagnostics never stop a run: a non-finite difference is a 0 gap there
    gap = correction_diagnostics(correction_statistics(old, bad, MASK))
    assert gap["rollout_correction/logprob_gap"] == pytest.approx(
        sum(abs(math.log(r)) for r in [1.5, 3.0, 0.4, 1.9]) / 5, rel=1e-14
    )
    bad[0, 0], bad[1, 2] = -1.0, float("nan")  # off the mask: never read
    rollout_correction(s, old, bad, MASK)


def test_an_empty_pack_gives_empty_weights():
    empty = torch.zeros(0, dtype=T64)
    s = RolloutCorrectionSettings("sequence_reject")
    out = rollout_correction(s, empty, empty, torch.zeros(0, dtype=torch.long))
    assert out.weights.numel() == 0 and out.mask.numel() == 0


def test_diagnostics_by_hand():
    old, rollout = _logprobs()
    out = rollout_correction(
        RolloutCorrectionSettings("token_mask", **SETTINGS), old, rollout, MASK
    )
    d = correction_diagnostics(correction_statistics(old, rollout, MASK, out))
    gap = sum(abs(math.log(r)) for r in [0.6, 1.5, 3.0, 0.4, 1.9]) / 5
    assert d["rollout_correction/logprob_gap"] == pytest.approx(gap, rel=1e-14)
    assert d["rollout_correction/fraction_corrected"] == pytest.approx(2 / 5)
    assert d["rollout_correction/weight_mean"] == pytest.approx((0.6 + 1.5 + 1.9) / 5, rel=1e-14)
    assert d["rollout_correction/weight_max"] == pytest.approx(1.9, rel=1e-14)
    rej = rollout_correction(
        RolloutCorrectionSettings("token_reject", **SETTINGS), old, rollout, MASK
    )
    d = correction_diagnostics(correction_statistics(old, rollout, MASK, rej))
    assert d["rollout_correction/weight_mean"] == 1.0  # over the 3 kept tokens only
    none = correction_diagnostics(correction_statistics(old, rollout, MASK))
    assert none["rollout_correction/fraction_corrected"] == 0.0
    assert none["rollout_correction/logprob_gap"] == pytest.approx(gap, rel=1e-14)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(ROLLOUT_CORRECTION_MODES),
    cap=st.floats(0.5, 3.0),
)
def test_properties_packed_equals_padded_and_bounds(seed, mode, cap):
    g = torch.Generator().manual_seed(seed)
    n, T = 4, 6
    lengths = torch.randint(0, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rollout = -torch.rand(n, T, generator=g, dtype=T64) * 3
    old = rollout + 0.4 * torch.randn(n, T, generator=g, dtype=T64)
    s = RolloutCorrectionSettings(mode, cap=cap, low=0.7, high=1.4)
    out = rollout_correction(s, old, rollout, mask)
    assert bool((out.weights >= 0).all()) and bool((out.weights[~mask] == 0).all())
    if mode.endswith("truncate"):
        assert bool((out.weights <= cap).all())
    if mode.startswith("sequence"):  # one weight per sequence, on each of its kept tokens
        kept = out.mask.bool()
        for i in range(n):
            assert out.weights[i][kept[i]].unique().numel() <= 1
    index = torch.arange(n).repeat_interleave(lengths)
    packed = rollout_correction(s, old[mask], rollout[mask], index, num_sequences=n)
    torch.testing.assert_close(packed.weights, out.weights[mask], rtol=1e-14, atol=0)
    assert (packed.mask >= 0).tolist() == out.mask.bool()[mask].tolist()


def _batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    n, T = 8, 7
    lengths = torch.randint(2, T + 1, (n,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(n, T, generator=g, dtype=T64)
    old = logp + 0.1 * torch.randn(n, T, generator=g, dtype=T64)
    rollout = old + 0.5 * torch.randn(n, T, generator=g, dtype=T64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.2, -0.4, 0.8, -1.6], dtype=T64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    return logp, old, rollout, mask, adv, ids


def _ba_loss(logp, old, mask, adv, ids, is_weights=None):
    """BA's loss and its gradient in logp, the plan built on `mask`'s lengths."""
    logp = logp.clone().requires_grad_()
    plan = LossPlan.build(AggregationSettings("balanced"), mask.sum(1), adv, ids)
    loss, _ = grpo_loss(logp, old, mask, plan, is_weights=is_weights)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


@pytest.mark.parametrize("mode", ["token_reject", "sequence_reject"])
def test_rejection_equals_ba_on_the_reduced_batch(mode):
    """Rejected tokens leave the mask before the plan: the loss and gradient are BA's on the batch
    rebuilt without them (kept tokens compacted to the left, rejected sequences' rows dropped)."""
    logp, old, rollout, mask, adv, ids = _batch()
    out = rollout_correction(RolloutCorrectionSettings(mode, low=0.7, high=1.4), old, rollout, mask)
    assert 0 < int(out.corrected.sum()) < int(mask.sum())
    loss, grad = _ba_loss(logp, old, out.mask, adv, ids, is_weights=out.weights)
    rows = out.mask.any(dim=1)
    kept = out.mask[rows]
    width = int(kept.sum(1).max())
    small_mask = torch.arange(width)[None, :] < kept.sum(1)[:, None]
    small = [torch.zeros(kept.shape[0], width, dtype=T64) for _ in range(2)]
    for dst, src in zip(small, (logp, old), strict=True):
        dst[small_mask] = src[rows][kept]
    ref_loss, ref_grad = _ba_loss(small[0], small[1], small_mask, adv[rows], ids[rows])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad[rows][kept], ref_grad[small_mask], rtol=1e-13, atol=1e-16)
    assert bool((grad[~out.mask] == 0).all())
    # Control: the rejected tokens kept in the denominators (weight 0, the full mask's plan).
    wrong, _ = _ba_loss(logp, old, mask, adv, ids, is_weights=out.weights)
    assert abs(float(wrong - ref_loss)) > 1e-4


def _reference(logp, old, mask, adv, ids, c):
    """-sum_i w_i sum_t c_{i,t} phi_{i,t} in float64, w the BA plan of `mask`'s lengths."""
    w = sequence_weights("balanced", mask.sum(1), adv, ids)[:, None]
    rho = (logp - old).exp()
    a = adv[:, None]
    phi = torch.minimum(rho * a, rho.clamp(0.8, 1.28) * a)
    return -(w * torch.where(mask, c * phi, 0.0)).sum()


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate"])
def test_weights_enter_the_ba_loss_per_token_and_masked_tokens_stay_counted(mode):
    """BA with the correction equals the float64 reference with c per token and the plan of the
    whole mask. Controls: c applied per sequence (its mean) and the masked tokens dropped from
    the denominators both give another loss."""
    logp, old, rollout, mask, adv, ids = _batch(7)
    out = rollout_correction(
        RolloutCorrectionSettings(mode, cap=1.2, low=0.7, high=1.4), old, rollout, mask
    )
    assert int(out.corrected.sum()) > 0
    loss, _ = _ba_loss(logp, old, out.mask, adv, ids, is_weights=out.weights)
    ref = _reference(logp, old, mask, adv, ids, out.weights)
    torch.testing.assert_close(loss, ref, rtol=1e-13, atol=0)
    per_seq = (out.weights.sum(1) / mask.sum(1))[:, None].expand_as(out.weights)
    if mode.startswith("token"):
        assert abs(float(_reference(logp, old, mask, adv, ids, per_seq) - loss)) > 1e-5
    if mode == "token_mask":
        dropped = mask & (out.weights > 0)
        wrong = _reference(logp, old, dropped, adv, ids, out.weights)
        assert abs(float(wrong - loss)) > 1e-5


def test_recipe_key_is_read_checked_and_refused_where_no_code_reads_it():
    from pathlib import Path

    from megatron_ba.recipe import RecipeError, load_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes/tiny-cpu.yaml"
    r = load_recipe(
        recipe, ["loss.rollout_correction.mode=sequence_mask", "loss.rollout_correction.high=3"]
    )
    assert r.loss.rollout_correction == RolloutCorrectionSettings("sequence_mask", high=3.0)
    assert load_recipe(recipe).loss.rollout_correction.mode == "none"
    with pytest.raises(RecipeError, match=r"^loss\.rollout_correction\.cap: must be > 0"):
        load_recipe(recipe, ["loss.rollout_correction.cap=0"])
    # the engines have none: their translations refuse it by name (the engines' table)
    from megatron_ba.integrations.engines.nemo_aligner import recipe_to_nemo_overrides

    other = load_recipe(recipe, ["backend=nemo_aligner", "loss.rollout_correction.mode=token_mask"])
    with pytest.raises(ValueError, match=r"^loss\.rollout_correction\.mode: the local backend"):
        recipe_to_nemo_overrides(other)
