"""The code's shape, read from its syntax trees: one home for torch.distributed, no import cycles.

    python -m pytest tests/test_code_structure.py        # < 1 s: parses files, runs none

- Every torch.distributed call of megatron_ba and benchmarks/ lives in
  megatron_ba/parallel/collectives.py (README: "every collective lives in one module"); names in
  docstrings, comments and strings (`python -m torch.distributed.run`) are not calls.
- The graph of imports between megatron_ba modules (module-level and lazy ones in functions
  alike: a lazy import is still a dependency) has no cycle.

Each check is also run on a small hand-written tree that breaks it, so that it is seen to fail.
"""

from __future__ import annotations

import ast
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


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}. `from pkg import sub` is an edge to the
    submodule when `sub` is one, else to `pkg`; a parent package's __init__ is not an edge."""
    files = {_module_name(root, p): p for p in _python_files(root, (package,))}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        for base, names in _imports(tree, mod, path.name == "__init__.py"):
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in files] or [base]
            for t in targets:
                # the deepest module of the package that the name lies in
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


def test_torch_distributed_is_called_only_in_collectives():
    offenders = []
    for path in _python_files(ROOT, (PACKAGE, "benchmarks")):
        if path.relative_to(ROOT) == COLLECTIVES:
            continue
        for line in torch_distributed_uses(path.read_text()):
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
    assert "megatron_ba.megatron.layout_check" in graph  # the walk found the package
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
