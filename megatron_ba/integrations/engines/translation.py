"""An engine's translation of a recipe, read from the engines' table (table.py).

    VERL = Engine("verl", print_order=(...), check_order=(...))
    VERL.overrides(Job(recipe, nodes=2, devices=8, run_dir="/abs/run"))  # ["key=value", ...]

What the table does not say, an Engine says: the order its overrides are printed in (the
engine's config, section by section, as a reader of the command finds them) and the order its
refusals are looked for (the first one found is the one named: the checks that read the most
basic settings come first). Both are checked against the table when the Engine is made: an
override the table writes and the print order lacks, or a refusal the check order lacks, fails
at import, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megatron_ba.integrations.engines.cells import REMOVE, Absent, Cell, Job, Put
from megatron_ba.integrations.engines.table import OPTIONS, TABLE, schema_default
from megatron_ba.integrations.hydra_values import hydra_value

# In a check order: every Absent row not named before it, in the table's order.
OTHER_ABSENT_KEYS = "<every other key the engine has no counterpart for>"


@dataclass(frozen=True)
class Engine:
    """One engine's column of the table, with its print and check orders."""

    name: str  # the backend's name in a recipe: verl, nemo_rl, nemo_aligner
    print_order: tuple[str, ...]  # the engine's keys, as its overrides are printed
    check_order: tuple[str, ...]  # recipe keys (and options) whose refusals are looked for
    prefix: str = ""  # before every `key=value` (NeMo-Aligner's `++`: add or replace)

    def __post_init__(self) -> None:
        written = [s.key for _, cell in self.cells() if isinstance(cell, Put) for s in cell.sets]
        _check("print order", self.name, self.print_order, set(written), set(written))
        refusing = {k for k, cell in self.cells() if _refuses(cell)}
        must = {k for k, cell in self.cells() if isinstance(cell, Put) and cell.needs}
        if OTHER_ABSENT_KEYS not in self.check_order:
            must |= {k for k, cell in self.cells() if isinstance(cell, Absent)}
        listed = [k for k in self.check_order if k != OTHER_ABSENT_KEYS]
        _check("check order", self.name, listed, must, refusing)

    def cells(self) -> Iterator[tuple[str, Cell]]:
        """(key, this engine's cell) of every recipe key, then of every option."""
        for key, row in (*TABLE.items(), *OPTIONS.items()):
            yield key, row.cell(self.name)

    def cell(self, key: str) -> Cell:
        return (TABLE.get(key) or OPTIONS[key]).cell(self.name)

    def refusal(self, job: Job) -> str | None:
        """The first `KEY: why` of a value this engine cannot honour, in the check order."""
        named = set(self.check_order)
        for item in self.check_order:
            keys = [item]
            if item == OTHER_ABSENT_KEYS:
                keys = [
                    k
                    for k, c in TABLE.items()
                    if isinstance(c.cell(self.name), Absent) and k not in named
                ]
            for key in keys:
                if (found := self._refusal(key, job)) is not None:
                    return found
        return None

    def _refusal(self, key: str, job: Job) -> str | None:
        cell = self.cell(key)
        if isinstance(cell, Absent):
            return cell.refusal(job, key, schema_default(key), self.name)
        for need in cell.needs if isinstance(cell, Put) else ():
            if (found := need.refusal(job, key)) is not None:
                return found
        return None

    def overrides(self, job: Job) -> list[str]:
        """The engine's `key=value` overrides for `job` in the print order (ValueError naming
        the first key it cannot honour); `~key` for a key taken out of its config."""
        if (found := self.refusal(job)) is not None:
            raise ValueError(found)
        values = {}
        for key, cell in self.cells():
            for s in cell.sets if isinstance(cell, Put) else ():
                if s.when is None or s.when(job):
                    values[s.key] = s.resolve(job, key)
        return [
            f"~{k}" if values[k] is REMOVE else f"{self.prefix}{k}={hydra_value(values[k])}"
            for k in self.print_order
            if k in values
        ]

    def environment(self, job: Job) -> dict[str, str]:
        """The environment variables the engine's process needs for `job` (verl's estimator)."""
        env = {}
        for key, cell in self.cells():
            for s in cell.env if isinstance(cell, Put) else ():
                if s.when is None or s.when(job):
                    env[s.key] = str(s.resolve(job, key))
        return env

    def notes(self, job: Job) -> list[str]:
        """What the translation changes without refusing it (printed by `megatron-ba train`)."""
        found = (c.approx(job) for _, c in self.cells() if isinstance(c, Put) and c.approx)
        return [note for note in found if note]


def _refuses(cell: Cell) -> bool:
    return (isinstance(cell, Put) and bool(cell.needs)) or isinstance(cell, Absent)


def _check(what: str, engine: str, ordered, must: set, may: set) -> None:
    """RuntimeError unless `ordered` holds each of `must` once and nothing outside `may`."""
    missing, extra = must - set(ordered), set(ordered) - may
    twice = {k for k in ordered if list(ordered).count(k) > 1}
    if missing or extra or twice:
        raise RuntimeError(
            f"{engine}'s {what} does not match the engines' table: missing {sorted(missing)}, "
            f"not in the table {sorted(extra)}, twice {sorted(twice)}"
        )
