"""Every published study under docs/ ships its runs, and its report is what they give.

A published study is a folder under docs/ with study.json (its plan) and report.md. It must hold
one run folder per element (recipe.yaml, metrics.jsonl.gz, summary.json), and `megatron-ba
report` on a copy of it must write report.md and report.json byte for byte as shipped. The
figures are not compared (they are images); report.md names the same files. A copy with one
metric value changed must no longer match: the comparison can fail.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from megatron_ba.studies.grid import Study
from megatron_ba.studies.reporting import write_report

ROOT = Path(__file__).resolve().parents[1]
# A study.json alone is a plan declared before its runs (committed first); with report.md it ships.
STUDIES = sorted(
    p.parent for p in (ROOT / "docs").rglob("study.json") if (p.parent / "report.md").is_file()
)
SHIPPED = ("report.md", "report.json")


def _regenerated(study: Path, tmp_path: Path) -> Path:
    """A copy of the study (same folder name: the report's title) without its report."""
    copy = tmp_path / study.name
    shutil.copytree(study, copy, ignore=shutil.ignore_patterns("figures", *SHIPPED))
    write_report(copy, figures=False)
    return copy


def test_the_published_studies_are_found():
    names = [str(p.relative_to(ROOT)) for p in STUDIES]
    assert names == [
        "docs/study-length-cpu",
        "docs/testbed/gap",
        "docs/testbed/gap-token-means",
        "docs/testbed/variance",
        "docs/testbed/variance-token-means",
    ]


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_a_published_study_ships_every_run(study):
    plan = Study.load(study)
    for e in plan.elements:
        run = plan.run_dir(e)
        for name in ("recipe.yaml", "metrics.jsonl.gz", "summary.json"):
            assert (run / name).is_file(), f"{run.relative_to(ROOT)}: no {name}"
    extra = {p.name for p in study.iterdir() if p.is_dir()} - {e.name for e in plan.elements}
    assert extra == {"figures"}


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_a_published_report_is_what_its_runs_give(study, tmp_path):
    copy = _regenerated(study, tmp_path)
    for name in SHIPPED:
        assert (copy / name).read_bytes() == (study / name).read_bytes(), (
            f"{study.relative_to(ROOT)}/{name} is not what `megatron-ba report` writes from the "
            "shipped runs"
        )
    assert "The runs are the declared plan" in (study / "report.md").read_text()


def test_one_changed_metric_value_breaks_the_match(tmp_path):
    study = ROOT / "docs/testbed/gap"
    source = tmp_path / "source" / study.name
    shutil.copytree(study, source, ignore=shutil.ignore_patterns("figures"))
    metrics = source / "token-seed0" / "metrics.jsonl.gz"
    with gzip.open(metrics, "rt") as f:
        rows = [json.loads(line) for line in f]
    last = max(i for i, r in enumerate(rows) if "eval_accuracy" in r)
    rows[last]["eval_accuracy"] += 1 / 256  # one more right sample of 64 x 4
    with gzip.open(metrics, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    copy = _regenerated(source, tmp_path / "regenerated")
    for name in SHIPPED:
        assert (copy / name).read_bytes() != (study / name).read_bytes(), name
