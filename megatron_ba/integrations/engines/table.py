"""The engines' table: every recipe key -> what verl, NeMo-RL and NeMo-Aligner do with it.

    from megatron_ba.integrations.engines.table import TABLE, OPTIONS
    TABLE["parallel.tp"].verl          # Put: actor_rollout_ref.actor.megatron.tensor_model_...
    TABLE["grpo.dynamic_sampling"].nemo_rl   # Absent: refused unless false, with why

TABLE holds one row per leaf key of the recipe schema, in the schema's order (the rows are
written by section in model_rows.py, data_rows.py, loss_rows.py, layout_rows.py,
run_rows.py and eval_rows.py; a schema key
without a row, or a row without a key, fails here at import). OPTIONS holds the options of
`megatron-ba train` an engine reads. Each engine's translation (engine.py) is these cells:
its overrides, its refusals and its notes. The docs' tables (docs/integrations.md,
docs/nemo-aligner.md) are `markdown_table(engine)`, and tests check they are.

This module imports neither an engine nor torch: the recipe loader's command calls it in any
environment.
"""

from __future__ import annotations

import dataclasses

from megatron_ba.integrations.engines import (
    data_rows,
    eval_rows,
    layout_rows,
    loss_rows,
    model_rows,
    run_rows,
)
from megatron_ba.integrations.engines.cells import Absent, Dropped, Put, Row
from megatron_ba.recipe import Recipe

ENGINES = ("verl", "nemo_rl", "nemo_aligner")


def schema_keys() -> list[str]:
    """Every leaf key of the recipe schema, dotted, in the schema's order."""

    def walk(obj, prefix: str) -> list[str]:
        keys = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            name = f"{prefix}{f.name}"
            keys += walk(value, name + ".") if dataclasses.is_dataclass(value) else [name]
        return keys

    return walk(Recipe(), "")


def _in_schema_order() -> dict[str, Row]:
    sections = (model_rows, data_rows, loss_rows, layout_rows, run_rows, eval_rows)
    sections = tuple(s.ROWS for s in sections)
    rows = {k: row for section in sections for k, row in section.items()}
    keys = schema_keys()
    if sum(map(len, sections)) != len(rows) or set(rows) != set(keys):
        raise RuntimeError(
            f"the engines' table must hold each recipe key once: missing "
            f"{sorted(set(keys) - set(rows))}, not in the schema {sorted(set(rows) - set(keys))}"
        )
    return {k: rows[k] for k in keys}


TABLE: dict[str, Row] = _in_schema_order()
OPTIONS: dict[str, Row] = run_rows.OPTION_ROWS


def schema_default(key: str):
    """The schema's default value of a dotted recipe key."""
    value = Recipe()
    for part in key.split("."):
        value = getattr(value, part)
    return value


def translated(engine: str) -> dict[str, str]:
    """Recipe key -> where `engine` puts it (the docs' words), for the keys it translates."""
    return {
        k: row.cell(engine).describe()
        for k, row in TABLE.items()
        if isinstance(row.cell(engine), Put)
    }


def local_only(engine: str) -> dict[str, str]:
    """Recipe key -> why `engine` has no counterpart (accepted at the schema's default only)."""
    return {
        k: row.cell(engine).why for k, row in TABLE.items() if isinstance(row.cell(engine), Absent)
    }


def not_passed_on(engine: str) -> tuple[str, ...]:
    """The recipe keys `engine` accepts and does not pass on."""
    return tuple(k for k, row in TABLE.items() if isinstance(row.cell(engine), Dropped))


def _describe(cell, key: str) -> str:
    if isinstance(cell, Absent):
        return cell.describe(schema_default(key))
    return cell.describe()


def markdown_table(engine: str, column: str) -> str:
    """The docs' table of `engine`: every recipe key, then the command's options it reads,
    each with its cell's words."""
    rows = [f"| recipe key | {column} |", "|---|---|"]
    for key, row in TABLE.items():
        rows.append(f"| `{key}` | " + _describe(row.cell(engine), key).replace("|", "\\|") + " |")
    for option, row in OPTIONS.items():
        rows.append(f"| `{option}` | " + row.cell(engine).describe().replace("|", "\\|") + " |")
    return "\n".join(rows) + "\n"
