"""What every loader returns: `Problem` records and a `LoadReport` saying what was read/dropped."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ba.errors import UserError


class SchemaError(UserError):
    """A data set lacks a column (or a column holds the wrong kind of value)."""


@dataclass(frozen=True)
class Problem:
    """One prompt with what its reward needs.

    question: the bare problem text (no template); templates.render_prompt() adds one.
    answer: the ground truth of a math problem ("" for code).
    tests / func_name / starter_code: a code problem's test cases ({input, output, testtype}),
    the function called by functional tests, and the code the prompt asks to complete.
    """

    id: str
    question: str
    answer: str = ""
    kind: str = "math"  # "math" | "code"
    tests: tuple[dict, ...] = ()
    func_name: str | None = None
    starter_code: str = ""
    source: str = ""
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in ("math", "code"):
            raise ValueError(f"Problem.kind must be 'math' or 'code', got {self.kind!r}")
        if not self.question.strip():
            raise ValueError(f"Problem {self.id!r} has an empty question")
        if self.kind == "math" and not self.answer.strip():
            raise ValueError(f"math Problem {self.id!r} has an empty answer")
        if self.kind == "code" and not self.tests:
            raise ValueError(f"code Problem {self.id!r} has no test cases")


@dataclass
class LoadReport:
    """Rows read, problems kept, and how many rows each filter dropped (reason -> count)."""

    name: str
    source: str
    rows_read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0  # prompts seen with different ground truths (DAPO-Math-17k)
    notes: list[str] = field(default_factory=list)  # what a user must know about this load

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count

    def note(self, text: str) -> None:
        self.notes.append(text)

    def summary(self) -> str:
        drops = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"
        line = (
            f"{self.name} from {self.source}: {self.rows_read} rows read, {self.kept} kept "
            f"(dropped {drops})"
        )
        return "; ".join([line, *self.notes])


@dataclass
class LoadedSet:
    problems: list[Problem]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self):
        return iter(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]
