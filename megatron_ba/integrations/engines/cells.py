"""The cells of the engines' table: what one engine does with one recipe key.

A row of the table (table.py) is a recipe key (or an option of `megatron-ba train`, `--nodes`)
and one cell per engine, of one of these kinds:

- Put: the key is translated. `sets` are the engine's config keys it writes (Set: a key and its
  value: the recipe's value as it is, a constant, or a function of the Job), `needs` the values
  the engine cannot honour (Need: refused naming the key, with why), `env` the environment
  variables it sets (verl's estimator reads two), `approx` a note printed when a value is
  translated approximately.
- Absent: the engine has no counterpart; the key is accepted at the schema's default only.
- Dropped: the key is accepted and not passed on (this project's console display, or a setting
  the engine's own config decides), with why.

A Job is what an engine is asked to run: the recipe and the command's options (nodes, devices,
run folder, ...); its attributes fall through to the recipe's sections (`job.grpo.steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ba.integrations.hydra_values import hydra_value

ROW = "<the row's value>"  # Set.value: the recipe's value of the row's key, as it is
REMOVE = "<removed>"  # Set.value: `~key`, the key taken out of the engine's config


@dataclass(frozen=True)
class Job:
    """The recipe and the options an engine's translation reads (the command's flags)."""

    recipe: Any
    nodes: int = 1
    devices: int | None = None  # GPUs (or CPU processes) per node; the engine's default if None
    run_dir: str | None = None
    accelerator: str = "gpu"
    prompt_files: tuple[str, str] | None = None
    hf_checkpoint: str = "refuse"  # NeMo-Aligner: "refuse" or "placeholder" (`???`)

    def __getattr__(self, name: str):  # job.grpo -> recipe.grpo (only for names not above)
        return getattr(self.recipe, name)

    @property
    def layout(self):
        """The recipe's ParallelLayout (megatron_ba.parallel.parallel_layout): its sizes, and
        what they imply (the experts' tensor parallelism), decided there once."""
        return self.recipe.parallel.layout()

    def value(self, key: str):
        """The recipe's value of a dotted key, or the option's (`--nodes` -> nodes)."""
        if key.startswith("--"):
            return getattr(self, key[2:].replace("-", "_"))
        value = self.recipe
        for part in key.split("."):
            value = getattr(value, part)
        return value


Value = Callable[[Job], Any]


@dataclass(frozen=True)
class Set:
    """One key of the engine's config and its value, written when `when(job)` holds."""

    key: str
    value: Any = ROW
    when: Value | None = None
    note: str = ""  # the docs' words after the key

    def resolve(self, job: Job, row: str):
        if self.value == ROW:
            return job.value(row)
        return self.value(job) if callable(self.value) else self.value

    def describe(self) -> str:
        """`key`, `key=constant`, then the note in parentheses (the docs' table)."""
        constant = not callable(self.value) and self.value not in (ROW, REMOVE)
        text = f"~{self.key}" if self.value == REMOVE else self.key
        text += f"={hydra_value(self.value)}" if constant else ""
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class Need:
    """A value the engine cannot honour: refused when `ok(job)` is false, the message
    `KEY: why` (`why` a string or a function of the job; KEY the row's unless `key` names
    another, as NeMo-Aligner's refusal of model.rope_scaling does)."""

    ok: Value
    why: str | Value
    key: str | None = None

    def refusal(self, job: Job, row: str) -> str | None:
        if self.ok(job):
            return None
        why = self.why(job) if callable(self.why) else self.why
        return f"{self.key or row}: {why}"


@dataclass(frozen=True)
class Put:
    """Translated: `sets` written once `needs` hold. `doc` replaces the docs' words made from
    the sets (where the engine's keys alone would not say it), `note` is added to them."""

    sets: tuple[Set, ...] = ()
    needs: tuple[Need, ...] = ()
    env: tuple[Set, ...] = ()
    approx: Value | None = None  # a note (or None) on a value the engine approximates
    note: str = ""
    doc: str = ""

    def describe(self) -> str:
        if self.doc:
            return self.doc
        text = ", ".join(s.describe() for s in self.sets)
        return f"{text} ({self.note})" if self.note and text else text or self.note


def put(*sets: Set | str, need: Need | tuple[Need, ...] = (), **kw) -> Put:
    """Put(...) with each bare string a Set of the row's value under that engine key."""
    needs = need if isinstance(need, tuple) else (need,)
    return Put(tuple(Set(s) if isinstance(s, str) else s for s in sets), needs, **kw)


@dataclass(frozen=True)
class Absent:
    """No counterpart in the engine: accepted at the schema's default, else refused with `why`
    (`said`: the whole refusal, where the engine's words it itself)."""

    why: str
    said: Value | None = None

    def refusal(self, job: Job, row: str, default, engine: str) -> str | None:
        value = job.value(row)
        if value == default:
            return None
        if self.said is not None:
            return self.said(job)
        fix = "leave it out" if default is None else f"use the default {default!r}"
        return f"{row}: not available on the {engine} backend ({self.why}); got {value!r}, {fix}"

    def describe(self, default) -> str:
        at = "left out" if default is None else f"`{default}`"
        return f"refused unless {at}: {self.why}"


@dataclass(frozen=True)
class Dropped:
    """Accepted and not passed on, with why."""

    why: str

    def describe(self) -> str:
        return f"not passed on: {self.why}"


Cell = Put | Absent | Dropped


@dataclass(frozen=True)
class Row:
    """One recipe key (or command option): what each engine does with it."""

    verl: Cell
    nemo_rl: Cell
    nemo_aligner: Cell

    def cell(self, engine: str) -> Cell:
        return getattr(self, engine)


def same(cell: Cell) -> Row:
    """A row whose cell is the same for every engine."""
    return Row(cell, cell, cell)
