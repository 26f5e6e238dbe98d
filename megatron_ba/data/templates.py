"""Prompt templates (DAPO's "Answer:" line, boxed, plain, LiveCodeBench's code format) and chat
templating.

    render_prompt("What is 1+1?", "dapo")     # DAPO-Math-17k's exact user prompt around it
    problem_messages(problem, "boxed")        # [{"role": "user", "content": ...}]
    chat_prompt(tokenizer, messages)          # the model's chat template, generation prompt on

The "dapo" template reproduces DAPO-Math-17k's prompts byte for byte, so a problem extracted
from the data set and rendered again is the prompt the paper trained on.
"""

from __future__ import annotations

from megatron_ba.data.records import Problem

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

MATH_TEMPLATES = ("dapo", "boxed", "plain", "polaris")

CODE_SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) "
    "and will generate a correct Python program that matches the specification and passes all "
    "tests."
)
_CODE_STDIN_FORMAT = (
    "### Format: Read the inputs from stdin, solve the problem and write the answer to stdout "
    "(do not directly test on the sample inputs). Enclose your code within delimiters as "
    "follows.\n```python\n# YOUR CODE HERE\n```\n\n"
)
_CODE_STARTER_FORMAT = (
    "### Format: You will use the following starter code to write the solution to the problem "
    "and enclose your code within delimiters.\n```python\n{starter}\n```\n\n"
)
_CODE_ANSWER = "### Answer: (use the provided format with backticks)\n\n"


def render_prompt(question: str, template: str = "dapo") -> str:
    """The user prompt of a math question under `template` (one of MATH_TEMPLATES).

    "polaris" is Polaris' own training prompt: the problem alone as the user message, as its data
    preparation writes it (POLARIS-Project, scripts/data/jsonl2parquet.py); the model's habit of
    a final \\boxed{} answer does the rest. "plain" is the same text, named for other sets.
    """
    if template == "dapo":
        return DAPO_PREFIX + question + DAPO_SUFFIX
    if template == "boxed":
        return question + BOXED_SUFFIX
    if template in ("plain", "polaris"):
        return question
    raise ValueError(f"template must be one of {MATH_TEMPLATES}, got {template!r}")


def strip_dapo_template(prompt: str) -> str:
    """The bare question inside a DAPO-templated prompt (unchanged if it has no template)."""
    text = prompt
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX) :]
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text


def code_prompt(question: str, starter_code: str = "") -> str:
    """LiveCodeBench's user prompt: stdin/stdout format, or completing `starter_code`."""
    fmt = (
        _CODE_STARTER_FORMAT.format(starter=starter_code.rstrip("\n"))
        if starter_code.strip()
        else _CODE_STDIN_FORMAT
    )
    return f"### Question:\n{question}\n\n{fmt}{_CODE_ANSWER}"


def problem_messages(
    problem: Problem, template: str = "dapo", system: str | None = None
) -> list[dict]:
    """Chat messages for a problem: math under `template`, code in LiveCodeBench's format."""
    if problem.kind == "code":
        messages = [{"role": "system", "content": system or CODE_SYSTEM}]
        messages.append(
            {"role": "user", "content": code_prompt(problem.question, problem.starter_code)}
        )
        return messages
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": render_prompt(problem.question, template)})
    return messages


def plain_chat(messages: list[dict]) -> str:
    """A template-free rendering: the contents joined by blank lines (for models without a
    chat template)."""
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """`messages` through the tokenizer's chat template, ending in the assistant's turn."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat_template; use templates.plain_chat for a base model"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
