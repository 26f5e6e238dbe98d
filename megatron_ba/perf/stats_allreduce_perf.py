"""The plan-statistics all-reduce: payload bytes per step (and its time on gloo) vs groups.

    megatron-ba perf stats-allreduce                       # 128 and 4,096 groups, DP 2
    megatron-ba perf stats-allreduce --groups 128,4096,32768 --dp 2 --group-size 16
    python megatron_ba/perf/stats_allreduce_perf.py --help            # the same without the CLI

Launches --dp gloo processes (one per data-parallel rank). For each number of groups, every rank
holds its share of a GRPO batch (--group-size responses per group, each group split across the
ranks) and builds the loss plan with `LossPlan.build(..., reduce=StatisticsReducer(dp_group))`,
exactly as megatron_ba.megatron.grpo_step does once per global batch. Printed per setting:
the reducer's calls per step (must be 1), the payload it all-reduced (bytes per rank), a check
that the reduced table equals the single-process one, and the median wall time of the whole plan
build over --rounds rounds (gloo over loopback on this machine: an upper bound for NCCL, and not
a target; the figure that matters is the payload, which is O(groups), independent of the number
of sequences, tokens and micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from megatron_ba.aggregation import NUM_COLUMNS, plan_statistics
from megatron_ba.loss import LossPlan
from megatron_ba.loss_settings import AggregationSettings
from megatron_ba.parallel import collectives
from megatron_ba.parallel.collectives import StatisticsReducer, statistics_payload_bytes
from megatron_ba.parallel.world import free_port, spawn


def _batch(num_groups: int, group_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    rewards = (torch.rand(n, generator=g) < 0.5).double()
    lengths = torch.where(rewards > 0, 200.0, 400.0) + torch.randint(0, 100, (n,), generator=g)
    adv = rewards - rewards.view(num_groups, group_size).mean(1).repeat_interleave(group_size)
    ids = torch.arange(num_groups).repeat_interleave(group_size)
    return lengths, adv, ids


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    collectives.init_process_group("gloo", rank=rank, world_size=world, port=port)
    world_group = collectives.world_group()
    rows_of_rank = slice(rank, None, world)  # every world-th response: groups span the ranks
    results = []
    for num_groups in args.groups:
        lengths, adv, ids = _batch(num_groups, args.group_size)
        mine = (lengths[rows_of_rank], adv[rows_of_rank], ids[rows_of_rank])
        times = []
        for _ in range(args.rounds):
            reducer = StatisticsReducer(world_group)
            collectives.barrier()
            t0 = time.perf_counter()
            LossPlan.build(
                AggregationSettings("balanced"), *mine, reduce=reducer, num_groups=num_groups
            )
            times.append(time.perf_counter() - t0)
        check = StatisticsReducer(world_group)
        reduced = plan_statistics(*mine, reduce=check, num_groups=num_groups).table
        whole = plan_statistics(lengths, adv, ids, num_groups=num_groups).table
        results.append(
            dict(
                groups=num_groups,
                sequences=num_groups * args.group_size,
                calls=reducer.calls,
                payload_bytes=reducer.last_payload_bytes,
                expected_bytes=statistics_payload_bytes(num_groups),
                table_matches=bool(torch.allclose(reduced, whole, rtol=1e-12, atol=0.0)),
                median_ms=1e3 * statistics.median(times),
            )
        )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    collectives.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-ba perf stats-allreduce", description=__doc__)
    p.add_argument("--groups", default="128,4096", help="comma-separated numbers of groups")
    p.add_argument("--group-size", type=int, default=16, help="responses per group (G)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (gloo processes)")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    args.groups = [int(x) for x in args.groups.split(",") if x.strip()]
    if args.dp < 1 or args.group_size < 1 or not args.groups or min(args.groups) < 1:
        raise SystemExit("stats-allreduce: --dp, --group-size and --groups must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        spawn(_worker, args.dp, (args.dp, free_port(), args, out))
        with open(out) as f:
            results = json.load(f)
    print(
        f"statistics all-reduce: [groups, {NUM_COLUMNS}] float64 table, SUM over {args.dp} DP "
        f"ranks (gloo), G={args.group_size}, {args.rounds} rounds"
    )
    print(f"{'groups':>8} {'sequences':>10} {'calls/step':>10} {'bytes/step':>11} "
          f"{'table ok':>8} {'plan build ms (median)':>23}")  # fmt: skip
    ok = True
    for r in results:
        ok &= r["calls"] == 1 and r["payload_bytes"] == r["expected_bytes"] and r["table_matches"]
        print(
            f"{r['groups']:>8} {r['sequences']:>10} {r['calls']:>10} {r['payload_bytes']:>11,} "
            f"{r['table_matches']!s:>8} {r['median_ms']:>23.3f}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
