"""The evaluation core: sample k answers per problem through any `generate` callable, score them.

    from megatron_ba.evaluation import evaluate
    def generate(prompts: list[str], n: int, temperature: float, max_tokens: int):
        ...      # -> list[list[str]]: n completions per prompt, e.g. the trainer's vLLM engine
    report = evaluate(generate, {"math500": problems}, samples=8)
    report.acc, report.best       # averages over benchmarks; report.benchmarks[...] per benchmark

It knows nothing of vLLM: the CLI (`megatron-ba eval`) wraps a vLLM engine into `generate`, and a
training run passes its in-process engine for periodic evaluation. Math answers are scored by
the math reward pool (hard per-answer timeout), code by the sandboxed code reward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from megatron_ba.data.benchmarks import BENCHMARKS
from megatron_ba.data.records import Problem
from megatron_ba.data.templates import plain_chat, problem_messages
from megatron_ba.evaluation.metrics import acc_at_k, best_at_k
from megatron_ba.evaluation.scores import BenchmarkResult, EvalReport
from megatron_ba.rewards.code import code_score
from megatron_ba.rewards.math_pool import MathRewardPool

GenerateFn = Callable[[list[str], int, float, int], list[list[str]]]


def _check_generated(out, prompts: list[str], n: int, name: str) -> list[list[str]]:
    if not isinstance(out, list) or len(out) != len(prompts):
        got = len(out) if isinstance(out, list) else type(out).__name__
        raise ValueError(f"generate returned {got} results for {len(prompts)} prompts ({name})")
    for i, row in enumerate(out):
        if not isinstance(row, list) or len(row) != n or not all(isinstance(s, str) for s in row):
            raise ValueError(f"generate must return {n} strings per prompt; prompt {i} of {name}")
    return out


def _score_code(
    problems: list[Problem], responses: list[list[str]], workers: int, timeout_s: float
) -> list[list[bool]]:
    jobs = [(i, j) for i in range(len(problems)) for j in range(len(responses[i]))]

    def one(job):
        i, j = job
        p = problems[i]
        tests = list(p.tests)
        return code_score(responses[i][j], tests, func_name=p.func_name, timeout_s=timeout_s)

    with ThreadPoolExecutor(max_workers=workers) as ex:  # each call is its own sandbox process
        scores = list(ex.map(one, jobs))
    correct = [[False] * len(r) for r in responses]
    for (i, j), s in zip(jobs, scores, strict=True):
        correct[i][j] = s == 1.0
    return correct


def _fitting(
    name: str,
    problems: list[Problem],
    prompts: list[str],
    prompt_tokens: Callable[[str], int] | None,
    max_model_len: int | None,
    max_tokens: int,
) -> tuple[list[Problem], list[str]]:
    """The problems (and their prompts) whose prompt plus `max_tokens` fit the engine's context;
    all of them without `prompt_tokens` and `max_model_len`. None fitting is an error."""
    if prompt_tokens is None or max_model_len is None:
        return problems, prompts
    keep = [i for i, x in enumerate(prompts) if prompt_tokens(x) + max_tokens <= max_model_len]
    if not keep:
        raise ValueError(
            f"benchmark {name!r}: no prompt fits the context of {max_model_len} tokens "
            f"with max_tokens={max_tokens} for generation (all {len(problems)} too long); "
            f"lower max_tokens or use a model with a longer context"
        )
    return [problems[i] for i in keep], [prompts[i] for i in keep]


def _score(
    problems: list[Problem],
    responses: list[list[str]],
    samples: int,
    math_pool,
    code_workers: int,
    code_timeout_s: float,
) -> tuple[list[list[bool]], int]:
    """(correct[problem][sample], math answers that hit the hard timeout)."""
    timeouts = 0
    math_idx = [i for i, p in enumerate(problems) if p.kind == "math"]
    code_idx = [i for i, p in enumerate(problems) if p.kind == "code"]
    correct = [[False] * samples for _ in problems]
    if math_idx:
        flat = [(i, j) for i in math_idx for j in range(samples)]
        scored = math_pool.score(
            [responses[i][j] for i, j in flat], [problems[i].answer for i, _ in flat]
        )
        timeouts = sum(scored.timed_out)
        for (i, j), s in zip(flat, scored.scores, strict=True):
            correct[i][j] = s == 1.0
    if code_idx:
        code_correct = _score_code(
            [problems[i] for i in code_idx],
            [responses[i] for i in code_idx],
            code_workers,
            code_timeout_s,
        )
        for i, row in zip(code_idx, code_correct, strict=True):
            correct[i] = row
    return correct, timeouts


def _check_request(benchmarks: dict, samples: int, max_tokens: int) -> None:
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not benchmarks:
        raise ValueError("benchmarks is empty: give at least one name -> problems")
    for name, problems in benchmarks.items():
        if not problems:
            raise ValueError(f"benchmark {name!r} has no problems")


def evaluate(
    generate: GenerateFn,
    benchmarks: dict[str, list[Problem]],
    *,
    samples: int = 8,
    temperature: float = 1.0,
    max_tokens: int = 4096,
    template: str = "dapo",
    format_prompt: Callable[[list[dict]], str] = plain_chat,
    prompt_of: Callable[[Problem], str] | None = None,
    prompt_tokens: Callable[[str], int] | None = None,
    max_model_len: int | None = None,
    math_pool=None,
    math_timeout_s: float = 5.0,
    code_workers: int = 2,
    code_timeout_s: float = 6.0,
    label: str = "model",
) -> EvalReport:
    """Acc@samples and Best@samples of `generate` on each benchmark (name -> problems).

    format_prompt turns a problem's chat messages into the prompt string (e.g. the tokenizer's
    chat template); math problems use `template` ("dapo" or "boxed"), code problems
    LiveCodeBench's format. `prompt_of(problem) -> str` replaces both (a training task whose
    prompts are already complete, e.g. the synthetic arithmetic task). `math_pool` (a
    MathRewardPool) is borrowed if given, else one is made for this call.

    With `prompt_tokens` (a prompt's token count) and `max_model_len` (the engine's context),
    problems whose prompt plus `max_tokens` do not fit are skipped and counted per benchmark
    (`skipped_too_long`); a benchmark left with no problem is an error raised before anything
    is generated.
    """
    _check_request(benchmarks, samples, max_tokens)
    prompts_of: dict[str, list[str]] = {}
    kept: dict[str, list[Problem]] = {}  # the caller's dict stays as it was
    for name, problems in benchmarks.items():
        prompts = [
            prompt_of(p) if prompt_of else format_prompt(problem_messages(p, template))
            for p in problems
        ]
        kept[name], prompts_of[name] = _fitting(
            name, problems, prompts, prompt_tokens, max_model_len, max_tokens
        )
    own_pool = None
    if math_pool is None and any(p.kind == "math" for ps in kept.values() for p in ps):
        math_pool = own_pool = MathRewardPool(timeout_s=math_timeout_s)
    results = {}
    try:
        for name, problems in kept.items():
            started = time.monotonic()
            prompts = prompts_of[name]
            out = generate(prompts, samples, temperature, max_tokens)
            responses = _check_generated(out, prompts, samples, name)
            correct, timeouts = _score(
                problems, responses, samples, math_pool, code_workers, code_timeout_s
            )
            spec = BENCHMARKS.get(name)
            results[name] = BenchmarkResult(
                name=name,
                title=spec.title if spec else name,
                problems=len(problems),
                samples=samples,
                acc=acc_at_k(correct),
                best=best_at_k(correct),
                correct_counts=[sum(row) for row in correct],
                timeouts=timeouts,
                seconds=round(time.monotonic() - started, 3),
                skipped_too_long=len(benchmarks[name]) - len(problems),
            )
    finally:
        if own_pool is not None:
            own_pool.close()
    settings = {"temperature": temperature, "max_tokens": max_tokens, "template": template}
    return EvalReport(label, samples, results, settings)
