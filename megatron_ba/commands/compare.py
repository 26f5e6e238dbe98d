"""`megatron-ba compare RECIPE --rules token,sequence,balanced [--seeds N]`: the paper's comparison.

    megatron-ba compare recipes/tiny-cpu.yaml                        # 3 rules x 1 seed, ~10 min
    megatron-ba compare recipes/tiny-cpu.yaml --seeds 2 --out runs/compare grpo.steps=60

Each (rule, seed) trains in OUT/<rule>-seed<k>/; OUT/report.md holds the table (peak -> last) and
the figures (PG loss drift, Acc@k, length variance and gap). Re-running continues where it stopped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_ba.recipe import RecipeError, load_recipe
from megatron_ba.rules import RULES
from megatron_ba.train.compare import run_all, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides for every run")
    p.add_argument("--rules", default="token,sequence,balanced", help="comma-separated rules")
    p.add_argument("--seeds", type=int, default=1, help="seeds per rule (default 1)")
    p.add_argument("--out", help="output folder (default runs/compare-<recipe name>)")
    p.add_argument(
        "--report-only", action="store_true", help="rewrite report.md from finished runs"
    )


def run(args: argparse.Namespace) -> int:
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    bad = [r for r in rules if r not in RULES]
    if bad or not rules:
        print(f"compare: --rules: unknown {bad}; choose from {', '.join(RULES)}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("compare: --seeds must be >= 1", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2

    out = Path(args.out or f"runs/compare-{recipe.name}")
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        runs = {r: [out / f"{r}-seed{s}" for s in range(args.seeds)] for r in rules}
    else:
        runs = run_all(recipe, args.recipe, rules, args.seeds, out, args.overrides)
    report = write_report(recipe, runs, out)
    print(f"report: {report}")
    return 0
