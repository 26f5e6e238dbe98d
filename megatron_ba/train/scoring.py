"""Rewards and evaluation of a local GRPO run (rank 0).

    scorer = Scorer(task, recipe, tokenizer, context=policy.spec.max_context)
    rewards = scorer.score(prompts, samples)          # one float per sample, prompt-major
    metrics = scorer.evaluate(rollouts, seed=s)       # the metrics.jsonl keys of an evaluation

Rewards and evaluation share one verifiable math reward (megatron_ba.rewards.MathRewardPool:
`reward.workers` worker processes, a hard `reward.timeout_s` per answer), and evaluation runs
through the same runner as `megatron-ba eval` (megatron_ba.evaluation.evaluate), so a training
run's Acc@k and the command line's are one computation. With `eval.benchmarks` the policy is
evaluated on those benchmarks (local files under `eval.data_dir`, else their hub mirrors), the
prompts rendered with `eval.template` through the tokenizer's chat template; without, on the
task's held-out prompts. Problems whose prompt plus the generation budget exceed the model's
context are skipped and counted (`eval/<name>/skipped_too_long`).
"""

from __future__ import annotations

import time

from megatron_ba.data.benchmarks import find_local_source, load_benchmark
from megatron_ba.data.records import Problem
from megatron_ba.data.templates import chat_prompt, plain_chat
from megatron_ba.evaluation import evaluate
from megatron_ba.rewards import MathRewardPool


class Scorer:
    def __init__(self, task, recipe, tokenizer, *, context: int) -> None:
        self.task, self.recipe, self.tokenizer, self.context = task, recipe, tokenizer, context
        rw = recipe.reward
        self.pool = MathRewardPool(workers=rw.workers, timeout_s=rw.timeout_s)
        self.benchmarks = self._load_benchmarks()

    def _load_benchmarks(self) -> dict:
        """name -> Problems: the recipe's benchmarks, or the task's held-out prompts."""

        e = self.recipe.eval
        if not e.benchmarks:
            prompts = self.task.prompts("eval", self.recipe.data.eval_prompts)
            return {
                "heldout": [
                    Problem(id=f"heldout-{i}", question=p, answer=self.task.answer(p))
                    for i, p in enumerate(prompts)
                ]
            }

        out = {}
        for name in e.benchmarks:
            source = find_local_source(e.data_dir, name) if e.data_dir else None
            if e.data_dir and source is None:
                raise FileNotFoundError(
                    f"eval.data_dir: no {name}.jsonl / {name}.parquet / {name}/ in {e.data_dir}"
                )
            out[name] = load_benchmark(name, source).problems
        return out

    def score(self, prompts: list[str], samples) -> list[float]:
        """The reward of every sample of every prompt, flattened prompt-major."""
        responses = [s.text for group in samples for s in group]
        truths = [
            self.task.answer(p) for p, group in zip(prompts, samples, strict=True) for _ in group
        ]
        return self.pool.score(responses, truths).scores

    def evaluate(self, rollouts, *, seed: int) -> dict:
        """Acc@k and Best@k of the current policy: their means over the benchmarks
        (`eval_accuracy`, `eval_best_at_k`) and each benchmark's (`eval/<name>/acc`, ...)."""

        e, g = self.recipe.eval, self.recipe.grpo
        max_tokens = e.max_new_tokens or g.max_new_tokens
        tok = self.tokenizer
        if "heldout" in self.benchmarks:  # the task's prompts are complete as they are
            render = {"prompt_of": lambda problem: problem.question}
        elif getattr(tok, "chat_template", None):
            render = {"format_prompt": lambda messages: chat_prompt(tok, messages)}
        else:
            render = {"format_prompt": plain_chat}
        t = time.perf_counter()
        report = evaluate(
            rollouts.generate_fn(seed),
            self.benchmarks,
            samples=e.samples,
            temperature=e.temperature,
            max_tokens=max_tokens,
            template=e.template,
            prompt_tokens=lambda text: len(tok(text)["input_ids"]),
            max_model_len=self.context,
            math_pool=self.pool,
            label="policy",
            **render,
        )
        out = {
            "eval_accuracy": report.acc,
            "eval_best_at_k": report.best,
            "eval_k": e.samples,
        }
        for name, b in report.benchmarks.items():
            out[f"eval/{name}/acc"] = b.acc
            out[f"eval/{name}/best"] = b.best
            out[f"eval/{name}/skipped_too_long"] = b.skipped_too_long
            out[f"eval/{name}/problems"] = b.problems  # a report's Acc@k says over how many
        out["time/eval"] = time.perf_counter() - t
        return out

    def close(self) -> None:
        self.pool.close()
