"""Data: training sets (DAPO-Math-17k, Polaris-53K), the six evaluation sets, prompt templates.

    from megatron_ba.data import load_dapo_math, load_polaris, load_benchmark, problem_messages

Every loader accepts a hub id or a local parquet/jsonl path and returns a LoadedSet (Problems +
a LoadReport of rows read and dropped); schema problems raise SchemaError (a ValueError) naming
the missing column. `datasets` is imported only when a loader runs.
"""

from megatron_ba.data.benchmarks import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    BenchmarkSpec,
    find_local_source,
    load_benchmark,
)
from megatron_ba.data.livecodebench import decode_test_cases, load_livecodebench
from megatron_ba.data.records import LoadedSet, LoadReport, Problem, SchemaError
from megatron_ba.data.templates import (
    MATH_TEMPLATES,
    chat_prompt,
    code_prompt,
    plain_chat,
    problem_messages,
    render_prompt,
    strip_dapo_template,
)
from megatron_ba.data.train_sets import load_dapo_math, load_polaris, parse_difficulty

__all__ = [
    "BENCHMARKS",
    "MATH_TEMPLATES",
    "PAPER_BENCHMARKS",
    "BenchmarkSpec",
    "LoadReport",
    "LoadedSet",
    "Problem",
    "SchemaError",
    "chat_prompt",
    "code_prompt",
    "decode_test_cases",
    "find_local_source",
    "load_benchmark",
    "load_dapo_math",
    "load_livecodebench",
    "load_polaris",
    "parse_difficulty",
    "plain_chat",
    "problem_messages",
    "render_prompt",
    "strip_dapo_template",
]
