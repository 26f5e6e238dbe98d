"""Math reward: extraction, the tricky-equivalence correctness table, and the never-hang pool."""

import threading
import time

import data_helpers  # noqa: F401  (offline settings)
import pytest

from megatron_ba.rewards import (
    MathRewardPool,
    extract_answer,
    judge_math,
    math_score,
    math_score_batch,
    normalize_answer,
)

# (ground truth, response, expected score): held-out tricky equivalences, true and false cases
CORRECTNESS_TABLE = [
    # fractions vs decimals
    ("\\frac{1}{2}", "Answer: 0.5", 1.0),
    ("0.5", "Answer: \\frac{1}{2}", 1.0),
    ("\\frac{1}{3}", "Answer: 0.33", 0.0),
    ("\\frac{3}{4}", "Answer: 3/4", 1.0),
    ("\\frac{3}{4}", "Answer: 0.75", 1.0),
    ("\\frac{3}{4}", "Answer: 0.7", 0.0),
    ("2", "Answer: 2.0", 1.0),
    ("2", "Answer: 2.5", 0.0),
    # \dfrac, \tfrac, \frac12
    ("\\frac{5}{6}", "the answer is \\boxed{\\dfrac{5}{6}}", 1.0),
    ("\\dfrac{5}{6}", "Answer: \\tfrac{5}{6}", 1.0),
    ("\\frac{5}{6}", "\\boxed{\\dfrac{6}{5}}", 0.0),
    ("\\frac12", "\\boxed{\\frac{1}{2}}", 1.0),
    # intervals
    ("[1, 3)", "Answer: [1,3)", 1.0),
    ("[1, 3)", "Answer: [1, 3]", 0.0),
    ("(-\\infty, 2]", "\\boxed{(-\\infty,2]}", 1.0),
    ("(-\\infty, 2]", "\\boxed{(-\\infty,2)}", 0.0),
    ("(0, 1) \\cup (2, 3)", "\\boxed{(0,1)\\cup(2,3)}", 1.0),
    # units
    ("10", "Answer: 10 \\text{ cm}", 1.0),
    ("10", "Answer: 10 cm", 1.0),
    ("90", "Answer: 90^\\circ", 1.0),
    ("90", "Answer: 90 degrees", 1.0),
    ("10", "Answer: 12 cm", 0.0),
    ("5", "Answer: \\$5", 1.0),
    ("25\\%", "Answer: 25\\%", 1.0),
    # negative numbers
    ("-7", "Answer: -7", 1.0),
    ("-7", "Answer: 7", 0.0),
    ("-\\frac{1}{2}", "Answer: -0.5", 1.0),
    ("-\\frac{1}{2}", "Answer: \\frac{-1}{2}", 1.0),
    ("-3", "Answer: - 3", 1.0),
    # sets and lists of answers
    ("\\{1, 2, 3\\}", "Answer: \\{3, 2, 1\\}", 1.0),
    ("\\{1, 2\\}", "Answer: \\{1, 3\\}", 0.0),
    ("1, 2", "Answer: 2, 1", 1.0),
    ("2, -2", "\\boxed{-2, 2}", 1.0),
    ("2, -2", "\\boxed{2}", 0.0),
    # symbolic, thousands separators, trailing punctuation, letters, equations
    ("3\\sqrt{2}", "Answer: \\sqrt{18}", 1.0),
    ("\\frac{\\pi}{2}", "Answer: \\pi/2", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("1000", "Answer: 1,000", 1.0),
    ("34", "Answer: 34.", 1.0),
    ("34", "no final answer here", 0.0),
    ("34", "Answer: 43", 0.0),
    ("\\text{(B)}", "Answer: (B)", 1.0),
    ("x = 3", "Answer: 3", 1.0),
]

# A right-hand side alone matches only where the left side is a bare name.
# The ground truths are MATH-500 / Minerva-style equations.
EQUATION_TABLE = [
    ("5x - 7y + 11z + 4 = 0", "Answer: 0", 0.0),
    ("5x - 7y + 11z + 4 = 0", "Answer: 5x - 7y + 11z + 4 = 0", 1.0),
    ("5x - 7y + 11z + 4 = 0", "Answer: -5x + 7y - 11z - 4 = 0", 1.0),  # rearranged
    ("5x - 7y + 11z + 4 = 0", "\\boxed{5x - 7y + 11z = -4}", 1.0),
    ("5x - 7y + 11z + 4 = 0", "Answer: 5x - 7y + 11z + 5 = 0", 0.0),  # same right side
    ("y'+ry-rx(t)=0", "Answer: 0", 0.0),
    ("y'+ry-rx(t)=0", "Answer: y'+ry-rx(t)=0", 1.0),
    ("y'+ry-rx(t)=0", "Answer: y' = rx(t) - ry", 1.0),
    ("m l \\ddot\\theta - m g \\sin\\theta = f(t)\\cos\\theta", "Answer: f(t)\\cos\\theta", 0.0),
    (
        "m l \\ddot\\theta - m g \\sin\\theta = f(t)\\cos\\theta",
        "Answer: m l \\ddot\\theta - m g \\sin\\theta = f(t)\\cos\\theta",
        1.0,
    ),
    ("x^2 + y^2 = 1", "Answer: 1", 0.0),
    ("x = 5", "Answer: 5", 1.0),
    ("k=3", "Answer: 3", 1.0),
    ("k=3", "Answer: 4", 0.0),
    ("\\theta = \\frac{\\pi}{4}", "Answer: \\frac{\\pi}{4}", 1.0),
    ("a_{n} = 2^n", "Answer: 2^n", 1.0),
]

# A box is not overridden by an "answer:" in prose; zero-padded AIME answers;
# hedging (many boxes, repeated Answer lines, several values in one answer) earns nothing.
PRECEDENCE_TABLE = [
    (
        "44",
        "so $17^{-1} \\equiv \\boxed{44} \\pmod{83}$. We may check our answer: "
        "$17 \\cdot 44 = 748$, and $748 = 9 \\cdot 83 + 1$.",
        1.0,
    ),
    ("073", "$\\boxed{\\textbf{(073)}}$", 1.0),
    ("073", "Answer: 73", 1.0),
    ("73", "\\boxed{073}", 1.0),
    ("073", "Answer: 37", 0.0),
    ("3", "\\boxed{1} \\boxed{2} \\boxed{3} \\boxed{4}", 0.0),  # only the last box counts
    ("4", "\\boxed{1} \\boxed{2} \\boxed{3} \\boxed{4}", 1.0),
    ("3", "Answer: 3\nAnswer: 4", 0.0),  # only the last Answer line counts
    ("4", "Answer: 3\nAnswer: 4", 1.0),
    ("3", "Answer: 4\nso \\boxed{3}", 0.0),  # the Answer line wins over any box
    ("3", "Answer: 3, 4", 0.0),
    ("3", "Answer: 3 \\text{ or } 4", 0.0),
    ("3", "Answer: 3 \\pm 1", 0.0),
    ("3", "Answer: 1, 2, 3, 4, 5", 0.0),
]


@pytest.fixture(scope="module")
def pool():
    with MathRewardPool(workers=2, timeout_s=10.0) as p:
        yield p


def _wrongly_scored(pool, table):
    out = pool.score([r for _, r, _ in table], [t for t, _, _ in table])
    assert 0 < sum(out.scores) < len(out.scores)  # both outcomes occur
    return [(t, r, e, s) for (t, r, e), s in zip(table, out.scores, strict=True) if s != e]


def test_equations_need_their_left_side(pool):
    assert _wrongly_scored(pool, EQUATION_TABLE) == []


def test_precedence_and_hedging(pool):
    assert _wrongly_scored(pool, PRECEDENCE_TABLE) == []


def test_correctness_table_through_the_pool(pool):
    truths = [t for t, _, _ in CORRECTNESS_TABLE]
    responses = [r for _, r, _ in CORRECTNESS_TABLE]
    out = pool.score(responses, truths)
    got = dict(zip(responses, out.scores, strict=True))
    wrong = [(t, r, e, got[r]) for t, r, e in CORRECTNESS_TABLE if got[r] != e]
    assert wrong == []
    assert out.metrics["math_reward/timeouts"] == 0
    # both outcomes occur: the table cannot pass by scoring everything the same
    assert 0 < sum(out.scores) < len(out.scores)
    assert math_score_batch(responses[:4], truths[:4], pool=pool) == out.scores[:4]


def test_extraction_rules():
    cases = {
        "so Answer: 34": None,  # running prose: not a final-answer line
        "3+5=8, 8-2=6. Answer: 6": "6",  # a last sentence that opens with Answer: (arithmetic)
        "3+5=8, so 8. 8-2=5, so 5. Answer: 5\nAnswer: 7": "7",  # the last marker wins
        "We may check our answer: 5": None,
        "Answer: 34": "34",
        "**Answer:** 34": "34",
        "### Final Answer: \\boxed{7}": "7",
        "Answer:\n$$12$$": "12",  # the value on the next line
        "Answer: \\boxed{5}.": "5",
        "Answer: \\boxed{1}, \\boxed{2}": "2",
        "\\boxed{3} and then\nAnswer: $4$": "4",
        "Answer: 3\nactually \\boxed{\\frac{1}{2}}": "3",  # the Answer line wins over a box
        "Answer: 1\nAnswer: 2": "2",
        "\\boxed{1} \\boxed{2} \\boxed{3}": "3",
        "we may check our answer: 17\n\\boxed{44}": "44",
        "\\boxed 7": "7",
        "\\boxed $": None,
        "\\fbox{x^{2}}": "x^{2}",
        "\\boxed{\\{1, \\{2\\}\\}}": "\\{1, \\{2\\}\\}",  # nested braces
        "answer: -2.": "-2",
        "nothing": None,
        "Answer:": None,
    }
    assert {r: extract_answer(r) for r in cases} == cases
    with pytest.raises(ValueError, match="response must be a str"):
        extract_answer(None)


def test_normalisation_fallback():
    same = [
        ("\\text{10 cm}", "10"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("x = 3", "3"),
        ("x = y = 3", "3"),
        ("\\alpha_{1} = 3", "3"),
        ("\\textbf{(073)}", "73"),
        ("2.50", "2.5"),
        ("1,000", "1000"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("$5$", "5"),
    ]
    for a, b in same:
        assert normalize_answer(a) == normalize_answer(b), (a, b)
    assert normalize_answer("1,2") != normalize_answer("12")  # not a thousands separator
    assert normalize_answer("-3") != normalize_answer("3")
    for equation in ("5x - 7y + 11z + 4 = 0", "x^2 + y^2 = 1", "2x = 6", "f(x) = 2"):
        assert normalize_answer(equation) != normalize_answer(equation.split("=")[-1])
    # the fallback alone decides what math-verify cannot parse
    assert judge_math("Answer: \\text{Monday}", "\\text{Monday}") == 1.0
    assert judge_math("Answer: \\text{Tuesday}", "\\text{Monday}") == 0.0


def test_a_hanging_answer_is_killed_counted_and_scored_wrong():
    """(10^{10^8})! makes sympy compute forever; with timeout_s < 2 math-verify's own SIGALRM
    limit is off, so only the hard wall-clock kill can end it."""
    hang = "Answer: (10^{100000000})!"
    responses = [hang, "Answer: 2", hang, "Answer: \\frac{1}{2}", "Answer: 3"]
    truths = ["5", "2", "5", "0.5", "4"]
    with MathRewardPool(workers=2, timeout_s=1.0) as p:
        started = time.monotonic()
        out = p.score(responses, truths)
        elapsed = time.monotonic() - started
        assert out.scores == [0.0, 1.0, 0.0, 1.0, 0.0]
        assert out.timed_out == [True, False, True, False, False]
        assert out.metrics["math_reward/timeouts"] == 2
        assert out.metrics["math_reward/timeout_share"] == pytest.approx(2 / 5)
        assert 0.0 < out.metrics["math_reward/worker_busy_share"] <= 1.0
        assert elapsed < 30  # it returned: nothing waited on the hung worker
        again = p.score(["Answer: 7"], ["7"])  # the replaced workers keep scoring
        assert again.scores == [1.0] and again.metrics["math_reward/timeouts"] == 0
        assert p.totals["timeouts"] == 2 and p.totals["pairs"] == 6


def test_math_score_works_off_the_main_thread():
    results = {}

    def work():
        results["right"] = math_score("Answer: \\dfrac{1}{2}", "0.5")
        results["wrong"] = math_score("Answer: 0.4", "0.5")

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert results == {"right": 1.0, "wrong": 0.0}


def test_bad_input_is_a_value_error(pool):
    with pytest.raises(ValueError, match="differ in length"):
        pool.score(["a"], [])
    with pytest.raises(ValueError, match=r"ground_truths\[0\] must be a str"):
        pool.score(["Answer: 1"], [1])
    with pytest.raises(ValueError, match="timeout_s"):
        MathRewardPool(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        MathRewardPool(workers=0)
    assert pool.score([], []).scores == []


def test_the_arithmetic_tasks_solutions_are_scored_right(pool):
    """The CPU run's own answer form ('... 6+3=9. Answer: 9'): correct solutions score 1, the
    sloppy (always wrong) ones 0 - a reward rule that misses this form zeroes the main job."""
    import random

    from megatron_ba.tasks.arithmetic import ArithmeticTask, correct_solution, sloppy_solution

    task = ArithmeticTask(min_terms=2, max_terms=4, seed=1234)
    prompts = task.prompts("train", 12)
    rng = random.Random(0)
    responses = [correct_solution(p) for p in prompts] + [sloppy_solution(p, rng) for p in prompts]
    truths = [task.answer(p) for p in prompts] * 2
    assert pool.score(responses, truths).scores == [1.0] * 12 + [0.0] * 12
