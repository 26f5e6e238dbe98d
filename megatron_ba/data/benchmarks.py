"""The paper's six evaluation sets, from their common hub mirrors or local files in their schema.

    from megatron_ba.data import BENCHMARKS, load_benchmark
    math500 = load_benchmark("math500")                         # hub mirror
    aime = load_benchmark("aime24", "fixtures/aime24.jsonl")    # a local file, same schema

Math sets become Problems with `answer`; columns are matched by the names the mirrors use:
question in problem/Problem/question, answer in answer/Answer/final_answer (OlympiadBench's list
of answers is joined with ", " so math-verify compares it as a set/tuple), or the last \\boxed{}
of `solution` when a Minerva copy has no answer column. LiveCodeBench lives in livecodebench.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ba.data.livecodebench import load_livecodebench
from megatron_ba.data.records import LoadedSet, LoadReport, Problem, SchemaError
from megatron_ba.data.sources import first_present, iter_rows, open_table
from megatron_ba.rewards.math_answer import last_boxed


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str  # the CLI name
    title: str  # the column title in reports
    hub_id: str
    config: str | None
    split: str
    kind: str  # "math" | "code"


BENCHMARKS: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in (
        BenchmarkSpec("math500", "MATH-500", "HuggingFaceH4/MATH-500", None, "test", "math"),
        BenchmarkSpec("aime24", "AIME24", "HuggingFaceH4/aime_2024", None, "train", "math"),
        BenchmarkSpec("aime25", "AIME25", "math-ai/aime25", None, "test", "math"),
        BenchmarkSpec(
            "olympiad",
            "OlympiadBench",
            "Hothan/OlympiadBench",
            "OE_TO_maths_en_COMP",
            "train",
            "math",
        ),
        BenchmarkSpec("minerva", "Minerva", "math-ai/minervamath", None, "test", "math"),
        BenchmarkSpec(
            "livecodebench",
            "LiveCodeBench",
            "livecodebench/code_generation_lite",
            None,
            "test",
            "code",
        ),
    )
}
PAPER_BENCHMARKS = tuple(BENCHMARKS)

QUESTION_COLUMNS = ["problem", "Problem", "question", "Question"]
ANSWER_COLUMNS = ["answer", "Answer", "final_answer", "expected_answer"]
ID_COLUMNS = ["unique_id", "id", "ID", "problem_id", "idx"]


def _answer_text(value) -> str:
    if isinstance(value, list):  # OlympiadBench: ["$\\frac{1}{2}$", ...]
        return ", ".join(str(v).strip().strip("$").strip() for v in value)
    if value is None:
        return ""
    return str(value).strip()


def load_math_benchmark(name: str, source: str | Path | None = None) -> LoadedSet:
    spec = BENCHMARKS[name]
    table = open_table(source or spec.hub_id, split=spec.split, config=spec.config)
    title = f"{spec.title} ({source or spec.hub_id})"
    qcol = first_present(table, QUESTION_COLUMNS, name=title, what="question")
    acol = next((c for c in ANSWER_COLUMNS if c in table.features), None)
    if acol is None and "solution" not in table.features:
        raise SchemaError(
            f"{title}: missing answer column (expected one of {ANSWER_COLUMNS}, or 'solution' "
            f"with a \\boxed answer); the table has columns {sorted(table.features)}"
        )
    icol = next((c for c in ID_COLUMNS if c in table.features), None)
    report = LoadReport(spec.title, str(source or spec.hub_id))
    problems = []
    for i, row in enumerate(iter_rows(table)):
        report.rows_read += 1
        if acol is not None:
            answer = _answer_text(row[acol])
        else:
            boxed = last_boxed(str(row.get("solution") or ""))
            answer = boxed[0].strip() if boxed else ""
        question = str(row[qcol] or "")
        if not answer or not question.strip():
            report.drop("empty question or answer")
            continue
        pid = str(row[icol]) if icol is not None else str(i)
        problems.append(Problem(pid, question, answer, source=name))
    report.kept = len(problems)
    if not problems:
        raise SchemaError(f"{title}: no usable rows ({report.summary()})")
    return LoadedSet(problems, report)


def load_benchmark(name: str, source: str | Path | None = None, **options) -> LoadedSet:
    """One of BENCHMARKS by name, from `source` (a local file/folder) or its hub mirror.

    options go to the LiveCodeBench loader (version, since, until).
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    if BENCHMARKS[name].kind == "code":
        return load_livecodebench(source, **options)
    if options:
        raise ValueError(f"benchmark {name!r} takes no options, got {sorted(options)}")
    return load_math_benchmark(name, source)


def find_local_source(data_dir: str | Path, name: str) -> Path | None:
    """`data_dir/NAME.{jsonl,parquet,json}` or the folder `data_dir/NAME`, if present."""
    base = Path(data_dir)
    for candidate in (base / f"{name}.jsonl", base / f"{name}.parquet", base / f"{name}.json"):
        if candidate.is_file():
            return candidate
    return base / name if (base / name).is_dir() else None
