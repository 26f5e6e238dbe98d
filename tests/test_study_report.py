"""`megatron-ba report` (studies/reporting.py) on run folders written here with hand-chosen
metrics: cell means and standard deviations, the paired rule differences with their 95% intervals,
the diagnostics against a swept length, and the refusal of runs of different recipes."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml

from megatron_ba.cli import main
from megatron_ba.commands.compare import DEFAULT_RULES
from megatron_ba.recipe import load_recipe
from megatron_ba.studies import figures as study_figures
from megatron_ba.studies.grid import Axis, Study, parse_grid
from megatron_ba.studies.reporting import write_report
from megatron_ba.studies.run_records import paired_interval, read_metrics, signed_shares

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes/tiny-cpu.yaml"
KEYS = ["loss.rule", "grpo.max_new_tokens", "seed"]


def _acc_last(rule: str, seed: int, pooled: bool = False) -> float:
    if rule == "token":  # the pooled token mean 0.05 above the per-group one
        return 0.5 + 0.1 * seed + (0.05 if pooled else 0.0)
    return 0.6 + 0.2 * seed  # balanced - token: .1 .2 .3


def _run(folder: Path, rule: str, length: int, seed: int, *extra: str) -> Path:
    run = folder / f"{rule}-{length}-{seed}{'-x' if extra else ''}"
    run.mkdir(parents=True)
    overrides = [f"loss.rule={rule}", f"grpo.max_new_tokens={length}", f"seed={seed}", *extra]
    load_recipe(TINY, overrides).dump(run / "recipe.yaml")
    last = _acc_last(rule, seed, pooled="loss.scope=batch" in extra)
    evals = [(0, 0.1), (2, last + 0.05), (4, last)]  # the peak at step 2
    rows = []
    for step in range(5):
        if step:
            rows.append({
                "step": step, "pg_loss": 0.01 * length if rule == "token" else 0.0,
                "length_mean_pos": length / 2, "length_mean_neg": float(length),
                "length_var": float(length), "length_gap_pos_minus_neg": -length / 2,
                "token/weight_share_pos": 1 / 3, "balanced/weight_share_pos": 0.5,
                "num_pos": 2.0 + step, "num_neg": 6.0 - step,
            })  # fmt: skip
        for s, acc in evals:
            if s == step:
                rows.append({"step": step, "eval_accuracy": acc, "eval_best_at_k": acc + 0.2,
                             "eval/heldout/acc": acc, "eval/heldout/best": acc + 0.2})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.fixture
def runs(tmp_path) -> Path:
    for rule in ("token", "balanced"):
        for length in (32, 64):
            for seed in (0, 1, 2):
                _run(tmp_path / "runs", rule, length, seed)
    return tmp_path / "runs"


def test_cells_pairs_and_diagnostics_are_the_hand_computed_values(runs):
    report = write_report(runs, KEYS)
    got = json.loads((runs / "report.json").read_text())
    assert got["swept"] == KEYS and len(got["cells"]) == 4
    cell = {"loss.rule": "token", "loss.scope": "group", "grpo.max_new_tokens": 32}
    token32 = next(c for c in got["cells"] if c["values"] == cell)
    assert token32["label"] == "token (per-group mean), grpo.max_new_tokens=32"
    assert token32["seeds"] == [0, 1, 2]
    last = token32["average"]["acc_last"]
    assert last["values"] == pytest.approx([0.5, 0.6, 0.7])
    assert (last["mean"], last["std"]) == pytest.approx((0.6, 0.1))  # sd with n - 1
    assert token32["average"]["acc_peak"]["mean"] == pytest.approx(0.65)
    assert token32["average"]["best_last"]["mean"] == pytest.approx(0.8)
    drop = token32["average"]["acc_last_minus_peak"]  # each seed ends 0.05 below its peak
    assert drop["values"] == pytest.approx([-0.05] * 3) and drop["std"] == pytest.approx(0.0)
    d = token32["diagnostics"]
    assert d["pg_loss_mean"] == pytest.approx(0.32) and d["pg_loss_mean_abs"] == pytest.approx(0.32)
    assert d["neg_over_pos_length"] == pytest.approx(2.0)
    assert d["token/weight_share_pos"] == pytest.approx(1 / 3)
    assert d["balanced/weight_share_pos"] == pytest.approx(0.5)
    assert (d["length_var"], d["length_gap_pos_minus_neg"]) == pytest.approx((32.0, -16.0))
    # k = 2 + step of 8 positive, T+ = T-/2: the pooled token mean's share k / (k + 2 (8 - k))
    pooled = [k / (k + 2 * (8 - k)) for k in (3, 4, 5, 6)]
    assert d["token_pooled/weight_share_pos"] == pytest.approx(sum(pooled) / 4)
    assert d["count_share_pos"] == pytest.approx((3 + 4 + 5 + 6) / 4 / 8)
    first = token32["diagnostics_first_step"]  # step 1 alone
    assert (first["token_pooled/weight_share_pos"], first["count_share_pos"]) == pytest.approx(
        (3 / 13, 3 / 8)
    )
    (pair32,) = [p for p in got["pairs"] if p["others"] == [32]]
    assert [pair32[x]["loss.rule"] for x in "ab"] == ["balanced", "token"]
    assert pair32["b"]["label"] == "token (per-group mean)" and pair32["seeds"] == [0, 1, 2]
    c = pair32["columns"]["acc_last"]
    half = 4.303 * 0.1 / math.sqrt(3)  # t(0.975, 2 df) x sd / sqrt(n)
    assert c["diffs"] == pytest.approx([0.1, 0.2, 0.3])
    assert (c["mean"], c["low"], c["high"]) == pytest.approx((0.2, 0.2 - half, 0.2 + half))
    text = report.read_text()
    row = "| average | token (per-group mean), grpo.max_new_tokens=32 | 3 | 0.6500 ± 0.1000 | "
    assert row + "0.6000 ± 0.1000 | 0.8500 ± 0.1000 | 0.8000 ± 0.1000 | -0.0500 ± 0.0000 |" in text
    assert "dr_grpo/weight_share_pos" not in text  # no run logs it: no column
    assert "### Against grpo.max_new_tokens" in text
    for name in ("pg_loss_mean", "neg_over_pos_length", "length_var", "length_gap_pos_minus_neg"):
        assert (runs / "figures" / f"{name}_vs_max_new_tokens.png").stat().st_size > 0


def test_the_interval_of_one_pair_and_of_many():
    m, lo, hi = paired_interval([1.0])
    assert m == 1.0 and math.isnan(lo) and math.isnan(hi)  # one seed: no interval
    xs = [0.1 * i for i in range(40)]  # 39 df: beyond the table, the normal 1.96
    sd = math.sqrt(sum((x - 1.95) ** 2 for x in xs) / 39)
    assert paired_interval(xs) == pytest.approx((1.95, 1.95 - 1.96 * sd / math.sqrt(40),
                                                 1.95 + 1.96 * sd / math.sqrt(40)))  # fmt: skip


def test_runs_of_another_recipe_are_refused_by_key(runs):
    _run(runs, "token", 32, 0, "optimizer.lr=0.001")  # differs from its twin in the lr only
    with pytest.raises(ValueError, match=r"differ in keys that are not swept \(optimizer\.lr: "
                                         r"0\.0002, 0\.001\)"):  # fmt: skip
        write_report(runs, KEYS)
    p = subprocess.run([sys.executable, "-m", "megatron_ba.cli", "report", str(runs), "--keys",
                        ",".join(KEYS)], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert p.returncode == 2 and "report: the runs' recipes differ" in p.stderr


def test_without_keys_a_swept_length_is_a_difference(runs):
    with pytest.raises(ValueError, match=r"grpo\.max_new_tokens: 32, 64"):
        write_report(runs)  # default: loss.rule and seed only


def test_a_study_folder_reports_its_elements_with_its_axes(tmp_path):
    axes = parse_grid(["loss.rule=token,balanced", "seed=0,1,2"])
    study = Study.open(tmp_path / "s", str(TINY), ["grpo.max_new_tokens=32"], axes)
    for e in study.elements:
        rule, seed = e.overrides[0].split("=")[1], int(e.overrides[1].split("=")[1])
        made = _run(tmp_path / "made", rule, 32, seed)
        made.rename(study.run_dir(e))
    write_report(study.folder)
    got = json.loads((study.folder / "report.json").read_text())
    assert got["swept"] == ["loss.rule", "seed"]
    assert [c["values"] for c in got["cells"]] == [
        {"loss.rule": "token", "loss.scope": "group"},
        {"loss.rule": "balanced", "loss.scope": "group"},
    ]


def test_compare_reports_group_token_mean_against_token(tmp_path, capsys):
    """`megatron-ba compare --rules token,group_token_mean`: the rule axis takes the new rule, each
    element's recipe validates it, the report pairs it with token seed by seed (--report-only, on
    run folders written here); an unknown rule is refused naming --rules (the control)."""
    out, shared = tmp_path / "cmp", ["grpo.max_new_tokens=32"]
    rules = ["token", "group_token_mean"]
    seed = load_recipe(TINY, shared).seed
    axes = [Axis("loss.rule", tuple(rules)), Axis("seed", (str(seed), str(seed + 1)))]
    study = Study.open(out, str(TINY), shared, axes)  # the study compare opens
    for e in study.elements:
        rule, s = e.overrides[0].split("=")[1], int(e.overrides[1].split("=")[1])
        _run(tmp_path / "made", rule, 32, s).rename(study.run_dir(e))
    cmd = ["compare", str(TINY), *shared, "--rules", ",".join(rules), "--seeds", "2"]
    assert main([*cmd, "--out", str(out), "--report-only"]) == 0
    got = json.loads((out / "report.json").read_text())
    assert [c["values"] for c in got["cells"]] == [
        {"loss.rule": r, "loss.scope": "group"} for r in rules
    ]
    (pair,) = got["pairs"]
    labels = [pair["a"]["label"], pair["b"]["label"]]
    assert labels == ["group_token_mean", "token (per-group mean)"]
    assert pair["columns"]["acc_last"]["diffs"] == pytest.approx(
        [0.1 + 0.1 * seed, 0.2 + 0.1 * seed]
    )
    capsys.readouterr()
    assert main(["compare", str(TINY), "--rules", "token,group_mean", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--rules: unknown ['group_mean']" in err and "group_token_mean" in err


def test_the_report_states_the_plan_and_its_comparison(tmp_path):
    axes = parse_grid(["loss.rule=token,balanced", "seed=0,1,2"])
    study = Study.open(tmp_path / "s", str(TINY), ["grpo.max_new_tokens=32"], axes)
    for e in study.elements:
        rule, seed = e.overrides[0].split("=")[1], int(e.overrides[1].split("=")[1])
        _run(tmp_path / "made", rule, 32, seed).rename(study.run_dir(e))
    text = write_report(study.folder).read_text()
    got = json.loads((study.folder / "report.json").read_text())["plan"]
    assert got["differences"] == [] and "The runs are the declared plan" in text
    assert got["declared"]["decision"]["compare"] == ["balanced", "token"]
    half = 4.303 * 0.1 / math.sqrt(3)  # balanced - token on acc_last: 0.1, 0.2, 0.3
    (row,) = got["decision"]
    assert (row["mean"], row["low"], row["high"]) == pytest.approx((0.2, 0.2 - half, 0.2 + half))
    shown = f"+0.2000 [{0.2 - half:+.4f}, {0.2 + half:+.4f}]"
    assert f"- balanced (per-group mean) - token (per-group mean), acc_last: {shown}" in text
    assert (
        "Acc@4 / Best@4 (4 samples per prompt; heldout: 128 prompts)" in text
    )  # data.eval_prompts
    # a run whose recipe is not the planned one (another seed), an element without metrics
    run = study.run_dir(study.elements[0])
    (run / "recipe.yaml").write_text(
        (run / "recipe.yaml").read_text().replace("seed: 0", "seed: 5")
    )
    (study.run_dir(study.elements[2]) / "metrics.jsonl").unlink()
    text = write_report(study.folder).read_text()
    assert "**The runs are not the declared plan:**" in text
    assert f"- element {study.elements[2].name}: no run" in text
    assert f"- run {study.elements[0].name}: recipe.yaml is not the planned recipe" in text
    assert "- seeds [0, 1, 2, 5], planned [0, 1, 2]" in text


def test_compressed_metrics_report_the_same(runs):
    report = write_report(runs, KEYS)
    before = report.read_text(), (runs / "report.json").read_text()
    for metrics in runs.glob("*/metrics.jsonl"):
        with gzip.open(metrics.with_suffix(".jsonl.gz"), "wt") as f:
            f.write(metrics.read_text())
        metrics.unlink()
    assert (write_report(runs, KEYS).read_text(), (runs / "report.json").read_text()) == before
    assert "No plan was declared" in before[0]  # run folders gathered by hand


def _element_run(study: Study, e, made: Path) -> None:
    """A run folder written here for a study element (its rule, scope and seed)."""
    o = dict(x.split("=", 1) for x in e.overrides)
    extra = [f"loss.scope={o['loss.scope']}"] if "loss.scope" in o else []
    _run(made, o["loss.rule"], 32, int(o["seed"]), *extra).rename(study.run_dir(e))


def _legends(drawn: dict) -> list[str]:
    (ax,) = drawn["eval_accuracy.png"].axes
    return ax.get_legend_handles_labels()[1]


def test_each_token_mean_is_named_from_its_runs_recipe(tmp_path, monkeypatch):
    """A per-group and a pooled token run in one report: each cell, pair, figure legend and run
    line names its mean, read from the run's recipe.yaml (loss.scope)."""
    folder = tmp_path / "runs"
    for seed in (0, 1):
        _run(folder, "token", 32, seed)
        _run(folder, "token", 32, seed, "loss.scope=batch")
    drawn: dict = {}
    monkeypatch.setattr(study_figures, "save", lambda figs, out: drawn.update(figs))
    text = write_report(folder).read_text()
    got = json.loads((folder / "report.json").read_text())
    assert [(c["values"], c["label"]) for c in got["cells"]] == [
        ({"loss.rule": "token", "loss.scope": "group"}, "token (per-group mean)"),
        ({"loss.rule": "token", "loss.scope": "batch"}, "token (pooled batch mean)"),
    ]
    (pair,) = got["pairs"]
    assert (pair["a"]["label"], pair["b"]["label"]) == (
        "token (pooled batch mean)",
        "token (per-group mean)",
    )
    assert pair["columns"]["acc_last"]["diffs"] == pytest.approx([0.05, 0.05])
    assert "| average | token (pooled batch mean) | 2 | " in text
    assert "- `token-32-0-x`: token (pooled batch mean), seed 0" in text
    assert "- `token-32-0`: token (per-group mean), seed 0" in text
    assert _legends(drawn) == ["token (per-group mean) (n=2)", "token (pooled batch mean) (n=2)"]
    plt.close("all")


def test_an_old_run_folder_without_a_scope_is_the_per_group_mean(tmp_path):
    """A recipe.yaml written before loss.scope existed reads as the loader reads it: scope group
    (the default, what such a run ran), named per-group; the same folder saying batch is named
    pooled (the label follows the recipe), and a key one run lacks is listed."""
    folder = tmp_path / "old"
    for rule in ("token", "balanced"):
        run = _run(folder, rule, 32, 0)
        recipe = yaml.safe_load((run / "recipe.yaml").read_text())
        del recipe["loss"]["scope"]
        (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    text = write_report(folder, figures=False).read_text()
    cells = json.loads((folder / "report.json").read_text())["cells"]
    assert [c["label"] for c in cells] == ["balanced (per-group mean)", "token (per-group mean)"]
    said = "(written before the key existed), read at their defaults as the recipe loader reads "
    assert said + "such a file: loss.scope." in text
    _run(folder, "token", 32, 1)  # a new run of the same recipe, with the key
    text = write_report(folder, figures=False).read_text()
    assert said + "such a file: loss.scope." in text
    cells = json.loads((folder / "report.json").read_text())["cells"]
    assert [(c["label"], c["seeds"]) for c in cells] == [
        ("balanced (per-group mean)", [0]),
        ("token (per-group mean)", [0, 1]),
    ]
    # the control: the old token run's recipe saying batch is the pooled mean
    run = folder / "token-32-0"
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["loss"]["scope"] = "batch"
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    write_report(folder, figures=False)
    cells = json.loads((folder / "report.json").read_text())["cells"]
    assert [c["label"] for c in cells] == [
        "balanced (per-group mean)",
        "token (pooled batch mean)",
        "token (per-group mean)",
    ]


def test_a_key_one_run_lacks_is_its_default_not_a_wildcard(tmp_path):
    folder = tmp_path / "runs"
    _run(folder, "token", 32, 0, "loss.neutral_eps=0.1")
    old = _run(folder, "balanced", 32, 0)
    recipe = yaml.safe_load((old / "recipe.yaml").read_text())
    del recipe["loss"]["neutral_eps"]  # read at its default 0.0: not the other run's 0.1
    (old / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    with pytest.raises(ValueError, match=r"not swept \(loss\.neutral_eps: 0\.0, 0\.1\)"):
        write_report(folder, figures=False)


def test_compare_runs_both_token_means_by_default(tmp_path, capsys):
    """`megatron-ba compare RECIPE`: the per-group and the pooled token mean, sequence and
    balanced; the declared comparison is balanced - the pooled one (--report-only, on run folders
    written here); a grid that runs one recipe twice, or an unknown scope, is refused."""
    out, shared = tmp_path / "cmp", ["grpo.max_new_tokens=32"]
    cmd = ["compare", str(TINY), *shared, "--out", str(out), "--report-only"]
    assert main(cmd) == 2  # the study declared, no run yet: no report
    assert "no run folders" in capsys.readouterr().err
    study = Study.load(out)
    assert study.axes[0].values == ("token@group", "token@batch", "sequence", "balanced")
    assert DEFAULT_RULES == ",".join(study.axes[0].values)
    assert study.plan["decision"]["compare"] == ["balanced", "token@batch"]
    for e in study.elements:
        _element_run(study, e, tmp_path / "made")
    assert main(cmd) == 0
    got = json.loads((out / "report.json").read_text())
    assert [c["label"] for c in got["cells"]] == [
        "token (per-group mean)",
        "token (pooled batch mean)",
        "sequence (per-group mean)",
        "balanced (per-group mean)",
    ]
    (row,) = got["plan"]["decision"]
    assert row["labels"] == ["balanced (per-group mean)", "token (pooled batch mean)"]
    seed = load_recipe(TINY, shared).seed  # balanced - pooled token: 0.05 + 0.1 seed
    assert row["mean"] == pytest.approx(0.05 + 0.1 * seed)  # per-group token: 0.1 + 0.1 seed
    capsys.readouterr()
    assert main(["compare", str(TINY), "--rules", "token@pooled", "--out", str(out)]) == 2
    assert "--rules: 'token@pooled': unknown scope 'pooled'" in capsys.readouterr().err
    twice = ["compare", str(TINY), "--rules", "token,token@group", "--out", str(tmp_path / "t")]
    assert main(twice) == 2
    said = "compare: elements token-seed0 and token-scopegroup-seed0 are the same recipe"
    assert said in capsys.readouterr().err


TOKEN_MEANS = sorted(
    p for p in (ROOT / "docs/testbed").glob("*-token-means") if (p / "report.md").is_file()
)


@pytest.mark.parametrize("study", TOKEN_MEANS, ids=lambda p: p.name)
def test_the_pooled_share_from_counts_is_what_a_pooled_run_logs(study):
    """The report's pooled token share and count share, from each step's logged counts and mean
    lengths, against the trainer's own: a pooled run logs the pooled token mean's share (to
    rounding), every run of equal groups BA's = the count share; a per-group run's logged token
    share is another number (the control: this comparison can fail)."""
    gaps = []
    for run in sorted(study.glob("token-scope*")):
        scope = yaml.safe_load((run / "recipe.yaml").read_text())["loss"]["scope"]
        for record in read_metrics(run):
            got = signed_shares(record) if "pg_loss" in record else {}
            if not got or math.isnan(record["token/weight_share_pos"]):
                continue
            assert got["count_share_pos"] == pytest.approx(
                record["balanced/weight_share_pos"], abs=1e-12
            )
            gap = abs(got["token_pooled/weight_share_pos"] - record["token/weight_share_pos"])
            (gaps if scope == "group" else [0.0]).append(gap)
            assert scope == "group" or gap < 1e-12, (run.name, record["step"])
    assert len(gaps) > 100 and max(gaps) > 1e-3
