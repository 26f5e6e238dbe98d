"""The balanced pair through verl 0.9.1's asynchronous trainers' own code, on CPU.

tests/verl_async_sim.py drives verl's rollouter loop (staleness gate, one uid per queue sample),
its message queue, its partial-rollout client and its trainer's step (queue read, batch assembly
with balance_batch, reward and advantage steps) with a fake rollout server. Runs in .venv-verl
(bash scripts/run_verl_tests.sh).

- staleness 0.5 with three responses cut by a weight sync and resumed under the new weights, two
  DP ranks, two mini-batches per step: every step batch holds whole groups and mixes policy
  versions; its advantages equal w_i A_i x steps, w_i the float64 reference
  (tests/verl_reference.py) on verl's own `grpo` advantages; the balanced loss over verl's
  DP x mini-batch split equals, for each optimizer step, the step plan of docs/math.md section 10
  (megatron_ba.step_plan.split_step_weights), balance_batch having spread groups over both
  mini-batches; control: each optimizer step planned on its own rows (a split group weighed by
  its part's own statistics) differs;
- verl's one-step-off trainer (its generation step: uid, repeat, balance_batch; then its reward
  and advantage steps): the same checks;
- staleness 0 (verl's synchronous-equivalent setting): each step batch holds the prompts the
  synchronous trainer would plan together, at one version, and verl's compute_advantage on the
  synchronous trainer's rows of those prompts gives equal advantages; the steps per batch agree.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl 0.9.1 lives in .venv-verl: bash scripts/run_verl_tests.sh")

from hydra import compose, initialize_config_dir, initialize_config_module
from verl import DataProto
from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask
from verl.workers.config import ActorConfig
from verl_async_sim import Client, FakeAgentLoop, Sim, run
from verl_reference import balanced_weights, weighted_loss
from verl_test_env import no_ba_environment  # noqa: F401 (autouse fixture)

import megatron_ba.integrations.verl  # noqa: F401 (registers the hooks)
from megatron_ba.aggregation import sequence_weights
from megatron_ba.integrations.verl import one_step_off_policy as one_step
from megatron_ba.integrations.verl.adapter import STEPS_ENV
from megatron_ba.integrations.verl.checks import check_config, steps_per_batch
from megatron_ba.integrations.verl.fully_async_policy import CONFIG_DIR
from megatron_ba.step_plan import split_step_weights

N, MINI, BATCHES, DP = 4, 3, 2, 2  # responses per prompt, prompts per mini-batch, mini-batches
PAIR = [
    "algorithm.adv_estimator=balanced",
    "actor_rollout_ref.actor.policy_loss.loss_mode=balanced",
    "algorithm.rollout_correction.bypass_mode=false",
    f"actor_rollout_ref.rollout.n={N}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
]


def _async_config(staleness: float):
    overrides = [
        *PAIR,
        "data.train_batch_size=0",  # what verl's rollouter requires (one prompt at a time)
        f"async_training.require_batches={BATCHES}",
        f"async_training.staleness_threshold={staleness}",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.concurrent_samples_per_replica=2",
        "trainer.balance_batch=true",
    ]
    with initialize_config_dir(CONFIG_DIR, version_base=None):
        return compose("fully_async_ppo_trainer", overrides=overrides)


def _checked(cfg, monkeypatch) -> int:
    """check_config, then the steps the entry exports to the estimator's process."""
    check_config(cfg)
    steps = steps_per_batch(cfg)
    monkeypatch.setenv(STEPS_ENV, str(steps))
    return steps


def _per_row(tokens, mask):
    """A per-token tensor that is constant on each response, as one value per row (float64)."""
    mask = mask.double()
    return (tokens.double() * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _reference(batch: DataProto):
    """(A_i, group ids, lengths): verl's own `grpo` advantages of the batch, per row."""
    mask = batch.batch["response_mask"]
    grpo, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["token_level_rewards"],
        response_mask=mask,
        index=batch.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=True,
    )
    _, gid = np.unique(batch.non_tensor_batch["uid"].astype(str), return_inverse=True)
    return _per_row(grpo, mask), torch.as_tensor(gid), mask.sum(-1).double()


def _optimizer_steps(n_rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(rows of each optimizer step, rows of each DP rank) as verl's actor splits a step batch:
    rank r takes the r-th contiguous chunk, cuts it in mini-batches of ppo_mini_batch_size x n /
    dp rows; optimizer step t is every rank's t-th mini-batch."""
    ranks = list(torch.arange(n_rows).chunk(DP))
    per = MINI * N // DP
    return [torch.cat([r[t * per : (t + 1) * per] for r in ranks]) for t in range(BATCHES)], ranks


def _step_loss(adv, batch, logp, rows, ranks):
    """What verl optimises in one optimizer step: each rank's micro-batches (two) through the
    balanced loss (x dp_size inside), averaged over the DP ranks."""
    clip = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    config = ActorConfig(strategy="fsdp", rollout_n=N, ppo_micro_batch_size_per_gpu=2, **clip)
    config.global_batch_info["dp_size"] = DP
    loss_fn = core_algos.get_policy_loss_fn("balanced")
    old, mask = batch.batch["old_log_probs"].double(), batch.batch["response_mask"]
    total = 0.0
    for rank in ranks:
        mine = torch.tensor([i for i in rank.tolist() if i in set(rows.tolist())])
        for micro in mine.chunk(2):
            loss, _ = loss_fn(old_log_prob=old[micro], log_prob=logp[micro],
                              advantages=adv[micro].double(), response_mask=mask[micro],
                              loss_agg_mode="token-mean", config=config)  # fmt: skip
            total = total + loss
    return total / DP


def _equals_the_reference(batch: DataProto, steps: int, seed: int) -> bool:
    """A step batch with verl's advantages: whole groups; advantages w_i A_i x steps (float64
    reference); the loss of each optimizer step of verl's split equals the step plan (section
    10), and (control) the step planned alone differs where it holds part of a group. Returns
    whether some group was split over the optimizer steps."""
    uid, mask = batch.non_tensor_batch["uid"], batch.batch["response_mask"]
    assert sorted(np.unique(uid, return_counts=True)[1]) == [N] * (MINI * BATCHES)
    a, gid, lengths = _reference(batch)
    folded = balanced_weights(lengths, a, gid) * a * steps
    torch.testing.assert_close(
        _per_row(batch.batch["advantages"], mask), folded, rtol=1e-5, atol=1e-7
    )
    g = torch.Generator().manual_seed(seed)
    old = batch.batch["old_log_probs"].double()
    logp = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    step_rows, ranks = _optimizer_steps(len(batch))
    split = False
    for rows in step_rows:
        in_step = torch.zeros(len(batch), dtype=torch.bool)
        in_step[rows] = True
        w = split_step_weights("balanced", lengths, a, gid, in_step)
        expected = weighted_loss(logp[rows], old[rows], a[rows], mask[rows], w[rows])
        got = _step_loss(batch.batch["advantages"], batch, logp, rows, ranks)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)
        if len(set(uid[rows])) > MINI:  # the step holds part of a group
            split = True
            # control: the step planned on its own rows (each part's own k, N^s and a Gamma of
            # parts), folded into the advantages the same way
            w_part = sequence_weights("balanced", lengths[rows], a[rows], gid[rows])
            alone = torch.zeros(len(batch), dtype=torch.float64)
            alone[rows] = w_part * a[rows]
            control = _step_loss(alone[:, None] * mask, batch, logp, rows, ranks)
            assert (control - expected).abs() > 1e-3 * expected.abs().clamp(min=1e-3)
    return split


def test_stale_partial_batches_plan_whole_groups_as_the_reference(monkeypatch):
    cfg = _async_config(staleness=0.5)
    steps = _checked(cfg, monkeypatch)
    assert steps == BATCHES
    sim = Sim(prompts=24, n=N, seed=1, cut={"1-0", "1-2", "9-3"})
    out = asyncio.run(run(cfg, sim, steps=4))
    assert max(s.batch.meta_info["param_version_diversity"] for s in out) > 1  # versions mixed
    assert sum(s.batch.meta_info["fully_async/partial/total_partial_num"] for s in out) >= 2
    split = [_equals_the_reference(s.batch, steps, 100 + k) for k, s in enumerate(out)]
    assert any(split), "balance_batch spread no group over both mini-batches: no split to test"


class _OneStep(OneStepOffRayTrainer):
    """verl's one-step-off trainer's methods over the fields they read (no workers, no Ray)."""

    def __init__(self, config, sim: Sim):
        self.config, self.global_steps, self.use_prefix_grouper, self.use_rm = (
            config,
            1,
            False,
            False,
        )
        self.async_rollout_manager = FakeAgentLoop(Client(config, sim))
        self.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(DP))})
        self.metrics, self.timing_raw, self.reward_extra_infos_dict = {}, {}, {}


def test_one_step_off_batches_plan_as_the_reference(monkeypatch):
    """verl's one-step-off generation step (_async_gen_next_batch: uid, repeat, union,
    balance_batch) on prompts generated one version behind, then its reward and advantage steps."""
    with initialize_config_dir(one_step.CONFIG_DIR, version_base=None):
        batch = [f"data.train_batch_size={MINI * BATCHES}", "trainer.balance_batch=true"]
        cfg = compose("one_step_off_ppo_trainer", overrides=[one_step.SEARCHPATH, *PAIR, *batch])
    steps = _checked(cfg, monkeypatch)
    assert steps == BATCHES
    sim = Sim(prompts=2 * MINI * BATCHES, n=N, seed=3)
    trainer = _OneStep(cfg, sim)
    per_step = MINI * BATCHES
    batches = iter([(0, sim.batch(*range(k * per_step, (k + 1) * per_step))) for k in range(2)])
    split = []
    for k in range(2):
        _, _, _, batch, _ = asyncio.run(trainer._async_gen_next_batch(batches))
        batch = trainer._fit_compute_reward(batch)
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"] + 0.05
        batch = trainer._fit_compute_advantage(batch)
        split.append(_equals_the_reference(batch, steps, 200 + k))
    assert any(split)


def _synchronous_rows(cfg, sim: Sim, prompts: list[int]) -> DataProto:
    """The rows verl's synchronous trainer plans for `prompts`: each prompt's n responses
    (the same servers), one uuid per prompt, the response mask, the reward as token_level_rewards;
    then verl's compute_advantage with the balanced estimator."""
    loop = FakeAgentLoop(Client(cfg, sim))

    async def generate():
        parts = []
        for p in prompts:
            one = DataProto.from_single_dict(sim.batch(p)).repeat(N, interleave=True)
            parts.append(await loop.generate_sequences_single(one))
        return DataProto.concat(parts)

    batch = asyncio.run(generate())
    batch.non_tensor_batch["uid"] = np.repeat([str(uuid.uuid4()) for _ in prompts], N).astype(
        object
    )
    batch.batch["response_mask"] = compute_response_mask(batch)
    batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
    return compute_advantage(batch, adv_estimator="balanced", num_repeat=N, config=cfg.algorithm)


def _by_response(batch: DataProto) -> dict:
    """(prompt, response index) -> the row's advantage."""
    adv = _per_row(batch.batch["advantages"], batch.batch["response_mask"])
    keys = zip(batch.non_tensor_batch["index"], batch.non_tensor_batch["resp"], strict=True)
    return {(int(p), int(j)): float(a) for (p, j), a in zip(keys, adv, strict=True)}


def test_staleness_zero_equals_the_synchronous_path(monkeypatch):
    cfg = _async_config(staleness=0)
    with initialize_config_module("verl.trainer.config", version_base=None):
        sync_cfg = compose(
            "ppo_trainer", overrides=[*PAIR, f"data.train_batch_size={MINI * BATCHES}"]
        )
    assert steps_per_batch(sync_cfg) == _checked(cfg, monkeypatch) == BATCHES
    check_config(sync_cfg)
    per_step = MINI * BATCHES
    sim = Sim(prompts=2 * per_step, n=N, seed=2)
    out = asyncio.run(run(cfg, sim, steps=2))
    for k, step in enumerate(out):
        prompts = list(range(k * per_step, (k + 1) * per_step))
        assert sorted({int(p) for p in step.batch.non_tensor_batch["index"]}) == prompts
        assert step.batch.meta_info["param_version_diversity"] == 1
        assert set(step.batch.non_tensor_batch["max_global_steps"]) == {k}
        assert step.batch.meta_info["fully_async/partial/total_partial_num"] == 0
        got, want = _by_response(step.batch), _by_response(_synchronous_rows(cfg, sim, prompts))
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[key] for key in want], list(want.values()), rtol=1e-6)
