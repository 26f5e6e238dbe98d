"""Code reward (LiveCodeBench style): the last fenced code block, run on every test, sandboxed.

    from megatron_ba.rewards import code_score
    tests = [{"input": "1 2\\n", "output": "3\\n", "testtype": "stdin"}]
    code_score("```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```", tests)  # 1.0

Test cases use LiveCodeBench's form {"input": str, "output": str, "testtype": "stdin" |
"functional"}. stdin tests feed `input` on stdin and compare stdout line by line (whitespace
stripped; numeric tokens compared as exact decimals, as LiveCodeBench does). Functional tests
call `func_name` (a method of `Solution`, or a plain function) with the JSON values on the
input's lines and compare the JSON return value with `output`. The expected outputs never enter
the sandbox: it returns raw outputs and they are compared here.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation

from megatron_ba.rewards.sandbox import SandboxLimits, run_program

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
TESTTYPES = ("stdin", "functional")


def extract_code(response: str) -> str | None:
    """The last fenced code block of `response` (python-tagged or untagged), or None."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(response)]
    if not blocks:
        return None
    pythonish = [b for lang, b in blocks if lang in ("python", "py", "python3", "")]
    return (pythonish or [blocks[-1][1]])[-1]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _as_decimal(token: str) -> Decimal | None:
    try:
        return Decimal(token)
    except InvalidOperation:
        return None


def stdout_matches(actual: str, expected: str) -> bool:
    """Line-by-line comparison; a line also matches when its whitespace-separated tokens are
    equal as exact decimals ("1.50" == "1.5"), never within a tolerance."""
    got, want = _lines(actual), _lines(expected)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if g == w:
            continue
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt):
            return False
        for a, b in zip(gt, wt, strict=True):
            if a == b:
                continue
            da, db = _as_decimal(a), _as_decimal(b)
            if da is None or db is None or da != db:
                return False
    return True


def result_matches(actual_json: str | None, expected: str) -> bool:
    """Functional tests: the returned value equals the expected JSON value (tuples as lists)."""
    if actual_json is None:
        return False
    try:
        return json.loads(actual_json) == json.loads(expected)
    except (json.JSONDecodeError, TypeError):
        return False


def validate_tests(test_cases: list[dict]) -> str:
    """Check the {input, output, testtype} form; return the (single) testtype."""
    if not isinstance(test_cases, list) or not test_cases:
        raise ValueError("test_cases must be a non-empty list of {input, output, testtype} dicts")
    kinds = set()
    for i, case in enumerate(test_cases):
        if not isinstance(case, dict):
            raise ValueError(f"test_cases[{i}] must be a dict, got {type(case).__name__}")
        for key in ("input", "output"):
            if not isinstance(case.get(key), str):
                raise ValueError(f"test_cases[{i}] needs a str {key!r}, got {case.get(key)!r:.60}")
        kind = case.get("testtype", "stdin")
        if kind not in TESTTYPES:
            raise ValueError(f"test_cases[{i}]['testtype'] must be one of {TESTTYPES}: {kind!r}")
        kinds.add(kind)
    if len(kinds) != 1:
        raise ValueError(f"test_cases mix test types {sorted(kinds)}; one problem uses one type")
    return kinds.pop()


def run_tests(
    program: str,
    test_cases: list[dict],
    *,
    func_name: str | None = None,
    limits: SandboxLimits | None = None,
) -> list[bool]:
    """Run `program` on every test in one sandbox; one pass/fail flag per test."""
    kind = validate_tests(test_cases)
    if kind == "functional" and not func_name:
        raise ValueError("func_name is required for functional test cases")
    run = run_program(
        program,
        [c["input"] for c in test_cases],
        mode="call" if kind == "functional" else "stdio",
        func_name=func_name,
        limits=limits,
    )
    flags = []
    for case, out in zip(test_cases, run.outputs, strict=True):
        if out.status != "ok":
            flags.append(False)
        elif kind == "functional":
            flags.append(result_matches(out.result, case["output"]))
        else:
            flags.append(stdout_matches(out.stdout or "", case["output"]))
    return flags


def code_score(
    response: str,
    test_cases: list[dict],
    *,
    func_name: str | None = None,
    timeout_s: float = 6.0,
) -> float:
    """1.0 if the last fenced code block of `response` passes every test case, else 0.0.

    Each test may run `timeout_s` seconds of wall-clock time; see SandboxLimits for the rest.
    """
    if not isinstance(response, str):
        raise ValueError(f"response must be a str, got {type(response).__name__}")
    validate_tests(test_cases)
    program = extract_code(response)
    if program is None:
        return 0.0
    flags = run_tests(
        program, test_cases, func_name=func_name, limits=SandboxLimits(timeout_s=timeout_s)
    )
    return 1.0 if all(flags) else 0.0
