"""verl's custom reward function: this project's rewards, the local trainer's, chosen by each
row's `data_source`.

`megatron-ba train RECIPE backend=verl` points verl at this file
(`reward.custom_reward_function.path`, `name=compute_score`, `reward_kwargs.timeout_s` from the
recipe's `reward.timeout_s`); verl's reward manager (naive) decodes each response and calls

    compute_score(data_source=..., solution_str=response, ground_truth=..., extra_info=..., **kw)

A math row (data_source `math_dapo`, DAPO-Math-17k's release, or a math benchmark's name:
math500, aime24, aime25, olympiad, minerva) is scored by megatron_ba.rewards' math judgement
(1.0 / 0.0: the last "Answer:" line or box, math-verify then normalised strings; 0 false
positives and 0 false negatives on 3,820 real pairs, docs/data-and-rewards.md) in worker
processes under a hard wall-clock limit per answer (`timeout_s`). A LiveCodeBench row
(data_source `livecodebench`) is scored by the sandboxed code reward, as `megatron-ba eval` and
the local trainer's evaluation score it: 1.0 when the response's last fenced code block passes
every test of the row, each under the code reward's own per-test limit (6 s). Its ground truth
is the JSON text of the tests in LiveCodeBench's form, [{"input", "output", "testtype"}, ...];
functional tests name their function in `extra_info.func_name` (or, as rllm writes them, in the
first test's `metadata.func_name`). Any other data_source is an error naming it: no row is given
a score by a judge that was not made for it. A failure of the scoring machinery raises
(MathRewardError, a sandbox error), never a silent default. verl loads this file by path, so it
imports only the rewards package and the recipe's benchmark names.
"""

from __future__ import annotations

import atexit
import json
import threading

from megatron_ba.recipe import BENCHMARK_NAMES
from megatron_ba.rewards.code import code_score
from megatron_ba.rewards.math_pool import MathRewardPool

# data_source -> judge. The training file's rows are DAPO-Math-17k's (math_dapo); a benchmark
# file DIR/NAME.parquet carries its benchmark's name.
CODE_SOURCES = ("livecodebench",)
MATH_SOURCES = ("math_dapo", *(n for n in BENCHMARK_NAMES if n not in CODE_SOURCES))

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
    """{"score", "acc"}: 1.0 if the response is right by the judge of its `data_source`, else
    0.0 (ValueError naming a data_source that has none)."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str: must be the decoded response, got {type(solution_str)}")
    if isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"reward_kwargs.timeout_s: must be > 0 seconds, got {timeout_s!r}")
    if data_source in MATH_SOURCES:
        score = _pool(float(timeout_s)).score([solution_str], [str(ground_truth)]).scores[0]
    elif data_source in CODE_SOURCES:
        tests, func_name = _code_tests(ground_truth, extra_info)
        score = code_score(solution_str, tests, func_name=func_name)
    else:
        raise ValueError(
            f"data_source {data_source!r}: this project's verl reward scores math rows "
            f"(data_source {', '.join(MATH_SOURCES)}) with the math reward and LiveCodeBench rows "
            f"({', '.join(CODE_SOURCES)}) with the sandboxed code reward, and no other rows; "
            f"set the file's data_source to the benchmark's name"
        )
    return {"score": score, "acc": score}


def _code_tests(ground_truth, extra_info: dict | None) -> tuple[list[dict], str | None]:
    """A LiveCodeBench row's tests and the function its functional tests call."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(tests, list) or not tests or not all(isinstance(t, dict) for t in tests):
        raise ValueError(
            "reward_model.ground_truth: a livecodebench row's ground truth must be the JSON text "
            f'of its tests, [{{"input", "output", "testtype"}}, ...], got {ground_truth!r:.80}'
        )
    func_name = (extra_info or {}).get("func_name") or (tests[0].get("metadata") or {}).get(
        "func_name"
    )
    if tests[0].get("testtype") == "functional" and not func_name:
        raise ValueError(
            "extra_info.func_name: a livecodebench row with functional tests must name the "
            "function they call (extra_info.func_name, or the first test's metadata.func_name)"
        )
    return tests, func_name
