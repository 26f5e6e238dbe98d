"""Verifiable rewards: math answers (math-verify, never hangs) and code (sandboxed tests).

    from megatron_ba.rewards import math_score, math_score_batch, code_score
    math_score("... Answer: 1/2", "\\frac{1}{2}")                 # 1.0
    math_score_batch(responses, ground_truths)                    # [1.0, 0.0, ...]
    code_score(response, [{"input": "1\\n", "output": "2\\n", "testtype": "stdin"}])

math-verify is imported only inside the scoring workers (a server process of their own, started
with subprocess: works from unguarded scripts, `python -` and REPLs); a failure of the
scoring machinery raises MathRewardError, never a 0.0; a sandbox whose runner never started
raises SandboxError, never a 0.0. The sandbox needs the stdlib alone.
"""

from megatron_ba.rewards.code import code_score, extract_code, run_tests
from megatron_ba.rewards.math_answer import extract_answer, judge_math, normalize_answer
from megatron_ba.rewards.math_pool import (
    MathRewardError,
    MathRewardPool,
    MathScores,
    default_pool,
    math_score,
    math_score_batch,
)
from megatron_ba.rewards.sandbox import SandboxError, SandboxLimits, SandboxRun, run_program

__all__ = [
    "MathRewardError",
    "MathRewardPool",
    "MathScores",
    "SandboxError",
    "SandboxLimits",
    "SandboxRun",
    "code_score",
    "default_pool",
    "extract_answer",
    "extract_code",
    "judge_math",
    "math_score",
    "math_score_batch",
    "normalize_answer",
    "run_program",
    "run_tests",
]
