"""Which recipe keys the code reads, found statically (tests/test_recipe.py uses it).

A key `section.field` counts as read where some module of megatron_ba (outside the recipe
package's loading and validation) accesses `<...>.section.field`, or `x.field` on a name bound
to `<...>.section` (`g = recipe.grpo; g.steps`), or `self.field` inside the section's own class
(its methods are called by the code that builds things from it). Hashing a whole section
(`.__dict__`) or validating it does not count: neither makes the setting do anything.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path


def recipe_keys(recipe_cls) -> dict[str, str | None]:
    """Every dotted key of the schema -> the name of its section's class (None: top level)."""
    out: dict[str, str | None] = {}
    for f in dataclasses.fields(recipe_cls):
        section = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if section is not None and dataclasses.is_dataclass(section):
            for g in dataclasses.fields(section):
                out[f"{f.name}.{g.name}"] = section.__name__
        else:
            out[f.name] = None
    return out


def _aliases(tree: ast.AST, sections: set[str]) -> dict[str, set[str]]:
    """Names bound to a section anywhere in the module: `x = <...>.section` (tuples too)."""
    out: dict[str, set[str]] = {s: set() for s in sections}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        pairs = []
        for t in node.targets:
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += list(zip(t.elts, node.value.elts, strict=False))
            else:
                pairs.append((t, node.value))
        for t, v in pairs:
            if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr in sections:
                out[v.attr].add(t.id)
    return out


def keys_read(package: Path, keys: dict[str, str | None], sources=None) -> set[str]:
    """The keys of `keys` that some module under `package` reads (see the module docstring).

    `sources` (path -> text) replaces the files on disk, for the tests' negative controls.
    """
    sections = {k.split(".")[0] for k, cls in keys.items() if cls is not None}
    top = {k for k, cls in keys.items() if cls is None}
    class_of = {cls: k.split(".")[0] for k, cls in keys.items() if cls is not None}
    if sources is None:
        sources = {p: p.read_text() for p in sorted(Path(package).rglob("*.py"))}
    found: set[str] = set()
    for path, text in sources.items():
        tree = ast.parse(text)
        aliases = _aliases(tree, sections)
        scopes: list[ast.AST] = [tree]
        if Path(path).parent.name == "recipe":  # the schema, loader and checks: only the
            # methods of schema.py's classes count (a section's, and the Recipe's builders)
            builders = {*class_of, "Recipe"}
            scopes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in builders]
        for scope in scopes:
            own = class_of.get(scope.name) if isinstance(scope, ast.ClassDef) else None
            for node in ast.walk(scope):
                if not isinstance(node, ast.Attribute):
                    continue
                v = node.value
                if isinstance(v, ast.Attribute) and v.attr in sections:
                    found.add(f"{v.attr}.{node.attr}")
                elif isinstance(v, ast.Name):
                    found |= {f"{s}.{node.attr}" for s, names in aliases.items() if v.id in names}
                    if own and v.id == "self":
                        found.add(f"{own}.{node.attr}")
                if node.attr in top and own is None:
                    found.add(node.attr)
    return found & set(keys)
