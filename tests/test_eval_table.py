"""The paper's peak -> last table of a run (summary.json; tests/test_study_report.py has its spread
over seeds)."""

from __future__ import annotations

from megatron_ba.train.run_log import eval_table, summarize


def _eval(step, a_acc, a_best, b_acc, b_best):
    return {
        "step": step,
        "eval_accuracy": (a_acc + b_acc) / 2,
        "eval_best_at_k": (a_best + b_best) / 2,
        "eval/math500/acc": a_acc,
        "eval/math500/best": a_best,
        "eval/aime24/acc": b_acc,
        "eval/aime24/best": b_best,
    }


RUN = [
    _eval(0, 0.25, 0.5, 0.0, 0.0),
    {"step": 1, "pg_loss": 0.1},
    _eval(2, 0.5, 0.75, 0.25, 0.5),  # mean 0.375: the peak
    {"step": 3, "pg_loss": -0.1},
    _eval(4, 0.5, 1.0, 0.0, 0.5),  # mean 0.25: the last
]


def test_peak_is_the_best_mean_and_each_benchmark_is_read_there():
    t = eval_table(RUN)
    assert (t["peak_step"], t["last_step"]) == (2, 4)
    assert t["benchmarks"]["math500"] == {
        "acc_peak": 0.5,
        "acc_last": 0.5,
        "best_peak": 0.75,
        "best_last": 1.0,
    }
    assert t["benchmarks"]["aime24"] == {
        "acc_peak": 0.25,
        "acc_last": 0.0,
        "best_peak": 0.5,
        "best_last": 0.5,
    }
    assert t["average"] == {
        "acc_peak": 0.375,
        "acc_last": 0.25,
        "best_peak": 0.625,
        "best_last": 0.75,
    }
    assert summarize(RUN)["eval_table"] == t
    # Ties go to the earliest evaluation; no evaluation at all gives no table.
    tied = [*RUN[:3], _eval(6, 0.5, 0.75, 0.25, 0.5)]
    assert eval_table(tied)["peak_step"] == 2
    assert eval_table([{"step": 1, "pg_loss": 0.0}]) == {}
