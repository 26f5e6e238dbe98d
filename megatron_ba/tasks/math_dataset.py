"""A real math data set as a training task (DAPO-Math-17k, Polaris): prompts and ground truths.

    task = MathTask.from_recipe(recipe, tokenizer)
    task.prompts("train", 128, offset=position)   # chat-templated prompt strings, a seeded stream
    task.answer(prompt)                           # its ground truth, for the math reward
    task.report                                   # rows read, kept, and what was dropped why

The same protocol as megatron_ba.tasks.arithmetic.ArithmeticTask, so the driver treats both alike.
Prompts are each problem under the recipe's template (`data.template`: DAPO's "Answer:" line,
boxed, or Polaris' plain question), through the tokenizer's chat template when it has one.
Prompts longer than `data.max_prompt_tokens` are dropped and counted; `data.train_prompts` keeps
the first that many of the (seeded) shuffled pool. The training stream walks the pool in epochs,
each in its own seeded order, so `offset` (the checkpoint's data position) fully determines what
comes next. `data.eval_prompts` problems are held out of the pool for the task's own evaluation
(used when `eval.benchmarks` is empty).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from megatron_ba.data import load_dapo_math, load_polaris
from megatron_ba.data.templates import chat_prompt, plain_chat, problem_messages


@dataclass
class MathTask:
    prompts_by_split: dict[str, list[str]]
    answers: dict[str, str]
    seed: int
    report: dict = field(default_factory=dict)

    @classmethod
    def from_recipe(cls, recipe, tokenizer) -> MathTask:
        d = recipe.data
        if d.dataset == "dapo-math-17k":
            loaded = load_dapo_math(d.path, on_conflict=d.on_conflict)
        else:
            loaded = load_polaris(d.path)
        return cls.from_problems(
            loaded.problems,
            tokenizer,
            template=d.template,
            max_prompt_tokens=d.max_prompt_tokens,
            train_prompts=d.train_prompts,
            # held out for the task's own evaluation, needed only without eval.benchmarks
            eval_prompts=0 if recipe.eval.benchmarks else d.eval_prompts,
            seed=d.seed,
            load_report={"rows_read": loaded.report.rows_read, **loaded.report.dropped},
        )

    @classmethod
    def from_problems(
        cls,
        problems,
        tokenizer,
        *,
        template: str,
        max_prompt_tokens: int | None,
        train_prompts: int | None,
        eval_prompts: int,
        seed: int,
        load_report: dict | None = None,
    ) -> MathTask:
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        report = {"load": dict(load_report or {}), "too_long": 0, "duplicate_prompt": 0}
        answers: dict[str, str] = {}
        order: list[str] = []
        for p in problems:
            messages = problem_messages(p, template)
            text = chat_prompt(tokenizer, messages) if has_chat else plain_chat(messages)
            if max_prompt_tokens is not None:
                if len(tokenizer(text)["input_ids"]) > max_prompt_tokens:
                    report["too_long"] += 1
                    continue
            if text in answers:  # two questions that render alike (loaders dedupe the rest)
                report["duplicate_prompt"] += 1
                continue
            answers[text] = p.answer
            order.append(text)
        random.Random(f"{seed}:pool").shuffle(order)
        held_out, pool = order[:eval_prompts], order[eval_prompts:]
        if train_prompts is not None:
            report["beyond_train_prompts"] = max(0, len(pool) - train_prompts)
            pool = pool[:train_prompts]
        if not pool:
            raise ValueError(
                f"data: no training prompts left ({report}); check data.path, "
                f"data.max_prompt_tokens and data.eval_prompts"
            )
        report.update(train=len(pool), eval=len(held_out))
        return cls({"train": pool, "eval": held_out}, answers, seed, report)

    def prompts(self, split: str, count: int, *, offset: int = 0) -> list[str]:
        """`count` prompts of `split`; train: position `offset` onwards of the endless stream."""
        if split not in self.prompts_by_split:
            raise ValueError(f"split: must be 'train' or 'eval', got {split!r}")
        if split == "eval":
            return self.prompts_by_split["eval"][:count]
        pool = self.prompts_by_split["train"]
        out = []
        for i in range(offset, offset + count):
            epoch, j = divmod(i, len(pool))
            out.append(self._epoch_order(epoch)[j])
        return out

    def _epoch_order(self, epoch: int) -> list[str]:
        cache = self.__dict__.setdefault("_orders", {})
        if epoch not in cache:
            order = list(self.prompts_by_split["train"])
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
            cache.clear()  # one epoch at a time is enough for a forward-moving stream
            cache[epoch] = order
        return cache[epoch]

    def answer(self, prompt: str) -> str:
        try:
            return self.answers[prompt]
        except KeyError:
            raise KeyError(f"prompt: not a prompt of this task: {prompt[:80]!r}") from None
