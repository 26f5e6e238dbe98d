"""The paper's comparison on one recipe: every rule, same seeds, one report.

    megatron-ba compare recipes/tiny-cpu.yaml --rules token,sequence,balanced --seeds 2

Runs `megatron-ba train` once per (rule, seed) in its own process (under torchrun when the recipe's
layout needs several), each in OUT/<rule>-seed<k>/, sharing the warm start of each seed, then
writes OUT/report.md with PNG figures: the PG loss per step (token aggregation drifts from zero,
sequence and balanced stay at it), held-out Acc@k at the peak and at the last step per rule, the
response-length variance and the positive-negative length gap over training (the paper's Figures
2-3 in miniature), and a table in the paper's layout (peak -> last). Finished runs are kept, an
interrupted one is resumed, so a compare can be re-run until done.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_ba.recipe import Recipe
from megatron_ba.train.plots import plot_comparison
from megatron_ba.train.run_log import MetricsLog, eval_table

FIGURES = [
    ("pg_loss", "pg_loss.png", "PG loss per step (rho = 1 at the first use of each batch)"),
    ("eval_accuracy", "eval_accuracy.png", "held-out Acc@k (temperature 1.0)"),
    ("length_var", "length_var.png", "response-length variance"),
    ("length_gap_pos_minus_neg", "length_gap.png", "mean length: positive - negative"),
    ("reward_mean", "reward.png", "training reward"),
]


def _launcher(recipe: Recipe) -> list[str]:
    """`python -m megatron_ba.cli`, under torchrun when the layout needs several processes."""
    nproc = recipe.parallel.tp * recipe.parallel.pp * recipe.parallel.cp
    if nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "-m",
            "megatron_ba.cli",
        ]
    return [sys.executable, "-m", "megatron_ba.cli"]


def run_all(
    recipe: Recipe,
    recipe_path: str,
    rules: list[str],
    seeds: int,
    out_dir: Path,
    overrides: list[str],
    log=print,
) -> dict[str, list[Path]]:
    """Train every (rule, seed) that has not finished yet; returns rule -> run folders."""
    runs: dict[str, list[Path]] = {}
    cache = out_dir / ".cache"
    for seed in range(seeds):
        for rule in rules:
            run_dir = out_dir / f"{rule}-seed{seed}"
            runs.setdefault(rule, []).append(run_dir)
            if (run_dir / "summary.json").is_file():
                log(f"[compare] {run_dir.name}: finished earlier, kept")
                continue
            args = [*overrides, f"loss.rule={rule}", f"seed={recipe.seed + seed}"]
            if (run_dir / "checkpoints" / "latest").is_file():
                where = ["--resume", str(run_dir)]
            else:
                shutil.rmtree(run_dir, ignore_errors=True)  # never checkpointed: start afresh
                where = ["--run-dir", str(run_dir)]
            cmd = [
                *_launcher(recipe),
                "train",
                recipe_path,
                *args,
                *where,
                "--cache-dir",
                str(cache),
            ]
            log(f"[compare] {run_dir.name}: {' '.join(cmd[2:])}")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            proc = subprocess.run(cmd, env=env)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"compare: the {rule} run (seed {seed}) failed with {proc.returncode}"
                )
    return runs


def _mean_curve(runs: list[list[dict]], key: str) -> list[dict]:
    """Per-step mean over seeds of `key` (steps where every seed has a value)."""
    by_step: dict[int, list[float]] = {}
    for records in runs:
        for r in records:
            v = r.get(key)
            if isinstance(v, int | float):
                by_step.setdefault(r["step"], []).append(float(v))
    return [
        {"step": s, key: sum(v) / len(v)} for s, v in sorted(by_step.items()) if len(v) == len(runs)
    ]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def peak_last(records: list[dict], key: str = "eval_accuracy") -> tuple[float, int, float]:
    evals = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    if not evals:
        return float("nan"), -1, float("nan")
    step, peak = max(evals, key=lambda e: (e[1], -e[0]))
    return peak, step, evals[-1][1]


def _spread(xs: list[float]) -> str:
    """Each seed's value, then mean +- std (population std over seeds; one seed: no spread)."""
    m = _mean(xs)
    std = (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5 if xs else float("nan")
    each = " / ".join(f"{x:.4f}" for x in xs)
    return f"{each} (mean {m:.4f} ± {std:.4f})" if len(xs) > 1 else f"{m:.4f}"


def seed_spread_lines(records: dict[str, list[list[dict]]], k: int) -> list[str]:
    """Per benchmark and rule: Acc@k and Best@k at the peak and the last step, every seed's value
    and their mean ± std, so that a difference within the seeds' spread is not read as an
    effect."""
    tables = {rule: [eval_table(r) for r in rs] for rule, rs in records.items()}
    names = sorted({n for ts in tables.values() for t in ts if t for n in t["benchmarks"]})
    if not names:
        return []
    out = [
        "",
        f"## Per benchmark: Acc@{k} / Best@{k}, peak -> last (each seed, mean ± std over seeds)",
        "",
        "| benchmark | rule | Acc peak | Acc last | Best peak | Best last |",
        "|---|---|---|---|---|---|",
    ]
    for name in [*names, "average"]:
        for rule, ts in tables.items():
            rows = [t["average"] if name == "average" else t["benchmarks"][name] for t in ts if t]
            cells = [
                _spread([r[c] for r in rows])
                for c in ("acc_peak", "acc_last", "best_peak", "best_last")
            ]
            out.append(f"| {name} | {rule} | " + " | ".join(cells) + " |")
    return out


def write_report(recipe: Recipe, runs: dict[str, list[Path]], out_dir: Path) -> Path:
    records = {
        rule: [MetricsLog(d / "metrics.jsonl").read() for d in dirs] for rule, dirs in runs.items()
    }
    curves = {}
    for key, _, _ in FIGURES:
        for rule, rs in records.items():
            curves.setdefault(rule, {})
            for point in _mean_curve(rs, key):
                curves[rule].setdefault(point["step"], {"step": point["step"]}).update(point)
    series = {rule: [v for _, v in sorted(c.items())] for rule, c in curves.items()}
    figs = plot_comparison(series, out_dir / "figures", FIGURES)

    k = recipe.eval.samples
    lines = [
        f"# Aggregation rules compared on `{recipe.name}`",
        "",
        f"{len(next(iter(runs.values())))} seed(s) per rule, {recipe.grpo.steps} GRPO steps, "
        f"{recipe.grpo.prompts_per_step} prompts x {recipe.grpo.group_size} samples per step; "
        f"held-out Acc@{k} / Best@{k} at temperature {recipe.eval.temperature} on "
        f"{recipe.data.eval_prompts} prompts (mean over seeds). Written by `megatron-ba compare`.",
        "",
        f"| rule | Acc@{k} start | Acc@{k} peak -> last | peak step | Best@{k} peak -> last "
        "| mean abs PG loss |",
        "|---|---|---|---|---|---|",
    ]
    summary = {}
    for rule, rs in records.items():
        acc = [peak_last(r) for r in rs]
        best = [peak_last(r, "eval_best_at_k") for r in rs]
        start = [
            next(
                (x["eval_accuracy"] for x in r if x.get("step") == 0 and "eval_accuracy" in x),
                float("nan"),
            )
            for r in rs
        ]
        pg = [abs(x["pg_loss"]) for r in rs for x in r if isinstance(x.get("pg_loss"), int | float)]
        row = {
            "acc_start": _mean(start),
            "acc_peak": _mean([a[0] for a in acc]),
            "acc_peak_step": [a[1] for a in acc],
            "acc_last": _mean([a[2] for a in acc]),
            "best_peak": _mean([b[0] for b in best]),
            "best_last": _mean([b[2] for b in best]),
            "pg_loss_mean_abs": _mean(pg),
        }
        summary[rule] = row
        lines.append(
            f"| {rule} | {row['acc_start']:.4f} | {row['acc_peak']:.4f} -> {row['acc_last']:.4f} | "
            f"{', '.join(map(str, row['acc_peak_step']))} | {row['best_peak']:.4f} -> "
            f"{row['best_last']:.4f} | {row['pg_loss_mean_abs']:.2e} |"
        )
    lines += seed_spread_lines(records, k)
    lines += ["", "## Figures", ""]
    for (key, _, title), path in zip(FIGURES, figs, strict=True):
        lines += [f"### {title}", "", f"![{key}](figures/{path.name})", ""]
    lines += [
        "## Runs",
        "",
        *[f"- `{d.name}`: {d}" for dirs in runs.values() for d in dirs],
        "",
    ]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return report
