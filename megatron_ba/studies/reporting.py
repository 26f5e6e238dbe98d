"""The report of a study (or of any run folders of one recipe): report.md, report.json, figures/.

    report = write_report(Path("runs/s"))     # megatron-ba report runs/s

The runs are the study's elements (study.json) or, in a folder without one, every subfolder
holding recipe.yaml and metrics.jsonl (runs copied from anywhere; metrics.jsonl.gz, as published
studies ship it, reads the same). Their recipes may differ only in the swept keys (the study's
axes; else `keys`, default loss.rule and seed): any other difference is refused, naming the keys.
A cell is one value of every swept key but the seed; its runs are its seeds. Where the rule is
swept, a cell's aggregation is its rule and scope, named by each run's own recipe.yaml
(rules.aggregation_label: "token (per-group mean)", "token (pooled batch mean)"). The report first
states the study's plan (studies/design.py: whether the runs are the planned ones, and the
declared comparison's result), then holds, per cell, the mean and standard deviation over seeds
(n - 1 in the denominator) of Acc@k / Best@k at the peak and the last evaluation, per benchmark
and averaged (run_log.eval_table: the paper's layout), and how far the last is below the peak;
for every two aggregations, the difference per seed (same seed, same other values) with its
mean and 95% interval (Student's t over seeds); the paper's diagnostics averaged over steps and
seeds, and at the first step (against each swept numeric key in figures): the PG-loss drift at
rho = 1 (the mean PG loss, and its mean absolute value, at the first use of each batch), the
sign-length coupling (mean negative length / mean positive length, the positive subset's weight
share under each rule, and under the pooled token mean and by count), the response-length
variance and the positive-negative length gap; and the per-step curves of each cell
(studies/figures.py). report.md and report.json depend on the runs and the folder's
name (the title) alone: the same runs give the same bytes (tests/test_shipped_reports.py holds
the published studies to that).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import yaml

from megatron_ba.loss_settings import aggregation_label
from megatron_ba.recipe import Recipe
from megatron_ba.studies import design
from megatron_ba.studies import figures as study_figures
from megatron_ba.studies.grid import MANIFEST, Study
from megatron_ba.studies.run_records import (
    check_one_recipe,
    diagnostics,
    find_runs,
    first_step,
    flat,
    fmt,
    mean_of,
    mean_std,
    paired_interval,
    read_metrics,
    swept_keys,
)
from megatron_ba.train.run_log import eval_table

# The last column is late-training behaviour: how far each run ends below its own peak.
COLUMNS = ("acc_peak", "acc_last", "best_peak", "best_last", "acc_last_minus_peak")
RULE_KEYS = ("loss.rule", "loss.scope")  # a cell's aggregation: its rule and the rule's scope


class _Runs:
    """The runs of a report, grouped into cells (one value of each swept key but the seed).

    A run's aggregation is its rule and scope: where loss.rule is swept, loss.scope is part of
    every cell (a study may run token at both scopes; the label names the scope where it changes
    the weights). A key that some runs' recipe.yaml lacks (written before the key existed) is read
    at its default, as the recipe loader reads such a file, and the report lists it (loss.rule
    and loss.scope even where no run holds them: the cells' names rest on them)."""

    def __init__(self, folder: Path, keys: list[str] | None) -> None:
        self.paths = find_runs(folder)
        if not self.paths:
            raise ValueError(
                f"{folder}: no run folders (recipe.yaml and metrics.jsonl[.gz]) to report"
            )
        self.swept = swept_keys(folder, keys)
        self.resolved = {r: yaml.safe_load((r / "recipe.yaml").read_text()) for r in self.paths}
        own = {r: flat(self.resolved[r]) for r in self.paths}
        every = set().union(*own.values(), RULE_KEYS)  # the label needs the rule and scope
        defaults = flat(Recipe().to_dict())
        self.defaulted = sorted(k for k in every if any(k not in o for o in own.values()))
        self.recipes = {r: {k: o.get(k, defaults.get(k)) for k in sorted(every)} | o
                        for r, o in own.items()}  # fmt: skip
        by_rule = "loss.rule" in self.swept and "loss.scope" not in self.swept
        check_one_recipe(self.recipes, [*self.swept, "loss.scope"] if by_rule else self.swept)
        self.records = {r: read_metrics(r) for r in self.paths}
        self.tables = {r: eval_table(self.records[r]) for r in self.paths}
        self.diagnostics = {r: diagnostics(self.records[r]) for r in self.paths}
        self.first_step = {r: diagnostics(first_step(self.records[r])) for r in self.paths}
        cell_keys = [k for k in self.swept if k != "seed"]
        if by_rule:
            cell_keys.insert(cell_keys.index("loss.rule") + 1, "loss.scope")
        self.cell_keys = cell_keys
        self.cells: dict[tuple, list[Path]] = {}
        for r in self.paths:
            self.cells.setdefault(self.values(r), []).append(r)
        self.labels = self._labels()

    def values(self, run: Path) -> tuple:
        return tuple(self.recipes[run].get(k) for k in self.cell_keys)

    def aggregation(self, cell: tuple) -> tuple | None:
        """(rule, scope) of a cell, None where the rule is not swept."""
        if "loss.rule" not in self.cell_keys:
            return None
        at = [self.cell_keys.index(k) for k in RULE_KEYS]
        return cell[at[0]], cell[at[1]]

    def others(self, cell: tuple) -> tuple:
        """A cell's values of the swept keys other than its aggregation."""
        skip = RULE_KEYS if "loss.rule" in self.cell_keys else ()
        return tuple(v for k, v in zip(self.cell_keys, cell, strict=True) if k not in skip)

    def other_keys(self) -> list[str]:
        skip = RULE_KEYS if "loss.rule" in self.cell_keys else ()
        return [k for k in self.cell_keys if k not in skip]

    def _labels(self) -> dict[tuple, str]:
        """Each cell's label: its aggregation's name (self.names: aggregation_label; a rule the
        scope does not change that ran at both scopes names the scope too), then the other
        keys' values."""
        names = {c: aggregation_label(*self.aggregation(c)) if self.aggregation(c) else ""
                 for c in self.cells}  # fmt: skip
        named = [(self.others(c), n) for c, n in names.items() if n]
        self.names = {c: f"{n}, loss.scope={self.aggregation(c)[1]}"
                      if named.count((self.others(c), n)) > 1 else n
                      for c, n in names.items()}  # fmt: skip
        out = {}
        for cell, name in self.names.items():
            rest = [f"{k}={v}" for k, v in zip(self.other_keys(), self.others(cell), strict=True)]
            out[cell] = ", ".join(([name] if name else []) + rest) or "all"
        return out

    def label(self, cell: tuple) -> str:
        return self.labels[cell]

    def column(self, runs: list[Path], col: str, bench: str | None = None) -> list[float]:
        tables = [self.tables[r] for r in runs if self.tables[r]]
        rows = [t["average"] if bench is None else t["benchmarks"][bench] for t in tables]
        if col == "acc_last_minus_peak":
            return [row["acc_last"] - row["acc_peak"] for row in rows]
        return [row[col] for row in rows]


def _cell_rows(runs: _Runs, bench: str | None) -> list[str]:
    out = []
    for cell, paths in runs.cells.items():
        stats = [
            mean_std(runs.column(paths, c, bench))
            if runs.column(paths, c, bench)
            else (math.nan, math.nan)
            for c in COLUMNS
        ]
        cells = " | ".join(f"{fmt(m)} ± {fmt(sd)}" for m, sd in stats)
        out.append(f"| {bench or 'average'} | {runs.label(cell)} | {len(paths)} | {cells} |")
    return out


def paired_differences(runs: _Runs) -> list[dict]:
    """For every two aggregations (rule and scope) at the same other values: per-seed
    differences (a - b) of each column (the average over benchmarks), their mean and 95%
    interval. a and b: {"loss.rule", "loss.scope", "label"}."""
    if "loss.rule" not in runs.cell_keys:
        return []
    groups: dict[tuple, dict[tuple, list[Path]]] = {}
    for cell, paths in runs.cells.items():
        groups.setdefault(runs.others(cell), {})[runs.aggregation(cell)] = paths
    cell_of = {(runs.others(c), runs.aggregation(c)): c for c in runs.cells}
    out = []
    for rest, by_rule in groups.items():
        for a, b in itertools.combinations(sorted(by_rule), 2):
            seed_a = {runs.recipes[r]["seed"]: r for r in by_rule[a]}
            seed_b = {runs.recipes[r]["seed"]: r for r in by_rule[b]}
            seeds = sorted(set(seed_a) & set(seed_b))
            side = {x: dict(zip(RULE_KEYS, x, strict=True), label=runs.names[cell_of[rest, x]])
                    for x in (a, b)}  # fmt: skip
            row = {"a": side[a], "b": side[b], "others": list(rest), "seeds": seeds,
                   "columns": {}}  # fmt: skip
            for col in COLUMNS:
                diffs = [
                    runs.column([seed_a[s]], col)[0] - runs.column([seed_b[s]], col)[0]
                    for s in seeds
                    if runs.tables[seed_a[s]] and runs.tables[seed_b[s]]
                ]
                if diffs:
                    m, lo, hi = paired_interval(diffs)
                    row["columns"][col] = {"diffs": diffs, "mean": m, "low": lo, "high": hi}
            out.append(row)
    return out


def _numeric_keys(runs: _Runs) -> list[str]:
    return [
        k
        for k in runs.cell_keys
        if k not in RULE_KEYS
        and all(
            isinstance(runs.recipes[r].get(k), int | float)
            and not isinstance(runs.recipes[r].get(k), bool)
            for r in runs.paths
        )
    ]


def _diagnostic_table(runs: _Runs, of: dict) -> tuple[list[str], dict[str, dict]]:
    """The diagnostics per cell (means over seeds) of `of` (runs.diagnostics, runs.first_step),
    the columns no run logged left out."""
    per_cell = {}
    for cell, paths in runs.cells.items():
        each = [of[r] for r in paths]
        per_cell[runs.label(cell)] = {n: mean_of([d[n] for d in each]) for n in each[0]}
    names = [n for n in next(iter(per_cell.values()))
             if not all(math.isnan(c[n]) for c in per_cell.values())]  # fmt: skip
    lines = ["| cell | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, means in per_cell.items():
        lines.append(f"| {label} | " + " | ".join(fmt(means[n], ".4g") for n in names) + " |")
    return lines, per_cell


def _against_key_points(runs: _Runs, key: str) -> dict:
    """points[aggregation][value of key][diagnostic]: one value per run (figures.py draws
    them); the aggregation as the cells name it ("runs" where the rule is not swept)."""
    at = runs.cell_keys.index(key)
    points: dict = {}
    for cell, paths in runs.cells.items():
        rule = runs.names[cell] or "runs"
        for r in paths:
            for name, value in runs.diagnostics[r].items():
                points.setdefault(rule, {}).setdefault(cell[at], {}).setdefault(name, [])
                points[rule][cell[at]][name].append(value)
    return points


def _evaluated_on(runs: _Runs) -> str:
    """The benchmarks each Acc@k averages over and how many prompts each held: logged by the
    run (eval/NAME/problems), else the task's data.eval_prompts less those skipped as too long."""
    counts: dict[str, set] = {}
    for r in runs.paths:
        last = next((x for x in reversed(runs.records[r]) if "eval_accuracy" in x), None)
        for name in sorted(k.split("/")[1] for k in last or {} if k.endswith("/acc")):
            n = last.get(f"eval/{name}/problems")
            if n is None and name == "heldout":
                n = runs.recipes[r]["data.eval_prompts"] - last.get(
                    f"eval/{name}/skipped_too_long", 0
                )
            counts.setdefault(name, set()).add(n)
    shown = []
    for name, ns in counts.items():
        n = "not logged" if None in ns else "/".join(str(x) for x in sorted(ns))
        shown.append(f"{name}: {n} prompts")
    return "; ".join(shown) or "no evaluation"


def _pair_lines(pairs: list[dict]) -> list[str]:
    if not pairs:
        return []
    lines = [
        "",
        "## Rule against rule, seed by seed (a - b: mean [95% interval])",
        "",
        "| a | b | other values | seeds | " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for p in pairs:
        cells = [p["columns"].get(c) for c in COLUMNS]
        shown = [
            f"{fmt(c['mean'])} [{fmt(c['low'])}, {fmt(c['high'])}]" if c else "n/a" for c in cells
        ]
        lines.append(
            f"| {p['a']['label']} | {p['b']['label']} | {p['others']} | "
            f"{len(p['seeds'])} | " + " | ".join(shown) + " |"
        )
    return lines


def _figure_lines(runs: _Runs, figures: Path, k, draw: bool) -> list[str]:
    """The figures' markdown, and the figures written to `figures` where `draw`: the
    diagnostics against each swept numeric key, then the per-step curves of every cell."""
    lines = []
    for key in _numeric_keys(runs):
        lines += ["", f"### Against {key}", ""]
        if draw:
            drawn = study_figures.against_key_figures(_against_key_points(runs, key), key)
            study_figures.save(drawn, figures)
        for name, _ in study_figures.DIAGNOSTICS:
            path = Path(study_figures.against_key_name(name, key))
            lines += [f"![{path.stem}](figures/{path.name})", ""]
    cells = {runs.label(c): [runs.records[r] for r in paths] for c, paths in runs.cells.items()}
    acc = (f"held-out Acc@{k} ({k} samples per prompt; {_evaluated_on(runs)})",
           f"Acc@{k} (fraction of samples correct)")  # fmt: skip
    if draw:
        study_figures.save(study_figures.curve_figures(cells, acc), figures)
    lines += ["", "## Per-step curves (mean over seeds, band: lowest to highest seed)", ""]
    for key, name, title, _ in study_figures.CURVES:
        lines += [f"### {title or acc[0]}", "", f"![{key}](figures/{name})", ""]
    return lines


def _cells_json(runs: _Runs, per_cell: dict, first: dict) -> list[dict]:
    return [
        {
            "values": dict(zip(runs.cell_keys, cell, strict=True)),
            "label": runs.label(cell),
            "runs": [r.name for r in paths],
            "seeds": [runs.recipes[r].get("seed") for r in paths],
            "average": {
                c: dict(
                    zip(("mean", "std"), mean_std(runs.column(paths, c)), strict=True),
                    values=runs.column(paths, c),
                )
                for c in COLUMNS
                if runs.column(paths, c)
            },
            "diagnostics": per_cell[runs.label(cell)],
            "diagnostics_first_step": first[runs.label(cell)],
        }
        for cell, paths in runs.cells.items()
    ]


WEIGHT_SHARES = (
    "`RULE/weight_share_pos`: the positive responses' share of the objective weight under RULE "
    "at the run's own loss.scope, as the trainer logs it; `token_pooled/weight_share_pos`: under "
    "the pooled token mean, N+ / (N+ + N-); `count_share_pos`: the positives' share of the "
    "responses with a sign, k / (k + n); the last two from each step's logged counts and mean "
    "lengths, whatever the run's scope."
)


def _aggregations_line(runs: _Runs) -> str:
    """What the cells' aggregation names mean, or the one aggregation of every run."""
    if "loss.rule" in runs.cell_keys:
        return (
            "A cell names its aggregation by each run's recipe.yaml: the rule and, where the "
            "scope changes its weights, which mean: per-group mean (loss.scope group: the mean "
            "over prompt groups of each group's objective, the paper's formula) or pooled batch "
            "mean (loss.scope batch: the whole batch as one group, verl's token-mean)."
        )
    names = sorted({aggregation_label(runs.recipes[r]["loss.rule"], runs.recipes[r]["loss.scope"])
                    for r in runs.paths})  # fmt: skip
    return f"Aggregation of every run (its recipe.yaml): {', '.join(names)}."


def _rule_values(folder: Path, runs: _Runs) -> dict[str, set]:
    """Each loss.rule value of a study's grid -> the (rule, scope) pairs its runs ran."""
    if not (folder / MANIFEST).is_file():
        return {}
    values = Study.load(folder).element_values()
    out: dict[str, set] = {}
    for r in runs.paths:
        value = values.get(r.name, {}).get("loss.rule")
        if value is not None:
            out.setdefault(value, set()).add(
                (runs.recipes[r]["loss.rule"], runs.recipes[r]["loss.scope"])
            )
    return out


def write_report(folder: Path, keys: list[str] | None = None, *, figures: bool = True) -> Path:
    """folder/report.md, report.json and figures/ from the runs in `folder` (see the module);
    figures=False leaves figures/ as it is (report.md names the same files)."""
    folder = Path(folder)
    runs = _Runs(folder, keys)
    k = next(iter(runs.recipes.values())).get("eval.samples")
    benches = sorted({n for t in runs.tables.values() if t for n in t["benchmarks"]})
    pairs = paired_differences(runs)
    plan = Study.load(folder).plan if (folder / MANIFEST).is_file() else None
    plan_lines, plan_json = design.plan_section(
        plan,
        {r.name: runs.resolved[r] for r in runs.paths},
        pairs,
        runs.other_keys(),
        _rule_values(folder, runs),
    )
    defaulted = (
        [f"Keys that runs' recipe.yaml lacks (written before the key existed), read at their "
         f"defaults as the recipe loader reads such a file: {', '.join(runs.defaulted)}.", ""]
        if runs.defaulted else []
    )  # fmt: skip
    lines = [
        f"# Study report: {folder.name}",
        "",
        f"{len(runs.paths)} runs in {len(runs.cells)} cells; swept: {', '.join(runs.swept)}. "
        f"Acc@{k} / Best@{k} ({k} samples per prompt; {_evaluated_on(runs)}) at the peak "
        "evaluation and the last one: mean ± standard deviation over seeds (n - 1). Written by "
        "`megatron-ba report`.",
        "",
        _aggregations_line(runs),
        "",
        *defaulted,
        *plan_lines,
        "## Cells",
        "",
        "| benchmark | cell | seeds | Acc peak | Acc last | Best peak | Best last "
        "| Acc last - peak |",
        "|---|---|---|---|---|---|---|---|",
        *[row for b in [*benches, None] for row in _cell_rows(runs, b)],
        *_pair_lines(pairs),
    ]
    table, per_cell = _diagnostic_table(runs, runs.diagnostics)
    lines += ["", "## Diagnostics (means over training steps and seeds)", "", *table, ""]
    first, per_cell_first = _diagnostic_table(runs, runs.first_step)
    lines += ["### At the first step (the starting policy's rollouts; means over seeds)", ""]
    lines += [*first, "", WEIGHT_SHARES]
    lines += _figure_lines(runs, folder / "figures", k, figures)
    lines += ["## Runs", ""]
    lines += [f"- `{r.name}`: {runs.label(runs.values(r))}, seed {runs.recipes[r].get('seed')}"
              for r in runs.paths] + [""]  # fmt: skip
    report = {
        "swept": runs.swept,
        "cell_keys": runs.cell_keys,
        "plan": plan_json,
        "cells": _cells_json(runs, per_cell, per_cell_first),
        "pairs": pairs,
    }
    (folder / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (folder / "report.md").write_text("\n".join(lines))
    return folder / "report.md"
