"""Multi-output agent sessions in verl's v1 trainer: the balanced rules group them as `grpo` does.

Runs inside .venv-verl (`bash scripts/run_verl_tests.sh`); in the main venv it skips. The batch
goes through verl 0.9.1's own `compute_advantage_for_multi_trajectories`, looked up where its
trainer looks it up (verl.trainer.ppo.v1.trainer_base), with the integration loaded first as
VERL_USE_EXTERNAL_MODULES loads it. Sessions have 1 to 3 outputs; verl copies a session's final
reward to its other outputs, as its agent loop does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip(
    "verl",
    reason="verl 0.9.1 lives in .venv-verl (bash scripts/run_verl_tests.sh), not in .venv",
)
import megatron_ba.integrations.verl  # before verl's trainer, as in a run
from megatron_ba.advantages import group_advantages
from megatron_ba.aggregation import sequence_weights

trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402

T = 8


def _batch(outputs_per_session, seed=0, prompts=2, sessions=4):
    """DataProto + keys: `prompts` prompts x `sessions` sessions, session s of prompt p having
    outputs_per_session[(p * sessions + s) % len] outputs; one 0/1 reward per session."""
    g = torch.Generator().manual_seed(seed)
    keys, uids, lengths, rewards = [], [], [], []
    for p in range(prompts):
        for s in range(sessions):
            reward = float(torch.randint(0, 2, (1,), generator=g))
            if s == 0:
                reward = 1.0 - float(p % 2)  # no group all-equal by chance: s 0 and 1 differ
            if s == 1:
                reward = float(p % 2)
            for i in range(outputs_per_session[(p * sessions + s) % len(outputs_per_session)]):
                keys.append(f"prompt_{p}_{s}_{i}")
                uids.append(f"prompt_{p}")
                lengths.append(int(torch.randint(1, T + 1, (1,), generator=g)))
                rewards.append(reward)
    n = len(keys)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()
    token_rewards = torch.zeros(n, T)
    token_rewards[torch.arange(n), torch.tensor(lengths) - 1] = torch.tensor(rewards)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": token_rewards, "response_mask": mask},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    return data, keys


def _advantages(data, keys, estimator):
    out = trainer_base.compute_advantage_for_multi_trajectories(
        data=data,
        batch_keys=keys,
        adv_estimator=estimator,
        config={"norm_adv_by_std_in_grpo": True},
    )
    return out.batch["advantages"].to(torch.float64)


def _session_layout(keys):
    heads = [k.rpartition("_")[0] for k in keys]
    names = list(dict.fromkeys(heads))
    return torch.tensor([names.index(h) for h in heads]), names


@pytest.mark.parametrize("rule", ["balanced", "balanced_mass", "group_token_mean"])
def test_sessions_are_one_member_each_as_in_grpo(rule):
    data, keys = _batch([1, 3, 2])
    mask = data.batch["response_mask"].to(torch.float64)
    ours = _advantages(data, keys, rule)
    grpo = _advantages(data, keys, AdvantageEstimator.GRPO)  # verl's own session grouping
    sid, names = _session_layout(keys)

    # every output of a session carries one value, on its loss tokens
    per_row = ours.sum(-1) / mask.sum(-1)
    torch.testing.assert_close(ours, per_row[:, None] * mask, rtol=0, atol=1e-7)
    assert all(len(set(per_row[sid == s].tolist())) == 1 for s in range(len(names)))

    # the core on sessions: grpo's per-session advantage, the session's whole length
    first = torch.tensor([int((sid == s).nonzero()[0]) for s in range(len(names))])
    a_grpo = (grpo.sum(-1) / mask.sum(-1))[first]
    groups = torch.tensor([int(n.split("_")[1]) for n in names])
    rewards = data.batch["token_level_rewards"].to(torch.float64).sum(-1)[first]
    a = group_advantages(rewards, groups, std="sample", eps=1e-6).advantages
    torch.testing.assert_close(a, a_grpo, rtol=1e-6, atol=1e-6)
    lengths = torch.zeros(len(names), dtype=torch.float64).index_add_(0, sid, mask.sum(-1))
    w = sequence_weights(rule, lengths, a, groups)
    torch.testing.assert_close(per_row, (w * a)[sid], rtol=1e-6, atol=1e-9)

    # negative control: the same rows without their sessions (what verl hands every estimator
    # but grpo) are planned as separate members, and differ
    rows, _ = megatron_ba.integrations.verl.balanced_advantages(
        data.batch["token_level_rewards"], data.batch["response_mask"],
        index=data.non_tensor_batch["uid"], rule=rule,
    )  # fmt: skip
    assert float((rows.to(torch.float64) - ours).abs().max()) > 1e-4


def test_single_output_sessions_equal_the_estimator_on_rows():
    data, keys = _batch([1])
    ours = _advantages(data, keys, "balanced")
    rows, _ = megatron_ba.integrations.verl.balanced_advantages(
        data.batch["token_level_rewards"], data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
    )  # fmt: skip
    torch.testing.assert_close(ours, rows.to(torch.float64), rtol=1e-6, atol=1e-9)


def test_other_estimators_reach_verls_function_unchanged():
    wrapped = trainer_base.compute_advantage_for_multi_trajectories
    assert wrapped.megatron_ba_sessions and wrapped.__wrapped__.__module__.endswith("v1.utils")
    data, keys = _batch([1, 3, 2], seed=1)
    theirs = wrapped.__wrapped__(data=data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO)
    data, keys = _batch([1, 3, 2], seed=1)
    ours = wrapped(data=data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO)
    assert torch.equal(theirs.batch["advantages"], ours.batch["advantages"])
    megatron_ba.integrations.verl.install_sessions()  # idempotent: not wrapped twice
    assert trainer_base.compute_advantage_for_multi_trajectories is wrapped


def test_malformed_session_keys_are_refused():
    data, keys = _batch([2])
    with pytest.raises(ValueError, match=r"batch_keys: expected '\{uid\}_\{session\}_\{index\}'"):
        _advantages(data, [k.replace("_0", "_x") for k in keys], "balanced")
