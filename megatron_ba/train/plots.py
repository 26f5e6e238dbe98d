"""PNG plots of one run from its metrics.jsonl (a study's figures: studies/figures.py).

megatron_ba.train.plots.plot_run(RUN_DIR)            # RUN_DIR/plots/*.png

Each panel's y axis names its unit; legends sit outside the axes. A panel of rounding noise
says so and draws 0; curves that coincide are one curve with both names; the rollout
correction's panel is drawn only when the correction acted.
"""

from __future__ import annotations

from pathlib import Path

from megatron_ba.train.run_log import MetricsLog

# (file name, title, y label, [(metrics key, label)])
PANELS = [
    ("reward.png", "training reward (mean over rollouts)", "mean reward (1 right, 0 wrong)",
     [("reward_mean", "reward")]),
    ("eval_accuracy.png", "held-out Acc@k (temperature 1.0)", "Acc@k (fraction of samples correct)",
     [("eval_accuracy", "Acc@k")]),
    ("pg_loss.png", "policy-gradient loss", "PG loss (dimensionless)", [("pg_loss", "pg loss")]),
    ("lengths.png", "response length by advantage sign", "mean length (tokens)",
     [("length_mean_pos", "positive"), ("length_mean_neg", "negative")]),
    ("length_var.png", "response-length variance", "length variance (tokens²)",
     [("length_var", "variance")]),
    ("weight_share.png", "positive sign's share of objective weight", "weight share (fraction)",
     [("token/weight_share_pos", "token"), ("sequence/weight_share_pos", "sequence"),
      ("balanced/weight_share_pos", "balanced")]),
    ("rollout_logprob_gap.png", "train/rollout log-prob gap (old - vLLM)",
     "mean |old - rollout| log-prob (nats per token)",
     [("rollout_correction/logprob_gap", "gap")]),
    ("rollout_correction.png", "rollout correction (loss.rollout_correction)",
     "weight (dimensionless) or fraction of tokens",
     [("rollout_correction/weight_mean", "weight mean"),
      ("rollout_correction/weight_max", "weight max"),
      ("rollout_correction/fraction_corrected", "fraction corrected")]),
]  # fmt: skip


# A panel whose values all lie within this of 0 plots float32 rounding, not a signal: the
# policy-gradient loss's value is 0 up to rounding when the advantages of each group cancel (its
# gradient, not its value, is what trains). Such a panel draws 0 and says so.
ROUNDING = 1e-6
_STYLES = ("-", "--", ":", "-.")  # curves that coincide stay visible: each its own dash


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _curves(records: list[dict], keys: list[tuple[str, str]]) -> list[tuple[list, list, str]]:
    """(steps, values, label) per key with data; keys whose series are equal are one curve whose
    label names them all ("sequence = balanced"), so no curve hides exactly under another."""
    curves: list[tuple[list, list, str]] = []
    for key, label in keys:
        xs, ys = _series(records, key)
        if not xs:
            continue
        same = next((i for i, (x, y, _) in enumerate(curves) if _equal(x, y, xs, ys)), None)
        if same is None:
            curves.append((xs, ys, label))
        else:
            x, y, first = curves[same]
            curves[same] = (x, y, f"{first} = {label}")
    return curves


def _equal(xs: list, ys: list, other_xs: list, other_ys: list) -> bool:
    """The same steps and values to 1e-9 (two rules' shares agree to float64 rounding)."""
    return xs == other_xs and all(abs(a - b) <= 1e-9 for a, b in zip(ys, other_ys, strict=True))


def _correction_never_acted(records: list[dict]) -> bool:
    """loss.rollout_correction off: every weight 1 and no token corrected at every step."""
    keys = ("rollout_correction/weight_mean", "rollout_correction/weight_max")
    weights = [v for k in keys for v in _series(records, k)[1]]
    fractions = _series(records, "rollout_correction/fraction_corrected")[1]
    return all(w == 1.0 for w in weights) and all(f == 0.0 for f in fractions)


def _benchmark_panels(records: list[dict]) -> list:
    """Acc@k and Best@k, a curve per benchmark of eval.benchmarks (each named in the legend)."""
    names = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/")})
    if not names:
        return []
    panels = []
    for metric, what, unit in (("acc", "Acc@k", "fraction of samples correct"),
                               ("best", "Best@k", "fraction solved by any")):  # fmt: skip
        keys = [(f"eval/{n}/{metric}", n) for n in names]
        panels.append((f"benchmarks_{metric}.png", f"{what} per benchmark (eval.benchmarks)",
                       f"{what} ({unit})", keys))  # fmt: skip
    return panels


def _draw(ax, curves: list[tuple[list, list, str]], always_legend: bool) -> None:
    values = [v for _, ys, _ in curves for v in ys]
    noise = any(v != 0 for v in values) and all(abs(v) < ROUNDING for v in values)
    for i, (xs, ys, label) in enumerate(curves):
        ys = [0.0] * len(ys) if noise else ys
        style = i % len(_STYLES)  # dash and width cycle together: the paper's six benchmarks
        ax.plot(xs, ys, _STYLES[style], marker="o" if len(xs) < 30 else None,
                label=label, linewidth=2.2 - 0.4 * style)  # fmt: skip
    if noise:
        ax.set_ylim(-1.0, 1.0)
        ax.text(0.02, 0.92, f"every value within {ROUNDING:g} of 0 (float32 rounding): drawn as 0",
                transform=ax.transAxes, fontsize=8, va="top")  # fmt: skip
    if always_legend or len(curves) > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def plot_run(run_dir: str | Path) -> list[Path]:
    """RUN_DIR/plots/*.png from RUN_DIR/metrics.jsonl: the panels with data (the rollout
    correction's only when it acted); the written files."""
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    benchmarks = _benchmark_panels(records)
    for name, title, ylabel, keys in [*PANELS, *benchmarks]:
        if name == "rollout_correction.png" and _correction_never_acted(records):
            continue
        curves = _curves(records, keys)
        if not curves:
            continue
        fig, ax = _figure(title, ylabel)
        _draw(ax, curves, always_legend=name.startswith("benchmarks_"))
        fig.savefig(out_dir / name, bbox_inches="tight")
        written.append(out_dir / name)
        plt.close(fig)
    return written
