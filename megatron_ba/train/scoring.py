"""Rewards and held-out evaluation of a local GRPO run (rank 0).

    scorer = Scorer(task, workers=1, timeout_s=5.0)
    rewards = scorer.score(prompts, samples)          # one float per sample, prompt-major
    metrics = scorer.evaluate(rollouts, prompts, k=4, temperature=1.0, max_tokens=64, seed=s)

Both go through the same verifiable math reward (megatron_ba.rewards.MathRewardPool: worker
processes with a hard per-answer time limit), and evaluation through the same runner as
`megatron-ba eval` (megatron_ba.evaluation.evaluate), so a training run's Acc@k and the command
line's are one computation. The task supplies the prompts and each prompt's ground truth
(`task.answer(prompt)`).
"""

from __future__ import annotations

import time


class Scorer:
    def __init__(self, task, *, workers: int = 1, timeout_s: float = 5.0) -> None:
        from megatron_ba.rewards import MathRewardPool

        self.task = task
        self.pool = MathRewardPool(workers=workers, timeout_s=timeout_s)

    def score(self, prompts: list[str], samples) -> list[float]:
        """The reward of every sample of every prompt, flattened prompt-major."""
        responses = [s.text for group in samples for s in group]
        truths = [
            self.task.answer(p) for p, group in zip(prompts, samples, strict=True) for _ in group
        ]
        return self.pool.score(responses, truths).scores

    def evaluate(
        self, rollouts, prompts: list[str], *, k: int, temperature: float, max_tokens: int, seed
    ) -> dict:
        """Acc@k and Best@k of the current policy on `prompts` (the metrics.jsonl keys)."""
        from megatron_ba.data.records import Problem
        from megatron_ba.evaluation import evaluate

        t = time.perf_counter()
        problems = [
            Problem(id=f"heldout-{i}", question=p, answer=self.task.answer(p), source="task")
            for i, p in enumerate(prompts)
        ]
        report = evaluate(
            rollouts.generate_fn(seed),
            {"heldout": problems},
            samples=k,
            temperature=temperature,
            max_tokens=max_tokens,
            prompt_of=lambda problem: problem.question,  # the task's prompts are complete
            math_pool=self.pool,
            label="policy",
        )
        return {
            "eval_accuracy": report.acc,
            "eval_best_at_k": report.best,
            "eval_k": k,
            "time/eval": time.perf_counter() - t,
        }

    def close(self) -> None:
        self.pool.close()
