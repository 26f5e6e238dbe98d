"""Loading a recipe: YAML, Hydra/NeMo-style `a.b.c=value` overrides, strictly typed.

    recipe = load_recipe("recipes/tiny-cpu.yaml", ["loss.rule=token", "grpo.steps=20"])

An unknown key fails with its dotted path named (and the closest known key suggested), a value of
the wrong type fails with the key and the expected type; override values are parsed as YAML
(`x=null`, `x=[1,2]`, `x=1e-4`). The cross-field checks run last (megatron_ba.recipe.validation).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from megatron_ba.errors import SettingError
from megatron_ba.recipe.schema import Recipe, RecipeError
from megatron_ba.recipe.validation import validate

# Keys a user may expect that no code reads yet: setting one is an error that says so, rather
# than a setting that is silently ignored. Each is added to the schema with the code that reads it.
NOT_IMPLEMENTED: dict[str, str] = {}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotated type `tp` (int accepted for float)."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # a key=value override: a comma-separated list
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list of {_type_name(item)}, got {value!r}")
        return [_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(path, value, option)
            except RecipeError:
                pass
        names = " or ".join(_type_name(o) for o in options)
        raise RecipeError(f"{path}: expected {names}, got {value!r}")
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads exponents without a dot, like 1e-6, as strings.
        try:
            return float(value)
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise RecipeError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{path or 'recipe'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields and where in NOT_IMPLEMENTED:
            raise RecipeError(f"{where}: not implemented yet: {NOT_IMPLEMENTED[where]}; remove it")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"{where}: unknown key{hint}; known keys: {', '.join(fields)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, where)
        else:
            kwargs[key] = _coerce(where, value, tp)
    try:
        return cls(**kwargs)
    except SettingError as e:  # a section that checks its own values (loss: the aggregation's)
        raise RecipeError(e.renamed(prefix=f"{path}." if path else "")) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    import yaml

    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise RecipeError(f"override {text!r}: empty key")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe: no such file {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: {path} must hold a mapping at the top level")
    data = apply_overrides(data, list(overrides or []))
    return validate(_build(Recipe, data, ""))
