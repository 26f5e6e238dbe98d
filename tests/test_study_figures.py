"""The report's figures (studies/figures.py) read back from the matplotlib objects: units on
the y axis, the seeds' spread drawn and counted, legends outside the axes, swept values drawn as
categories (points with bars at their own ticks, no line through values nobody ran)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from megatron_ba.studies import figures as study_figures

ACC = ("held-out Acc@4 (4 samples per prompt; heldout: 64 prompts)", "Acc@4 (fraction correct)")


def _records(offset: float) -> list[dict]:
    rows = [{"step": 0, "eval_accuracy": 0.3 + offset}]
    for step in range(1, 5):
        rows.append({"step": step, "pg_loss": offset * step, "length_var": 10.0 + offset,
                     "length_gap_pos_minus_neg": -offset, "reward_mean": 0.5 + offset})  # fmt: skip
    return [*rows, {"step": 4, "eval_accuracy": 0.5 + offset}]


@pytest.fixture
def curves():
    cells = {"loss.rule=token": [_records(o) for o in (0.0, 0.1, 0.3)],
             "loss.rule=balanced": [_records(o) for o in (0.05, 0.2)]}  # fmt: skip
    yield study_figures.curve_figures(cells, ACC)
    plt.close("all")


def _legend_is_outside(fig) -> bool:
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent()
    return legend.x0 >= ax.get_window_extent().x1


def test_curves_carry_units_the_seed_band_and_n(curves):
    assert sorted(curves) == sorted(name for _, name, _, _ in study_figures.CURVES)
    for name, fig in curves.items():
        (ax,) = fig.axes
        assert "(" in ax.get_ylabel() and ax.get_ylabel().endswith(")"), name  # a unit
        labels = ax.get_legend_handles_labels()[1]
        assert labels == ["loss.rule=token (n=3)", "loss.rule=balanced (n=2)"], name
        assert len(ax.collections) == 2, name  # one band per cell
        assert "band: lowest to highest seed" in ax.get_title(), name
        assert _legend_is_outside(fig), name
    (ax,) = curves["eval_accuracy.png"].axes
    assert ax.get_title().startswith(ACC[0]) and ax.get_ylabel() == ACC[1]
    # the token band spans its seeds at the last evaluation: 0.5 .. 0.8
    band = ax.collections[0].get_paths()[0].vertices
    at_last = sorted({round(y, 9) for x, y in band if x == 4})
    assert at_last == [0.5, 0.8]


def test_one_seed_says_there_is_no_spread():
    figs = study_figures.curve_figures({"all": [_records(0.0)]}, ACC)
    (ax,) = figs["reward.png"].axes
    assert "one seed: no spread" in ax.get_title() and not ax.collections


def test_a_swept_key_is_drawn_as_categories_with_the_runs_range():
    points = {
        rule: {4: {n: [1.0 + b, 2.0 + b, 6.0 + b] for n, _ in study_figures.DIAGNOSTICS},
               8: {n: [10.0 + b, 14.0 + b] for n, _ in study_figures.DIAGNOSTICS}}
        for rule, b in (("token", 0.0), ("balanced", 0.5))
    }  # fmt: skip
    figs = study_figures.against_key_figures(points, "data.max_terms")
    assert sorted(figs) == sorted(f"{n}_vs_max_terms.png" for n, _ in study_figures.DIAGNOSTICS)
    fig = figs["length_var_vs_max_terms.png"]
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "8"]
    assert list(ax.get_xticks()) == [0, 1]  # categories: no 4.5, 5.0, ... ticks
    assert ax.get_ylabel() == "length variance (tokens²)"
    assert "data.max_terms" in ax.get_xlabel()
    assert ax.get_legend_handles_labels()[1] == ["balanced (n=2/3)", "token (n=2/3)"]
    for line in ax.lines:  # markers and caps only: nothing joins the points
        assert line.get_linestyle() == "None"
    token = ax.containers[1]  # (data line, caps, bars) of the second rule, sorted
    xs, ys = token.lines[0].get_data()
    assert list(ys) == pytest.approx([3.0, 12.0])  # the means
    assert list(xs) == pytest.approx([0.15, 1.15])  # beside its tick, balanced on the other side
    (bars,) = token.lines[2]
    low_high = [sorted(seg[:, 1]) for seg in bars.get_segments()]
    assert low_high == [pytest.approx([1.0, 6.0]), pytest.approx([10.0, 14.0])]  # lowest-highest
    assert _legend_is_outside(fig)
