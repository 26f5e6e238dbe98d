"""Evaluation: Acc@k / Best@k on the paper's benchmarks through any `generate` callable.

    from megatron_ba.evaluation import evaluate, markdown_table
    report = evaluate(generate, {"math500": problems}, samples=8)
    print(markdown_table([report]))

`megatron-ba eval MODEL_DIR` wraps a vLLM engine (megatron_ba.evaluation.eval_engine) around it.
"""

from megatron_ba.evaluation.metrics import acc_at_k, average, best_at_k
from megatron_ba.evaluation.runner import GenerateFn, evaluate
from megatron_ba.evaluation.scores import BenchmarkResult, EvalReport, markdown_table

__all__ = [
    "BenchmarkResult",
    "EvalReport",
    "GenerateFn",
    "acc_at_k",
    "average",
    "best_at_k",
    "evaluate",
    "markdown_table",
]
