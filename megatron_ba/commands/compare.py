"""`megatron-ba compare RECIPE [--rules R1,R2,...] [--seeds N]`: the paper's comparison.

    megatron-ba compare recipes/tiny-cpu.yaml                        # 4 rules x 1 seed
    megatron-ba compare recipes/tiny-cpu.yaml --seeds 2 --out runs/compare grpo.steps=60
    megatron-ba compare recipes/tiny-cpu.yaml --rules token,sequence,balanced   # the recipe's scope

The study (`megatron-ba study`) of one grid: loss.rule over the rules x seed over recipe seed,
seed + 1, ... A rule is RULE (at the recipe's loss.scope) or RULE@SCOPE. The default runs both
token means: `token@group`, the per-group mean of the paper's formula, and `token@batch`, the
whole batch pooled as verl's token-mean does (the paper's runs), then sequence and balanced at the
recipe's scope; the declared comparison is balanced - token@batch. Each (rule, seed) trains in
OUT/<rule>[-scope<scope>]-seed<s>/; OUT/report.md (and report.json, figures/) is the study's
report: the table (peak -> last, mean ± sd over seeds), rule against rule seed by seed, the
diagnostics and the per-step curves, each run named by its rule and which mean. Re-running
continues where it stopped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_ba.loss_settings import RULES, split_rule_value
from megatron_ba.recipe import RecipeError, load_recipe

# Both token means (docs/math.md, section 1), then sequence and balanced at the recipe's scope.
DEFAULT_RULES = "token@group,token@batch,sequence,balanced"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides for every run")
    p.add_argument(
        "--rules",
        default=DEFAULT_RULES,
        help=f"comma-separated rules, each RULE (the recipe's loss.scope) or RULE@SCOPE "
        f"(default {DEFAULT_RULES}: the per-group and the pooled token mean)",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per rule (default 1)")
    p.add_argument("--out", help="output folder (default runs/compare-<recipe name>)")
    p.add_argument(
        "--report-only", action="store_true", help="rewrite report.md from finished runs"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_ba.commands.study import train_and_report
    from megatron_ba.studies.grid import Axis, Study

    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    bad = [r for r in rules if r.partition("@")[0] not in RULES]
    if bad or not rules:
        print(f"compare: --rules: unknown {bad}; choose from {', '.join(RULES)}", file=sys.stderr)
        return 2
    try:
        for r in rules:
            split_rule_value(r)
    except ValueError as e:
        print(f"compare: --rules: {e}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("compare: --seeds must be >= 1", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        seeds = tuple(str(recipe.seed + k) for k in range(args.seeds))
        axes = [Axis("loss.rule", tuple(rules)), Axis("seed", seeds)]
        out = Path(args.out or f"runs/compare-{recipe.name}")
        study = Study.open(out, args.recipe, args.overrides, axes)
    except (RecipeError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    return train_and_report(study, train=not args.report_only)
