"""Studies (studies/grid.py, commands/study.py): the grid, the manifest, the element folders,
the local runner's bookkeeping and the Slurm submission, without training (tests/test_slurm.py runs
a real array)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ba.recipe import RecipeError
from megatron_ba.studies import grid as study_mod
from megatron_ba.studies.grid import Axis, Study, elements, parse_grid, run_locally

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes/tiny-cpu.yaml")


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], r"--grid: give at least one"),
        (["seed"], r"--grid 'seed': expected KEY=V1,V2"),
        (["seed=0,,1"], r"no empty value"),
        (["seed=0,1,0"], r"a value is listed twice"),
        (["seed=0,1", "seed=2"], r"seed is swept twice"),
        (["loss.rule=token@pooled"], r"--grid loss\.rule: 'token@pooled': unknown scope 'pooled'"),
        (["loss.rule=tokens@batch"], r"unknown rule 'tokens'"),
        (["loss.rule=dr_grpo@batch"], r"the scope does not change dr_grpo's weights"),
        (["loss.rule=token@batch", "loss.scope=group,batch"], r"sets loss\.scope, which is swept"),
    ],
)
def test_a_bad_grid_names_the_flag(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_grid(specs)


def test_the_cross_product_in_axis_order_with_the_rule_first_in_each_name():
    axes = parse_grid(["grpo.max_new_tokens=32,64", "loss.rule=token,balanced", "seed=0,1"])
    got = elements(axes)
    assert len(got) == 8
    assert got[0].overrides == ("grpo.max_new_tokens=32", "loss.rule=token", "seed=0")
    assert got[1].overrides == ("grpo.max_new_tokens=32", "loss.rule=token", "seed=1")
    assert [e.name for e in got[:3]] == [
        "token-max_new_tokens32-seed0",
        "token-max_new_tokens32-seed1",
        "balanced-max_new_tokens32-seed0",
    ]
    assert [e.index for e in got] == list(range(8))
    odd = elements([Axis("data.path", ("a/b.parquet", "c d.parquet"))])
    assert [e.name for e in odd] == ["patha_b.parquet", "pathc_d.parquet"]  # one path part


def test_a_rule_at_a_scope_sets_both_keys_and_its_name_says_the_scope():
    got = elements(parse_grid(["seed=0,1", "loss.rule=token@group,token@batch,balanced"]))
    assert [e.name for e in got[:3]] == [
        "token-scopegroup-seed0",
        "token-scopebatch-seed0",
        "balanced-seed0",
    ]
    assert got[1].overrides == ("seed=0", "loss.rule=token", "loss.scope=batch")
    assert got[2].overrides == ("seed=0", "loss.rule=balanced")  # the recipe's scope


def test_two_elements_of_the_same_recipe_are_refused(tmp_path):
    ok = Study.open(tmp_path / "ok", TINY, [], parse_grid(["loss.rule=token@group,token@batch"]))
    assert [e.name for e in ok.elements] == ["token-scopegroup", "token-scopebatch"]
    with pytest.raises(ValueError, match=r"^elements token and token-scopegroup are the same"):
        Study.open(tmp_path / "s", TINY, [], parse_grid(["loss.rule=token,token@group"]))
    assert not (tmp_path / "s").exists()  # tiny-cpu.yaml's scope is group: the same run twice


def test_the_manifest_is_written_once_and_another_study_is_refused(tmp_path):
    axes = parse_grid(["loss.rule=token,balanced", "seed=0,1"])
    s = Study.open(tmp_path / "s", TINY, ["grpo.steps=2"], axes, write=False)
    assert not (tmp_path / "s").exists()  # a dry run writes nothing
    s = Study.open(tmp_path / "s", TINY, ["grpo.steps=2"], axes)
    manifest = json.loads((tmp_path / "s" / "study.json").read_text())
    assert manifest["recipe"] == TINY and manifest["overrides"] == ["grpo.steps=2"]
    assert [e["name"] for e in manifest["elements"]] == [e.name for e in s.elements]
    again = Study.open(tmp_path / "s", TINY, ["grpo.steps=2"], axes)  # the same: reopened
    assert again.elements == s.elements and Study.load(tmp_path / "s").elements == s.elements
    with pytest.raises(
        ValueError,
        match=r"another study \(overrides \['grpo.steps=2'\] there, \['grpo.steps=3'\] given; grid",
    ):
        Study.open(tmp_path / "s", TINY, ["grpo.steps=3"], parse_grid(["seed=0,1"]))


def test_a_bad_value_fails_before_anything_runs_naming_the_element(tmp_path):
    with pytest.raises(RecipeError, match=r"^element nope-seed0: loss\.rule: must be one of"):
        Study.open(tmp_path / "s", TINY, [], parse_grid(["loss.rule=token,nope", "seed=0,1"]))
    assert not (tmp_path / "s").exists()


def test_status_and_train_arguments(tmp_path):
    s = Study.open(tmp_path / "s", TINY, ["grpo.steps=2"], parse_grid(["seed=0,1,2"]))
    new, resumed, done = s.elements
    (s.run_dir(resumed) / "checkpoints").mkdir(parents=True)
    (s.run_dir(resumed) / "checkpoints" / "latest").write_text("2")
    s.run_dir(done).mkdir()
    (s.run_dir(done) / "summary.json").write_text("{}")
    assert [s.status(e) for e in s.elements] == ["new", "resume", "finished"]
    assert s.train_arguments(new) == ["train", TINY, "grpo.steps=2", "seed=0", "--run-dir",
                                      str(s.run_dir(new)), "--cache-dir",
                                      str(tmp_path / "s" / ".cache")]  # fmt: skip
    assert s.train_arguments(resumed)[3:6] == ["seed=1", "--resume", str(s.run_dir(resumed))]


def test_run_locally_keeps_finished_elements_and_names_a_failed_one(tmp_path, monkeypatch):
    s = Study.open(tmp_path / "s", TINY, [], parse_grid(["seed=0,1,2"]))
    s.run_dir(s.elements[0]).mkdir()
    (s.run_dir(s.elements[0]) / "summary.json").write_text("{}")
    s.run_dir(s.elements[1]).mkdir()
    (s.run_dir(s.elements[1]) / "stale.txt").write_text("no checkpoint: started afresh")
    ran = []

    def fake_run(cmd, env):
        ran.append(cmd)
        run_dir = Path(cmd[cmd.index("--run-dir") + 1])
        assert not (run_dir / "stale.txt").exists()
        return subprocess.CompletedProcess(cmd, 0 if len(ran) == 1 else 3)

    monkeypatch.setattr(study_mod.subprocess, "run", fake_run)
    ticks = iter(range(0, 1000, 60))  # every clock reading a minute later
    lines = []
    with pytest.raises(RuntimeError, match=r"element seed2 failed with exit status 3"):
        run_locally(s, log=lines.append, clock=lambda: next(ticks))
    assert [c[c.index("train") + 2] for c in ran] == ["seed=1", "seed=2"]  # seed0 was finished
    assert lines[0] == "[study] 1/3 elements finished earlier; 2 to run"
    # readings: 0 start, 60 began, 120 ended (1 min spent), 180 now; one element left
    assert "seed1: finished in 1m00s; 2/3 done, study 3m00s, ETA 1m00s" in lines[2]


def _cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ba.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_dry_run_of_a_3x3x2_grid_prints_18_elements_and_one_array(tmp_path):
    out = tmp_path / "s"
    p = _cli("study", TINY, "grpo.steps=2", "--grid", "loss.rule=token,sequence,balanced",
             "--grid", "grpo.max_new_tokens=32,64,96", "--grid", "seed=0,1", "--out", str(out),
             "--slurm", "--max-parallel", "4", "--sbatch-args", "--time=01:00:00 --mem=8G",
             "--dry-run")  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"study: 18 elements in {out}"
    assert len([line for line in lines if line.startswith("   ")]) == 18
    (submission,) = [line for line in lines if line.startswith("submission: ")]
    assert submission == (
        f"submission: sbatch --parsable --array=0-17%4 --job-name=s "
        f"--export=ALL,MBA_STUDY={out},CACHE_DIR={out}/.cache,MBA_HOME={ROOT} "
        f"--output={out}/slurm-%A_%a.out "
        f"--time=01:00:00 --mem=8G {ROOT}/slurm/grpo_balanced.sh {TINY}"
    )
    assert not out.exists()


def test_study_cli_errors_name_the_flag(tmp_path):
    p = _cli("study", TINY, "--grid", "seed", "--out", str(tmp_path / "s"))
    assert p.returncode == 2 and "study: --grid 'seed': expected KEY=V1,V2" in p.stderr
    p = _cli("study", TINY, "--grid", "seed=0,1", "--out", str(tmp_path / "s"), "--max-parallel",
             "2")  # fmt: skip
    assert p.returncode == 2 and "are for --slurm" in p.stderr


def test_an_array_task_reads_its_element(tmp_path):
    s = Study.open(tmp_path / "s", TINY, ["grpo.steps=2"], parse_grid(["seed=0,1"]))
    element = [
        sys.executable,
        "-m",
        "megatron_ba.studies.grid",
        "element",
        str(tmp_path / "s"),
        "1",
    ]
    p = subprocess.run(element, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(s.run_dir(s.elements[1]).resolve()), "grpo.steps=2", "seed=1"]
