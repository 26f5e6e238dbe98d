"""Training tasks: prompts with verifiable answers.

    task = build_task(recipe, tokenizer)
    task.prompts("train", count, offset=position)   # the training stream (deterministic)
    task.prompts("eval", count)                     # held-out prompts
    task.answer(prompt)                             # the ground truth the math reward checks

`arithmetic` (tasks/arithmetic.py) is the synthetic task of the CPU run; `math` (tasks/
math_dataset.py) a real data set file: DAPO-Math-17k or Polaris.
"""

from __future__ import annotations

from megatron_ba.tasks.arithmetic import ArithmeticTask
from megatron_ba.tasks.math_dataset import MathTask


def build_task(recipe, tokenizer=None):
    d = recipe.data
    if d.task == "arithmetic":
        return ArithmeticTask(
            min_terms=d.min_terms,
            max_terms=d.max_terms,
            seed=d.seed,
            restates=d.sloppy_restates,
        )
    if d.task == "math":
        if tokenizer is None:
            raise ValueError("tokenizer: the math task renders prompts with the model's tokenizer")
        return MathTask.from_recipe(recipe, tokenizer)
    raise ValueError(f"data.task: must be arithmetic or math, got {d.task!r}")
