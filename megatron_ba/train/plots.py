"""PNG plots of a run (or of several runs side by side) from their metrics.jsonl.

megatron_ba.train.plots.plot_run(RUN_DIR)            # RUN_DIR/plots/*.png
plot_comparison({"token": run_a, ...}, OUT_DIR)      # used by `megatron-ba compare`
"""

from __future__ import annotations

from pathlib import Path

from megatron_ba.train.run_log import MetricsLog

# (file name, title, [(metrics key, label)])
PANELS = [
    ("reward.png", "training reward (mean over rollouts)", [("reward_mean", "reward")]),
    ("eval_accuracy.png", "held-out Acc@k (temperature 1.0)", [("eval_accuracy", "Acc@k")]),
    ("pg_loss.png", "policy-gradient loss", [("pg_loss", "pg loss")]),
    (
        "lengths.png",
        "response length by advantage sign",
        [("length_mean_pos", "positive"), ("length_mean_neg", "negative")],
    ),
    ("length_var.png", "response-length variance", [("length_var", "variance")]),
    (
        "weight_share.png",
        "positive sign's share of objective weight",
        [
            ("token/weight_share_pos", "token"),
            ("sequence/weight_share_pos", "sequence"),
            ("balanced/weight_share_pos", "balanced"),
        ],
    ),
]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def _figure(title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    return fig, ax


def plot_run(run_dir: str | Path) -> list[Path]:
    run_dir = Path(run_dir)
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    names = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/")})
    panels = list(PANELS)
    for metric, what in (("acc", "Acc@k"), ("best", "Best@k")):
        if names:  # one curve per benchmark (eval.benchmarks), beside their mean
            keys = [(f"eval/{n}/{metric}", n) for n in names]
            panels.append((f"benchmarks_{metric}.png", f"{what} per benchmark", keys))
    for name, title, keys in panels:
        fig, ax = _figure(title)
        drawn = False
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
                drawn = True
        if drawn:
            if len(keys) > 1:
                ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / name)
            written.append(out_dir / name)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return written


def plot_comparison(
    runs: dict[str, list[dict]], out_dir: str | Path, keys: list[tuple[str, str, str]]
) -> list[Path]:
    """One figure per (key, file name, title): every run's curve (mean over its seeds)."""
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name, title in keys:
        fig, ax = _figure(title)
        for label, records in runs.items():
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        if key == "pg_loss":
            ax.axhline(0.0, color="black", lw=0.8)
        if ax.get_legend_handles_labels()[0]:  # a key no run logged: an empty figure, no legend
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written
