"""A study: one recipe trained over the cross product of a few keys' values, one run per element.

    axes = parse_grid(["loss.rule=token,balanced", "seed=0,1,2"])
    study = Study.open(Path("runs/s"), "recipes/tiny-cpu.yaml", ["grpo.steps=20"], axes)
    run_locally(study)                    # element after element; a re-run keeps finished ones

The folder holds study.json (the recipe, the shared overrides, the axes, the elements and the
plan of studies/design.py: what the study is and what decides it, written once, before any
run; opening it again with other arguments, or after the recipe changed, is refused, naming what
differs) and one run folder per element, named by its values (`token-seed0`,
`balanced-max_new_tokens64-seed1`: a rule by its name, other keys by their last part). An element
is finished when its run folder holds summary.json; one with a checkpoint resumes from it; any
other starts afresh. On Slurm each element is one task of a job array (slurm_array.py) running
slurm/grpo_balanced.sh, which reads its element from study.json (`python -m
megatron_ba.studies.grid element DIR INDEX`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ba.loss_settings import split_rule_value
from megatron_ba.recipe import load_recipe
from megatron_ba.studies import design

MANIFEST = "study.json"


@dataclass(frozen=True)
class Axis:
    """One swept recipe key and its values (as typed: YAML values, like any override)."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Element:
    """One run of the study: its position, folder name and the overrides that make it."""

    index: int
    name: str
    overrides: tuple[str, ...]


def parse_grid(specs: list[str]) -> list[Axis]:
    """`--grid KEY=V1,V2,...` flags as axes (ValueError naming the flag that is wrong)."""
    axes: list[Axis] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        parts = tuple(v.strip() for v in values.split(","))
        if not sep or not key.strip() or not all(parts):
            raise ValueError(f"--grid {spec!r}: expected KEY=V1,V2,... (no empty value)")
        if len(set(parts)) != len(parts):
            raise ValueError(f"--grid {spec!r}: a value is listed twice")
        if key.strip() in (a.key for a in axes):
            raise ValueError(f"--grid {spec!r}: {key.strip()} is swept twice")
        axes.append(Axis(key.strip(), parts))
    if not axes:
        raise ValueError("--grid: give at least one KEY=V1,V2,...")
    rules = next((a for a in axes if a.key == "loss.rule"), None)
    scoped = [v for v in rules.values if "@" in v] if rules else []
    for value in scoped:
        try:
            split_rule_value(value)
        except ValueError as e:
            raise ValueError(f"--grid loss.rule: {e}") from None
    if scoped and any(a.key == "loss.scope" for a in axes):
        raise ValueError(f"--grid loss.rule: {scoped[0]} sets loss.scope, which is swept too; "
                         "give the scope in one place")  # fmt: skip
    return axes


def _overrides(key: str, value: str) -> list[tuple[str, str]]:
    """The recipe keys one grid value sets: a rule value RULE@SCOPE sets loss.rule and
    loss.scope (rules.split_rule_value); any other value its own key."""
    if key == "loss.rule" and "@" in value:
        rule, scope = value.split("@", 1)
        return [("loss.rule", rule), ("loss.scope", scope)]
    return [(key, value)]


def _label(key: str, value: str) -> str:
    text = value if key == "loss.rule" else f"{key.rsplit('.', 1)[-1]}{value}"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)  # a folder name, one path part


def elements(axes: list[Axis]) -> list[Element]:
    """The cross product in the order of the axes (the last one varies fastest); the rule comes
    first in every name so that a rule's runs sort together, then its scope where the value
    names one (`token@batch` at seed 0: `token-scopebatch-seed0`)."""
    out = []
    for i, values in enumerate(itertools.product(*(a.values for a in axes))):
        sets = [_overrides(a.key, v) for a, v in zip(axes, values, strict=True)]
        named = sorted(sets, key=lambda kvs: kvs[0][0] != "loss.rule")
        out.append(
            Element(
                index=i,
                name="-".join(_label(k, v) for kvs in named for k, v in kvs),
                overrides=tuple(f"{k}={v}" for kvs in sets for k, v in kvs),
            )
        )
    if len({e.name for e in out}) != len(out):
        raise ValueError("--grid: two elements would share a run folder name; rename the values")
    return out


@dataclass
class Study:
    """A study's folder and what study.json says of it."""

    folder: Path
    recipe: str
    overrides: tuple[str, ...]
    axes: tuple[Axis, ...]
    plan: dict | None = None  # None: a study.json written before studies had plans

    @property
    def elements(self) -> list[Element]:
        return elements(list(self.axes))

    def run_dir(self, element: Element) -> Path:
        return self.folder / element.name

    def element_values(self) -> dict[str, dict[str, str]]:
        """Each element's value of every axis, as the grid gives it (`token@batch`), by name."""
        product = itertools.product(*(a.values for a in self.axes))
        return {
            e.name: dict(zip((a.key for a in self.axes), values, strict=True))
            for e, values in zip(self.elements, product, strict=True)
        }

    def manifest(self) -> dict:
        return {
            "recipe": self.recipe,
            "overrides": list(self.overrides),
            "grid": [{"key": a.key, "values": list(a.values)} for a in self.axes],
            "elements": [asdict(e) | {"run_dir": e.name} for e in self.elements],
            **({"plan": self.plan} if self.plan is not None else {}),
        }

    @classmethod
    def open(
        cls,
        folder: Path,
        recipe: str,
        overrides: list[str],
        axes: list[Axis],
        *,
        write=True,
        compare: tuple[str, str] | None = None,
        metric: str | None = None,
    ) -> Study:
        """The study in `folder`: made, with its plan declared now (study.json written, unless
        `write` is false), or, if there, the same one again.

        Every element's recipe is loaded first, so a bad value fails before anything runs
        (RecipeError naming the element and the key); two elements of the same recipe are
        refused. compare / metric: the plan's deciding comparison (design.make_plan; None:
        balanced against token on acc_last); a study already declared keeps its own, and refuses
        others or a recipe changed since (ValueError)."""
        recipe = str(Path(recipe).resolve())  # array tasks and reports run from anywhere
        study = cls(Path(folder), recipe, tuple(overrides), tuple(axes))
        study._load_elements()
        path = study.folder / MANIFEST
        if path.is_file():
            saved = json.loads(path.read_text())
            study._check_same(saved, folder)
            if saved.get("plan") is not None:
                study.plan = saved["plan"]
                _check_decision(study.plan, compare, metric)
                design.check_unchanged(study.plan, study)
            return study
        rules = next((list(a.values) for a in axes if a.key == "loss.rule"), [])
        compare = compare or design.default_compare(rules)
        study.plan = design.make_plan(study, compare, metric or "acc_last")
        if not write:
            return study
        study.folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(study.manifest(), indent=2) + "\n")
        return study

    def _load_elements(self) -> None:
        """Load every element's recipe: RecipeError naming the element with a bad value,
        ValueError naming two elements that would be the same run (`token` and `token@group`
        where the recipe's scope is group)."""
        seen: dict[str, str] = {}
        for e in self.elements:
            try:
                resolved = load_recipe(self.recipe, [*self.overrides, *e.overrides]).to_dict()
            except ValueError as err:
                raise type(err)(f"element {e.name}: {err}") from None
            twin = seen.setdefault(design.recipe_sha256(resolved), e.name)
            if twin != e.name:
                raise ValueError(f"elements {twin} and {e.name} are the same recipe (the same "
                                 "run twice); drop one of the values")  # fmt: skip

    def _check_same(self, saved: dict, folder: Path) -> None:
        mine = self.manifest()
        differs = [k for k in ("recipe", "overrides", "grid") if saved.get(k) != mine[k]]
        if differs:
            shown = "; ".join(f"{k} {saved.get(k)} there, {mine[k]} given" for k in differs)
            raise ValueError(f"--out {folder}: holds another study ({shown}); choose another --out")

    @classmethod
    def load(cls, folder: Path) -> Study:
        """The study whose study.json is in `folder` (ValueError if there is none)."""
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise ValueError(f"{folder}: no {MANIFEST}: not a study folder")
        m = json.loads(path.read_text())
        axes = tuple(Axis(a["key"], tuple(a["values"])) for a in m["grid"])
        return cls(Path(folder), m["recipe"], tuple(m["overrides"]), axes, m.get("plan"))

    def status(self, element: Element) -> str:
        """finished | resume (a checkpoint to continue from) | new."""
        run = self.run_dir(element)
        if (run / "summary.json").is_file():
            return "finished"
        return "resume" if (run / "checkpoints" / "latest").is_file() else "new"

    def train_arguments(self, element: Element) -> list[str]:
        """`megatron-ba train` arguments of one element (its run folder, resumed if it can)."""
        run = self.run_dir(element)
        where = (
            ["--resume", str(run)] if self.status(element) == "resume" else ["--run-dir", str(run)]
        )
        cache = ["--cache-dir", str(self.folder / ".cache")]  # one warm start per seed
        return ["train", self.recipe, *self.overrides, *element.overrides, *where, *cache]


def _check_decision(plan: dict, compare, metric) -> None:
    """ValueError when --compare / --metric name another decision than the declared one."""
    declared = plan["decision"]
    if compare is not None and list(compare) != declared["compare"]:
        raise ValueError(f"--compare {','.join(compare)}: the plan in study.json declared "
                         f"{','.join(declared['compare'] or ['none'])}")  # fmt: skip
    if metric is not None and metric != declared["metric"]:
        raise ValueError(f"--metric {metric}: the plan in study.json declared {declared['metric']}")


def _launcher(study: Study, element: Element) -> list[str]:
    """`python -m megatron_ba.cli`, under torchrun when the layout needs several processes."""
    p = load_recipe(study.recipe, [*study.overrides, *element.overrides]).parallel
    nproc = p.tp * p.pp * p.cp
    cli = ["-m", "megatron_ba.cli"]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *cli]
    return [sys.executable, *cli]


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def run_locally(study: Study, log=print, clock=time.monotonic) -> None:
    """Train every element that has not finished, one after another (RuntimeError naming the
    element whose run fails; the finished ones stay finished)."""
    todo = [e for e in study.elements if study.status(e) != "finished"]
    n, start, spent = len(study.elements), clock(), []
    log(f"[study] {n - len(todo)}/{n} elements finished earlier; {len(todo)} to run")
    for e in todo:
        run = study.run_dir(e)
        if study.status(e) == "new":
            shutil.rmtree(run, ignore_errors=True)  # never checkpointed: start afresh
        cmd = [*_launcher(study, e), *study.train_arguments(e)]
        log(f"[study] {e.name}: {shlex.join(cmd[1:])}")
        began = clock()
        env = dict(os.environ, PYTHONUNBUFFERED="1", MBA_STUDY=str(study.folder.resolve()))
        proc = subprocess.run(cmd, env=env)  # MBA_STUDY: its trackers group it (tracking.py)
        if proc.returncode != 0:
            raise RuntimeError(f"study: element {e.name} failed with exit status {proc.returncode}")
        spent.append(clock() - began)
        left = len(todo) - len(spent)
        eta = sum(spent) / len(spent) * left
        log(f"[study] {e.name}: finished in {_duration(spent[-1])}; {n - left}/{n} done, "
            f"study {_duration(clock() - start)}, ETA {_duration(eta)}")  # fmt: skip


def _element_main(folder: str, index: str) -> int:
    """`python -m megatron_ba.studies.grid element DIR INDEX`: the element's run folder and
    overrides as shell words (slurm/lib.sh reads them for an array task)."""
    study = Study.load(Path(folder))
    e = study.elements[int(index)]
    print(shlex.join([str(study.run_dir(e).resolve()), *study.overrides, *e.overrides]))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "element":
        sys.exit("usage: python -m megatron_ba.studies.grid element STUDY_DIR INDEX")
    sys.exit(_element_main(sys.argv[2], sys.argv[3]))
