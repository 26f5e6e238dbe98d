"""PNG plots of one run from its metrics.jsonl (a study's figures: studies/figures.py).

megatron_ba.train.plots.plot_run(RUN_DIR)            # RUN_DIR/plots/*.png

Each panel's y axis names its unit; legends sit outside the axes.
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
            unit = "fraction of samples correct" if metric == "acc" else "fraction solved by any"
            unit = f"{what} ({unit})"
            panels.append((f"benchmarks_{metric}.png", f"{what} per benchmark", unit, keys))
    for name, title, ylabel, keys in panels:
        fig, ax = _figure(title, ylabel)
        drawn = False
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
                drawn = True
        if drawn:
            if len(keys) > 1:
                ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
            fig.savefig(out_dir / name, bbox_inches="tight")
            written.append(out_dir / name)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return written
