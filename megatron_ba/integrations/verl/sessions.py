"""Multi-output agent sessions in verl's v1 trainer, grouped as verl's `grpo` groups them.

An agent loop may return several outputs for one session (one sampled trajectory of a prompt).
verl 0.9.1's v1 trainer stores them under the keys `{uid}_{session}_{index}` and computes the
advantages with `compute_advantage_for_multi_trajectories` (verl/trainer/ppo/v1/utils.py, called
from trainer_base.py). For `grpo` a session is one group member: the statistics are taken over each
session's final output and every output of the session gets that advantage. Every other
estimator is handed the rows alone, grouped by `uid`: each output a member of its own, with its
own length, so a session of three outputs counts three times. No hook sees the keys but that
function, so this module wraps it for the balanced rules only (every other estimator, `grpo`
included, goes to verl's own code unchanged):

- `session_advantages`: one group member per session, with its final output's reward (verl
  copies it to the session's other outputs) and the session's whole length, the loss tokens of
  all its outputs (all of them carry the session's advantage in the loss); w_s A_s on every output
  of the session. With one output per session it equals the estimator on the rows.
- `install`: wraps the function in `verl.trainer.ppo.v1.trainer_base`, where the trainer looks it
  up: at once if that module is imported, else when it is (a finder on sys.meta_path, since
  VERL_USE_EXTERNAL_MODULES imports this package while `import verl` runs, before the trainer).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys

import numpy as np
import torch

from megatron_ba.integrations._common import sequence_lengths
from megatron_ba.integrations.verl.adapter import PLAN_RULES, folded_advantages, group_ids_from_uid

TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
FUNCTION = "compute_advantage_for_multi_trajectories"


def session_ids(batch_keys) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows] dense session id of each row, [sessions] row of each session's final output) from
    verl's `{uid}_{session}_{index}` keys."""
    sessions, final, last = {}, [], []
    ids = []
    for row, key in enumerate(batch_keys):
        head, sep, index = str(key).rpartition("_")
        if not sep or not index.isdigit():
            raise ValueError(f"batch_keys: expected '{{uid}}_{{session}}_{{index}}', got {key!r}")
        s = sessions.setdefault(head, len(sessions))
        if s == len(final):
            final.append(row)
            last.append(int(index))
        elif int(index) > last[s]:
            final[s], last[s] = row, int(index)
        ids.append(s)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(final, dtype=torch.long)


def session_advantages(data, batch_keys, rule: str, config=None):
    """`data` (verl's DataProto) with advantages = returns = w_s A_s of each row's session."""
    mask = data.batch["response_mask"]
    rewards = data.batch["token_level_rewards"]
    sid, final = session_ids(batch_keys)
    row_lengths = sequence_lengths(mask, name="response_mask")
    lengths = torch.zeros(len(final), dtype=torch.float64).index_add_(0, sid, row_lengths)
    scores = rewards[final].to(torch.float64).sum(dim=-1)
    uid = np.asarray(data.non_tensor_batch["uid"], dtype=object)[final.numpy()]
    folded = folded_advantages(rule, scores, lengths, group_ids_from_uid(uid), config)
    out = folded.to(rewards.dtype)[sid][:, None] * mask.to(rewards.dtype)
    data.batch["advantages"] = out
    data.batch["returns"] = out
    return data


def wrap(function):
    """`function` (verl's multi-trajectory advantage step) with the balanced rules grouped by
    session; other estimators reach `function` unchanged."""
    if getattr(function, "megatron_ba_sessions", False):
        return function
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        estimator = bound.arguments["adv_estimator"]
        rule = str(getattr(estimator, "value", estimator))
        if rule not in PLAN_RULES:
            return function(*args, **kwargs)
        a = bound.arguments
        return session_advantages(a["data"], a["batch_keys"], rule, a.get("config"))

    wrapped.megatron_ba_sessions = True
    return wrapped


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds TRAINER_MODULE with the path finder and wraps FUNCTION once the module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRAINER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            setattr(module, FUNCTION, wrap(getattr(module, FUNCTION)))

        spec.loader.exec_module = exec_and_wrap
        return spec


def install() -> None:
    """Wrap FUNCTION in TRAINER_MODULE now if it is imported, else when it is (idempotent)."""
    module = sys.modules.get(TRAINER_MODULE)
    if module is not None:
        setattr(module, FUNCTION, wrap(getattr(module, FUNCTION)))
    elif not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())
