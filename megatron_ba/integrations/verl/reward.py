"""verl's custom reward function: this project's verifiable math reward, the local trainer's.

`megatron-ba train RECIPE backend=verl` points verl at this file
(`reward.custom_reward_function.path`, `name=compute_score`, `reward_kwargs.timeout_s` from the
recipe's `reward.timeout_s`); verl's reward manager (naive) decodes each response and calls

    compute_score(data_source=..., solution_str=response, ground_truth=..., extra_info=..., **kw)

The score is megatron_ba.rewards' math judgement (1.0 / 0.0: the last "Answer:" line or box,
math-verify then normalised strings; 0 false positives and 0 false negatives on 3,820 real
pairs, docs/data-and-rewards.md) in worker processes under a hard wall-clock limit per answer,
never a hang and never a silent default: a failure of the scoring machinery raises
(MathRewardError). verl loads this file by path, so it imports only the rewards package.
"""

from __future__ import annotations

import atexit
import threading

from megatron_ba.rewards.math_pool import MathRewardPool

_POOLS: dict[float, MathRewardPool] = {}
_LOCK = threading.Lock()  # verl's reward loop calls from executor threads


def _pool(timeout_s: float) -> MathRewardPool:
    with _LOCK:
        if timeout_s not in _POOLS:
            _POOLS[timeout_s] = MathRewardPool(timeout_s=timeout_s)
            atexit.register(_POOLS[timeout_s].close)
        return _POOLS[timeout_s]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth,
    extra_info: dict | None = None,
    *,
    timeout_s: float = 5.0,
    **_: object,
) -> dict[str, float]:
    """{"score", "acc"}: 1.0 if the response's final answer equals `ground_truth`, else 0.0
    (`data_source` and `extra_info` are verl's bookkeeping; the math reward reads neither)."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str: must be the decoded response, got {type(solution_str)}")
    if isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"reward_kwargs.timeout_s: must be > 0 seconds, got {timeout_s!r}")
    score = _pool(float(timeout_s)).score([solution_str], [str(ground_truth)]).scores[0]
    return {"score": score, "acc": score}
