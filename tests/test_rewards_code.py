"""Code reward: extraction, output comparison, stdin and functional tests in the sandbox."""

import data_helpers  # noqa: F401
import pytest
from data_helpers import BENCH

from megatron_ba.data import load_livecodebench
from megatron_ba.rewards import code_score, extract_code, run_tests
from megatron_ba.rewards.code import result_matches, stdout_matches

# `stack`: what a release of megatron-core, torch or Python changes; run again on the current
# stack by scripts/run_current_tests.sh (pyproject.toml's markers).
pytestmark = pytest.mark.stack


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\nDone."


ADD = "a, b = map(int, input().split())\nprint(a + b)"
ADD_WRONG = "a, b = map(int, input().split())\nprint(a - b)"
DOUBLE = (
    "class Solution:\n    def doubleAll(self, nums: List[int]) -> List[int]:\n"
    "        return [2 * x for x in nums]"
)


@pytest.fixture(scope="module")
def lcb():
    return {p.id: p for p in load_livecodebench(BENCH / "livecodebench")}


def test_extract_code_takes_the_last_python_block():
    text = "```python\nfirst\n```\nthen\n```python\nsecond\n```\n```text\nnot code\n```"
    assert extract_code(text) == "second\n"
    assert extract_code("```\nuntagged\n```") == "untagged\n"
    assert extract_code("```cpp\nint main(){}\n```") == "int main(){}\n"
    assert extract_code("no code at all") is None


def test_output_comparison():
    assert stdout_matches("3\n", "3")
    assert stdout_matches("  1 2  \n3\n\n", "1 2\n3")
    assert stdout_matches("1.50\n", "1.5\n")  # exact decimals
    assert not stdout_matches("1.5000001\n", "1.5\n")  # ... never a tolerance
    assert not stdout_matches("3\n4\n", "3\n")
    assert not stdout_matches("1 2\n", "1 2 3\n")
    assert not stdout_matches("abc\n", "abd\n")
    assert result_matches("[2, 4]", "[2,4]")
    assert result_matches("true", "true") and not result_matches("false", "true")
    assert not result_matches(None, "1") and not result_matches("{bad", "1")


def test_stdin_problem_right_and_wrong(lcb):
    add = lcb["abc000_a"]
    tests = list(add.tests)
    assert code_score(fenced(ADD), tests) == 1.0
    assert code_score(fenced(ADD_WRONG), tests) == 0.0
    assert run_tests(ADD_WRONG, tests) == [False, False, False]
    almost = "a, b = map(int, input().split())\nprint(abs(a) + b)"  # wrong only for a < 0
    assert run_tests(almost, tests) == [True, True, False]
    assert code_score(fenced(almost), tests) == 0.0  # one failing test fails the program
    assert code_score("I don't know.", tests) == 0.0
    crash = "raise SystemExit(3)"
    assert code_score(fenced(crash), tests) == 0.0


def test_functional_problem_right_and_wrong(lcb):
    double = lcb["9001"]
    tests = list(double.tests)
    assert code_score(fenced(DOUBLE), tests, func_name=double.func_name) == 1.0
    wrong = DOUBLE.replace("2 * x", "x + 2")
    assert run_tests(wrong, tests, func_name="doubleAll") == [False, True]  # [] stays []
    assert code_score(fenced(wrong), tests, func_name="doubleAll") == 0.0
    plain_function = "def doubleAll(nums):\n    print('noise')\n    return [x * 2 for x in nums]"
    assert code_score(fenced(plain_function), tests, func_name="doubleAll") == 1.0
    with pytest.raises(ValueError, match="func_name is required"):
        code_score(fenced(DOUBLE), tests)


def test_slow_test_times_out_and_fails():
    tests = [{"input": "", "output": "done\n", "testtype": "stdin"}]
    slow = "import time\ntime.sleep(30)\nprint('done')"
    assert code_score(fenced(slow), tests, timeout_s=1.0) == 0.0
    assert code_score(fenced("print('done')"), tests, timeout_s=1.0) == 1.0


def test_invalid_test_cases_are_value_errors():
    with pytest.raises(ValueError, match="non-empty list"):
        code_score(fenced(ADD), [])
    with pytest.raises(ValueError, match=r"test_cases\[0\] needs a str 'output'"):
        code_score(fenced(ADD), [{"input": "1"}])
    with pytest.raises(ValueError, match="testtype"):
        code_score(fenced(ADD), [{"input": "1", "output": "1", "testtype": "interactive"}])
    mixed = [
        {"input": "1", "output": "1", "testtype": "stdin"},
        {"input": "1", "output": "1", "testtype": "functional"},
    ]
    with pytest.raises(ValueError, match="mix test types"):
        code_score(fenced(ADD), mixed, func_name="f")
