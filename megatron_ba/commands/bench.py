"""`megatron-ba bench NAME [options]`: run one benchmark of benchmarks/ and print its figures.

    megatron-ba bench --help                       # list the benchmarks
    megatron-ba bench vocab-parallel --help        # options of one benchmark
    megatron-ba bench vocab-parallel --tokens 2048

Benchmarks live in the repository's benchmarks/ folder (not in the installed package), each a
module with `main(argv) -> int`; this command puts the repository root on sys.path and calls it.
Results worth keeping go to docs/performance.md with the exact command that produced them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# name -> (module under the repository root, one-line help). New benchmarks register here.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "vocab-parallel": (
        "benchmarks.vocab_parallel",
        "chunked vocab-parallel log-prob + entropy vs the naive fp32 path: peak memory, time",
    ),
    "stats-allreduce": (
        "benchmarks.stats_allreduce",
        "the plan-statistics all-reduce over DP: payload bytes per step for 128 / 4,096 groups",
    ),
}

REPO_ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    listing = "; ".join(f"{n}: {h}" for n, (_, h) in BENCHMARKS.items())
    p.add_argument("name", choices=sorted(BENCHMARKS), help=f"the benchmark ({listing})")
    p.add_argument("options", nargs=argparse.REMAINDER, help="passed on to the benchmark")


def run(args: argparse.Namespace) -> int:
    if not (REPO_ROOT / "benchmarks").is_dir():
        raise SystemExit(
            f"bench: no benchmarks/ folder under {REPO_ROOT} (needs a source checkout)"
        )
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(BENCHMARKS[args.name][0])
    return int(module.main(list(args.options)) or 0)
