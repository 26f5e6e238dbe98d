"""A recipe value as it goes on a Hydra command line (`key=VALUE`), for the overrides the recipe
backends print: NeMo-Aligner's (nemo_aligner/overrides.py) and verl's (verl_recipe.py)."""

from __future__ import annotations


def hydra_value(value) -> str:
    """None -> null, booleans lower-case, lists and tuples as [a,b], anything else str()."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return str(value)
