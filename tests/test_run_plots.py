"""A run's plots (megatron_ba/train/plots.py) on a hand-written metrics.jsonl: each rule of the
module seen to act, and not to act on the input one property away."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from megatron_ba.train import plots


def _run(tmp_path, rows: list[dict]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _rows(**series) -> list[dict]:
    steps = len(next(iter(series.values())))
    return [{"step": s + 1, **{k.replace("__", "/"): v[s] for k, v in series.items()}}
            for s in range(steps)]  # fmt: skip


def test_rounding_noise_is_drawn_as_zero_and_a_real_loss_as_itself():
    noise = [3e-9, -2e-8, 5e-9]
    assert plots._curves(_rows(pg_loss=noise), [("pg_loss", "pg loss")]) == [
        ([1, 2, 3], noise, "pg loss")
    ]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for values, drawn in ((noise, [0.0, 0.0, 0.0]), ([3e-3, -2e-3, 5e-3], [3e-3, -2e-3, 5e-3])):
        fig, ax = plt.subplots()
        plots._draw(ax, [([1, 2, 3], values, "pg loss")], always_legend=False)
        assert list(ax.lines[0].get_ydata()) == drawn
        said = [t.get_text() for t in ax.texts]
        assert bool(said) == (values is noise) and (not said or "float32 rounding" in said[0])
        plt.close(fig)


def test_equal_rules_share_one_curve_named_for_both():
    share = [0.5, 0.6, 0.7]
    keys = [("token/weight_share_pos", "token"), ("sequence/weight_share_pos", "sequence"),
            ("balanced/weight_share_pos", "balanced")]  # fmt: skip
    rows = _rows(token__weight_share_pos=[0.4, 0.6, 0.8], sequence__weight_share_pos=share,
                 balanced__weight_share_pos=[v + 1e-12 for v in share])  # fmt: skip
    assert [c[2] for c in plots._curves(rows, keys)] == ["token", "sequence = balanced"]
    rows[1]["balanced/weight_share_pos"] = 0.61  # control: one step apart, two curves
    assert [c[2] for c in plots._curves(rows, keys)] == ["token", "sequence", "balanced"]


def test_the_correction_panel_only_when_it_acted_and_benchmarks_have_a_legend(tmp_path):
    one = [1.0, 1.0]
    off = _rows(rollout_correction__weight_mean=one, rollout_correction__weight_max=one,
                rollout_correction__fraction_corrected=[0.0, 0.0], eval__aime24__acc=[0.1, 0.2],
                eval__aime24__best=[0.3, 0.4], reward_mean=[0.2, 0.3])  # fmt: skip
    written = {p.name for p in plots.plot_run(_run(tmp_path / "off", off))}
    assert "rollout_correction.png" not in written and "reward.png" in written
    assert {"benchmarks_acc.png", "benchmarks_best.png"} <= written
    on = [dict(r) for r in off]
    on[1]["rollout_correction/weight_max"] = 1.3  # control: one weight moved
    assert "rollout_correction.png" in {p.name for p in plots.plot_run(_run(tmp_path / "on", on))}
    name, title, _, keys = plots._benchmark_panels(off)[0]
    assert name == "benchmarks_acc.png" and "per benchmark" in title
    assert keys == [("eval/aime24/acc", "aime24")]
    import matplotlib.pyplot as plt

    for always, legend in ((True, ["aime24"]), (False, None)):  # control: a lone curve, no legend
        fig, ax = plt.subplots()
        plots._draw(ax, [([1, 2], [0.1, 0.2], "aime24")], always_legend=always)
        got = ax.get_legend()
        assert ([t.get_text() for t in got.get_texts()] if got else None) == legend
        plt.close(fig)


def test_many_curves_keep_visible_widths():
    """Seven benchmarks (the paper's six and one more): every curve at least 1 pt wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    curves = [([1, 2], [0.1 * i, 0.2 * i], f"b{i}") for i in range(1, 8)]
    plots._draw(ax, curves, always_legend=True)
    assert len(ax.lines) == 7 and min(line.get_linewidth() for line in ax.lines) >= 1.0
    plt.close(fig)
