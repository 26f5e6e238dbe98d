"""BalancedPGLossFn on micro-batches, against NeMo-RL's own ClippedPGLossFn and float64 references.

- With `ba_rule=token, ba_scope=batch` (NeMo-RL's own token-level normalisation) it is
  ClippedPGLossFn: loss, gradient and every metric, KL term included (k1/k2/k3, clamps, the
  on-policy approximation), in float64.
- With the balanced rules it is a float64 reference written out term by term (reference.py): the
  plan's weights by explicit loops, NeMo-RL's KL with its score-function factor.
- Settings whose effect it would drop are refused by name; missing data keys are named.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

import torch
from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn
from reference import importance_weights, plan_weights, reference_loss

from megatron_ba.integrations.nemo_rl import BalancedPGLossFn
from megatron_ba.integrations.nemo_rl.pg_loss import REFUSED

G, PROMPT, SEQ = 4, 3, 12
STOCK = {  # examples/configs/grpo_math_1B.yaml's loss_fn: KL 0.01, k3, clamps 20 / 10
    "reference_policy_kl_penalty": 0.01,
    "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.28,
}


def _data(seed=0, num_groups=3):
    """A NeMo-RL GRPO train batch (float64): responses after a prompt, advantages on tokens."""
    g = torch.Generator().manual_seed(seed)
    n = G * num_groups
    resp = torch.randint(1, SEQ - PROMPT + 1, (n,), generator=g)
    pos = torch.arange(SEQ)[None, :]
    token_mask = ((pos >= PROMPT) & (pos < PROMPT + resp[:, None])).double()
    sample_mask = torch.ones(n, dtype=torch.float64)
    sample_mask[5] = 0.0  # e.g. an overlong response, filtered
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    grouped = rewards.view(-1, G)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    rand = lambda: -torch.rand(n, SEQ, generator=g, dtype=torch.float64)  # noqa: E731
    data = {
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": adv.reshape(-1)[:, None].expand(n, SEQ).clone(),
        "prev_logprobs": rand(),
        "generation_logprobs": rand(),
        "reference_policy_logprobs": rand(),
    }
    logp = data["prev_logprobs"][:, 1:] + 0.3 * torch.randn(n, SEQ - 1, generator=g).double()
    return data, logp


def _tokens(data) -> torch.Tensor:
    return (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()


def _call(loss_fn, data, logp, rows=None):
    """One micro-batch (rows of the global batch) as NeMo-RL calls it: global counts passed."""
    mb = data if rows is None else {k: v[rows] for k, v in data.items()}
    lp = logp if rows is None else logp[rows]
    seqs = data["sample_mask"].sum()
    return loss_fn(lp, mb, seqs, _tokens(data))


def _value_and_grad(loss_fn, data, logp, splits=None):
    x = logp.detach().clone().requires_grad_(True)
    total, metrics = 0.0, []
    for rows in splits or [None]:
        loss, m = _call(loss_fn, data, x, rows)
        total, metrics = total + loss, [*metrics, m]
    (grad,) = torch.autograd.grad(total, x)
    return total.detach(), grad, metrics


IS = {"use_importance_sampling_correction": True}
# NeMo-RL's importance-sampling corrections: (truncated type, low, high)
CORRECTIONS = {
    "is": (None, None, None),
    "tis": ("tis", None, 1.2),
    "icepop": ("icepop", 0.7, 1.5),
    "seq-mask-tis": ("seq-mask-tis", 0.8, 1.25),
}


def _correction(name):
    kind, low, high = CORRECTIONS[name]
    cfg = IS | {"truncated_importance_sampling_type": kind}
    return cfg | {"truncated_importance_sampling_ratio": high,
                  "truncated_importance_sampling_ratio_min": low}  # fmt: skip


VARIANTS = {
    **{name: _correction(name) for name in CORRECTIONS},
    "cispo": {"use_cispo": True},
    "reinforce": {"disable_ppo_ratio": True},
    "on_policy_ratio": {"force_on_policy_ratio": True},
    "stock": {},
    "k1": {"reference_policy_kl_type": "k1"},
    "k2": {"reference_policy_kl_type": "k2"},
    "on_policy_kl": {"use_on_policy_kl_approximation": True},
    "output_clamp_active": {"kl_output_clamp_value": 0.05, "reference_policy_kl_penalty": 0.5},
    "dual_clip": {"ratio_clip_c": 3.0},
    "no_kl": {"reference_policy_kl_penalty": 0.0},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_token_rule_at_batch_scope_is_nemo_rls_clipped_pg_loss(variant):
    """NeMo-RL's token-level loss is the plan 1/N: our loss equals its loss, gradient, metrics,
    for its KL settings, its importance-sampling corrections and its PPO variants."""
    cfg = STOCK | VARIANTS[variant]
    data, logp = _data()
    ours = BalancedPGLossFn(cfg | {"ba_rule": "token", "ba_scope": "batch"}, group_size=G)
    ours.attach_plan(data)
    theirs = ClippedPGLossFn(ClippedPGLossConfig(**cfg))
    value, grad, (metrics,) = _value_and_grad(ours, data, logp)
    ref_value, ref_grad, (ref_metrics,) = _value_and_grad(theirs, data, logp)
    torch.testing.assert_close(value, ref_value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert set(metrics) >= set(ref_metrics)
    for key, want in ref_metrics.items():
        assert metrics[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key


def test_balanced_is_token_rule_only_where_they_agree():
    """Control for the test above: the balanced plan differs from NeMo-RL's token mean."""
    data, logp = _data()
    ours = BalancedPGLossFn(STOCK, group_size=G)
    ours.attach_plan(data)
    value, _, _ = _value_and_grad(ours, data, logp)
    ref, _, _ = _value_and_grad(ClippedPGLossFn(ClippedPGLossConfig(**STOCK)), data, logp)
    assert abs(float(value - ref)) > 1e-3


# Micro-batches as NeMo-RL forms them: in another order (dynamic batching sorts by length), of
# unequal sizes, one of them a single response.
SPLITS = [[7, 2, 11], [0, 5, 9, 1], [3], [10, 4, 6, 8]]


@pytest.mark.parametrize("rule", ["balanced", "group_token_mean"])
def test_micro_batches_sum_to_the_float64_reference(rule):
    data, logp = _data()
    loss_fn = BalancedPGLossFn(STOCK | {"ba_rule": rule, "ratio_clip_c": 3.0}, group_size=G)
    loss_fn.attach_plan(data)
    splits = [torch.tensor(s) for s in SPLITS]
    value, grad, _ = _value_and_grad(loss_fn, data, logp, splits)

    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    weights = plan_weights(rule, mask.sum(1), data["advantages"][:, -1], G)
    x = logp.detach().clone().requires_grad_(True)
    ref = reference_loss(x, data, weights, dual_clip=3.0, kl=STOCK["reference_policy_kl_penalty"])
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(value, ref.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)

    # Negative control: each micro-batch planned on its own (a per-micro-batch normalisation).
    whole_groups = [torch.arange(i, i + G) for i in range(0, len(weights), G)]
    other = 0.0
    for rows in whole_groups:
        mb = {k: v[rows] for k, v in data.items()}
        loss_fn.attach_plan(mb)
        other = other + loss_fn(logp[rows], mb, data["sample_mask"].sum(), _tokens(data))[0]
    assert abs(float(other.detach() - ref.detach())) > 1e-4


def test_kl_gradient_carries_nemo_rls_score_function_term():
    """NeMo-RL multiplies k3 by exp(lp - stopgrad(lp)) even without the on-policy approximation:
    the same value as plain k3, another gradient. Ours has NeMo-RL's; plain k3 (the control) does
    not match it."""
    data, logp = _data()
    cfg = STOCK | {"reference_policy_kl_penalty": 0.05}
    loss_fn = BalancedPGLossFn(cfg, group_size=G)
    loss_fn.attach_plan(data)
    value, grad, _ = _value_and_grad(loss_fn, data, logp)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    weights = plan_weights("balanced", mask.sum(1), data["advantages"][:, -1], G)
    grads = {}
    for score_function in (True, False):
        x = logp.detach().clone().requires_grad_(True)
        ref = reference_loss(x, data, weights, kl=0.05, score_function=score_function)
        torch.testing.assert_close(value, ref.detach(), rtol=1e-9, atol=1e-12)  # same value
        (grads[score_function],) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(grad, grads[True], rtol=1e-9, atol=1e-12)
    assert (grad - grads[False]).norm() / grads[False].norm() > 1e-3


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_balanced_with_nemo_rls_correction_is_the_float64_reference(name):
    """BA's weights and NeMo-RL's per-token importance weights, each where it belongs (the
    weight on every token's term; masked tokens stay in BA's lengths). Control: the same weight
    placed on the sequence (its mean over the response) does not match."""
    kind, low, high = CORRECTIONS[name]
    data, logp = _data()
    loss_fn = BalancedPGLossFn(STOCK | _correction(name), group_size=G)
    loss_fn.attach_plan(data)
    value, grad, _ = _value_and_grad(loss_fn, data, logp, [torch.tensor(s) for s in SPLITS])
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    weights = plan_weights("balanced", mask.sum(1), data["advantages"][:, -1], G)
    c = importance_weights(data, kind, low, high)
    x = logp.detach().clone().requires_grad_(True)
    ref = reference_loss(x, data, weights, kl=0.01, is_weights=c)
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(value, ref.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    on_sequence = (c * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    wrong = reference_loss(logp, data, weights, kl=0.01, is_weights=on_sequence.expand_as(c))
    assert abs(float(wrong - ref.detach())) > 1e-4


BAD_VALUES = {
    "sequence_level_importance_ratios": True,
    "token_level_loss": False,
    "positive_example_nll_weight": 0.1,
}


def test_every_refused_setting_has_a_bad_value_here():
    assert set(BAD_VALUES) == set(REFUSED)


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_settings_whose_effect_would_be_dropped_are_refused_by_name(key):
    cfg = STOCK | {key: BAD_VALUES[key]}
    if key == "token_level_loss":  # NeMo-RL's own config requires it for GSPO only
        cfg["sequence_level_importance_ratios"] = False
    with pytest.raises(ValueError, match=rf"^loss_fn\.{key}: BalancedPGLossFn supports only"):
        BalancedPGLossFn(cfg, group_size=G)


def test_bad_ba_keys_are_named():
    with pytest.raises(ValueError, match=r"loss_fn\.ba_rule"):
        BalancedPGLossFn(STOCK | {"ba_rule": "mean"}, group_size=G)
    with pytest.raises(ValueError, match=r"loss_fn\.ba_rul: unknown key"):
        BalancedPGLossFn(STOCK | {"ba_rul": "balanced"}, group_size=G)
    with pytest.raises(ValueError, match="group_size"):
        BalancedPGLossFn(STOCK, group_size=0)
    with pytest.raises(ValueError, match="whole groups"):
        BalancedPGLossFn(STOCK, group_size=5).attach_plan(_data()[0])


@pytest.mark.parametrize(
    ("key", "step"),
    [
        ("token_mask", "attach_plan"),
        ("sample_mask", "attach_plan"),
        ("advantages", "attach_plan"),
        ("prev_logprobs", "loss"),
        ("generation_logprobs", "loss"),
        ("reference_policy_logprobs", "loss"),  # STOCK has a KL term
    ],
)
def test_missing_data_keys_are_named(key, step):
    data, logp = _data()
    loss_fn = BalancedPGLossFn(STOCK, group_size=G)
    if step == "loss":
        loss_fn.attach_plan(data)
    del data[key]
    with pytest.raises(ValueError, match=rf"data: missing \['{key}'\]"):
        if step == "attach_plan":
            loss_fn.attach_plan(data)
        else:
            _call(loss_fn, data, logp)


def test_reference_logprobs_are_not_needed_without_kl_and_a_missing_plan_is_named():
    data, logp = _data()
    loss_fn = BalancedPGLossFn(STOCK | {"reference_policy_kl_penalty": 0.0}, group_size=G)
    with pytest.raises(ValueError, match="attach_plan"):
        _call(loss_fn, data, logp)
    loss_fn.attach_plan(data)
    del data["reference_policy_logprobs"]
    assert torch.isfinite(_call(loss_fn, data, logp)[0])


def test_plan_of_another_batch_is_refused():
    """Weights attached to the global batch but not sliced with it (one per global row)."""
    data, logp = _data()
    loss_fn = BalancedPGLossFn(STOCK, group_size=G)
    loss_fn.attach_plan(data)
    micro = {k: (v if k == "ba_weights" else v[:4]) for k, v in data.items()}
    with pytest.raises(ValueError, match=r"data\['ba_weights'\]: must hold one weight per row"):
        loss_fn(logp[:4], micro, None, None)


def test_the_loss_function_survives_pickling():
    """NeMo-RL's Policy.train sends the loss function to its Ray workers, pickled."""
    data, logp = _data()
    loss_fn = BalancedPGLossFn(STOCK, group_size=G)
    loss_fn.attach_plan(data)
    copy = pickle.loads(pickle.dumps(loss_fn))
    torch.testing.assert_close(_call(copy, data, logp)[0], _call(loss_fn, data, logp)[0])


def test_docs_snippet_runs():
    text = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    (snippet,) = re.findall(r"```python\n# docs snippet: nemo_rl\n(.*?)```", text, re.S)
    namespace: dict = {}
    exec(compile(snippet, "docs/integrations.md", "exec"), namespace)
    loss, metrics = namespace["loss"], namespace["metrics"]
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"token_mult_prob_error", "gen_kl_error", "ba_weight_pos_sum"} <= set(metrics)
