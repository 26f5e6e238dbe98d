"""DAPO dynamic sampling in the rollout schedule: zero-variance groups are set aside and more
prompts drawn until the batch is full; the data position advances by what was drawn; without it,
one round."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from megatron_ba.generation.engine import Sample
from megatron_ba.recipe import load_recipe
from megatron_ba.train.rollout_schedule import RolloutSchedule

ROOT = Path(__file__).resolve().parents[1]


class FakeTask:
    def prompts(self, split, count, *, offset=0):
        return [f"p{i}" for i in range(offset, offset + count)]


class FakeRollouts:
    def generate(self, prompts, n, temperature, seed):
        return [[0] for _ in prompts], [[Sample([1], p, True) for _ in range(n)] for p in prompts]


class FakeScorer:
    """Prompt p<i> is solved by all samples when i % 3 == 0, by none when i % 3 == 1, and by
    half of them otherwise: only i % 3 == 2 groups have reward variance."""

    def score(self, prompts, samples):
        out = []
        for p, group in zip(prompts, samples, strict=True):
            i = int(p[1:])
            out += [
                1.0 if (i % 3 == 0 or (i % 3 == 2 and j % 2 == 0)) else 0.0
                for j in range(len(group))
            ]
        return out


def _fake(*overrides):
    recipe = load_recipe(
        ROOT / "recipes/tiny-cpu.yaml", ["grpo.prompts_per_step=4", "grpo.group_size=4", *overrides]
    )
    ctx = SimpleNamespace(is_main=True)
    return RolloutSchedule(recipe, ctx, FakeRollouts(), task=FakeTask(), scorer=FakeScorer())


def _batch(schedule):
    b = schedule._rounds(0, first=None)
    return b.prompts, b.ids, b.samples, b.rewards, b.report


def test_dynamic_sampling_fills_the_batch_with_groups_that_have_variance():
    fake = _fake("grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=8")
    prompts, ids, samples, rewards, report = _batch(fake)
    assert prompts == ["p2", "p5", "p8", "p11"]  # the groups with variance, in stream order
    assert len(rewards) == 16 and len(samples) == len(ids) == 4
    # rounds draw p0-p3 (p2 kept), p4-p6 (p5), p7-p8 (p8), p9, p10, p11 (p11): six rounds
    assert report["sampling/rounds"] == 6 and fake.data_position == 12
    assert (
        report["sampling/zero_variance_set_aside"] == 8
        and report["sampling/zero_variance_filled"] == 0
    )


def test_rounds_run_out_and_set_aside_groups_fill_the_rest():
    fake = _fake("grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=2")
    prompts, _, _, rewards, report = _batch(fake)
    assert prompts == ["p2", "p5", "p0", "p1"]  # 2 with variance, then the first set-aside ones
    assert report["sampling/zero_variance_filled"] == 2 and fake.data_position == 7
    assert len(rewards) == 16


def test_without_dynamic_sampling_one_round_keeps_every_group():
    fake = _fake()
    prompts, _, _, _, report = _batch(fake)
    assert prompts == ["p0", "p1", "p2", "p3"] and fake.data_position == 4
    assert set(report) == {"reward_seconds"}
