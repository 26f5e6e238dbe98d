"""The code's shape, read from its syntax trees: one home for torch.distributed, no import cycles,
imports that go down the layers only, no package module that only tests use.

    python -m pytest tests/test_code_structure.py        # < 1 s: parses files, runs none

- Every torch.distributed call of megatron_ba (its perf/ benchmarks included) lives in
  megatron_ba/parallel/collectives.py (README: "every collective lives in one module"); names in
  docstrings, comments and strings (`python -m torch.distributed.run`) are not calls.
- The graph of imports between megatron_ba modules (module-level and lazy ones in functions
  alike: a lazy import is still a dependency) has no cycle.
- Every import of megatron_ba/ and scripts/ (module-level and in functions) goes from a folder
  (or top-level module) to one that ALLOWED lists for it; ALLOWED itself has none of the arrows
  NEVER forbids (the design's "never" arrows).
- Every module under megatron_ba/ is used by the product: imported by megatron_ba/ or scripts/
  (tests do not count), named by its dotted path or file name in their code or in
  the launch scripts (slurm/, scripts/*.sh), or an entry point that users run (ENTRY_POINTS).

Each check is also run on a small hand-written tree that breaks it, so that it is seen to fail.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_ba"
COLLECTIVES = Path(PACKAGE, "parallel", "collectives.py")


def _python_files(root: Path, folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py"))


def torch_distributed_uses(source: str) -> list[int]:
    """Line numbers where `source` imports or names torch.distributed (not in strings)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hit = any(a.name == "torch.distributed" or a.name.startswith("torch.distributed.")
                      for a in node.names)  # fmt: skip
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            hit = (mod == "torch" and any(a.name == "distributed" for a in node.names)) or (
                node.level == 0
                and (mod == "torch.distributed" or mod.startswith("torch.distributed."))
            )
        elif isinstance(node, ast.Attribute):
            # torch.distributed.x, and torch.distributed reached through an alias of torch
            hit = (
                node.attr == "distributed"
                and isinstance(node.value, ast.Name)
                and (node.value.id == "torch")
            )
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return sorted(set(lines))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool):
    """Absolute names each import statement of a module asks for (TYPE_CHECKING blocks skipped)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            yield base, [a.name for a in node.names]


def import_graph(
    root: Path, package: str = PACKAGE, folders: tuple[str, ...] | None = None
) -> dict[str, set[str]]:
    """{module: the modules of `folders` (default: the package) it imports}. `from pkg import
    sub` is an edge to the submodule when `sub` is one, else to `pkg`; a parent package's
    __init__ is not an edge."""
    files = {_module_name(root, p): p for p in _python_files(root, folders or (package,))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        for base, names in _imports(tree, mod, path.name == "__init__.py"):
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in files] or [base]
            for t in targets:
                # the deepest module of the walked folders that the name lies in
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# The process launcher (`--nproc-per-node`) imports torchrun's own launcher, torch.distributed.run
# and its elastic agent's error type: it starts processes and calls no collective.
LAUNCHER = Path(PACKAGE, "parallel", "local_launch.py")
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.elastic.")


def test_torch_distributed_is_called_only_in_collectives():
    offenders = []
    for path in _python_files(ROOT, (PACKAGE,)):
        if path.relative_to(ROOT) == COLLECTIVES:
            continue
        source = path.read_text()
        for line in torch_distributed_uses(source):
            text = source.splitlines()[line - 1]
            launcher = path.relative_to(ROOT) == LAUNCHER and "import" in text
            if launcher and any(f"from {m}" in text for m in LAUNCHER_MODULES):
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, "torch.distributed outside parallel/collectives.py: " + ", ".join(
        offenders
    )
    assert torch_distributed_uses((ROOT / COLLECTIVES).read_text())  # the walker sees real uses


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("import torch.distributed as dist\n", [1]),
        ("import torch\n\ndef f():\n    torch.distributed.barrier()\n", [4]),
        ("from torch import distributed\n", [1]),
        ("from torch.distributed import all_gather_object\n", [1]),
        ('"""Calls torch.distributed.barrier()."""\nx = "torch.distributed.run"  # dist.x\n', []),
        ("from megatron.core.distributed import finalize_model_grads\n", []),
    ],
)
def test_torch_distributed_walker(source, lines):
    assert torch_distributed_uses(source) == lines


def test_no_import_cycles_in_the_package():
    graph = import_graph(ROOT)
    assert "megatron_ba.layout_equivalence.check" in graph  # the walk found the package
    assert graph["megatron_ba.megatron.grpo_step"] >= {
        "megatron_ba.loss",
        "megatron_ba.megatron.batching",
        "megatron_ba.parallel.collectives",
    }
    cycles = find_cycles(graph)
    assert not cycles, "import cycles within megatron_ba: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_cycle_finder_sees_a_lazy_cycle_and_relative_imports(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from pkg.sub.c import C\nA = 1\n",
            "pkg/b.py": "import pkg.a\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
                "def f():\n    from .. import a  # lazy: still a dependency\nC = 2\n"
            ),
        },
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg.a"}  # the TYPE_CHECKING import is not an edge
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.c"]]


# --- layers -----------------------------------------------------------------------------------

# The math: pure torch, no framework, no process group (reduce is passed in).
CORE = frozenset(
    {"errors", "loss_settings", "_checks", "aggregation", "advantages", "loss", "diagnostics"}
    | {"rollout_correction", "step_settings", "step_plan"}
)
# The model's shape, its presets and its RoPE scaling settings: pure Python that every layer
# above the math may read.
SHAPE = frozenset({"model_shape", "rope_scaling"})
# Folder (or top-level module of megatron_ba, or benchmarks / scripts) -> what it may import
# besides itself. Read bottom-up: core <- parallel <- megatron <- conversion / generation <-
# train <- commands; recipe/ is the schema the others read and imports none of them.
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "loss_settings": frozenset({"errors"}),
    "_checks": frozenset(),
    "aggregation": frozenset({"_checks", "loss_settings"}),
    "advantages": frozenset({"_checks"}),
    "loss": frozenset({"_checks", "aggregation", "loss_settings"}),
    "diagnostics": frozenset({"_checks", "aggregation"}),
    "rollout_correction": frozenset({"loss", "loss_settings"}),
    "step_settings": frozenset({"errors", "loss_settings"}),
    "step_plan": frozenset({"_checks", "aggregation", "loss_settings"}),
    "megatron_ba": frozenset({"loss_settings", "aggregation", "advantages", "loss", "diagnostics"}),
    "model_shape": frozenset({"rope_scaling"}),
    "rope_scaling": frozenset(),
    "recipe": frozenset({"errors", "loss_settings", "step_settings", "parallel"}) | SHAPE,
    "tokenization": frozenset({"errors"}),
    "rewards": frozenset({"errors"}),
    "data": frozenset({"errors", "rewards"}),
    "tasks": frozenset({"errors", "data", "rewards"}),
    "testing": frozenset({"errors", "tokenization"}) | SHAPE,
    "planning": frozenset({"errors", "recipe", "step_settings", "parallel"}) | SHAPE,
    "parallel": CORE,
    "megatron": CORE | SHAPE | {"parallel", "recipe"},
    "conversion": CORE | SHAPE | {"parallel", "megatron"},
    "generation": CORE | SHAPE | {"parallel", "megatron", "conversion", "recipe"},
    "evaluation": frozenset({"errors", "data", "rewards", "generation"}),
    "integrations": CORE | SHAPE | {"parallel", "megatron", "rewards", "recipe"},
    "train": CORE
    | SHAPE
    | {"parallel", "megatron", "conversion", "generation", "recipe", "tokenization"}
    | {"data", "tasks", "rewards", "evaluation"},
    "layout_equivalence": CORE | SHAPE | {"parallel", "megatron"},
    # a study runs `megatron-ba train` as a child and reads its run folders (train.run_log)
    "studies": frozenset({"errors", "loss_settings", "recipe", "train"}),
    "commands": CORE
    | SHAPE
    | {"parallel", "megatron", "conversion", "generation", "recipe", "tokenization"}
    | {"data", "tasks", "rewards", "evaluation", "planning", "integrations", "testing", "train"}
    | {"layout_equivalence", "studies"},
    # the commands are imported by name (importlib); parallel: --nproc-per-node's launcher
    "cli": frozenset({"errors", "parallel"}),
    "perf": CORE
    | SHAPE
    | {"parallel", "megatron", "conversion", "generation", "recipe", "planning", "rewards"},
    "scripts": frozenset({"errors", "recipe", "planning", "megatron", "perf", "parallel"}) | SHAPE,
}
# The design's parts (its units) and the arrows it never allows, with its reasons.
PARTS: dict[str, frozenset[str]] = {
    "Core": CORE | SHAPE,
    "Parallel": frozenset({"parallel"}),
    "Megatron": frozenset({"megatron"}),
    "Equivalence": frozenset({"layout_equivalence"}),
    "Studies": frozenset({"studies"}),
    "Conversion": frozenset({"conversion"}),
    "Generation": frozenset({"generation"}),
    "Recipe": frozenset({"recipe"}),
    "Train": frozenset({"train"}),
    "Data": frozenset({"data", "tasks", "tokenization"}),
    "Rewards": frozenset({"rewards"}),
    "Eval": frozenset({"evaluation"}),
    "Integrations": frozenset({"integrations"}),
    "Planning": frozenset({"planning"}),
    "CLI": frozenset({"commands", "cli"}),
    "Bench": frozenset({"perf"}),
}
NEVER: list[tuple[str, str, str]] = [
    ("Core", "Megatron", "the math knows no framework"),
    ("Core", "Parallel", "reduce is passed in"),
    ("Core", "Train", "the math knows no driver"),
    ("Rewards", "Train", "rewards know no training"),
    ("Data", "Train", "data knows no training"),
    ("Megatron", "Train", "adapters know no driver"),
    ("Megatron", "Equivalence", "the step knows no check of it"),
    ("Train", "Equivalence", "the trainer runs the step, not its check"),
    ("Eval", "Train", "evaluation takes a generate callable"),
    ("Parallel", "Megatron", "collectives know no model"),
    ("Conversion", "Train", "conversion knows no driver"),
    ("Conversion", "Generation", "conversion knows no engine"),
    ("Megatron", "Conversion", "the model knows no checkpoint format"),
    ("Integrations", "Train", "adapters know no local driver"),
    ("Generation", "Train", "engines know no driver"),
    ("Recipe", "Megatron", "the schema builds no model"),
    ("Planning", "Megatron", "the planner builds no model"),
    ("Bench", "Train", "benchmarks need no driver"),
]
WALKED = (PACKAGE, "scripts")
# Imports against the table that are still there, each a debt to pay (remove the entry when it
# is): the check fails on any other, and on one of these once it is gone.
KNOWN_UPWARD: dict[str, str] = {}


def unit_of(module: str, package: str = PACKAGE) -> str:
    """The folder or top-level module a module belongs to (`megatron_ba.train.driver` -> train;
    `megatron_ba.loss` -> loss; `megatron_ba` -> megatron_ba; `megatron_ba.perf.step_perf` ->
    perf)."""
    parts = module.split(".")
    if parts[0] != package or len(parts) == 1:
        return parts[0]
    return parts[1]


def upward_imports(
    root: Path,
    allowed: dict[str, frozenset[str]],
    *,
    package: str = PACKAGE,
    folders: tuple[str, ...] = WALKED,
) -> list[str]:
    """'importer -> imported' for every import (at any level) that `allowed` does not list, and
    for every unit that `allowed` does not know."""
    out = []
    for mod, targets in sorted(import_graph(root, package, folders).items()):
        src = unit_of(mod, package)
        for t in sorted(targets):
            dst = unit_of(t, package)
            if dst == src:
                continue
            if src not in allowed or dst not in allowed.get(src, frozenset()):
                out.append(f"{mod} -> {t}")
    return out


def test_every_unit_is_in_the_table():
    units = {unit_of(m) for m in import_graph(ROOT, PACKAGE, WALKED)}
    assert units == set(ALLOWED), units ^ set(ALLOWED)


def test_the_table_has_no_never_arrow():
    found = [
        f"{a} -> {b} ({why}): {sorted(PARTS[b] & ALLOWED[u])} in ALLOWED[{u!r}]"
        for a, b, why in NEVER
        for u in PARTS[a]
        if PARTS[b] & ALLOWED[u]
    ]
    assert not found, "; ".join(found)


def test_imports_go_down_the_layers():
    graph = import_graph(ROOT, PACKAGE, WALKED)
    assert "megatron_ba.parallel.world" in graph["megatron_ba.megatron.startup"]
    assert (
        "megatron_ba.megatron.model" in graph["megatron_ba.perf.step_perf"]
    )  # the walk sees megatron_ba/perf/
    offenders = upward_imports(ROOT, ALLOWED)
    new = [o for o in offenders if o not in KNOWN_UPWARD]
    paid = [o for o in KNOWN_UPWARD if o not in offenders]
    assert not new, "imports that ALLOWED does not list: " + "; ".join(new)
    assert not paid, "no longer there, remove from KNOWN_UPWARD: " + "; ".join(paid)


def test_layer_check_sees_a_planted_upward_import(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/core.py": "def f():\n    from pkg.train import driver  # lazy: still an import\n",
            "pkg/train/__init__.py": "",
            "pkg/train/driver.py": "from pkg import core\nfrom pkg.train import other\n",
            "pkg/train/other.py": "",
            "bench/run.py": "import pkg.train.driver\n",
        },
    )
    allowed = {
        "pkg": frozenset(),
        "core": frozenset(),
        "train": frozenset({"core"}),
        "bench": frozenset({"core"}),
    }
    found = upward_imports(root, allowed, package="pkg", folders=("pkg", "bench"))
    assert found == ["bench.run -> pkg.train.driver", "pkg.core -> pkg.train.driver"]


# --- every package module is used by the product ---------------------------------------------

# Modules users run themselves, outside this repository's code and scripts.
ENTRY_POINTS: dict[str, str] = {
    "megatron_ba.integrations.nemo_rl.run_grpo_balanced": "run inside a NeMo-RL checkout",
    "megatron_ba.integrations.verl.main_ppo": "verl's main_ppo with the config checked first",
    "megatron_ba.integrations.verl.reward": "verl loads it by path (custom_reward_function)",
}
LAUNCH_SCRIPTS = ("slurm", "scripts")


def _code_strings(tree: ast.AST) -> list[str]:
    """String constants of a module that are not docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def unused_modules(
    root: Path,
    *,
    package: str = PACKAGE,
    users: tuple[str, ...] = WALKED,
    scripts: tuple[str, ...] = LAUNCH_SCRIPTS,
    entry_points: dict[str, str] | None = None,
) -> list[str]:
    """Modules of `package` (packages' __init__ aside: a folder's public face) that no module of
    `users` imports, no string of theirs names (dotted, or by file name), no shell script under
    `scripts` names, and that are not entry points."""
    graph = import_graph(root, package, users)
    used = {t for targets in graph.values() for t in targets}
    names: list[str] = []
    by_folder: dict[Path, list[str]] = {}  # a file name counts in its own folder's code only
    for path in _python_files(root, users):
        strings = _code_strings(ast.parse(path.read_text()))
        names += strings
        by_folder.setdefault(path.parent, []).extend(strings)
    for folder in scripts:
        names += [p.read_text() for p in sorted((root / folder).glob("*.sh"))]
    text = "\n".join(names)
    out = []
    for path in _python_files(root, (package,)):
        mod = _module_name(root, path)
        if path.name == "__init__.py" or mod in used or mod in (entry_points or {}):
            continue
        if re.search(rf"\b{re.escape(mod)}\b", text):
            continue
        if any(path.name in s for s in by_folder.get(path.parent, [])):
            continue
        out.append(mod)
    return out


def test_no_package_module_is_used_by_tests_alone():
    unused = unused_modules(ROOT, entry_points=ENTRY_POINTS)
    assert not unused, "modules only tests use (move them to tests/): " + ", ".join(unused)


def test_unused_module_finder_sees_a_test_only_module(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\nCMD = ['python', '-m', 'pkg.run']\n",
            "pkg/b.py": "",
            "pkg/run.py": "",
            "pkg/helper.py": '"""Run as pkg.only_tests (a docstring names no user)."""\n',
            "pkg/only_tests.py": "",
            "pkg/server.py": "",
            "pkg/launch.py": "SCRIPT = 'server.py'\n",
            "pkg/user_run.py": "",
            "tests/test_x.py": "from pkg import only_tests, helper, launch\n",
            "sh/start.sh": "python -m pkg.launch\n",
        },
    )
    found = unused_modules(
        root, package="pkg", users=("pkg",), scripts=("sh",), entry_points={"pkg.user_run": ""}
    )
    assert found == ["pkg.a", "pkg.helper", "pkg.only_tests"]


# --- one name, one module ------------------------------------------------------------------------


def shared_module_names(root: Path, package: str = PACKAGE) -> dict[str, list[str]]:
    """Module names (file stems; a folder's __init__ aside) that two modules of `package` share."""
    by_name: dict[str, list[str]] = {}
    for path in _python_files(root, (package,)):
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(str(path.relative_to(root)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_package_modules_share_a_name():
    """A module's name says what it holds, once: `loss` is the core's, not also an adapter's."""
    assert shared_module_names(ROOT) == {}


def test_shared_name_finder_sees_a_planted_twin(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/loss.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/loss.py": "",
        },
    )
    assert shared_module_names(root, "pkg") == {"loss": ["pkg/loss.py", "pkg/sub/loss.py"]}
