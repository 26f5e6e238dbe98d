"""`megatron-ba perf overlap`: synchronous GRPO against asynchronous (rollout.max_staleness), side
by side on one machine: wall time per step, the engines' and the trainer's idle time, held-out
accuracy per evaluation, and the time each schedule takes to reach the synchronous run's final
accuracy. It runs `megatron-ba train` itself, so it lives among the commands.

    megatron-ba perf overlap                                   # tiny-cpu, K = 0 and 1, seed 0
    megatron-ba perf overlap --staleness 0 1 2 --seeds 0 1 2 --out runs/overlap eval.every=5
    megatron-ba perf overlap --summarize docs/runs/async-cpu   # recompute from shipped runs

Each (K, seed) is one `megatron-ba train` of the recipe (`rollout.sync_every` K: batches up to K
steps old; evaluation every `eval.every` steps, no checkpoints before the end) into
OUT/k{K}-seed{S}; `OUT/summary.json` holds the per-run series
and the comparison, recomputable from each run's metrics.jsonl (`summarize`). The step's wall
time is `time/step` (rollouts, rewards, update, refit; evaluation excluded, the same for both);
the trainer idles while it waits for rollouts (`time/rollout` + `time/reward`, the work not
overlapped), the engines while they are not generating (`time/step` - `time/engine_busy`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_ba.errors import UserError
from megatron_ba.studies.run_records import read_metrics
from megatron_ba.train import warmstart_cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-ba perf overlap", description=__doc__)
    p.add_argument("--recipe", default="recipes/tiny-cpu.yaml")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", type=Path, default=Path("runs/perf-overlap"))
    p.add_argument("--cache-dir", type=Path, default=warmstart_cache(), help="warm-start cache")
    p.add_argument(
        "--summarize",
        type=Path,
        metavar="DIR",
        help="recompute the comparison from DIR's k<K>-seed<S> runs (metrics.jsonl[.gz]); "
        "train nothing",
    )
    p.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = p.parse_args(argv)
    if args.summarize:
        print(json.dumps(summarize(args.summarize)["comparison"], indent=1))
        return 0
    if 0 not in args.staleness:
        p.error("--staleness: include 0 (the synchronous run every other is compared with)")
    runs = {}
    for k in args.staleness:
        for seed in args.seeds:
            name = f"k{k}-seed{seed}"
            _train(args, k, seed, args.out / name)
            runs[name] = {"staleness": k, "seed": seed, **series(args.out / name)}
    summary = {"recipe": args.recipe, "overrides": args.overrides, "runs": runs}
    summary["comparison"] = compare(runs)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["comparison"], indent=1))
    return 0


def _train(args, k: int, seed: int, run_dir: Path) -> None:
    cmd = [
        sys.executable, "-m", "megatron_ba.cli", "train", args.recipe,
        f"rollout.max_staleness={k}", f"rollout.sync_every={max(k, 1)}", f"seed={seed}",
        "checkpoint.every=0",
        "logging.progress=false", "logging.plots=false", *args.overrides,
        "--run-dir", str(run_dir), "--cache-dir", str(args.cache_dir),
    ]  # fmt: skip
    if run_dir.exists():
        raise SystemExit(f"--out: {run_dir} exists; choose another --out")
    subprocess.run(cmd, check=True)


def summarize(folder: Path) -> dict:
    """The comparison of the runs in `folder` (k<K>-seed<S>/ with metrics.jsonl[.gz])."""
    runs = {}
    for run in sorted(Path(folder).glob("k*-seed*")):
        k, seed = run.name[1:].split("-seed")
        runs[run.name] = {"staleness": int(k), "seed": int(seed), **series(run)}
    if not runs:
        raise UserError(f"--summarize: no k<K>-seed<S> run folders in {folder}")
    return {"runs": runs, "comparison": compare(runs)}


def series(run_dir: Path) -> dict:
    """A run's per-step wall time and idle times, and its held-out accuracy per evaluation."""
    rows = read_metrics(Path(run_dir))
    steps = [r for r in rows if r["step"] > 0]
    return {
        "step_seconds": [r["time/step"] for r in steps],
        "trainer_wait_seconds": [r["time/rollout"] + r["time/reward"] for r in steps],
        "engine_idle_seconds": [r["time/step"] - r["time/engine_busy"] for r in steps],
        "eval_steps": [r["step"] for r in rows if "eval_accuracy" in r],
        "eval_accuracy": [r["eval_accuracy"] for r in rows if "eval_accuracy" in r],
    }


def _mean_curve(runs: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Evaluation steps, mean accuracy over seeds, and mean cumulative wall time at each."""
    steps = runs[0]["eval_steps"]
    acc = [statistics.fmean(r["eval_accuracy"][i] for r in runs) for i in range(len(steps))]
    wall = [statistics.fmean(sum(r["step_seconds"][:s]) for r in runs) for s in steps]
    return steps, acc, wall


def compare(runs: dict) -> dict:
    """Per K: mean step time (all steps but the first, which no schedule overlaps), its ratio
    to K = 0, the mean accuracy curve, and the wall time to reach K = 0's final mean accuracy
    (the first evaluation at or above it; None if never) with its ratio."""
    by_k: dict[int, list[dict]] = {}
    for r in runs.values():
        by_k.setdefault(r["staleness"], []).append(r)
    _, sync_acc, _ = _mean_curve(by_k[0])
    target = sync_acc[-1]
    out = {"target_accuracy": target}
    for k, rs in sorted(by_k.items()):
        steps, acc, wall = _mean_curve(rs)
        reached = next((w for a, w in zip(acc, wall, strict=True) if a >= target), None)
        step_time = statistics.fmean(t for r in rs for t in r["step_seconds"][1:])
        out[f"k{k}"] = {
            "mean_step_seconds": step_time,
            "trainer_wait_seconds": statistics.fmean(
                t for r in rs for t in r["trainer_wait_seconds"][1:]
            ),
            "engine_idle_seconds": statistics.fmean(
                t for r in rs for t in r["engine_idle_seconds"][1:]
            ),
            "eval_steps": steps,
            "mean_accuracy": acc,
            "final_accuracy": acc[-1],
            "seconds_to_target": reached,
        }
    base = out["k0"]
    for k in sorted(by_k):
        entry = out[f"k{k}"]
        entry["step_time_ratio"] = entry["mean_step_seconds"] / base["mean_step_seconds"]
        reached = entry["seconds_to_target"]
        entry["time_to_target_ratio"] = (
            None if reached is None else reached / base["seconds_to_target"]
        )
    return out
