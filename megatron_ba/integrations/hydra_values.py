"""A recipe value as it goes on a Hydra command line (`key=VALUE`), for the overrides the recipe
backends print: verl's, NeMo-RL's and NeMo-Aligner's (integrations/engines/)."""

from __future__ import annotations


def hydra_value(value) -> str:
    """None -> null, booleans lower-case, lists and tuples as [a,b], dicts as {k:v}, anything
    else str()."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return str(value)
