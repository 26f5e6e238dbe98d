"""A study's plan: what it will run and what decides it, declared in study.json before any run.

    plan = make_plan(study, compare=("balanced", "token"), metric="acc_last")
    differences = plan_differences(plan, runs)         # [] when the runs are the planned ones

`megatron-ba study ... --plan-only` writes study.json with its plan and runs nothing; the same
command without the flag runs it (a plain `megatron-ba study` declares the plan as it starts).
The plan holds when it was declared and from which commit, the recipe file's sha256, every
element's resolved recipe as a sha256 (the run folder's recipe.yaml hashes to it), the seeds,
and the comparison that decides the study: rule a minus rule b on one report column, paired by
seed. The report (studies/reporting.py) states whether the runs are the planned ones and prints
the declared comparison first. The resolved hashes, not the file's, are what a run can be checked
against: a comment edited in the recipe changes the file and no run.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from megatron_ba.recipe import load_recipe

# The report's columns a plan may name as the deciding metric (reporting.COLUMNS).
METRICS = ("acc_peak", "acc_last", "best_peak", "best_last", "acc_last_minus_peak")


def recipe_sha256(resolved: dict) -> str:
    """The sha256 of a resolved recipe (Recipe.to_dict(), or a run's recipe.yaml read back):
    canonical JSON, so that YAML's layout and key order do not matter."""
    text = json.dumps(resolved, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _commit(where: Path) -> dict:
    """The git commit the plan was declared from, and whether the tree had changes."""
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "uncommitted_changes": None}
    if head.returncode != 0:
        return {"commit": None, "uncommitted_changes": None}
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def default_compare(rules: list[str]) -> tuple[str, str] | None:
    """balanced against token when the study sweeps both, else no declared comparison. Where
    the grid holds several token means (`token`, `token@group`, `token@batch`), balanced is
    compared with the pooled one, `token@batch`: the token-mean of verl, whose runs the paper
    reports."""
    tokens = [t for t in ("token@batch", "token", "token@group") if t in rules]
    return ("balanced", tokens[0]) if "balanced" in rules and tokens else None


def make_plan(study, compare: tuple[str, str] | None, metric: str, *, clock=time.time) -> dict:
    """The plan of `study` (a train.study.Study whose elements all load), declared now.

    compare: the two rules whose paired difference decides, both among the study's loss.rule
    values (ValueError naming --compare otherwise); metric: one of METRICS (--metric)."""
    rules = next((list(a.values) for a in study.axes if a.key == "loss.rule"), [])
    if compare is not None:
        missing = [r for r in compare if r not in rules]
        if len(compare) != 2 or compare[0] == compare[1] or missing:
            raise ValueError(
                f"--compare {','.join(compare)}: give two different rules of the study's "
                f"--grid loss.rule ({','.join(rules) or 'not swept'})"
            )
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r}: choose one of {', '.join(METRICS)}")
    resolved = {
        e.name: load_recipe(study.recipe, [*study.overrides, *e.overrides]).to_dict()
        for e in study.elements
    }
    recipe = Path(study.recipe)
    return {
        "declared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(clock())),
        **_commit(recipe.parent),
        "recipe_file_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest(),
        "element_recipe_sha256": {name: recipe_sha256(r) for name, r in resolved.items()},
        "seeds": sorted({r["seed"] for r in resolved.values()}),
        "decision": {
            "compare": list(compare) if compare else None,
            "metric": metric,
            "over": "the average over benchmarks, paired by seed",
        },
    }


def check_unchanged(plan: dict, study) -> None:
    """ValueError naming the elements whose recipe, resolved now, is not the planned one (the
    recipe file was edited since the plan was declared)."""
    planned = plan["element_recipe_sha256"]
    changed = [
        e.name
        for e in study.elements
        if recipe_sha256(load_recipe(study.recipe, [*study.overrides, *e.overrides]).to_dict())
        != planned.get(e.name)
    ]
    if changed:
        raise ValueError(
            f"{study.recipe}: the recipe of {', '.join(changed)} differs from the plan declared "
            f"at {plan['declared_at']} (study.json); declare a new study with another --out"
        )


def plan_differences(plan: dict, runs: dict[str, dict]) -> list[str]:
    """How the runs (element name -> its recipe.yaml as read) differ from the plan: elements
    without a run, runs no element planned, recipes that are not the planned ones, other seeds.
    [] when the runs are exactly the planned ones."""
    planned = plan["element_recipe_sha256"]
    out = [f"element {n}: no run" for n in planned if n not in runs]
    out += [f"run {n}: not an element of the plan" for n in runs if n not in planned]
    out += [
        f"run {n}: recipe.yaml is not the planned recipe (sha256 {recipe_sha256(r)[:12]}, "
        f"planned {planned[n][:12]})"
        for n, r in runs.items()
        if n in planned and recipe_sha256(r) != planned[n]
    ]
    seeds = sorted({r.get("seed") for r in runs.values()}, key=str)
    if runs and seeds != plan["seeds"]:
        out.append(f"seeds {seeds}, planned {plan['seeds']}")
    return out


def _aggregation(side: dict) -> tuple[str, str]:
    return side["loss.rule"], side["loss.scope"]


def decision_rows(decision: dict, pairs: list[dict], resolve: dict[str, set]) -> list[dict]:
    """One declared comparison's result, one row per value of the other swept keys: the paired
    difference a - b on the declared metric, its mean and 95% interval (reporting.py's pairs,
    turned round where the report ordered the two the other way). resolve: each loss.rule value
    of the grid -> the (rule, scope) pairs its runs ran (`token` -> the recipe's scope); where
    both values ran at several scopes (loss.scope swept too) each scope is compared with its own."""
    compare, metric = decision["compare"], decision["metric"]
    if compare is None:
        return []
    want_a, want_b = (resolve.get(v, set()) for v in compare)
    rows = []
    for p in pairs:
        col = p["columns"].get(metric)
        a, b = _aggregation(p["a"]), _aggregation(p["b"])
        if a in want_a and b in want_b:
            sign, first, second = 1.0, p["a"], p["b"]
        elif b in want_a and a in want_b:
            sign, first, second = -1.0, p["b"], p["a"]
        else:
            continue
        if col is None or (len(want_a) > 1 and len(want_b) > 1 and a[1] != b[1]):
            continue
        low, high = sorted((sign * col["low"], sign * col["high"]))
        rows.append({"labels": [first["label"], second["label"]], "others": p["others"],
                     "seeds": p["seeds"], "mean": sign * col["mean"], "low": low,
                     "high": high})  # fmt: skip
    return rows


def plan_section(
    plan: dict | None,
    runs: dict[str, dict],
    pairs: list[dict],
    others: list[str],
    resolve: dict[str, set],
):
    """The report's plan section: markdown lines and report.json's "plan". runs: element name ->
    its recipe.yaml as read; others: the swept keys besides the rule, its scope and the seed;
    resolve: as decision_rows takes it."""
    if plan is None:
        text = "No plan was declared: the folder has no study.json with a plan (a study made "
        text += "before studies declared plans, or run folders gathered by hand)."
        return ["## Plan", "", text, ""], {"declared": None}
    differences = plan_differences(plan, runs)
    d = plan["decision"]
    commit = (plan["commit"] or "no git commit")[:12]
    if plan.get("uncommitted_changes"):
        commit += ", with uncommitted changes"
    lines = [
        "## Plan",
        "",
        f"Declared in study.json at {plan['declared_at']} ({commit}): recipe file sha256 "
        f"{plan['recipe_file_sha256'][:12]}, {len(plan['element_recipe_sha256'])} elements, "
        f"seeds {', '.join(str(s) for s in plan['seeds'])}; the deciding comparison: "
        + (f"{d['compare'][0]} - {d['compare'][1]} on {d['metric']} ({d['over']})."
           if d["compare"] else "none declared."),
        "",
    ]  # fmt: skip
    if differences:
        lines += ["**The runs are not the declared plan:**", ""]
        lines += [f"- {x}" for x in differences] + [""]
    else:
        lines += ["The runs are the declared plan: one run per element, each run's recipe.yaml "
                  "the planned recipe (sha256), the planned seeds.", ""]  # fmt: skip
    rows = decision_rows(d, pairs, resolve)
    for r in rows:
        where = "".join(f", {k}={v}" for k, v in zip(others, r["others"], strict=True))
        lines.append(
            f"- {r['labels'][0]} - {r['labels'][1]}, {d['metric']}{where}: "
            f"{r['mean']:+.4f} [{r['low']:+.4f}, {r['high']:+.4f}], {len(r['seeds'])} seeds"
        )
    if rows:
        lines.append("")
    result = {"declared": plan, "differences": differences, "decision": rows}
    return lines, result
