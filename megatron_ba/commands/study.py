"""`megatron-ba study RECIPE --grid KEY=V1,V2 [--grid ...] --out DIR`: a grid of runs, one report.

    megatron-ba study recipes/tiny-cpu.yaml --grid loss.rule=token,balanced --grid seed=0,1 \
        --out runs/study grpo.steps=20                         # here, one run after another
    megatron-ba study recipes/qwen2.5-math-7b-dapo17k.yaml --grid loss.rule=token,balanced \
        --grid seed=0,1,2 --out /shared/study --slurm --max-parallel 3 \
        --sbatch-args "--nodes=4 --gpus-per-node=8 --time=24:00:00"     # one Slurm job array
    megatron-ba study ... --dry-run                            # the elements and the submission
    megatron-ba study ... --compare balanced,token --metric acc_last --plan-only   # declare it
    megatron-ba study recipes/tiny-cpu.yaml --grid loss.rule=token@group,token@batch \
        --grid seed=0,1 --out runs/token-means --compare token@batch,token@group   # both means

A loss.rule value is RULE (at the recipe's loss.scope) or RULE@SCOPE (`token@batch`: the pooled
token mean, run as loss.rule=token loss.scope=batch, in `token-scopebatch-...`).

The plan (studies/design.py) is written to DIR/study.json before anything runs: the recipe's
hashes, the grid, the seeds and the comparison that decides (--compare A,B: rule A - rule B,
paired by seed, on --metric; balanced against token and acc_last by default). --plan-only writes
it and stops; the same command without the flag then runs what was declared, and refuses to run
if the recipe has changed since. The report says whether the runs are the planned ones.

One run folder per element of the cross product under DIR (studies/grid.py has the names), and
DIR/study.json. Re-running the same command keeps finished elements and resumes interrupted ones;
other arguments on the same DIR are refused. After local runs DIR/report.md is written
(`megatron-ba report DIR`); a Slurm study's report is written by `megatron-ba report DIR` once
its array has run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (recipes/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of every element")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a swept recipe key and its values (repeat: the cross product)",
    )
    p.add_argument("--out", required=True, help="the study folder")
    p.add_argument("--slurm", action="store_true", help="submit one sbatch job array")
    p.add_argument("--sbatch-args", default="", help='sbatch options, e.g. "--time=04:00:00"')
    p.add_argument("--max-parallel", type=int, default=None, help="--slurm: array tasks at once")
    p.add_argument(
        "--compare",
        default=None,
        metavar="A,B",
        help="the plan's deciding comparison: rule A - rule B, paired by seed "
        "(default balanced,token when both are swept)",
    )
    p.add_argument(
        "--metric",
        default=None,
        help="the report column that decides (default acc_last): acc_peak, acc_last, "
        "best_peak, best_last, acc_last_minus_peak",
    )
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="declare the study: write DIR/study.json (its plan) and run nothing",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the elements (and the submission), run and write nothing",
    )


def run(args: argparse.Namespace) -> int:
    from megatron_ba.studies.grid import Study, parse_grid
    from megatron_ba.studies.slurm_array import array_submission, parse_sbatch_args

    try:
        axes = parse_grid(args.grid)
        compare = tuple(r.strip() for r in args.compare.split(",")) if args.compare else None
        decision = {"compare": compare, "metric": args.metric}
        study = Study.open(
            Path(args.out), args.recipe, args.overrides, axes, write=False, **decision
        )
        sbatch_args = parse_sbatch_args(args.sbatch_args)
        submission = array_submission(
            study, sbatch_args=sbatch_args, max_parallel=args.max_parallel
        )
    except ValueError as e:
        print(f"study: {e}", file=sys.stderr)
        return 2
    if (args.sbatch_args or args.max_parallel) and not args.slurm:
        print("study: --sbatch-args and --max-parallel are for --slurm", file=sys.stderr)
        return 2
    elements = study.elements
    print(f"study: {len(elements)} elements in {study.folder}")
    for e in elements:
        print(f"  {e.index:>3}  {e.name:<40} {' '.join(e.overrides)}")
    if args.dry_run and args.plan_only:
        print("study: --dry-run writes nothing and --plan-only writes study.json; give one",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.dry_run:
        if args.slurm:
            import shlex

            print("submission: " + shlex.join(submission))
        return 0
    Study.open(study.folder, args.recipe, args.overrides, axes, **decision)  # writes study.json
    if args.plan_only:
        print(f"study: plan declared in {study.folder / 'study.json'}; nothing has run. "
              "The same command without --plan-only runs it")  # fmt: skip
        return 0
    if args.slurm:
        proc = subprocess.run(submission, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"study: sbatch failed: {proc.stderr.strip()}", file=sys.stderr)
            return 1
        job = proc.stdout.strip().split(";")[0]
        print(
            f"study: submitted job array {job} ({len(elements)} tasks); when it has run: "
            f"megatron-ba report {study.folder}"
        )
        return 0
    return train_and_report(study)


def train_and_report(study, *, train: bool = True) -> int:
    """Run the study's unfinished elements here (unless `train` is false), then write its
    report; the exit status (1: an element failed; 2: no report, said why). `megatron-ba
    compare` ends here too."""
    from megatron_ba.studies.grid import run_locally
    from megatron_ba.studies.reporting import write_report

    if train:
        try:
            run_locally(study)
        except RuntimeError as e:
            print(str(e), file=sys.stderr)
            return 1
    try:
        print(f"report: {write_report(study.folder)}")
    except ValueError as e:  # no finished run yet, runs of another recipe
        print(f"report: {e}", file=sys.stderr)
        return 2
    return 0
