"""LiveCodeBench files in rllm's layout: tests/fixtures/rllm/livecodebench.json is written as rllm
writes its file (json.dump(records, f, indent=4) of {problem, starter_code, tests, metadata}; its
third problem is functional with metadata {}, as many of rllm's are);
LiveCodeBench's own records rewritten that way load to the same problems, and reach
`megatron-ba eval --benchmarks livecodebench` through --source and --data-dir."""

from __future__ import annotations

import argparse
import json

import data_helpers  # noqa: F401
import pytest
from data_helpers import BENCH, FIXTURES, read_jsonl

from megatron_ba.commands import eval as eval_command
from megatron_ba.data.livecodebench import load_livecodebench, solution_methods
from megatron_ba.data.records import SchemaError
from megatron_ba.rewards.code import code_score

RLLM = FIXTURES / "rllm" / "livecodebench.json"


def _as_rllm_writes_it(row: dict) -> dict:
    """One LiveCodeBench record mapped as rllm's preprocessing maps it."""
    from megatron_ba.data.livecodebench import decode_test_cases

    tests = decode_test_cases(row["public_test_cases"]) + decode_test_cases(
        row["private_test_cases"]
    )
    return {
        "problem": row["question_content"],
        "starter_code": row["starter_code"],
        "tests": tests,
        "metadata": json.loads(row["metadata"]),
    }


def _fields(loaded):
    return [(p.question, p.tests, p.func_name, p.starter_code, p.kind) for p in loaded]


def test_rllm_layout_maps_field_by_field(tmp_path):
    """LiveCodeBench's fixture records rewritten in rllm's layout load to the same problems."""
    rows = read_jsonl(BENCH / "livecodebench" / "test.jsonl")
    own = load_livecodebench(BENCH / "livecodebench" / "test.jsonl")
    path = tmp_path / "livecodebench.json"
    path.write_text(json.dumps([_as_rllm_writes_it(r) for r in rows], indent=4))
    theirs = load_livecodebench(path)
    assert _fields(theirs) == _fields(own)
    assert [p.id for p in theirs] == [
        "livecodebench.json#0",
        "livecodebench.json#1",
        "livecodebench.json#2",
    ]
    # DeepCoder keeps tests and metadata as JSON text: the same problems
    text = [{**r, "tests": json.dumps(r["tests"]), "metadata": json.dumps(r["metadata"])}
            for r in (_as_rllm_writes_it(r) for r in rows)]  # fmt: skip
    lines = tmp_path / "deepcoder.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in text))
    assert _fields(load_livecodebench(lines)) == _fields(own)


def test_rllm_fixture_file_loads():
    loaded = load_livecodebench(RLLM)
    add, double, evens = loaded.problems
    assert add.question == "Read two integers a and b and print a+b."
    assert [t["output"] for t in add.tests] == ["3\n", "30\n"] and add.func_name is None
    assert double.func_name == "doubleAll" and double.starter_code.startswith("class Solution")
    assert {t["testtype"] for t in double.tests} == {"functional"}
    assert evens.func_name == "countEvens"  # metadata {}: the method of class Solution
    assert loaded.report.rows_read == loaded.report.kept == 3


def _fenced(body: str) -> str:
    return f"Here it is.\n```python\n{body}\n```\n"


def test_a_function_named_only_by_its_starter_code_scores():
    """rllm leaves metadata {} for many functional problems: the name comes from the stub,
    and the sandbox calls that method (a right body under another name scores 0)."""
    evens = load_livecodebench(RLLM).problems[2]
    right = (
        "class Solution:\n    def countEvens(self, nums):\n"
        "        return sum(x % 2 == 0 for x in nums)"
    )
    wrong = right.replace("x % 2 == 0", "x % 2 == 1")
    renamed = right.replace("countEvens", "count")
    scores = [code_score(_fenced(r), list(evens.tests), func_name=evens.func_name, timeout_s=10)
              for r in (right, wrong, renamed)]  # fmt: skip
    assert scores == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("stub", "name"),
    [
        ("class Solution:\n    def f(self, a):\n        ", "f"),
        ("# class ListNode:\n#     def g(self): pass\nclass Solution(object):  # note\n"
         "    def mergeTwo(self, l1: Optional[ListNode]) -> int:\n        ", "mergeTwo"),
        ("class Helper:\n    def no(self):\n        pass\n\nclass Solution:\n"
         "    def yes( self, x):\n", "yes"),
    ],
)  # fmt: skip
def test_the_method_of_class_solution_is_read_from_the_stub(stub, name):
    assert solution_methods(stub) == [name]


def test_a_functional_problem_with_no_name_anywhere_is_refused_by_name(tmp_path):
    rows = json.loads(RLLM.read_text())
    rows[2]["starter_code"] = "def countEvens(nums):\n    "  # no class Solution
    path = tmp_path / "nameless.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(SchemaError, match=(
        r"^LiveCodeBench nameless.json: record 2 \(nameless.json#2\): functional tests need a "
        r"function name: metadata.func_name is absent and its starter_code has no method of "
        r"class Solution$")):  # fmt: skip
        load_livecodebench(path)
    rows[2]["starter_code"] = "class Solution:\n    def a(self):\n        pass\n    def b(self):\n"
    path.write_text(json.dumps(rows))
    with pytest.raises(SchemaError, match=r"record 2 .*class Solution defines 2 methods \(a, b\)"):
        load_livecodebench(path)


def _eval_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    eval_command.add_arguments(p)
    return p.parse_args(["model", "--benchmarks", "livecodebench", *argv])


def test_rllm_file_through_eval_source_and_data_dir(tmp_path):
    by_source = eval_command.load_problems(_eval_args("--source", f"livecodebench={RLLM}"))
    assert _fields(by_source["livecodebench"]) == _fields(load_livecodebench(RLLM))
    by_dir = eval_command.load_problems(_eval_args("--data-dir", str(RLLM.parent)))
    assert _fields(by_dir["livecodebench"]) == _fields(load_livecodebench(RLLM))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r.pop("tests"), r"record 0: missing column 'tests'"),
        (lambda r: r.update(tests=[{"input": 1}]), r"record 0: tests must be a list of"),
        (lambda r: r.update(tests=[]), r"record 0: code Problem .* has no test cases"),
        (lambda r: r.update(problem=""), r"record 0: Problem .* has an empty question"),
        (lambda r: r.update(metadata="{oops"), r"record 0: metadata is not valid JSON"),
        (
            lambda r: r["tests"][0].update(testtype="functional"),
            r"record 0 \(bad.json#0\): functional tests need a function name",
        ),
    ],
)
def test_bad_rllm_records_are_schema_errors(tmp_path, edit, match):
    rows = json.loads(RLLM.read_text())
    edit(rows[0])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(SchemaError, match=match):
        load_livecodebench(path)


def test_rllm_layout_refuses_a_date_window():
    with pytest.raises(SchemaError, match=r"rllm's layout has no contest_date"):
        load_livecodebench(RLLM, since="2024-08-01")
