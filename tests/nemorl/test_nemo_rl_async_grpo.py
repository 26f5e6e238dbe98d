"""BalancedPGLossFn in NeMo-RL's own async GRPO (`async_grpo_train`, grpo.async_grpo.enabled).

`async_grpo_train` runs as it is, with NeMo-RL's real ReplayBuffer (a Ray actor on the local Ray),
its test fixture `mock_grpo_components` (mocked generation, environment, logger), BalancedPGLossFn
installed by `balanced_setup`, and a policy whose `train` is NeMo-RL's training step on a small
model (worker_loop.py): two optimizer steps per batch (train_global_batch_size = half of it), an
SGD update after each. What stands in for the trajectory collector (a Ray actor generating in the
background): on each weight version it generates the prompt groups a schedule gives it with the
policy's weights of that moment, through the mocked rollout, and adds them to the replay buffer
with their generation and target versions, one entry per prompt, as its prompt-group workers do.

- Mixed versions (max_trajectory_age_steps 1): version 0 generates step 0's 4 groups and one of
  step 1's, version 1 the other 3 (the collector's gap filling), so step 1's batch, and its first
  optimizer step, mix two policy versions. NeMo-RL's batch holds whole groups in contiguous blocks;
  each optimizer step's loss and gradient equal the float64 reference (reference.py) of the rows
  it trained: BA's plan of its whole groups, NeMo-RL's importance weights (async GRPO requires the
  correction) and KL term. Controls: the token rule's weights, and one plan over the whole batch,
  do not.
- Staleness 0: each version generates only its own step's groups (NeMo-RL's smallest age window is
  1: an age of 0 sizes its replay buffer 0, which the entry script refuses by name). Every step's
  train data, loss and gradients equal synchronous `grpo_train`'s exactly.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

pytest.importorskip(
    "nemo_rl.algorithms.loss", reason="NeMo-RL is not installed: bash scripts/run_nemorl_tests.sh"
)

import ray
import torch
from nemo_rl.algorithms.grpo import _default_grpo_save_state, async_grpo_train, grpo_train
from nemo_rl.algorithms.loss import ClippedPGLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from reference import importance_weights, plan_weights, reference_loss
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (NeMo-RL's own fixture)
    _mock_policy_generation,
    mock_grpo_components,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from worker_loop import TokenModel, logprobs, policy_config, policy_train

from megatron_ba.integrations.nemo_rl import BalancedPGLossFn
from megatron_ba.integrations.nemo_rl.run_grpo_balanced import (
    SETUP_LOSS_FN,
    SETUP_MASTER_CONFIG,
    SETUP_POLICY,
    balanced_setup,
    check_master_config,
)

G, PROMPTS, VOCAB, STEP, LR = 4, 4, 17, 8, 2.0  # STEP: train_global_batch_size
# Per response of prompts 0..7 (prompt-major): k = 1, 3, 0 (no weight), 2 | 1, 2, 3, 2.
REWARDS = [1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0,
           0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1]  # fmt: skip
LENGTHS = [3, 6, 2, 5, 4, 1, 7, 2, 3, 3, 5, 2, 2, 7, 6, 1,
           5, 2, 6, 3, 1, 4, 7, 5, 6, 2, 3, 7, 4, 6, 1, 3]  # fmt: skip
LOSS = {"reference_policy_kl_penalty": 0.05, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28,
        "ratio_clip_c": 3.0, "use_importance_sampling_correction": True}  # fmt: skip
# weight version -> [(target step, prompts)] its collector generates when that version is set
SCHEDULES = {
    "mixed": {0: [(0, [0, 1, 2, 3]), (1, [4])], 1: [(1, [5, 6, 7])]},
    "fresh": {0: [(0, [0, 1, 2, 3])], 1: [(1, [4, 5, 6, 7])]},
}


def _prompt_ids(i: int) -> torch.Tensor:
    return torch.tensor([1 + i, 5, 9][: 2 + i % 2])


def _prompts(indices) -> BatchedDataDict:
    n = len(indices)
    return BatchedDataDict({
        "message_log": [[{"role": "user", "content": f"q{i}", "token_ids": _prompt_ids(i)}]
                        for i in indices],
        "task_name": ["math"] * n,
        "extra_env_info": [{} for _ in range(n)],
        "loss_multiplier": torch.ones(n),
        "idx": torch.tensor(list(indices)),
        "length": torch.tensor([len(_prompt_ids(i)) for i in indices]),
        "total_reward": torch.zeros(n),
    })  # fmt: skip


def _rollout(model):
    """Stands in for NeMo-RL's (async) multi-turn rollout: one reply per row, sampled by `model`
    as it is when called (its log-probs become generation_logprobs), fixed rewards. A row's reply
    depends on its prompt and its place in the group alone, so a group gets the same replies
    alone (the async collector) or in a batch (grpo_train)."""

    def rollout(*, input_batch, **kwargs):
        logs, rewards = [], []
        for row, log in enumerate(input_batch["message_log"]):
            key = int(input_batch["idx"][row]) * G + row % G
            n = LENGTHS[key]
            tokens = torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(key))
            lp = logprobs(model, torch.cat([log[0]["token_ids"], tokens])[None])[0, -n:]
            reply = {"role": "assistant", "content": "a", "token_ids": tokens,
                     "generation_logprobs": lp}  # fmt: skip
            logs.append([*log, reply])
            rewards.append(float(REWARDS[key]))
        out = BatchedDataDict(dict(input_batch))
        out["message_log"], out["total_reward"] = logs, torch.tensor(rewards)
        return out, {"mean_gen_tokens_per_sample": 4.0}

    return rollout


class _Actor:
    """A local object called as a Ray actor handle: `handle.method.remote(...)` runs the method
    here and returns an ObjectRef of its result (methods it lacks do nothing)."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name, lambda *a, **k: None)
        return SimpleNamespace(remote=lambda *a, **k: ray.put(method(*a, **k)))


class _Collector:
    """The trajectory collector's stand-in: on each weight version, the schedule's prompt groups
    generated by the weights of that moment (its prompt-group workers: one prompt's row repeated
    num_generations_per_prompt times, rolled out, added as one entry with both versions)."""

    def __init__(self, schedule, rollout, replay_buffer):
        self.schedule, self.rollout, self.buffer = schedule, rollout, replay_buffer

    def set_weight_version(self, version: int) -> None:
        for target, prompts in self.schedule.get(version, ()):
            for i in prompts:
                batch, metrics = self.rollout(input_batch=_prompts([i]).repeat_interleave(G))
                entry = {"batch": batch, "rollout_metrics": metrics, "timestamp": 0.0}
                assert ray.get(self.buffer.add.remote(entry, version, target)) == "success"


def _collector_class(schedule, rollout):
    """What `AsyncTrajectoryCollector.options(...).remote(..., replay_buffer=...)` returns."""
    cls = MagicMock()
    cls.options.return_value.remote.side_effect = lambda **kw: _Actor(
        _Collector(schedule, rollout, kw["replay_buffer"])
    )
    return cls


def _configure(master, *, async_enabled: bool):
    """The fixture's MasterConfig for 2 steps of 4 prompts x 4 responses, 2 optimizer steps each."""
    master.grpo.update(num_prompts_per_step=PROMPTS, num_generations_per_prompt=G)
    master.grpo.update(max_num_steps=2, max_num_epochs=1, val_period=0, val_at_start=False)
    master.grpo["async_grpo"] = {"enabled": async_enabled, "max_trajectory_age_steps": 1}
    master.policy.update(policy_config("plain"), train_global_batch_size=STEP)
    # async GRPO needs non-colocated generation (its assert); the training math ignores it
    master.policy["generation"]["colocated"] = {"enabled": False}
    master.loss_fn = ClippedPGLossConfig(**LOSS, ba_rule="balanced")
    assert check_master_config(master) == {"group_size": G, "step_size": STEP}


def _install(c, model, seen: list, records: list) -> tuple:
    """The fixture's policy with NeMo-RL's training step on `model` as its `train` (recording what
    it trains), BalancedPGLossFn installed by balanced_setup: setup's result."""
    master, policy = c["master_config"], c["policy"]
    reference = TokenModel(VOCAB, seed=1)
    policy.get_logprobs.side_effect = lambda d, **k: {"logprobs": logprobs(model, d["input_ids"])}
    policy.get_reference_policy_logprobs.side_effect = lambda d, **k: {
        "reference_logprobs": logprobs(reference, d["input_ids"])
    }

    def train(data, loss_fn, *args, **kwargs):  # the workers' steps, on this process
        seen.append(data)
        return policy_train(model, data, loss_fn, master.policy, LR, steps=data.size // STEP,
                            record=records)  # fmt: skip

    policy.train = train
    result = [None] * 13
    result[SETUP_POLICY], result[SETUP_LOSS_FN] = policy, c["loss_fn"]
    result[SETUP_MASTER_CONFIG] = master
    installed = balanced_setup(lambda master_config, *a, **k: tuple(result))(master, None, None)
    assert isinstance(installed[SETUP_LOSS_FN], BalancedPGLossFn)
    return installed


def _run(c, monkeypatch, schedule=None) -> dict:
    """Two GRPO steps, async (with `schedule`) or synchronous (None), from the same initial
    weights: each step's train data (plan attached), each optimizer step's record, the metrics
    logged under `train`."""
    master = c["master_config"]
    _configure(master, async_enabled=schedule is not None)
    model, seen, records = TokenModel(VOCAB), [], []
    installed = _install(c, model, seen, records)
    loader = MagicMock(spec=StatefulDataLoader)
    loader.__iter__ = lambda self: iter([_prompts(range(4)), _prompts(range(4, 8))])
    loader.__len__ = MagicMock(return_value=2)
    rollout = _rollout(model)
    grpo = "nemo_rl.algorithms.grpo"
    for name in ("run_multi_turn_rollout", "run_async_multi_turn_rollout"):
        monkeypatch.setattr(f"{grpo}.{name}", rollout)
    monkeypatch.setattr(f"{grpo}.refit_policy_generation", lambda *a, **k: None)
    monkeypatch.setattr(f"{grpo}.print_performance_metrics", lambda *a, **k: {})
    c["checkpointer"].get_latest_checkpoint_path.return_value = None
    c["logger"].reset_mock()
    args = (installed[SETUP_POLICY], _mock_policy_generation(), loader, c["val_dataloader"],
            c["tokenizer"], installed[SETUP_LOSS_FN], c["task_to_env"], c["val_task_to_env"],
            c["logger"], c["checkpointer"], _default_grpo_save_state(), master)  # fmt: skip
    if schedule is None:
        grpo_train(*args)
    else:
        # NeMo-RL's real ReplayBuffer actor, in this environment's Python (its registry names
        # NeMo-RL's vLLM environment, built with uv).
        monkeypatch.setattr(f"{grpo}.get_actor_python_env", lambda _: sys.executable)
        monkeypatch.setattr("nemo_rl.algorithms.async_utils.AsyncTrajectoryCollector",
                            _collector_class(schedule, rollout))  # fmt: skip
        async_grpo_train(*args, max_trajectory_age_steps=1)
    logged = [m.args[0] for m in c["logger"].log_metrics.call_args_list
              if m.kwargs.get("prefix") == "train" and "loss" in m.args[0]]  # fmt: skip
    # async_grpo_train prints an error in its loop and returns: count what trained
    assert (len(seen), len(records), len(logged)) == (2, 4, 2), (len(seen), len(records))
    return {"data": seen, "records": records, "logged": logged}


def _mask(data) -> torch.Tensor:
    return (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).double()


def _weights(data, rule: str) -> torch.Tensor:
    """reference.py's plan of `rule` for the rows of `data`: GRPO's blocks of G responses, each
    response's advantage read at its first loss token."""
    mask = _mask(data)
    first = mask.argmax(dim=1)
    adv = data["advantages"][:, 1:].double()[torch.arange(data.size), first]
    return plan_weights(rule, mask.sum(1), adv, G)


def _reference(params: torch.Tensor, data, weights: torch.Tensor):
    """Loss and gradient of one optimizer step's rows, float64, from the weights it started with:
    NeMo-RL's plain importance weights on each token's term, dual clip 3, KL 0.05."""
    model = TokenModel(VOCAB, dtype=torch.float64)
    with torch.no_grad():
        model.table.copy_(params.double())
    ids = data["input_ids"]
    logp = torch.log_softmax(model(ids[:, :-1]), -1).gather(-1, ids[:, 1:, None])[..., 0]
    data64 = {k: data[k].double() for k in ("token_mask", "sample_mask", "advantages",
              "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")}  # fmt: skip
    c = importance_weights(data64, None, None, None)
    loss = reference_loss(logp, data64, weights, dual_clip=3.0, kl=0.05, is_weights=c)
    (grad,) = torch.autograd.grad(loss, model.table)
    return loss.detach(), grad


def _relative_errors(record, want) -> tuple[float, float]:
    loss, grad = want
    dl = abs(float(record["loss"]) - float(loss)) / abs(float(loss))
    dg = float((record["grads"][0].double() - grad).norm() / grad.norm())
    return dl, dg


def _step_of(record) -> int:
    return record["rows"].start // STEP


def _check_groups(data, prompts, *, stale) -> None:
    """`data` is whole groups in contiguous blocks of G, of these prompts in order; the blocks
    whose prompts are in `stale` were generated by an older version (their generation log-probs
    differ from the trained policy's), the others by the trained one."""
    mask = data["token_mask"][:, 1:].bool()
    for b, i in enumerate(prompts):
        rows = slice(b * G, (b + 1) * G)
        p = _prompt_ids(i)
        assert torch.equal(data["input_ids"][rows, : len(p)], p.expand(G, -1)), (b, i)
        gap = (data["generation_logprobs"] - data["prev_logprobs"])[rows, 1:][mask[rows]].abs()
        assert (gap.max() > 1e-3) if i in stale else (gap.max() < 1e-5), (i, float(gap.max()))


def test_async_steps_mixing_policy_versions_equal_the_float64_reference(
    mock_grpo_components,  # noqa: F811  (NeMo-RL's fixture, imported above)
    gloo_world,
    local_ray,
    monkeypatch,
):
    run = _run(mock_grpo_components, monkeypatch, SCHEDULES["mixed"])
    data = run["data"]
    _check_groups(data[0], [0, 1, 2, 3], stale=[])
    _check_groups(data[1], [4, 5, 6, 7], stale=[4])  # one version-0 group, three version-1
    assert [m["avg_trajectory_age"] for m in run["logged"]] == [0.0, 0.25]
    for t, record in enumerate(run["records"]):
        step_data = data[t // 2]
        rows = record["rows"]
        chunk = step_data.slice(rows.start, rows.stop)
        torch.testing.assert_close(chunk["ba_weights"], _weights(chunk, "balanced"),
                                   rtol=1e-12, atol=0)  # fmt: skip
        dl, dg = _relative_errors(record, _reference(record["params"][0], chunk,
                                                     _weights(chunk, "balanced")))  # fmt: skip
        assert dl <= 1e-5 and dg <= 1e-5, (t, dl, dg)
        # controls: the token rule's weights; one plan over the whole batch (its 4 groups)
        for control in (_weights(chunk, "token"), _weights(step_data, "balanced")[rows]):
            dl, dg = _relative_errors(record, _reference(record["params"][0], chunk, control))
            assert max(dl, dg) > 1e-3, (t, dl, dg)
    moved = run["records"][2]["params"][0] - run["records"][0]["params"][0]
    assert float(moved.abs().max()) > 1e-2  # version 1 is not version 0


def test_async_at_staleness_zero_is_synchronous_grpo_exactly(
    mock_grpo_components,  # noqa: F811
    gloo_world,
    local_ray,
    monkeypatch,
):
    fresh = _run(mock_grpo_components, monkeypatch, SCHEDULES["fresh"])
    sync = _run(mock_grpo_components, monkeypatch)
    assert [m["avg_trajectory_age"] for m in fresh["logged"]] == [0.0, 0.0]
    for a, s in zip(fresh["data"], sync["data"], strict=True):
        assert set(a) == set(s)
        for key in s:
            assert torch.equal(a[key], s[key]), key
    for a, s in zip(fresh["records"], sync["records"], strict=True):
        assert a["rows"] == s["rows"]
        assert torch.equal(a["params"][0], s["params"][0])
        assert torch.equal(a["loss"], s["loss"]) and torch.equal(a["grads"][0], s["grads"][0])


def test_entry_checks_async_grpo_keys(mock_grpo_components):  # noqa: F811
    """The entry's check of async GRPO: accepted at any age >= 1, with the data plane on too (in
    NeMo-RL v0.7.0 async_grpo_train never uses it); an age of 0 refused by name (NeMo-RL's
    replay buffer would be sized 0: its own error, shown here, comes from inside its actor)."""
    from nemo_rl.algorithms.async_utils.replay_buffer import ReplayBufferImpl

    master = mock_grpo_components["master_config"]
    _configure(master, async_enabled=True)
    master.grpo["async_grpo"]["max_trajectory_age_steps"] = 3
    master.data_plane = {"enabled": True}
    assert check_master_config(master) == {"group_size": G, "step_size": STEP}
    for age in (0, -1, 1.5, None):
        master.grpo["async_grpo"]["max_trajectory_age_steps"] = age
        with pytest.raises(ValueError, match=r"^grpo\.async_grpo\.max_trajectory_age_steps: must"):
            check_master_config(master)
    with pytest.raises(ValueError, match="max_size must be positive"):
        ReplayBufferImpl(max_size=PROMPTS * 0 * 2)
    master.grpo["async_grpo"] = {"enabled": False, "max_trajectory_age_steps": 1}
    with pytest.raises(ValueError, match=r"^data_plane\.enabled: must be false"):
        check_master_config(master)
    master.data_plane = None
    master.policy["train_global_batch_size"] = 6  # a group cut across optimizer steps
    master.grpo["async_grpo"]["enabled"] = True
    with pytest.raises(ValueError, match=r"^policy\.train_global_batch_size: must be whole"):
        check_master_config(master)
