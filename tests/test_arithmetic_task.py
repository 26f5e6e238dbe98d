"""The synthetic arithmetic task: its expression space and the held-out split's size."""

from __future__ import annotations

import random

import pytest

from megatron_ba.tasks.arithmetic import ArithmeticTask


@pytest.mark.parametrize("terms", [2, 3])
def test_expressions_are_the_space_random_prompts_come_from(terms):
    task = ArithmeticTask(min_terms=terms, max_terms=terms)
    space = list(task._expressions(terms))
    assert len(space) == len(set(space)) == 10 * 11 ** (terms - 1)
    rng = random.Random(0)
    drawn = {task._random_prompt(rng) for _ in range(20_000)}
    assert drawn <= set(space)
    if terms == 2:  # small enough that 20,000 draws find every expression
        assert drawn == set(space)


def test_the_held_out_split_can_be_asked_for_whole_but_not_more():
    task = ArithmeticTask(min_terms=2, max_terms=3)
    available = task.eval_split_size
    held_out = {p for n in (2, 3) for p in task._expressions(n) if task._is_eval(p)}
    assert available == len(held_out) == 114  # fewer than the default data.eval_prompts, 128
    prompts = task.prompts("eval", available)
    assert set(prompts) == held_out
    # Drawing distinct prompts until 128 are found never ended before this check.
    with pytest.raises(ValueError, match=r"data\.eval_prompts: 128 .* only 114"):
        task.prompts("eval", 128)


def test_large_spaces_are_not_enumerated():
    task = ArithmeticTask(min_terms=2, max_terms=6)
    assert task.eval_split_size is None
    assert len(set(task.prompts("eval", 500))) == 500
