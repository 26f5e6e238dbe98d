"""Prompt templates and chat templating."""

import pytest
from data_helpers import FIXTURES, read_jsonl

from megatron_ba.data import (
    Problem,
    chat_prompt,
    code_prompt,
    plain_chat,
    problem_messages,
    render_prompt,
    strip_dapo_template,
)
from megatron_ba.testing.tiny_hf import build_tokenizer


def test_dapo_template_is_the_data_sets_prompt_exactly():
    original = read_jsonl(FIXTURES / "dapo_math.jsonl")[0]["prompt"][0]["content"]
    question = strip_dapo_template(original)
    assert question == "What is $3 + 4 \\cdot 5$?"
    assert render_prompt(question, "dapo") == original
    assert original.startswith("Solve the following math problem step by step. The last line")
    assert original.endswith('Remember to put your answer on its own line after "Answer:".')
    assert strip_dapo_template("no template here") == "no template here"


def test_boxed_and_plain_templates():
    assert render_prompt("Q?", "boxed") == (
        "Q?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert render_prompt("Q?", "plain") == "Q?"
    with pytest.raises(ValueError, match="template must be one of"):
        render_prompt("Q?", "cot")


def test_code_prompt_formats():
    stdin = code_prompt("Add two numbers.")
    assert stdin.startswith("### Question:\nAdd two numbers.\n\n### Format: Read the inputs")
    assert "```python\n# YOUR CODE HERE\n```" in stdin
    starter = code_prompt("Double.", "class Solution:\n    def f(self):\n        ")
    assert "starter code" in starter and "class Solution:\n    def f(self):" in starter
    assert "YOUR CODE HERE" not in starter
    tests = ({"input": "1", "output": "1", "testtype": "stdin"},)
    msgs = problem_messages(Problem("1", "Add.", kind="code", tests=tests))
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"].startswith("You are an expert Python programmer")


def test_math_messages_and_chat_templating():
    p = Problem("1", "What is 2+2?", "4")
    msgs = problem_messages(p, "boxed", system="Be brief.")
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": render_prompt("What is 2+2?", "boxed")},
    ]
    tok = build_tokenizer()
    text = chat_prompt(tok, msgs)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        + render_prompt("What is 2+2?", "boxed")
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    # the locally trained tokenizer round-trips arbitrary text (byte level)
    assert tok.decode(tok(text)["input_ids"]) == text
    assert plain_chat(msgs) == "Be brief.\n\n" + msgs[1]["content"] + "\n\n"
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        chat_prompt(tok, msgs)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        chat_prompt(build_tokenizer(), [{"content": "x"}])


def test_problem_validates_itself():
    with pytest.raises(ValueError, match="empty answer"):
        Problem("1", "Q?", "")
    with pytest.raises(ValueError, match="no test cases"):
        Problem("1", "Q?", kind="code")
    with pytest.raises(ValueError, match="kind"):
        Problem("1", "Q?", "1", kind="proof")
