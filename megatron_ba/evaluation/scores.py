"""Evaluation results: per-benchmark Acc@k / Best@k, their average, JSON and the paper's table.

    report.to_json()                       # a dict, json.dumps-able
    markdown_table([report_a, report_b])   # one row pair (Acc@k, Best@k) per labelled run

The table follows the paper's layout: benchmarks as columns in the order MATH-500, AIME24,
AIME25, OlympiadBench, Minerva, LiveCodeBench, then the average; values as fractions with four
decimals (0.3634).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_ba.evaluation.metrics import average


@dataclass
class BenchmarkResult:
    name: str
    title: str
    problems: int
    samples: int
    acc: float
    best: float
    correct_counts: list[int]  # per problem: how many of its samples were correct
    timeouts: int = 0  # math answers killed by the hard limit (scored wrong)
    seconds: float = 0.0
    skipped_too_long: int = 0  # problems whose prompt + generation budget exceed the context


@dataclass
class EvalReport:
    label: str
    samples: int
    benchmarks: dict[str, BenchmarkResult]
    settings: dict = field(default_factory=dict)

    @property
    def acc(self) -> float:
        return average([b.acc for b in self.benchmarks.values()])

    @property
    def best(self) -> float:
        return average([b.best for b in self.benchmarks.values()])

    def to_json(self) -> dict:
        k = self.samples
        return {
            "label": self.label,
            "samples": k,
            "settings": dict(self.settings),
            "benchmarks": {n: asdict(b) for n, b in self.benchmarks.items()},
            "average": {f"acc@{k}": self.acc, f"best@{k}": self.best},
        }


def markdown_table(reports: list[EvalReport]) -> str:
    """The paper's layout: one Acc@k and one Best@k row per run, benchmarks as columns."""
    if not reports:
        raise ValueError("markdown_table needs at least one report")
    names = list(reports[0].benchmarks)
    for r in reports[1:]:
        if list(r.benchmarks) != names:
            raise ValueError(f"report {r.label!r} covers {list(r.benchmarks)}, not {names}")
    titles = [reports[0].benchmarks[n].title for n in names]
    lines = [
        "| Run | Metric | " + " | ".join(titles) + " | Avg. |",
        "|---|---|" + "---:|" * (len(names) + 1),
    ]
    for r in reports:
        k = r.samples
        for metric, avg in (("acc", r.acc), ("best", r.best)):
            cells = [f"{getattr(r.benchmarks[n], metric):.4f}" for n in names]
            label = f"{metric.capitalize()}@{k}"
            lines.append(f"| {r.label} | {label} | " + " | ".join(cells) + f" | {avg:.4f} |")
    return "\n".join(lines) + "\n"
