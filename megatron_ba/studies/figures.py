"""The figures of a study's report (studies/reporting.py): what a reader needs to judge them.

    figs = curve_figures(cells, ("held-out Acc@4 (4 samples per prompt, 64 prompts)",
                                 "Acc@4 (fraction of samples correct)"))
    figs = against_key_figures(points, "data.max_terms")
    save(figs, out_dir)                                  # out_dir/<name>.png

Every figure states its unit on the y axis and the seed spread as well as the mean: per-step
curves draw the mean over seeds with a band from the lowest to the highest seed, against-key
figures a point per value with a bar over the same range, and each legend entry says how many
seeds (n) it holds. A swept value is a category (a study runs a few of them), so it is drawn as
points at its own ticks, never as a line through values nobody ran. Legends sit outside the axes,
where they hide no data. Figures are built and returned first so that tests can read them.
"""

from __future__ import annotations

from pathlib import Path

# (metrics key, file name, title, y label). The eval curve's title and label are the report's:
# it knows k and the number of prompts.
CURVES = [
    ("pg_loss", "pg_loss.png", "PG loss per step (rho = 1 at the first use of each batch)",
     "PG loss (dimensionless)"),
    ("eval_accuracy", "eval_accuracy.png", None, None),
    ("length_var", "length_var.png", "response-length variance per step",
     "length variance (tokens²)"),
    ("length_gap_pos_minus_neg", "length_gap.png", "mean length: positive - negative",
     "length difference (tokens)"),
    ("reward_mean", "reward.png", "training reward per step", "mean reward (1 right, 0 wrong)"),
]  # fmt: skip
# The diagnostics drawn against a swept numeric key: (name, y label).
DIAGNOSTICS = [
    ("pg_loss_mean", "mean PG loss at rho = 1 (dimensionless)"),
    ("neg_over_pos_length", "negative / positive mean length (ratio)"),
    ("length_var", "length variance (tokens²)"),
    ("length_gap_pos_minus_neg", "positive - negative mean length (tokens)"),
]
SPREAD = "band: lowest to highest seed"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_outside(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # a key no run logged: an empty figure, no legend
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)


def _by_step(runs: list[list[dict]], key: str) -> tuple[list[int], list[list[float]]]:
    """The steps where every seed logged `key`, and the seeds' values at each."""
    per_run = [
        {r["step"]: float(r[key]) for r in records if isinstance(r.get(key), int | float)}
        for records in runs
    ]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    return steps, [[p[s] for p in per_run] for s in steps]


def curve_figures(
    cells: dict[str, list[list[dict]]], acc_labels: tuple[str, str]
) -> dict[str, object]:
    """One figure per CURVES entry: per cell (label -> its seeds' metrics records) the mean over
    seeds by step, with the band from the lowest to the highest seed; acc_labels: the eval
    curve's title and y label. {file name: figure}."""
    plt = _pyplot()
    out = {}
    for key, name, title, ylabel in CURVES:
        fig, ax = plt.subplots(figsize=(8.4, 3.8), dpi=100)
        title, ylabel = (title, ylabel) if title else acc_labels
        one_seed = all(len(runs) == 1 for runs in cells.values())
        spread = "one seed: no spread" if one_seed else f"mean over seeds; {SPREAD}"
        ax.set_title(f"{title}\n{spread}", fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        for label, runs in cells.items():
            steps, values = _by_step(runs, key)
            if not steps:
                continue
            mean = [sum(v) / len(v) for v in values]
            (line,) = ax.plot(steps, mean, marker="o" if len(steps) < 30 else None, ms=3,
                              label=f"{label} (n={len(runs)})")  # fmt: skip
            if len(runs) > 1:
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values],
                                color=line.get_color(), alpha=0.15, lw=0)  # fmt: skip
        if key == "pg_loss":
            ax.axhline(0.0, color="black", lw=0.8)
        _legend_outside(ax)
        out[name] = fig
    return out


def against_key_name(name: str, key: str) -> str:
    """The file name of diagnostic `name` drawn against the swept `key`."""
    return f"{name.replace('/', '_')}_vs_{key.rsplit('.', 1)[-1]}.png"


def against_key_figures(
    points: dict[str, dict[object, dict[str, list[float]]]], key: str
) -> dict[str, object]:
    """Each diagnostic against the swept `key`: points[rule][value][diagnostic] holds one value
    per run (its seeds, over the other keys' values too). Each value of `key` is a category at
    its own tick; each rule a point at the mean with a bar from the lowest to the highest run,
    side by side. {file name: figure}."""
    plt = _pyplot()
    values = sorted({v for by_value in points.values() for v in by_value})
    rules = sorted(points)
    width = 0.6 / max(1, len(rules))
    out = {}
    for name, ylabel in DIAGNOSTICS:
        fig, ax = plt.subplots(figsize=(7.2, 3.8), dpi=100)
        for i, rule in enumerate(rules):
            xs, mean, low, high, ns = [], [], [], [], set()
            for j, value in enumerate(values):
                runs = [x for x in points[rule].get(value, {}).get(name, []) if x == x]  # no NaN
                if not runs:
                    continue
                m = sum(runs) / len(runs)
                xs.append(j + (i - (len(rules) - 1) / 2) * width)
                mean.append(m)
                low.append(m - min(runs))
                high.append(max(runs) - m)
                ns.add(len(runs))
            if xs:
                n = "/".join(str(k) for k in sorted(ns))
                ax.errorbar(xs, mean, yerr=[low, high], fmt="o", capsize=4, ls="none",
                            label=f"{rule} (n={n})")  # fmt: skip
        ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_xlim(-0.6, len(values) - 0.4)
        ax.set_xlabel(f"{key} (the values the study ran)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} against {key}\nmean over runs; bar: lowest to highest run",
                     fontsize=10)  # fmt: skip
        ax.grid(alpha=0.3, axis="y")
        _legend_outside(ax)
        out[against_key_name(name, key)] = fig
    return out


def save(figures: dict[str, object], out_dir: Path) -> list[Path]:
    """Write each figure as out_dir/<name> (the legend, outside the axes, inside the image)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        fig.savefig(out_dir / name, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        written.append(out_dir / name)
    return written
