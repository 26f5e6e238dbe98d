"""evaluate() end to end with a generate callable whose answers are known: exact numbers."""

import data_helpers  # noqa: F401
import pytest
from data_helpers import BENCH

from megatron_ba.data import PAPER_BENCHMARKS, find_local_source, load_benchmark, render_prompt
from megatron_ba.evaluation import evaluate, markdown_table

K = 4
GOOD_CODE = {
    "abc000_a": "a, b = map(int, input().split())\nprint(a + b)",
    "9001": "class Solution:\n    def doubleAll(self, nums):\n        return [2 * x for x in nums]",
    "1000A": "print(input())",
}


def is_right(i: int, j: int) -> bool:
    """Which samples the fake model gets right: problem 0 -> all, 1 -> sample 0 only, others
    -> none."""
    return i == 0 or (i == 1 and j == 0)


@pytest.fixture(scope="module")
def benchmarks():
    return {
        name: load_benchmark(name, find_local_source(BENCH, name)).problems
        for name in PAPER_BENCHMARKS
    }


def make_generate(benchmarks, calls):
    by_prompt = {}

    def generate(prompts, n, temperature, max_tokens):
        calls.append((len(prompts), n, temperature, max_tokens))
        out = []
        for prompt in prompts:
            _, i, problem = by_prompt[prompt]
            row = []
            for j in range(n):
                if problem.kind == "math":
                    ans = problem.answer if is_right(i, j) else "123456789"
                    row.append(f"Let me think.\nAnswer: {ans}" if j % 2 else f"\\boxed{{{ans}}}")
                else:
                    code = GOOD_CODE[problem.id] if is_right(i, j) else "print('nope')"
                    row.append(f"```python\n{code}\n```")
            out.append(row)
        return out

    return generate, by_prompt


def test_reported_numbers_are_exact(benchmarks):
    calls = []
    generate, by_prompt = make_generate(benchmarks, calls)
    seen_prompts = []

    def fmt(messages):
        text = "\n".join(m["content"] for m in messages)
        seen_prompts.append(text)
        return text

    # map every prompt the runner will build back to its problem
    from megatron_ba.data import problem_messages

    for name, problems in benchmarks.items():
        for i, p in enumerate(problems):
            by_prompt["\n".join(m["content"] for m in problem_messages(p, "dapo"))] = (name, i, p)
    report = evaluate(
        generate, benchmarks, samples=K, temperature=0.7, max_tokens=99, format_prompt=fmt
    )
    expected = {}
    for name, problems in benchmarks.items():
        n = len(problems)
        right = [[is_right(i, j) for j in range(K)] for i in range(n)]
        acc = sum(map(sum, right)) / (n * K)
        best = sum(any(r) for r in right) / n
        expected[name] = (acc, best)
        got = report.benchmarks[name]
        assert (got.acc, got.best) == pytest.approx((acc, best), abs=0), name
        assert got.correct_counts == [sum(r) for r in right]
        assert got.timeouts == 0
    # hand check of one: MATH-500 has 3 problems -> (4 + 1 + 0) / 12 and 2 / 3
    assert expected["math500"] == (5 / 12, 2 / 3)
    assert report.acc == pytest.approx(sum(a for a, _ in expected.values()) / 6, abs=1e-15)
    assert report.best == pytest.approx(sum(b for _, b in expected.values()) / 6, abs=1e-15)
    assert calls == [(len(p), K, 0.7, 99) for p in benchmarks.values()]
    math_prompt = render_prompt(benchmarks["aime25"][0].question, "dapo")
    assert math_prompt in seen_prompts
    assert any(p.startswith("You are an expert Python programmer") for p in seen_prompts)
    table = markdown_table([report])
    assert (
        "| MATH-500 | AIME24 | AIME25 | OlympiadBench | Minerva | LiveCodeBench | Avg. |" in table
    )


def test_a_wrong_scorer_would_be_caught(benchmarks):
    """Negative control: the same pipeline with every answer wrong reports zeros."""

    def generate(prompts, n, temperature, max_tokens):
        return [["Answer: 123456789"] * n for _ in prompts]

    subset = {"aime24": benchmarks["aime24"], "minerva": benchmarks["minerva"]}
    report = evaluate(generate, subset, samples=2, max_tokens=8)
    assert report.acc == 0.0 and report.best == 0.0


def test_generate_must_return_n_strings_per_prompt(benchmarks):
    subset = {"aime24": benchmarks["aime24"]}
    with pytest.raises(ValueError, match="2 strings per prompt"):
        evaluate(lambda p, n, t, m: [["x"] for _ in p], subset, samples=2)
    with pytest.raises(ValueError, match="results for 2 prompts"):
        evaluate(lambda p, n, t, m: [], subset, samples=2)
    with pytest.raises(ValueError, match="samples"):
        evaluate(lambda p, n, t, m: [], subset, samples=0)
    with pytest.raises(ValueError, match="no problems"):
        evaluate(lambda p, n, t, m: [], {"aime24": []})


def test_prompts_that_do_not_fit_the_context_are_skipped_and_counted():
    """A model whose context cannot hold a prompt plus the generation budget: those problems are
    skipped and counted, the rest scored; none fitting is an error before any generation."""
    from megatron_ba.data.records import Problem

    problems = [
        Problem(id="short", question="1+1?", answer="2"),
        Problem(id="long", question="x" * 200, answer="3"),
    ]
    calls = []

    def generate(prompts, n, temperature, max_tokens):
        calls.append(list(prompts))
        return [["Answer: 2"] * n for _ in prompts]

    report = evaluate(
        generate,
        {"math500": problems},
        samples=2,
        max_tokens=16,
        template="plain",
        prompt_tokens=len,  # one token per character
        max_model_len=64,
    )
    b = report.benchmarks["math500"]
    assert (b.problems, b.skipped_too_long, b.acc) == (1, 1, 1.0)
    assert calls == [["1+1?\n\n"]]  # the long prompt never reached the engine
    # Without the context check both are generated (the check is what skipped the long one).
    calls.clear()
    report = evaluate(generate, {"math500": problems}, samples=2, max_tokens=16, template="plain")
    assert report.benchmarks["math500"].skipped_too_long == 0 and len(calls[0]) == 2
    calls.clear()
    with pytest.raises(ValueError, match=r"benchmark 'math500': no prompt fits the context of 8"):
        evaluate(
            generate,
            {"math500": problems},
            samples=2,
            max_tokens=16,
            template="plain",
            prompt_tokens=len,
            max_model_len=8,
        )
    assert calls == []
