"""The engines' table (megatron_ba/integrations/engines/): one row per recipe key, read by all three
translations, the docs' tables and the checks that keep them apart from nothing.

What each engine's overrides hold is tested against the engine's own code elsewhere
(tests/test_backend_verl.py, tests/nemorl/test_nemo_rl_recipe.py, tests/nemo/
test_nemo_overrides.py); here: the table's shape, that the docs are the table, that a cell's
words name the keys it writes, that an engine's print and check orders cannot drift from the
table, and that PLAN_RULES is defined once. Each check is also run on a planted fault.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_ba.integrations.engines import model_rows, table
from megatron_ba.integrations.engines.cells import Put, Set
from megatron_ba.integrations.engines.nemo_aligner import NEMO_ALIGNER
from megatron_ba.integrations.engines.nemo_aligner import markdown_table as nemo_aligner_table
from megatron_ba.integrations.engines.nemo_rl import NEMO_RL
from megatron_ba.integrations.engines.translation import Engine
from megatron_ba.integrations.engines.verl import VERL

ROOT = Path(__file__).resolve().parents[1]
ENGINES = [VERL, NEMO_RL, NEMO_ALIGNER]


def test_the_table_holds_every_recipe_key_once_in_the_schemas_order():
    assert list(table.TABLE) == table.schema_keys()


def test_a_recipe_key_without_a_row_fails_naming_it(monkeypatch):
    rows = dict(model_rows.ROWS)
    del rows["model.attention"]
    monkeypatch.setattr(model_rows, "ROWS", rows)
    with pytest.raises(RuntimeError, match=r"missing \['model.attention'\]"):
        table._in_schema_order()


def test_nemo_aligners_docs_table_is_the_table():
    text = (ROOT / "docs/nemo-aligner.md").read_text()
    assert nemo_aligner_table() in text
    for key in [*table.schema_keys(), *table.OPTIONS]:
        assert f"| `{key}` |" in text, key


def unnamed_keys(cell: Put) -> list[str]:
    """The engine keys a cell writes that its docs' words do not name. A key added to the
    engine's config (verl's `+key`, Hydra's "append") is not in it, and the engine's own key
    check would fail on its full name: its parts are named instead."""
    words = cell.describe()

    def named(key: str) -> bool:
        if key.startswith("+") and not key.startswith("++"):
            return all(part in words for part in key[1:].split("."))
        return key.lstrip("+") in words

    return [s.key for s in cell.sets if not named(s.key)]


def test_each_cells_words_name_the_keys_it_writes():
    for engine in ENGINES:
        for key, cell in engine.cells():
            if isinstance(cell, Put):
                assert unnamed_keys(cell) == [], (engine.name, key)


def test_control_words_that_leave_a_key_out_are_caught():
    cell = Put((Set("trainer.save_freq"), Set("trainer.resume_mode", "auto")),
               doc="trainer.save_freq (0: grpo.steps)")  # fmt: skip
    assert unnamed_keys(cell) == ["trainer.resume_mode"]


def test_a_print_order_without_a_key_the_table_writes_fails_naming_it():
    with pytest.raises(RuntimeError, match=r"verl's print order .*missing \['trainer.logger'\]"):
        Engine("verl", tuple(k for k in VERL.print_order if k != "trainer.logger"),
               VERL.check_order)  # fmt: skip


def test_a_check_order_without_a_refusing_key_fails_naming_it():
    with pytest.raises(RuntimeError, match=r"nemo_rl's check order .*missing \['eval.samples'\]"):
        Engine("nemo_rl", NEMO_RL.print_order,
               tuple(k for k in NEMO_RL.check_order if k != "eval.samples"))  # fmt: skip


def definitions(sources: dict[str, str], name: str) -> list[str]:
    """The files whose module level assigns `name`."""
    found = []
    for path, text in sources.items():
        for node in ast.parse(text).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(path)
    return found


def test_plan_rules_are_defined_once():
    sources = {
        str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "megatron_ba").rglob("*.py")
    }
    assert definitions(sources, "PLAN_RULES") == ["megatron_ba/integrations/engines/loss_rows.py"]
    planted = {**sources, "megatron_ba/integrations/verl/x.py": 'PLAN_RULES = ("balanced",)\n'}
    assert len(definitions(planted, "PLAN_RULES")) == 2  # the control: a second one is seen
