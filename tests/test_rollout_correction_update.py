"""The local trainer's rollout correction (train/update.grpo_update with loss.rollout_correction):
the engine's log-probs ride in the Experience token-aligned, the step's policy-gradient loss is
the hand-computed corrected BA loss, and the diagnostics are the hand-computed ones.

At the first update the policy is the old one (rho = 1), so the PG loss is
-sum_i w_i A_i sum_{t kept} c_{i,t}: BA's is 0 without a correction (sum_i A_i / G = 0 per group),
and with one it depends on every weight and on the plan of the kept tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ba.generation.engine import Sample
from megatron_ba.train.experience import build_experience

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def _samples(with_logprobs: bool):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(2):
        group = []
        for j in range(3):
            ids = torch.randint(1, 60, (3 + 4 * j + i,), generator=g).tolist()
            logp = [-0.1 * (k + 1) for k in range(len(ids))] if with_logprobs else None
            group.append(Sample(ids, "", True, logp))
        out.append(group)
    return out


def test_experience_keeps_the_engines_logprobs_token_aligned():
    exp = build_experience([[1, 2, 3], [4, 5]], _samples(True), REWARDS, pad_id=0)
    mask = exp.response_mask
    assert exp.rollout_logprobs.shape == mask.shape
    assert bool((exp.rollout_logprobs[~mask] == 0).all())
    row = exp.rollout_logprobs[0][mask[0]]  # prompt [1, 2, 3], 3 response tokens
    torch.testing.assert_close(row, torch.tensor([-0.1, -0.2, -0.3]), rtol=0, atol=1e-7)
    assert int(mask[0].nonzero()[0]) == 3  # the first response token's position
    none = build_experience([[1, 2, 3], [4, 5]], _samples(False), REWARDS, pad_id=0)
    assert none.rollout_logprobs is None


def _update(mode: str | None, delta: torch.Tensor | None = None, rule: str = "balanced"):
    """(metrics, response mask, advantages, group ids) of one update; the rollout log-probs are
    the old ones minus `delta` on the response tokens, so the token ratio is exp(delta)."""
    pytest.importorskip("megatron.core")
    from megatron_ba.megatron import model as mm
    from megatron_ba.megatron.grpo_step import compute_logprobs
    from megatron_ba.megatron.optimizer_choice import build_optimizer
    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel import full_shape
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from megatron_ba.recipe import load_recipe
    from megatron_ba.train import update

    overrides = ["grpo.prompts_per_step=2", "grpo.group_size=3", "parallel.micro_batch_size=2"]
    overrides.append(f"loss.rule={rule}")
    if mode is not None:
        overrides += [f"loss.rollout_correction.mode={mode}", "loss.rollout_correction.cap=1.3"]
        overrides += ["loss.rollout_correction.low=0.8", "loss.rollout_correction.high=1.25"]
    recipe = load_recipe(ROOT / "recipes/tiny-cpu.yaml", overrides)
    ctx = setup(ParallelLayout(dp=None), seed=0)
    try:
        spec = mm.tiny_qwen2_spec()
        chunks = mm.build_model_chunks(spec, config=mm.transformer_config(spec))
        full_shape.load_full_state_dict(chunks, mm.full_init_state_dict(spec, 0))
        optimizer = build_optimizer(chunks, recipe.optimizer, precision="fp32", device=ctx.device)
        exp = build_experience([[1, 2, 3], [4, 5]], _samples(False), REWARDS, pad_id=0)
        if delta is not None:
            old, _ = compute_logprobs(chunks, exp.tokens)  # the update's old log-probs
            exp.rollout_logprobs = torch.where(exp.response_mask, old - delta, 0.0)
        metrics = update.grpo_update(chunks, None, optimizer, recipe.step_settings(), ctx, exp)
        return metrics, exp.response_mask, exp.advantages.double(), exp.group_ids
    finally:
        teardown()


def _delta(mask: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.where(mask, 0.3 * torch.randn(mask.shape, generator=g), 0.0)


def _pg_reference(c, kept, adv, ids, plan_mask=None, rule="balanced") -> float:
    """-sum_i w_i A_i sum_{t kept} c_{i,t} in float64, w `rule`'s plan of the kept lengths (or
    of `plan_mask`'s, the control)."""
    from megatron_ba.aggregation import sequence_weights

    lengths = (kept if plan_mask is None else plan_mask).sum(1).double()
    w = sequence_weights(rule, lengths, adv, ids)
    return float(-(w * adv * torch.where(kept, c, 0.0).sum(1)).sum())


@pytest.mark.slow
def test_corrected_update_equals_the_hand_computed_loss_and_diagnostics():
    _, mask, adv, ids = _update(None)
    delta = _delta(mask)
    ratio = delta.double().exp()
    n = int(mask.sum())
    gap = float(delta.abs().sum()) / n

    none, _, _, _ = _update("none", delta)
    assert none["pg_loss"] == pytest.approx(0.0, abs=1e-7)  # BA at rho = 1, no correction
    assert none["rollout_correction/logprob_gap"] == pytest.approx(gap, rel=1e-5)
    assert none["rollout_correction/fraction_corrected"] == 0.0

    tis, _, _, _ = _update("token_truncate", delta)
    c = ratio.clamp(max=1.3)
    assert tis["pg_loss"] == pytest.approx(_pg_reference(c, mask, adv, ids), rel=1e-5)
    truncated = int((mask & (ratio > 1.3)).sum())
    assert 0 < truncated < n
    assert tis["rollout_correction/fraction_corrected"] == pytest.approx(truncated / n)
    assert tis["rollout_correction/weight_max"] == pytest.approx(1.3, rel=1e-6)
    assert tis["rollout_correction/weight_mean"] == pytest.approx(float(c[mask].mean()), rel=1e-5)
    # Control: the engine's log-probs one position off (the alignment a shift would break) give
    # another loss. (A per-sequence mean of c would not: at rho = 1 the term is linear in c.)
    shifted = torch.where(mask.roll(1, dims=1), ratio.roll(1, dims=1), 1.0).clamp(max=1.3)
    assert abs(_pg_reference(shifted, mask, adv, ids) - tis["pg_loss"]) > 1e-4

    # Rejection under the token rule (BA's loss at rho = 1 is 0 whatever the lengths): the plan
    # is the one of the kept tokens.
    rej, _, _, _ = _update("token_reject", delta, rule="token")
    kept = mask & (ratio >= 0.8) & (ratio <= 1.25)
    assert 0 < int(kept.sum()) < n
    ones = torch.ones_like(ratio)
    ref = _pg_reference(ones, kept, adv, ids, rule="token")
    assert rej["pg_loss"] == pytest.approx(ref, rel=1e-5)
    # Control: the rejected tokens left in the plan's denominators give another loss.
    wrong = _pg_reference(ones, kept, adv, ids, plan_mask=mask, rule="token")
    assert abs(wrong - rej["pg_loss"]) > 1e-4
    assert rej["rollout_correction/fraction_corrected"] == pytest.approx(1 - int(kept.sum()) / n)
    assert math.isfinite(rej["loss"])


def test_builtin_sampler_returns_each_sampled_tokens_logprob_after_the_temperature():
    from megatron_ba.generation.builtin_sampler import BuiltinSampler

    base = torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64)

    def forward(tokens, positions, mask):
        return base.expand(tokens.shape[0], tokens.shape[1], 4)

    sampler = BuiltinSampler(forward, eos_token_id=3, pad_token_id=0, decode=lambda ids: "")
    groups = sampler.generate([[1, 2], [2]], n=3, temperature=0.7, max_tokens=5, seed=0)
    expected = torch.log_softmax(base / 0.7, dim=-1)
    untempered = torch.log_softmax(base, dim=-1)  # the control: the temperature forgotten
    for s in (s for group in groups for s in group):
        assert len(s.logprobs) == len(s.token_ids) > 0
        for tok, lp in zip(s.token_ids, s.logprobs, strict=True):
            assert lp == pytest.approx(float(expected[tok]), rel=1e-12)
            assert lp != pytest.approx(float(untempered[tok]), rel=1e-6)


def test_vllm_completion_logprobs_are_the_sampled_tokens():
    from types import SimpleNamespace as NS

    from megatron_ba.generation.vllm_engine import _token_logprobs

    c = NS(
        token_ids=[5, 7], logprobs=[{5: NS(logprob=-0.1)}, {7: NS(logprob=-0.2), 5: NS(logprob=-3)}]
    )
    assert _token_logprobs(c) == [-0.1, -0.2]
    assert _token_logprobs(NS(token_ids=[5], logprobs=None)) is None


# Two mini-batches' correction statistics per rank (gap sum, valid, corrected, kept, weight sum,
# weight max), made up so that each column's reduction shows.
DP_STATS = [
    [[1.0, 10.0, 2.0, 9.0, 9.5, 1.2], [0.5, 5.0, 0.0, 5.0, 5.0, 1.0]],
    [[3.0, 20.0, 1.0, 20.0, 20.5, 1.7], [0.25, 5.0, 1.0, 4.0, 3.5, 1.1]],
]


def _dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json
    from types import SimpleNamespace

    from megatron_ba.megatron.startup import setup, teardown
    from megatron_ba.parallel.parallel_layout import ParallelLayout
    from megatron_ba.train import update

    torch.set_num_threads(1)
    setup(ParallelLayout(dp=None), seed=0, backend="gloo", rank=rank, world_size=world, port=port)
    stats = [torch.tensor(s, dtype=torch.float64) for s in DP_STATS[rank]]
    got = update._with_diagnostics(stats, SimpleNamespace(dp=world))
    with open(f"{out_dir}/rank-{rank}.json", "w") as f:
        json.dump(got, f)
    teardown()


@pytest.mark.distributed
def test_diagnostics_are_reduced_over_data_parallel_ranks(tmp_path):
    """Sums over mini-batches and both DP ranks, the max of the weight max, on every rank. The
    control: one rank's own diagnostics differ."""
    import json

    pytest.importorskip("megatron.core")
    from megatron_ba.parallel.world import free_port, spawn

    spawn(_dp_worker, 2, (2, free_port(), str(tmp_path)))
    want = {
        "rollout_correction/logprob_gap": 4.75 / 40,
        "rollout_correction/fraction_corrected": 4 / 40,
        "rollout_correction/weight_mean": 38.5 / 38,
        "rollout_correction/weight_max": 1.7,
    }
    for rank in range(2):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert got == pytest.approx(want, rel=1e-15)
    from megatron_ba.rollout_correction import correction_diagnostics

    alone = correction_diagnostics(torch.tensor(DP_STATS[0][0], dtype=torch.float64))
    assert alone != pytest.approx(want, rel=1e-6)
