"""A study's plan (studies/design.py, `megatron-ba study --plan-only`): declared in study.json
before anything runs, refused when the recipe or the decision changes afterwards, and checked
against the runs' own recipe.yaml files."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ba.recipe import load_recipe
from megatron_ba.studies.design import plan_differences, recipe_sha256
from megatron_ba.studies.grid import Study, parse_grid

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-cpu.yaml"
GRID = ["--grid", "loss.rule=token,balanced", "--grid", "seed=0,1"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ba.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _runs(study: Study, tmp_path: Path) -> dict[str, dict]:
    """Each element's recipe.yaml as a run writes it (Recipe.dump), read back as the report
    reads it."""
    out = {}
    for e in study.elements:
        path = tmp_path / f"{e.name}.yaml"
        load_recipe(study.recipe, [*study.overrides, *e.overrides]).dump(path)
        out[e.name] = yaml.safe_load(path.read_text())
    return out


def test_plan_only_declares_the_study_and_runs_nothing(tmp_path):
    out = tmp_path / "s"
    p = _cli("study", str(TINY), "grpo.steps=2", *GRID, "--out", str(out), "--plan-only")
    assert p.returncode == 0, p.stderr
    assert "plan declared" in p.stdout and "nothing has run" in p.stdout
    assert sorted(x.name for x in out.iterdir()) == ["study.json"]  # no run folder, no report
    plan = json.loads((out / "study.json").read_text())["plan"]
    assert plan["recipe_file_sha256"] == hashlib.sha256(TINY.read_bytes()).hexdigest()
    assert plan["seeds"] == [0, 1]
    assert plan["decision"]["compare"] == ["balanced", "token"]
    assert plan["decision"]["metric"] == "acc_last"
    study = Study.load(out)
    runs = _runs(study, tmp_path)  # what each element's run folder will hold
    assert plan["element_recipe_sha256"] == {n: recipe_sha256(r) for n, r in runs.items()}
    assert plan_differences(plan, runs) == []


def test_the_runs_are_checked_against_the_plan(tmp_path):
    study = Study.open(tmp_path / "s", TINY, ["grpo.steps=2"], parse_grid(GRID[1::2]))
    runs = _runs(study, tmp_path)
    runs["token-seed1"]["optimizer"]["lr"] *= 2  # a run of another recipe
    del runs["balanced-seed0"]
    assert plan_differences(study.plan, runs) == [
        "element balanced-seed0: no run",
        f"run token-seed1: recipe.yaml is not the planned recipe (sha256 "
        f"{recipe_sha256(runs['token-seed1'])[:12]}, planned "
        f"{study.plan['element_recipe_sha256']['token-seed1'][:12]})",
    ]
    runs = {n: r for n, r in _runs(study, tmp_path).items() if n.endswith("seed0")}
    assert plan_differences(study.plan, runs) == [
        "element token-seed1: no run",
        "element balanced-seed1: no run",
        "seeds [0], planned [0, 1]",
    ]


def test_a_recipe_edited_after_the_plan_is_refused_a_comment_is_not(tmp_path):
    recipe = tmp_path / "r.yaml"
    shutil.copy(TINY, recipe)
    axes = parse_grid(["seed=0,1"])
    Study.open(tmp_path / "s", recipe, [], axes)
    recipe.write_text(recipe.read_text() + "# a comment changes the file, not a run\n")
    Study.open(tmp_path / "s", recipe, [], axes)
    recipe.write_text(recipe.read_text().replace("lr: 0.0002", "lr: 0.0003"))
    with pytest.raises(ValueError, match=r"the recipe of seed0, seed1 differs from the plan"):
        Study.open(tmp_path / "s", recipe, [], axes)


def test_the_decision_is_checked_and_kept(tmp_path):
    out = str(tmp_path / "s")
    p = _cli("study", str(TINY), *GRID, "--out", out, "--compare", "balanced,sequence",
             "--plan-only")  # fmt: skip
    assert p.returncode == 2 and "--compare balanced,sequence: give two different rules" in p.stderr
    p = _cli("study", str(TINY), *GRID, "--out", out, "--metric", "acc", "--plan-only")
    assert p.returncode == 2 and "--metric 'acc': choose one of acc_peak" in p.stderr
    p = _cli("study", str(TINY), *GRID, "--out", out, "--compare", "token,balanced",
             "--metric", "best_last", "--plan-only")  # fmt: skip
    assert p.returncode == 0, p.stderr
    p = _cli("study", str(TINY), *GRID, "--out", out, "--metric", "acc_last", "--dry-run")
    assert p.returncode == 2 and "--metric acc_last: the plan in study.json declared best_last" in (
        p.stderr
    )
    assert Study.load(Path(out)).plan["decision"]["compare"] == ["token", "balanced"]
