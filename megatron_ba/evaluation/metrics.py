"""Acc@k and Best@k from a correctness matrix (problems x samples), as the paper reports them.

Acc@k  = mean correctness over all k samples of all problems (the expected single-sample accuracy).
Best@k = share of problems with at least one correct sample among their k (the empirical value,
         not an unbiased pass@k estimate and not a bootstrap).
The average over benchmarks is unweighted (each benchmark counts once, as in the paper's tables).
"""

from __future__ import annotations


def _check(correct: list[list[bool]]) -> int:
    if not correct:
        raise ValueError("correct must hold at least one problem")
    k = len(correct[0])
    if k == 0:
        raise ValueError("correct: every problem needs at least one sample")
    for i, row in enumerate(correct):
        if len(row) != k:
            raise ValueError(f"correct[{i}] has {len(row)} samples, expected {k} like correct[0]")
        for j, x in enumerate(row):
            if x not in (0, 1):
                raise ValueError(f"correct[{i}][{j}] must be a bool or 0/1, got {x!r}")
    return k


def acc_at_k(correct: list[list[bool]]) -> float:
    """Mean correctness over every (problem, sample) pair."""
    k = _check(correct)
    return sum(sum(bool(x) for x in row) for row in correct) / (len(correct) * k)


def best_at_k(correct: list[list[bool]]) -> float:
    """Share of problems with at least one correct sample."""
    _check(correct)
    return sum(any(bool(x) for x in row) for row in correct) / len(correct)


def average(values: list[float]) -> float:
    """Unweighted mean across benchmarks."""
    if not values:
        raise ValueError("average of no benchmarks")
    return sum(values) / len(values)
