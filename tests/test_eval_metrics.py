"""Acc@k / Best@k on hand-made correctness matrices, the report JSON and the paper table."""

from dataclasses import asdict

import pytest

from megatron_ba.evaluation import (
    BenchmarkResult,
    EvalReport,
    acc_at_k,
    average,
    best_at_k,
    markdown_table,
)


def test_hand_computed_matrices():
    m = [
        [1, 0, 0, 1],  # 2 of 4
        [0, 0, 0, 0],  # none
        [1, 1, 1, 1],  # all
    ]
    assert acc_at_k(m) == 6 / 12
    assert best_at_k(m) == 2 / 3
    assert acc_at_k([[True] * 8]) == 1.0 and best_at_k([[False] * 8]) == 0.0
    one_lucky = [[False] * 7 + [True]] * 4
    assert acc_at_k(one_lucky) == 1 / 8 and best_at_k(one_lucky) == 1.0
    # negative control: Acc@k is not the share of problems solved, Best@k is not the mean
    assert acc_at_k(m) != best_at_k(m)
    assert average([0.5, 0.25, 0.0]) == 0.25


def test_malformed_matrices_are_rejected():
    with pytest.raises(ValueError, match="at least one problem"):
        acc_at_k([])
    with pytest.raises(ValueError, match=r"correct\[1\] has 3 samples"):
        best_at_k([[1, 0], [1, 0, 1]])
    with pytest.raises(ValueError, match=r"correct\[0\]\[1\] must be a bool or 0/1"):
        acc_at_k([[1, 0.5]])
    with pytest.raises(ValueError, match="no benchmarks"):
        average([])


def _report(label, acc_best):
    results = {
        name: BenchmarkResult(name, title, 10, 8, acc, best, [0] * 10)
        for (name, title), (acc, best) in zip(
            [("math500", "MATH-500"), ("aime24", "AIME24")], acc_best, strict=True
        )
    }
    return EvalReport(label, 8, results)


def test_table_and_json_in_the_papers_layout():
    a = _report("balanced", [(0.5, 0.75), (0.125, 0.25)])
    b = _report("token", [(0.25, 0.5), (0.0, 0.0)])
    assert a.acc == 0.3125 and a.best == 0.5
    assert markdown_table([a, b]) == (
        "| Run | Metric | MATH-500 | AIME24 | Avg. |\n"
        "|---|---|---:|---:|---:|\n"
        "| balanced | Acc@8 | 0.5000 | 0.1250 | 0.3125 |\n"
        "| balanced | Best@8 | 0.7500 | 0.2500 | 0.5000 |\n"
        "| token | Acc@8 | 0.2500 | 0.0000 | 0.1250 |\n"
        "| token | Best@8 | 0.5000 | 0.0000 | 0.2500 |\n"
    )
    data = a.to_json()
    assert data["average"] == {"acc@8": 0.3125, "best@8": 0.5}
    assert data["benchmarks"]["aime24"]["best"] == 0.25
    assert data["benchmarks"]["math500"] == asdict(a.benchmarks["math500"])
    c = EvalReport("x", 8, {"math500": a.benchmarks["math500"]})
    with pytest.raises(ValueError, match="covers"):
        markdown_table([a, c])
